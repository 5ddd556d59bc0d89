"""strategy="spmd" / "fsdp" (xla_utils.step.strategy, runtime.spmd, simulate.devices) on 8
real XLA:CPU devices: same numbers as "spawn", exact resume, real shardings, ResNet-18,
and every bad input refused before device time."""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers import digits_dataset, digits_rgb_uint8

from xla_utils import OneCycleTrainer, runtime
from xla_utils.train.checkpoint import ResumeError
from xla_utils.diagnostics.memory import llama_shapes
from xla_utils.step.strategy import (StrategyPlan, check_global_batch, consolidated_state_dict,
                                     resolve_wrap)

pytestmark = pytest.mark.skipif(not runtime.xla_available(), reason="needs torch_xla")

DEVICES = 8


class Net(torch.nn.Module):
    """A small MLP with two repeated blocks (FSDP units by class name)."""

    def __init__(self):
        super().__init__()
        self.stem = torch.nn.Linear(64, 32)
        self.blocks = torch.nn.Sequential(Block(), Block())
        self.head = torch.nn.Linear(32, 10)

    def forward(self, x):
        return self.head(self.blocks(torch.relu(self.stem(x))))


class Block(torch.nn.Module):
    def __init__(self, width: int = 32):
        super().__init__()
        self.fc = torch.nn.Linear(width, width)

    def forward(self, x):
        return torch.relu(self.fc(x)) + x


def _trainer(strategy: str, ckdir, **kw) -> OneCycleTrainer:
    extra = dict(fsdp_wrap=["Block"]) if strategy == "fsdp" else {}
    # 64 samples = one global batch of 8 x 8: every epoch is one step, so the
    # history's train_loss per epoch is the loss curve step by step.
    args = dict(batch_size=8, epochs=20, max_lr=3e-2, log_every=1, compile_cache=None,
                strategy=strategy, checkpoint_dir=ckdir, keep_checkpoints=20, **extra)
    return OneCycleTrainer(Net, torch.nn.CrossEntropyLoss(), digits_dataset(64), **{**args, **kw})


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """20 steps under each strategy on 8 simulated devices, checkpoints every epoch."""
    out = {}
    for s in ("spawn", "spmd", "fsdp"):
        d = tmp_path_factory.mktemp(s)
        tr = _trainer(s, d)
        h = tr.fit(simulate=DEVICES)
        out[s] = (h, d, tr)
    return out


@pytest.mark.slow
def test_same_loss_curve_over_20_steps(runs):
    curves = {s: [e["train_loss"] for e in h.epochs] for s, (h, _, _) in runs.items()}
    assert all(len(c) == 20 and all(map(math.isfinite, c)) for c in curves.values())
    assert curves["spawn"][-1] < 0.5 * curves["spawn"][0]  # it trained
    for s in ("spmd", "fsdp"):
        np.testing.assert_allclose(curves[s], curves["spawn"], rtol=0, atol=1e-4, err_msg=s)
        assert runs[s][0].world_size == DEVICES and runs[s][0].global_batch == 64
        assert runs[s][0].max_lr == pytest.approx(runs["spawn"][0].max_lr)
    ref = runs["spawn"][0].state_dict
    for s in ("spmd", "fsdp"):
        got = runs[s][0].state_dict
        assert set(got) == set(ref)
        for k in ref:
            torch.testing.assert_close(got[k], ref[k], rtol=0, atol=1e-4)


@pytest.mark.parametrize("strategy", ["spawn", "spmd", "fsdp"])
def test_resume_from_epoch_checkpoint_is_exact(runs, strategy):
    h, d, _ = runs[strategy]
    ckpt = next(d.glob("epoch_010-*.pt"))
    twins = sorted(p.name for p in d.glob("epoch_*.dcp"))
    assert twins == ([] if strategy == "spawn" else [p.stem + ".dcp" for p in
                                                     sorted(d.glob("epoch_*.pt"))])
    tr = _trainer(strategy, d)
    h2 = tr.fit(simulate=DEVICES, resume=ckpt)
    full = [e["train_loss"] for e in h.epochs]
    resumed = [e["train_loss"] for e in h2.epochs]
    assert len(resumed) == 20 and resumed[:10] == full[:10]  # history carried over
    np.testing.assert_allclose(resumed[10:], full[10:], rtol=0, atol=1e-6)
    # final.pt is consolidated: it loads into the plain model anywhere.
    plain = Net()
    plain.load_state_dict(torch.load(d / "final.pt"))
    for k, v in plain.state_dict().items():
        torch.testing.assert_close(v, h2.state_dict[k])


@pytest.mark.parametrize("was,now", [("spmd", "spmd"), ("spmd", "fsdp")])
def test_resume_from_the_sharded_dcp_twin(runs, tmp_path, was, now):
    """The .dcp folder alone resumes (nothing consolidated is read): exact under its own
    strategy, and under the other one with the same devices (the state is equivalent).
    fsdp's own exact .dcp resume: the EMA test below."""
    h, d, _ = runs[was]
    dcp = next(d.glob("epoch_015-*.dcp"))
    h2 = _trainer(now, tmp_path).fit(simulate=DEVICES, resume=dcp)
    full, resumed = [e["train_loss"] for e in h.epochs], [e["train_loss"] for e in h2.epochs]
    assert len(resumed) == 20 and resumed[:15] == full[:15]
    np.testing.assert_allclose(resumed[15:], full[15:], rtol=0,
                               atol=1e-6 if was == now else 1e-4)
    for k, v in h.state_dict.items():
        torch.testing.assert_close(h2.state_dict[k], v, rtol=0, atol=1e-6 if was == now else 1e-4)


def test_sharded_dcp_under_spawn_or_another_mesh_is_refused_naming_both(runs, tmp_path):
    _, d, _ = runs["fsdp"]
    dcp = next(d.glob("epoch_010-*.dcp"))
    with pytest.raises(ResumeError, match=r"a sharded checkpoint \(.dcp\) of strategy 'fsdp', "
                                          r"strategy 'spawn' now.*consolidated twin epoch_010-"):
        _trainer("spawn", tmp_path).fit(simulate=DEVICES, resume=dcp)
    with pytest.raises(ResumeError, match=r"cores: 8 in the checkpoint, 4 now \(strategy "
                                          r"'fsdp' then, 'spmd' now"):
        _trainer("spmd", tmp_path).fit(simulate=4, resume=dcp)


@pytest.mark.slow
def test_ema_under_fsdp_equals_spawn_compiles_once_and_resumes_from_the_dcp(tmp_path):
    """ema= on the mesh: the EMA copy is sharded like its parameters (see the set-up test),
    its weights equal spawn's, no compile after epoch 1, exact resume from the .dcp alone.
    With grad_clip= too: fsdp's gradients are sharded, yet the clip is by the whole model's
    norm, as spawn's averaged gradients are (a per-shard norm would train otherwise)."""
    def run(strategy, d, **kw):
        return _trainer(strategy, d, ema=0.9, epochs=4, val_data=digits_dataset(40),
                        grad_clip=0.3).fit(simulate=DEVICES, **kw)

    ref = run("spawn", tmp_path / "spawn")
    h = run("fsdp", tmp_path / "fsdp")
    assert [e["clipped_steps"] for e in h.epochs] == [e["clipped_steps"] for e in ref.epochs]
    assert ref.epochs[0]["clipped_steps"] == 1  # one step an epoch, clipped
    np.testing.assert_allclose([e["grad_norm"] for e in h.epochs],
                               [e["grad_norm"] for e in ref.epochs], rtol=1e-4)
    np.testing.assert_allclose([e["val_loss"] for e in h.epochs],
                               [e["val_loss"] for e in ref.epochs], rtol=0, atol=1e-4)
    for k, v in ref.ema_state_dict.items():
        torch.testing.assert_close(h.ema_state_dict[k], v, rtol=0, atol=1e-4)
    assert [e["compiles"] for e in h.epochs][1:] == [h.epochs[1]["compiles"]] * 3
    h2 = run("fsdp", tmp_path / "again",
             resume=next((tmp_path / "fsdp").glob("epoch_002-*.dcp")))
    assert [e["val_loss"] for e in h2.epochs][2:] == [e["val_loss"] for e in h.epochs][2:]
    for k, v in h.ema_state_dict.items():
        torch.testing.assert_close(h2.ema_state_dict[k], v, rtol=0, atol=0)


def test_checkpoint_resumes_under_another_strategy_with_same_devices(runs, tmp_path):
    h, d, _ = runs["spawn"]
    tr = _trainer("fsdp", tmp_path)
    h2 = tr.fit(simulate=DEVICES, resume=next(d.glob("epoch_015-*.pt")))
    np.testing.assert_allclose([e["train_loss"] for e in h2.epochs][15:],
                               [e["train_loss"] for e in h.epochs][15:], rtol=0, atol=1e-4)


def test_checkpoint_of_other_mesh_size_is_refused_naming_both(runs, tmp_path):
    _, d, _ = runs["spawn"]
    tr = _trainer("fsdp", tmp_path)
    with pytest.raises(ResumeError, match=r"cores: 8 in the checkpoint, 4 now \(strategy "
                                          r"'spawn' then, 'fsdp' now"):
        tr.fit(simulate=4, resume=next(d.glob("epoch_010-*.pt")))


def test_predict_under_fsdp_matches_the_plain_model(runs):
    tr = runs["fsdp"][2]
    data = digits_dataset(100)  # not a multiple of the global batch: the tail is padded and dropped
    got = tr.predict(data, simulate=DEVICES, activation=None)
    with torch.no_grad():
        want = tr.model(data.tensors[0]).numpy()
    assert got.shape == (100, 10)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4)
    ev = tr.evaluate(data, simulate=DEVICES)
    want_loss = torch.nn.functional.cross_entropy(torch.tensor(want), data.tensors[1]).item()
    assert ev["samples"] == 100 and ev["loss"] == pytest.approx(want_loss, abs=1e-4)


def _inspect_fsdp_shards(tmp):
    """In the 8-device SPMD process: wrap Net under FSDPv2, run one step, read shardings."""
    from xla_utils.train import loop
    from xla_utils.runtime import spmd
    from xla_utils.step.strategy import enter_mesh, load_sharded_checkpoint

    plan = StrategyPlan("fsdp", DEVICES, DEVICES, wrap=(Block,))
    _, run = enter_mesh(plan, None)
    model = run.wrap(loop.replica_model(Net(), runtime.device()))
    x, y = next(iter(run.feed([(torch.randn(64, 64), torch.randint(0, 10, (64,)))])))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    torch.nn.functional.cross_entropy(model(x), y).backward()
    runtime.sync()
    w = model.blocks[0].fc.weight
    grad_bytes = spmd.local_shard_bytes(w.grad)
    opt.step()
    runtime.sync()
    # the sharded checkpoint (torch.distributed.checkpoint, SPMD planners) round trip
    folder = run.save_sharded(model, opt, tmp, 1, "t", keep=1)
    model2 = run.wrap(loop.replica_model(Net(), runtime.device()))
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-3)
    torch.nn.functional.cross_entropy(model2(x), y).backward()
    opt2.step()
    runtime.sync()
    load_sharded_checkpoint(model2, opt2, folder)
    runtime.sync()
    w2 = model2.blocks[0].fc.weight
    same = all(torch.equal(a.cpu(), b.cpu()) for a, b in
               zip(model.state_dict().values(), model2.state_dict().values()))
    same_opt = torch.equal(opt.state[w]["exp_avg"].cpu(), opt2.state[w2]["exp_avg"].cpu())
    return {"dcp": (same, same_opt, spmd.sharding_spec(w2), sorted(p.name for p in
                                                                    Path(tmp).iterdir())),"devices": spmd.device_count(), "world": runtime.world_size(),
            "w_spec": spmd.sharding_spec(w), "w_bytes": spmd.local_shard_bytes(w),
            "grad_bytes": grad_bytes,
            "adam_bytes": [a + b for a, b in zip(*(spmd.local_shard_bytes(opt.state[w][k])
                                                   for k in ("exp_avg", "exp_avg_sq")))],
            "x_spec": spmd.sharding_spec(x), "x_bytes": spmd.local_shard_bytes(x),
            "keys": sorted(consolidated_state_dict(model))}


def test_fsdp_shards_8_ways_read_from_the_real_tensors(tmp_path):
    from xla_utils.simulate.devices import run_on_devices

    r = run_on_devices(_inspect_fsdp_shards, (str(tmp_path),), DEVICES, timeout=300)
    assert r["dcp"] == (True, True, "{devices=[8,1]0,1,2,3,4,5,6,7}", ["epoch_001-t.dcp"])
    assert r["devices"] == DEVICES and r["world"] == 1  # one process owns all 8
    assert r["w_spec"].startswith("{devices=[8,1]") and r["x_spec"].startswith("{devices=[8,1]")
    assert r["w_bytes"] == [32 * 32 * 4 // 8] * 8 and r["grad_bytes"] == r["w_bytes"]
    assert r["adam_bytes"] == [2 * 32 * 32 * 4 // 8] * 8
    assert r["x_bytes"] == [8 * 64 * 4] * 8
    assert r["keys"] == sorted(Net().state_dict())


class Tower(torch.nn.Module):
    """8 blocks of 64 x 64 (tiny compiles; 8 units, none more than 1/8 of the model)."""

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.Sequential(*(Block(64) for _ in range(8)))
        self.norm = torch.nn.BatchNorm1d(64)

    def forward(self, x):
        return self.norm(self.blocks(x))


def _device_model_bytes(model) -> int:
    """Bytes ONE device holds of ``model``'s parameters and buffers now, read from the
    real shards (an unsharded device tensor counts whole: every device holds it)."""
    from xla_utils.runtime import spmd

    ts = {id(t): t for t in [*model.parameters(), *model.buffers()] if t.device.type == "xla"}
    return sum(max(spmd.local_shard_bytes(t)) for t in ts.values())


def _setup_peak_memory():
    """In the 8-device SPMD process: the peak per-device bytes of the model while it is
    placed (after every parameter), moved whole first (what FSDPv2 does to a unit) versus
    straight into its shards; and the trainer's own wrap from a host model, with every
    mark_sharding call recorded (an unsharded parameter reaching it was on the devices whole)."""
    import torch_xla.distributed.spmd as xs

    from xla_utils.runtime import spmd
    from xla_utils.step.strategy import MeshRun, enter_mesh

    _, run = enter_mesh(StrategyPlan("fsdp", DEVICES, DEVICES, wrap=(Block,)), None)
    total = sum(t.numel() * t.element_size() for t in [*Tower().parameters(), *Tower().buffers()])
    whole, peak = Tower(), [0]
    for name, p in list(whole.named_parameters()):  # nn.Module.to, one tensor at a time
        mod = whole.get_submodule(name.rpartition(".")[0])
        mod._parameters[name.rpartition(".")[2]] = torch.nn.Parameter(p.detach().to(runtime.device()))
        peak[0] = max(peak[0], _device_model_bytes(whole))
    whole_peak = peak[0]
    sharded, peak[0] = Tower(), 0
    spmd.shard_to_device(sharded, run.mesh,
                         on_place=lambda: peak.__setitem__(0, max(peak[0], _device_model_bytes(sharded))))
    sharded_peak = peak[0]
    seen, real = [], xs.mark_sharding

    def recording(t, *a, **k):
        if isinstance(t, torch.nn.Parameter):
            seen.append(spmd.sharding_spec(t))
        return real(t, *a, **k)

    xs.mark_sharding = recording
    try:
        model = MeshRun.wrap(run, Tower())
    finally:
        xs.mark_sharding = real
    from xla_utils.train.ema import DeviceEMA

    ema = DeviceEMA(Tower(), 0.9, 0, runtime.device(), place=run.place)
    x = next(iter(run.feed([(torch.randn(64, 64),)])))[0]
    out = model(x).sum()
    out.backward()
    runtime.sync()
    return {"total": total, "whole_peak": whole_peak, "sharded_peak": sharded_peak,
            "unsharded_params_marked": [s for s in seen if s == ""],
            "after_wrap": _device_model_bytes(model), "loss_finite": math.isfinite(out.item()),
            "specs": sorted({spmd.sharding_spec(p) for p in model.parameters()}),
            "ema_same_specs": [spmd.sharding_spec(e) == spmd.sharding_spec(p) for e, p in
                               zip(ema.module.parameters(), model.parameters())],
            "ema_bytes": _device_model_bytes(ema.module)}


def test_fsdp_setup_never_holds_the_model_whole_on_a_device():
    """A model bigger than one core: each parameter goes from the host straight into its
    shards, so the per-device peak during set-up is ~1/8 of the model, not all of it."""
    from xla_utils.simulate.devices import run_on_devices

    r = run_on_devices(_setup_peak_memory, (), DEVICES, timeout=300)
    buffers = 2 * 64 * 4 + 8  # BatchNorm's running stats and step count stay replicated
    assert r["whole_peak"] == r["total"] - buffers  # the probe sees the parameters moved whole
    assert r["sharded_peak"] == (r["total"] - buffers) / DEVICES  # 1/8 of the parameters
    assert r["sharded_peak"] < r["total"] / 6
    assert r["unsharded_params_marked"] == []  # FSDPv2 found every parameter sharded already
    assert r["after_wrap"] <= (r["total"] - buffers) / DEVICES + buffers
    assert r["specs"] == ["{devices=[8,1]0,1,2,3,4,5,6,7}", "{devices=[8]0,1,2,3,4,5,6,7}"]
    assert r["loss_finite"]
    # the EMA copy (ema=) is placed the same way: sharded like its parameters
    assert r["ema_same_specs"] == [True] * 18 and r["ema_bytes"] == r["after_wrap"]


@pytest.mark.slow
def test_resnet18_one_short_epoch_under_fsdp():
    torchvision = pytest.importorskip("torchvision")
    from torchvision.models.resnet import BasicBlock

    tr = OneCycleTrainer(lambda: torchvision.models.resnet18(weights=None, num_classes=10),
                         torch.nn.CrossEntropyLoss(), digits_rgb_uint8(64), digits_rgb_uint8(40),
                         batch_size=4, epochs=1, max_lr=1e-3, compile_cache=None,
                         strategy="fsdp", fsdp_wrap=[BasicBlock],
                         activation_checkpointing=True, flip=False)
    h = tr.fit(simulate=DEVICES)  # 2 steps of 32 images, then validation (padded tail)
    assert h.world_size == DEVICES and len(h.epochs) == 1
    assert math.isfinite(h.epochs[0]["train_loss"]) and h.epochs[0]["samples"] == 40
    assert math.isfinite(h.epochs[0]["val_loss"])
    assert set(h.state_dict) == set(tr.model.state_dict())


# ------------------------------------------------------------- lr_find on the mesh
# ------------------------------------------------------------- bad input, no device time
def test_bad_strategy_settings_are_refused_in_the_config():
    data = digits_dataset(64)
    with pytest.raises(ValueError, match="strategy must be one of"):
        OneCycleTrainer(Net, torch.nn.CrossEntropyLoss(), data, strategy="ddp")
    with pytest.raises(ValueError, match="fsdp_wrap applies to FSDP units.*strategy='fsdp'"):
        OneCycleTrainer(Net, torch.nn.CrossEntropyLoss(), data, strategy="spmd", fsdp_wrap=[Block])
    with pytest.raises(ValueError, match="activation_checkpointing applies"):
        OneCycleTrainer(Net, torch.nn.CrossEntropyLoss(), data, activation_checkpointing=True)
    with pytest.raises(ValueError, match="fsdp_wrap must be None"):
        OneCycleTrainer(Net, torch.nn.CrossEntropyLoss(), data, strategy="fsdp", fsdp_wrap=0.5)


def test_wrap_policy_matching_nothing_is_refused_before_device_time():
    tr = OneCycleTrainer(Net, torch.nn.CrossEntropyLoss(), digits_dataset(64), batch_size=8,
                         strategy="fsdp", fsdp_wrap=["DecoderLayer"], compile_cache=None)
    with pytest.raises(ValueError, match=r"fsdp_wrap names \['DecoderLayer'\].*'Block'"):
        tr.fit(simulate=DEVICES)
    with pytest.raises(ValueError, match="fsdp_wrap=5000 .* largest has 2,112 parameters"):
        resolve_wrap(Net(), 5000)
    assert resolve_wrap(Net(), [Block, "Linear"]) == (Block, torch.nn.Linear)
    assert resolve_wrap(Net(), 1000) == 1000


def test_mesh_that_does_not_divide_the_batch_is_refused():
    with pytest.raises(ValueError, match="global batch 30 does not divide over the mesh's 8 "
                                         "devices.*multiple of 8"):
        check_global_batch(30, 8)
    check_global_batch(64, 8)


def test_fsdp_on_torch_xla_without_spmd_names_the_fix():
    from xla_utils.runtime.spmd import spmd_support

    assert spmd_support() is None  # both CI stacks have FSDPv2
    why = spmd_support(("torch_xla.experimental.no_such_fsdpv2",))
    assert "cannot run SPMD/FSDPv2" in why and "strategy='spawn'" in why


@pytest.mark.skipif(runtime.tpu_present(), reason="a TPU host has the devices")
def test_mesh_strategy_without_tpu_or_simulate_names_the_fix():
    tr = OneCycleTrainer(Net, torch.nn.CrossEntropyLoss(), digits_dataset(64), batch_size=8,
                         strategy="fsdp", compile_cache=None)
    for run in (tr.fit, lambda: tr.find_lr(on_mesh=True)):
        with pytest.raises(ValueError, match="strategy='fsdp' needs the devices of a TPU.*"
                                             "simulate=8"):
            run()
