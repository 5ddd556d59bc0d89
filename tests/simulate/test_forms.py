"""xla_utils.simulate on the other torch_xla program forms (issue 21): list
reduce_scatter with outputs, replica groups, torch.distributed's ``xla``
backend and DDP, SPMD on N real XLA:CPU devices. Scripts in tests/fixtures/forms/."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from xla_utils import runtime as rt
from xla_utils import simulate

FORMS = Path(__file__).resolve().parents[1] / "fixtures" / "forms"
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.multicore
@pytest.mark.timeout(300)
def test_list_reduce_scatter_groups_and_subset_rendezvous_8_cores(capfd):
    assert simulate.run_script(FORMS / "mp_collectives.py", cores=8) == 0
    assert capfd.readouterr().out.count("mp_collectives ok") == 8


@pytest.mark.multicore
@pytest.mark.timeout(300)
def test_torch_compile_fullgraph_over_collectives_warns_once(capfd):
    assert simulate.run_script(FORMS / "compiled_collectives.py", cores=4) == 0
    out, err = capfd.readouterr()
    assert out.count("compiled_collectives ok") == 4
    assert err.count("torch.compile(fullgraph=True) is not checked") == 1


def _rank_dependent_groups():
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.runtime as xr

    groups = [[0, 1], [2, 3]] if xr.global_ordinal() != 3 else [[0, 2], [1, 3]]
    return xm.all_reduce(xm.REDUCE_SUM, torch.ones(2, device=torch_xla.device()),
                         groups=groups).tolist()


@pytest.mark.multicore
@pytest.mark.timeout(120)
def test_rank_dependent_groups_are_a_named_mismatch():
    with pytest.raises(rt.ReplicaError) as info:
        rt.launch(_rank_dependent_groups, simulate=4)
    msg = info.value.remote_traceback
    assert info.value.exc_type == "CollectiveError"
    assert "groups=[[0, 1], [2, 3]]" in msg and "groups=[[0, 2], [1, 3]]" in msg
    assert "rank 3: xm.all_reduce" in msg and "test_forms.py" in msg


@pytest.mark.multicore
@pytest.mark.timeout(300)
@pytest.mark.parametrize("init", ["xla", "env"])
def test_torch_distributed_xla_backend_collectives_8_cores(init, capfd):
    args = ["--env"] if init == "env" else []
    assert simulate.run_script(FORMS / "dist_collectives.py", cores=8, args=args) == 0
    assert capfd.readouterr().out.count("dist_collectives ok") == 8


def _dist_rank_dependent():
    import torch.distributed as dist
    import torch_xla
    import torch_xla.distributed.xla_backend  # noqa: F401

    dist.init_process_group("xla", init_method="xla://")
    x = torch.ones(2, device=torch_xla.device())
    if dist.get_rank() == 0:
        dist.all_reduce(x)
    else:
        dist.all_gather([torch.zeros_like(x) for _ in range(2)], x)
    return x.cpu().tolist()


@pytest.mark.multicore
@pytest.mark.timeout(120)
def test_dist_rank_dependent_collective_is_named_not_a_hang():
    t0 = time.monotonic()
    with pytest.raises(rt.ReplicaError) as info:
        rt.launch(_dist_rank_dependent, simulate=2)
    assert time.monotonic() - t0 < 60
    msg = info.value.remote_traceback
    assert info.value.exc_type == "CollectiveError"
    assert "rank 0: dist.all_reduce" in msg and "rank 1: dist.all_gather" in msg
    assert "test_forms.py" in msg


# --------------------------------------------------------------------------
# SPMD: one process with N real XLA:CPU devices
# --------------------------------------------------------------------------
def _cli(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ, PJRT_DEVICE="CPU")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-m", "xla_utils.simulate", *args],
                          capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)


@pytest.mark.slow
@pytest.mark.multicore
@pytest.mark.timeout(300)
def test_spmd_script_gets_8_devices_and_an_8_way_sharding_via_cli():
    p = _cli("--cores", "8", str(FORMS / "spmd_devices.py"))
    assert p.returncode == 0, p.stderr[-3000:]
    assert "spmd ok: 8 devices, {devices=[8,1]0,1,2,3,4,5,6,7}" in p.stdout
    assert "as SPMD (one process with 8 XLA:CPU devices) because it uses `use_spmd`" in p.stderr


@pytest.mark.slow
@pytest.mark.multicore
@pytest.mark.timeout(300)
def test_spmd_script_via_run_script_4_devices(capfd):
    assert simulate.run_script(FORMS / "spmd_devices.py", cores=4, args=["4"]) == 0
    assert "spmd ok: 4 devices, {devices=[4,1]0,1,2,3}" in capfd.readouterr().out


def test_form_detection_reads_code_not_comments(tmp_path):
    from xla_utils.simulate.forms import detect_form

    spawn = tmp_path / "spawn.py"
    spawn.write_text("# no xr.use_spmd() here\ns = 'mark_sharding'\nimport torch_xla\n")
    assert detect_form(spawn)[0] == "spawn"
    spmd = tmp_path / "spmd.py"
    spmd.write_text("import torch_xla.distributed.spmd as xs\nm = xs.Mesh([0], (1,))\n")
    assert detect_form(spmd) == ("spmd", "it uses `Mesh` (line 2)")


@pytest.mark.slow
@pytest.mark.multicore
@pytest.mark.timeout(300)
def test_mixing_spmd_and_spawn_is_named(tmp_path):
    script = tmp_path / "mixed.py"
    script.write_text(textwrap.dedent("""
        import torch_xla.distributed.xla_multiprocessing as xmp
        import torch_xla.runtime as xr

        def _mp_fn(index):
            xr.use_spmd()

        if __name__ == "__main__":
            xmp.spawn(_mp_fn)
    """))
    p = _cli("--cores", "2", str(script))
    assert p.returncode == 1
    assert "mixes SPMD and multi-process forms" in p.stderr and "--form spawn" in p.stderr
    p = _cli("--cores", "2", "--form", "spawn", str(script))
    assert p.returncode == 1
    assert "xr.use_spmd() inside a simulated xmp.spawn" in p.stderr
    assert "--form spmd" in p.stderr


def _all_to_all_and_permute():
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.runtime as xr

    r, dev = xr.global_ordinal(), torch_xla.device()
    # [2, 4]: column j holds 10 * rank + j; groups of two swap their column halves
    x = (torch.arange(4.0) + 10 * r).repeat(2, 1).to(dev)
    a2a = xm.all_to_all(x, split_dimension=1, concat_dimension=1, split_count=2,
                        groups=[[0, 2], [1, 3]])
    perm = xm.collective_permute(torch.full((3,), float(r), device=dev), [[0, 1], [1, 2]])
    return {r: (a2a.cpu()[0].tolist(), perm.cpu().tolist())}


@pytest.mark.multicore
@pytest.mark.timeout(120)
def test_all_to_all_with_groups_and_collective_permute_4_cores():
    import torch_xla.core.xla_model as xm  # noqa: F401  (only to fail early without torch_xla)

    got = rt.launch(_gather_all_to_all, simulate=4)
    # group [0, 2]: rank 0 gets column chunk 0 of ranks 0 and 2; rank 2 gets chunk 1
    assert got[0][0] == [0.0, 1.0, 20.0, 21.0]
    assert got[2][0] == [2.0, 3.0, 22.0, 23.0]
    assert got[1][0] == [10.0, 11.0, 30.0, 31.0]
    assert got[3][0] == [12.0, 13.0, 32.0, 33.0]
    # pairs 0->1, 1->2: rank 1 gets 0's, rank 2 gets 1's, ranks 0 and 3 get zeros
    assert [got[k][1] for k in range(4)] == [[0.0] * 3, [0.0] * 3, [1.0] * 3, [0.0] * 3]


def _gather_all_to_all():
    import torch_xla.core.xla_model as xm

    mine = _all_to_all_and_permute()
    import pickle

    blobs = xm.rendezvous("a2a", pickle.dumps(mine))
    out = {}
    for b in blobs:
        out.update(pickle.loads(b))
    return out


def _spmd_fn(index_or_tag, want=8):
    """An SPMD function (a notebook cell's): its devices and a batch's sharding spec."""
    import numpy as np
    import torch_xla
    import torch_xla.distributed.spmd as xs
    import torch_xla.runtime as xr

    xr.use_spmd()
    n = xr.global_runtime_device_count()
    mesh = xs.Mesh(np.arange(n), (n, 1), ("data", "model"))
    t = torch.arange(64.0).reshape(16, 4).to(torch_xla.device())
    xs.mark_sharding(t, mesh, ("data", None))
    return {"arg": index_or_tag, "devices": n, "world": xr.world_size(),
            "spec": torch_xla._XLAC._get_xla_sharding_spec(t), "sum": (t * 2).sum()}


@pytest.mark.multicore
@pytest.mark.timeout(300)
def test_launch_simulate_runs_an_spmd_function_on_8_devices(capfd):
    got = rt.launch(_spmd_fn, "tag", simulate=8)
    assert got["arg"] == "tag"
    assert got["devices"] == 8
    assert got["spec"].startswith("{devices=[8,1]0,1,2,3,4,5,6,7}"), got["spec"]
    assert got["sum"].device.type == "cpu" and got["sum"].item() == 2 * sum(range(64))
    err = capfd.readouterr().err
    assert "as SPMD (one process with 8 XLA:CPU devices) because it uses `use_spmd`" in err


@pytest.mark.multicore
@pytest.mark.timeout(300)
def test_simulated_spawn_cell_runs_an_spmd_function_on_8_devices(capfd):
    import torch_xla
    import torch_xla.runtime as xr

    with simulate.simulated_spawn(cores=8):
        got = torch_xla.launch(_spmd_fn, args=(8,))
        with pytest.raises(RuntimeError, match="called inside `with simulated_spawn"):
            xr.use_spmd()
    assert got["arg"] == 0  # fn(index, *args) with index 0, as the one SPMD process
    assert got["devices"] == 8
    assert got["spec"].startswith("{devices=[8,1]0,1,2,3,4,5,6,7}"), got["spec"]
    assert "because it uses `use_spmd`" in capfd.readouterr().err


def _calls_spmd_helper():
    return _spmd_fn("via helper")


def test_spmd_function_detection_follows_user_helpers_not_library_code():
    from xla_utils.simulate.forms import fn_uses_spmd

    assert "`use_spmd`" in fn_uses_spmd(_calls_spmd_helper)
    assert fn_uses_spmd(_rank_dependent_groups) is None
    assert fn_uses_spmd(rt.launch) is None  # library code is not scanned


def _spmd_fn_fails():
    import torch_xla.runtime as xr

    xr.use_spmd()
    raise KeyError(f"bad config on {xr.global_runtime_device_count()} devices")


@pytest.mark.multicore
@pytest.mark.timeout(300)
def test_spmd_function_error_carries_its_traceback():
    with pytest.raises(rt.ReplicaError) as info:
        rt.launch(_spmd_fn_fails, simulate=4)
    assert info.value.exc_type == "KeyError"
    assert "bad config on 4 devices" in info.value.remote_traceback
    assert "_spmd_fn_fails" in info.value.remote_traceback


# --------------------------------------------------------------------------
# One model, every form: the same loss curve as one device
# --------------------------------------------------------------------------
@pytest.mark.multicore
@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_every_form_gives_the_one_device_loss_curve(tmp_path, capfd):
    script = FORMS / "train_forms.py"
    curves = {}
    for name, cores, mode, form in (("one", 1, "xm", "spawn"), ("xm", 8, "xm", "spawn"),
                                    ("ddp", 8, "ddp", "spawn"),
                                    ("compiled", 8, "compiled", "spawn"),
                                    ("spmd", 8, "spmd", "spmd")):
        out = tmp_path / f"{name}.json"
        assert simulate.run_script(script, cores=cores, form=form,
                                   args=["--mode", mode, "--out", str(out)]) == 0
        got = json.loads(out.read_text())
        if mode == "spmd":
            assert got["devices"] == 8
            got = got["losses"]
        assert len(got) == 20 and all(v == v for v in got)
        curves[name] = got
    for name, curve in curves.items():
        assert curve == pytest.approx(curves["one"], abs=1e-4), name
    assert curves["one"][-1] < 0.5 * curves["one"][0]  # it trains
    err = capfd.readouterr().err
    assert err.count("torch_xla.compile(full_graph=True) is not checked") == 1


@pytest.mark.multicore
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_mp_mnist_style_script_three_modes_agree(capfd):
    """test_train_mp_mnist.py's three modes (xm.optimizer_step, --pjrt_distributed,
    --ddp) on 8 simulated cores: the same final loss and accuracy."""
    script = FORMS / "train_mp_mnist_style.py"
    finals = []
    for mode in ([], ["--pjrt_distributed"], ["--ddp"]):
        assert simulate.run_script(script, cores=8, args=mode) == 0
        lines = [l for l in capfd.readouterr().out.splitlines() if l.startswith("final ")]
        assert len(lines) == 1, lines
        finals.append(lines[0])
    assert finals[0] == finals[1] == finals[2], finals
    acc = float(finals[0].split("accuracy=")[1])
    assert acc > 0.8, finals[0]  # it learns
