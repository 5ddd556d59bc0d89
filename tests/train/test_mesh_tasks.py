"""find_lr, check() and debug() of a mesh strategy (xla_utils.train.mesh_tasks) on 8 real
XLA:CPU devices: where the LR sweep runs and says so, the sharded step checked and
debugged as the mesh run, and the per-device memory verdict under "fsdp"."""
from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from xla_utils import OneCycleTrainer, runtime
from xla_utils.diagnostics.memory import llama_shapes

from helpers import digits_dataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "step"))  # the module pytest imports
from test_strategy import DEVICES, Net  # noqa: E402

pytestmark = pytest.mark.skipif(not runtime.xla_available(), reason="needs torch_xla")


def _tiny_chip():
    """A TPU core of 1 KiB: no model fits it (the automatic choice's mesh side)."""
    from xla_utils.diagnostics.readiness import TPUChip

    return TPUChip("tiny", 1.0, 2**10 / 2**30, 128, 1)


def test_find_lr_sweeps_on_the_mesh_when_one_core_cannot_hold_the_model(capsys):
    tr = OneCycleTrainer(Net, torch.nn.CrossEntropyLoss(), digits_dataset(256), batch_size=8,
                         compile_cache=None, strategy="fsdp", fsdp_wrap=["Block"])
    before = {k: v.clone() for k, v in tr.model.state_dict().items()}
    rng = torch.get_rng_state()
    kw = dict(num_it=20, show_progress=False)
    mesh = tr.find_lr(simulate=DEVICES, tpu=_tiny_chip(), **kw)
    said = capsys.readouterr().out
    assert "lr_find: on the 8-device mesh as strategy='fsdp' runs: one tiny core cannot hold" in said
    assert mesh.placement in said and tr.lr_finder_result is mesh
    # seen inside the SPMD process: 8 devices, the parameters and the batch sharded 8 ways
    assert (mesh.devices, mesh.strategy) == (DEVICES, "fsdp")
    assert mesh.shardings["parameter"].startswith("{devices=[1,8]")  # stem [32, 64]: dim 1
    assert mesh.shardings["batch"] == "{devices=[8,1]0,1,2,3,4,5,6,7}"
    # the fit's global batch: 8 per device x 8 devices, one micro-batch per step
    assert (mesh.batch_size, mesh.micro_batch_size, mesh.accum_steps) == (64, 64, 1)
    assert math.isfinite(mesh.suggestion) and len(mesh.lrs) == 20
    for k, v in tr.model.state_dict().items():  # the trainer's model is untouched
        assert torch.equal(v, before[k]), k
    assert torch.equal(torch.get_rng_state(), rng)
    # A model that fits one v5e core (the default target) sweeps on one core, accumulating
    # 8 micro-batches of 8: the same global batches, the same curve.
    one = tr.find_lr(simulate=DEVICES, **kw)
    assert "lr_find: on one core: the model fits one v5e core" in capsys.readouterr().out
    assert (one.devices, one.strategy, one.shardings) == (1, None, {})
    assert (one.batch_size, one.micro_batch_size, one.accum_steps) == (64, 8, 8)
    np.testing.assert_allclose(mesh.losses, one.losses, rtol=0, atol=1e-4)
    # for fit(cores=1): the global batch of one device, not of the 8 simulated ones
    single = tr.find_lr(simulate=DEVICES, cores=1, **kw)
    assert (single.batch_size, single.micro_batch_size, single.accum_steps) == (8, 8, 1)


def test_fit_max_lr_find_uses_the_mesh_sweep(capsys):
    tr = OneCycleTrainer(Net, torch.nn.CrossEntropyLoss(), digits_dataset(128), batch_size=8,
                         epochs=1, compile_cache=None, strategy="spmd", lr_find_on_mesh=True)
    h = tr.fit(simulate=DEVICES, max_lr="find")
    res = tr.lr_finder_result
    assert "lr_find: on the 8-device mesh as strategy='spmd' runs (asked: on_mesh=True)" \
        in capsys.readouterr().out
    assert res.devices == DEVICES and res.shardings["parameter"] == "{replicated}"
    assert res.batch_size == h.global_batch == 64 and math.isfinite(res.suggestion)
    # measured at the fit's own global batch: used as is, no scaling on top
    assert h.base_lr == res.suggestion and h.max_lr == pytest.approx(res.suggestion)
    assert math.isfinite(h.epochs[0]["train_loss"])
    with pytest.raises(ValueError, match="on_mesh=True sweeps as a mesh run, but "
                                         "strategy='spawn'"):
        OneCycleTrainer(Net, torch.nn.CrossEntropyLoss(), digits_dataset(64)).find_lr(on_mesh=True)
    with pytest.raises(ValueError, match="lr_find_on_mesh=True sweeps as a mesh run"):
        OneCycleTrainer(Net, torch.nn.CrossEntropyLoss(), digits_dataset(64), lr_find_on_mesh=True)


# ------------------------------------------------------------- check() and debug() on the mesh
def test_check_and_debug_run_the_sharded_step_on_the_mesh():
    tr = OneCycleTrainer(Net, torch.nn.CrossEntropyLoss(), digits_dataset(128), batch_size=8,
                         compile_cache=None, strategy="fsdp", fsdp_wrap=["Block"])
    before = {k: v.clone() for k, v in tr.model.state_dict().items()}
    r = tr.check(steps=4, tpu="v5e-8", measure_loader=False)
    mesh = r.measurements["mesh"]
    assert mesh["devices"] == DEVICES and "recompile" not in r.codes and "cpu_fallback" not in r.codes
    assert [d["compiles"] for d in mesh["per_step"]][2:] == [0, 0]  # steps 3.. reuse the graph
    assert [d["executions"] for d in mesh["per_step"]] == [1] * 4  # one SPMD graph per step
    note = next(f for f in r.findings if f.code == "strategy")
    assert note.message.startswith("strategy='fsdp': the sharded step on 8 XLA:CPU devices (one "
                                   "process, batch 8 per device, 64 global)"), note.message
    memory = next(f for f in r.findings if f.code == "memory")
    assert "Under strategy='fsdp' on 8 v5e devices" in memory.message and "it fits" in memory.message
    d = tr.debug(steps=4, simulate=DEVICES)  # the debug steps as the mesh run, barrier each
    assert (d.devices, d.strategy) == (DEVICES, "fsdp")
    assert "strategy 'fsdp': one process, a mesh of 8 devices, batch 64 split over it" in d.report
    assert [s["compiles"] for s in d.per_step][2:] == [0, 0] and all(map(math.isfinite, d.losses))
    assert "reused the compiled graph" in d.report
    for k, v in tr.model.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_check_on_the_mesh_finds_a_step_that_recompiles():
    calls = [0]

    def ragged(model, batch, loss):  # every other step sees half the batch: a new graph
        calls[0] += 1
        x, y = batch
        n = len(x) // (1 + calls[0] % 2)
        return loss(model(x[:n]), y[:n])

    tr = OneCycleTrainer(Net, torch.nn.CrossEntropyLoss(), digits_dataset(128), batch_size=8,
                         compile_cache=None, strategy="spmd", train_step=ragged)
    r = tr.check(steps=4, measure_loader=False, devices=2)
    bad = [f for f in r.findings if f.code == "recompile" and "sharded step on 2" in f.message]
    assert bad and bad[0].severity == "error" and "compiled again at steps [3]" in bad[0].message


def test_fsdp_memory_verdict_of_check_is_per_device():
    """A 1B model: one v5e core cannot hold its fp32 AdamW states (an error on one core),
    8 FSDPv2 shards can (check under strategy='fsdp' says so)."""
    from xla_utils.diagnostics.findings import ReadinessReport, memory_finding
    from xla_utils.env.tpus import TPU_CHIPS
    from xla_utils.train.mesh_tasks import _sharded_memory

    shapes = llama_shapes("1b")
    n = sum(math.prod(s) for s in shapes)
    meas = {"batch_rows": 1, "param_bytes": 4 * n, "grad_bytes": 4 * n,
            "optimizer_state_bytes": 8 * n, "activation_bytes": 2**28,
            "activation_bytes_tiled": 2**28, "param_shapes": shapes, "tpu_devices": None}
    report = ReadinessReport(findings=[memory_finding(meas, TPU_CHIPS["v5e"])], measurements=meas)
    assert report.findings[0].severity == "error"
    _sharded_memory(report, 8, "v5e")
    f = report.findings[0]
    assert f.severity == "info" and "about 2.55 GiB per device (2.30 GiB of sharded states" in f.message, f.message
    _sharded_memory(report, 1, "v5e")  # a mesh of one device shards nothing
    assert report.findings[0].severity == "error" and "does not fit either" in report.findings[0].message
