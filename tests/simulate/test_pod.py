"""A pod slice rehearsed on one machine (xla_utils.simulate.pod): the README's quick start as
a script, its paths in the GCS emulator's bucket, run once per simulated host (each with its own
/tmp, HOME and working folder), against the same script on one host; a host lost, a host late,
a cache path only one host has."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import xla_utils
from xla_utils.runtime import resolve
from xla_utils.runtime.hosts import POD_ENV, PodWorld, simulated_pod, slice_host

sys.path.insert(0, str(Path(__file__).parents[1]))
from test_readme import _block, _plants, _substitute  # noqa: E402

PRIVATE = os.geteuid() == 0  # private disks need root (a mount namespace)
STRATEGIES = Path(__file__).parents[2] / "docs" / "STRATEGIES.md"


def test_a_host_of_a_rehearsed_slice_has_the_slice_s_placement(monkeypatch):
    pod = PodWorld(hosts=2, host=1, cores=4, master_host=1, port=1, folder="/x")
    assert [pod.ordinal(i) for i in range(4)] == [0, 1, 2, 3]  # the master host holds 0..3
    assert [pod.ordinal(i, host=0) for i in range(4)] == [4, 5, 6, 7]
    assert [pod.host_of(g) for g in (0, 3, 4, 7)] == [1, 1, 0, 0]
    monkeypatch.setenv(POD_ENV, pod.env_value())
    assert simulated_pod() == pod and slice_host() == (1, 2)
    p = resolve()
    assert (p.backend, p.kind, p.replicas, p.host_devices, p.hosts, p.host, p.joined) == \
        ("xla", "xla_cpu", 8, 4, 2, 1, "pod")
    assert resolve(simulate=8) == p and resolve(1).replicas == 1
    with pytest.raises(ValueError, match=r"simulate=4 on host 1 .* the world is 8 cores"):
        resolve(simulate=4)
    monkeypatch.setenv(POD_ENV, "{")
    with pytest.raises(ValueError, match="XLA_UTILS_SIM_POD"):
        resolve()


def _script(tmp_path: Path, bucket: str, out: Path) -> Path:
    """The README's quick start with its paths in ``bucket`` (cache, checkpoints), small sizes
    and a small CNN (so that 8 replica processes fit CI), the LR finder on; then what each
    host saw, written to ``out`` (shared /dev/shm: every host's disk is its own)."""
    code = _substitute(_block("python", "xla_utils.split("), {
        '"cache/train"': f'"{bucket}/cache/train"', '"cache/test"': f'"{bucket}/cache/test"',
        'checkpoint_dir="ckpt"': f'checkpoint_dir="{bucket}/ckpt"',
        "size=224": "size=16", "batch_size=64": "batch_size=2", "epochs=5": "epochs=2",
        "max_lr=1e-3": 'max_lr="find"', "trainer.check()": "", "simulate=8": "simulate=4",
        "torchvision.models.resnet18(num_classes=train.num_classes)":
            "torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, stride=2), torch.nn.ReLU(), "
            "torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(4, 3))"})
    trailer = f"""
import json, os
where = json.loads(os.environ.get("XLA_UTILS_SIM_POD", '{{"host": 0}}'))["host"]
torch.save(trainer.model.state_dict(), "{out}/weights-%d.pt" % where)
with open("{out}/out-%d.json" % where, "w") as f:
    json.dump({{"world": history.world_size, "run_id": history.run_id, "base_lr": history.base_lr,
               "losses": [e["train_loss"] for e in history.epochs], "preds": preds.tolist(),
               "submission": open("submission.csv").read() if os.path.exists("submission.csv")
               else None}}, f)
"""
    path = tmp_path / "quick_start.py"
    path.write_text("import torch\ntorch.manual_seed(0)\n" + code + trailer)
    return path


def _simulate(args: list[str], cwd: Path, env: dict, timeout: int = 400) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "xla_utils.simulate", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def _env(tmp_path: Path, **extra: str) -> dict:
    env = {**os.environ, "HOME": str(tmp_path / "home"), **extra,
           "PYTHONPATH": os.pathsep.join([str(Path(xla_utils.__file__).parents[1]),
                                          os.environ.get("PYTHONPATH", "")])}
    env.pop(POD_ENV, None)
    return env


def _doc_command() -> list[str]:
    """docs/STRATEGIES.md's rehearsal command's options (tests/test_readme.py counts its block
    as run here)."""
    doc = next(b for b in re.findall(r"```bash\n(.*?)```", STRATEGIES.read_text(), re.S)
               if "xla_utils.simulate --hosts" in b).strip()
    assert doc == "python -m xla_utils.simulate --hosts 2 --cores 4 train.py", doc
    return doc.split()[3:-1]


def _shared_out(tmp_path: Path) -> Path:
    """A folder every simulated host sees (/dev/shm: their /tmp and working folder are their
    own), removed with tmp_path's test."""
    out = Path(f"/dev/shm/xla_utils-test-pod-{os.getpid()}-{tmp_path.name}")
    out.mkdir()
    return out


@pytest.mark.slow
@pytest.mark.multicore
@pytest.mark.timeout(900)
def test_quick_start_on_two_hosts_equals_one_host_of_as_many_cores(tmp_path, gcs_emulator):
    """The README's quick start as a script, its cache and checkpoints in the emulator's
    bucket: on 2 hosts x 2 cores (docs/STRATEGIES.md's command with CI's 2 cores per host;
    4 per host was checked by hand, 2026-12-02) with global ordinal 0 on the second host, the
    same losses, weights and predictions as on 1 host x 4 cores (the same global batch); the cache built by one host while the other waits, the LR finder swept once, one
    checkpoint object per epoch, every test id once, in order, in the master host's
    submission."""
    _plants(tmp_path)
    out = _shared_out(tmp_path)
    try:
        runs = {}
        # 2 cores per host here (CI's 2 cores): a world of 4, against one host of 4 cores
        for name, args in (("one", ["--hosts", "1", "--cores", "4"]),
                           ("two", [*_doc_command(), "--master-host", "1"])):
            if name == "two":
                args[args.index("--cores") + 1] = "2"
            bucket = gcs_emulator()
            (out / name).mkdir()
            script = _script(tmp_path, bucket, out / name)
            if args is None:
                proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, timeout=400,
                                      env=_env(tmp_path / name), capture_output=True, text=True)
            else:
                proc = _simulate([*args, str(script)], tmp_path, _env(tmp_path / name))
            assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
            runs[name] = (bucket, proc.stdout + proc.stderr)
        want = json.loads((out / "one" / "out-0.json").read_text())
        w0 = torch.load(out / "one" / "weights-0.pt")
        for host in (0, 1):
            got = json.loads((out / "two" / f"out-{host}.json").read_text())
            assert got["world"] == 4 and got["base_lr"] == want["base_lr"]
            assert got["losses"] == pytest.approx(want["losses"], abs=1e-5)
            assert torch.tensor(got["preds"]) == pytest.approx(torch.tensor(want["preds"]), abs=1e-5)
            w = torch.load(out / "two" / f"weights-{host}.pt")
            assert max(float((w[k] - w0[k]).abs().max()) for k in w0) <= 1e-5
        log = runs["two"][1]
        # one display: the sweep's and the epochs' bars come from global ordinal 0 only
        assert len(re.findall(r"^lr_find: \d+ steps .*100%", log, re.M)) == 1, log[-3000:]
        assert not re.search(r"^\[host 0\] (lr_find: \d+ steps|Epoch)", log, re.M)
        assert "4 cores on 2 hosts x 2 per core = 8 global batch" in log
        # every host ran build_cache; one built the cache (the other waited for it, or found it)
        assert len(re.findall(r"in gs://\S+/cache/train: .*\(1 shards built", log)) == 1, log[-3000:]
        assert len(re.findall(r"in gs://\S+/cache/train: .*\(0 shards built, 1 reused", log)) == 1
        import fsspec

        run_id = json.loads((out / "two" / "out-1.json").read_text())["run_id"]
        names = sorted(p.rsplit("/", 1)[1] for p in
                       fsspec.filesystem("gs").ls(runs["two"][0][5:] + "/ckpt"))
        assert [n for n in names if n.startswith("epoch_")] == \
            [f"epoch_00{e}-{run_id}.pt" for e in (1, 2)]
        rows = json.loads((out / "two" / "out-1.json").read_text())["submission"].splitlines()
        assert [r.split(",")[0] for r in rows[1:]] == [f"test_{i}.png" for i in range(5)]
    finally:
        import shutil

        shutil.rmtree(out, ignore_errors=True)


POINTS = Path(__file__).parents[1] / "fixtures" / "hosts" / "pod_points.py"


def _no_process_left(marker: str) -> bool:
    """No process whose environment holds ``marker`` is left (the slice's hosts, their zygotes,
    jobs and replicas all inherit it; other tests' processes do not)."""
    for pid in os.listdir("/proc"):
        if pid.isdigit() and int(pid) != os.getpid():
            try:
                env = open(f"/proc/{pid}/environ", "rb").read().decode(errors="replace")
            except OSError:
                continue
            if marker in env:
                return False
    return True


@pytest.mark.slow
@pytest.mark.multicore
@pytest.mark.timeout(400)
def test_a_host_killed_mid_run_ends_the_slice_naming_it(tmp_path):
    """One host killed mid-epoch (SIGKILL to every process): the other host's fit ends within
    60 s with an error naming the dead host, and no process of the slice is left."""
    out = _shared_out(tmp_path)
    script = tmp_path / "killed_host.py"
    script.write_text(POINTS.read_text())
    try:
        import time

        t0 = time.monotonic()
        mark = f"XLA_UTILS_TEST_SLICE_{os.getpid()}_{tmp_path.name}"
        proc = _simulate(["--hosts", "2", "--cores", "2", "--kill-host", "1:12", str(script),
                          "train", "400", str(out)], tmp_path, _env(tmp_path, **{mark: "1"}))
        took = time.monotonic() - t0
        log = proc.stdout + proc.stderr
        assert proc.returncode != 0 and not (out / "out-0.json").exists(), log[-3000:]
        assert "host 1 of 2 was lost: killed" in log
        # host 0's own error names the lost host
        assert re.search(r"^HostLost: host 1 of 2 was lost: killed.*host 0 stopped too", log,
                         re.M) or re.search(r"HostLost: host 1 of 2 was lost", log), log[-3000:]
        assert took < 12 + 60, took
        assert _no_process_left(mark + "=1")
    finally:
        import shutil

        shutil.rmtree(out, ignore_errors=True)


@pytest.mark.slow
@pytest.mark.multicore
@pytest.mark.skipif(not PRIVATE, reason="private disks need root (a mount namespace)")
@pytest.mark.timeout(400)
def test_checkpoints_in_a_bucket_resume_on_every_host_and_a_local_folder_is_refused(
        tmp_path, gcs_emulator):
    """Global ordinal 0 on the second host writes the checkpoints; resume="last" from the
    bucket continues on both hosts; from a local folder (only the master host's disk has it)
    the first host refuses, naming the fix, and the slice stops."""
    proc = _simulate(["--hosts", "2", "--cores", "1", "--master-host", "1", str(POINTS),
                      "resume", gcs_emulator()], tmp_path, _env(tmp_path))
    log = proc.stdout + proc.stderr
    assert "[host 0] resumed on host 0: epochs [1, 2]" in log and "resumed on host 1: epochs [1, 2]" \
        in log, log[-4000:]
    assert proc.returncode != 0
    assert re.search(r"\[host 0\] \S*ResumeError: .*\n\[host 0\] This is host 0 of 2: each host "
                     r"of the run reads its own disk.*checkpoint_dir='gs://", log), log[-4000:]
    assert "host 0 of 2 was lost: it ended first, with exit code 1" in log


@pytest.mark.slow
@pytest.mark.skipif(not PRIVATE, reason="private disks need root (a mount namespace)")
@pytest.mark.timeout(400)
def test_a_cache_only_on_the_first_host_s_disk_is_refused_on_the_second(tmp_path):
    """The first host builds a cache in its working folder; the second host, whose disk
    is its own, refuses that path before training, naming it and the fix (a bucket)."""
    proc = _simulate(["--hosts", "2", "--cores", "1", str(POINTS), "local-cache"], tmp_path,
                     _env(tmp_path))
    log = proc.stdout + proc.stderr
    assert proc.returncode != 0, log[-3000:]
    assert re.search(r"\[host 1\] FileNotFoundError: \S*cache/train does not exist", log), log[-4000:]
    assert "[host 1] This is host 1 of 2: each host of a pod slice" in log
    assert "host 1 of 2 was lost: it ended first, with exit code 1" in log
    assert "epoch 1 " not in log  # nobody trained
    assert not (tmp_path / "cache").exists()  # the first host's disk was its own too


@pytest.mark.timeout(300)
def test_every_host_building_one_bucket_cache_builds_it_once(tmp_path, gcs_emulator):
    """Every host of a slice runs the script's build_cache into the same bucket at once: one
    builds, the other says it waits, then reuses the finished cache (without a slice the
    second build is refused as before: the lock is held)."""
    _plants(tmp_path, per_class=200)
    url = gcs_emulator() + "/cache/train"
    code = f"import xla_utils; xla_utils.build_cache('plants/train', {url!r}, size=64, variants=4)"
    procs = [subprocess.Popen(
        [sys.executable, "-c", code], cwd=tmp_path, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True,
        env={**_env(tmp_path), POD_ENV: PodWorld(2, h, 1, 0, 1, "/nowhere").env_value()})
        for h in (0, 1)]
    logs = [p.communicate(timeout=240)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], logs
    both = "".join(logs)
    assert len(re.findall(r"\(1 shards built", both)) == 1, logs
    waited = [log for log in logs if "another host is building" in log]
    # the second host either waited for the first or found its cache finished
    assert len(re.findall(r"\(0 shards built, 1 reused", both)) == 1, logs
    assert all("(0 shards built, 1 reused" in log for log in waited), logs


def test_max_lr_find_on_a_real_multi_host_tpu_slice_is_refused_with_the_fix(monkeypatch):
    """On a real TPU slice the hosts have no channel before the launch (the rehearsal's
    store is the simulator's), so a sweep per host could pick different LRs: refused, naming
    the fix. The placement reads the slice from TPU_WORKER_HOSTNAMES / TPU_WORKER_ID."""
    from torch import nn

    from xla_utils import OneCycleTrainer
    from xla_utils.runtime.placement import Placement

    monkeypatch.setenv("TPU_WORKER_HOSTNAMES", "t1k-w-0,t1k-w-1")
    monkeypatch.setenv("TPU_WORKER_ID", "1")
    assert slice_host() == (1, 2)
    data = torch.utils.data.TensorDataset(torch.randn(32, 4), torch.randint(0, 2, (32,)))
    t = OneCycleTrainer(nn.Linear(4, 2), nn.CrossEntropyLoss(), data, batch_size=4)
    pod = Placement("xla", "tpu", 4, host_devices=4, hosts=2, host=1)
    with pytest.raises(ValueError, match=r"max_lr='find' on host 1 of a 2-host TPU pod slice.*"
                                         r"pass max_lr=<that number> on every host"):
        t._new_run_lr(t.config, "find", pod)


RAW = '''
import os, sys
import torch
import torch_xla
import torch_xla.core.xla_model as xm
import torch_xla.runtime as xr

def fn(index):
    dev = torch_xla.device()
    total = xm.all_reduce(xm.REDUCE_SUM, torch.full((1,), float(xr.global_ordinal()), device=dev))
    xm.save({"ordinal": xr.global_ordinal()}, os.path.join(sys.argv[1], "saved-%d.pt" % xr.host_index()))
    print("REPLICA index=%d world=%d ordinal=%d local=%d host=%d master=%s sum=%d" % (
        index, xr.world_size(), xr.global_ordinal(), xr.local_ordinal(), xr.host_index(),
        xm.is_master_ordinal(local=False), int(total.cpu().item())), flush=True)

if __name__ == "__main__":
    torch_xla.launch(fn)
    print("WORKER", os.environ["TPU_WORKER_ID"], flush=True)
'''


@pytest.mark.slow
@pytest.mark.multicore
@pytest.mark.timeout(300)
def test_a_torch_xla_script_sees_the_slice_s_world_on_every_host(tmp_path):
    """An unmodified torch_xla script (torch_xla.launch) on 2 hosts x 2 cores, global ordinal 0
    on the second host, the first host started 20 s late: 4 replicas, ordinals 0-1 on host 1
    and 2-3 on host 0, one global master, an all_reduce over all 4, xm.save written once per
    host (torch_xla's default)."""
    script = tmp_path / "raw.py"
    script.write_text(RAW)
    out = _shared_out(tmp_path)
    try:
        proc = _simulate(["--hosts", "2", "--cores", "2", "--master-host", "1", "--late-host",
                          "0:20", str(script), str(out)], tmp_path, _env(tmp_path))
        log = proc.stdout + proc.stderr
        assert proc.returncode == 0, log[-3000:]
        rows = re.findall(r"^(\[host 0\] )?REPLICA index=(\d) world=(\d) ordinal=(\d) local=(\d) "
                          r"host=(\d) master=(\w+) sum=(\d+)$", log, re.M)
        got = sorted((int(o), int(h), int(i), int(lo), m, int(w), int(s))
                     for _, i, w, o, lo, h, m, s in rows)
        assert got == [(0, 1, 0, 0, "True", 4, 6), (1, 1, 1, 1, "False", 4, 6),
                       (2, 0, 0, 0, "False", 4, 6), (3, 0, 1, 1, "False", 4, 6)], log[-3000:]
        assert all((row[0] == "[host 0] ") == (row[5] == "0") for row in rows)
        assert sorted(p.name for p in out.iterdir()) == ["saved-0.pt", "saved-1.pt"]
        assert torch.load(out / "saved-1.pt")["ordinal"] == 0  # host 1's local master
        assert "[host 0] WORKER 0" in log and re.search(r"^WORKER 1$", log, re.M)
    finally:
        import shutil

        shutil.rmtree(out, ignore_errors=True)


def test_the_rehearsal_s_options_are_checked(tmp_path, capsys):
    """Options of a slice without --hosts, negative times and SPMD scripts are refused."""
    from xla_utils.simulate import main, run_script

    x = tmp_path / "x.py"
    x.write_text("print('never run')\n")
    for argv, why in ((["--late-host", "1:5", str(x)], "--late-host rehearses a pod slice"),
                      (["--hosts", "2", "--late-host", "1:-3", str(x)], "must be 0 or more"),
                      (["--hosts", "2", "--master-host", "2", str(x)], "master_host: host 2")):
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == 2 and why in capsys.readouterr().err
    spmd = tmp_path / "spmd.py"
    spmd.write_text("import torch_xla.runtime as xr\nxr.use_spmd()\n")
    with pytest.raises(ValueError, match=r"spmd program .* Rehearse the spmd program on one host"):
        run_script(spmd, cores=2, hosts=2)
