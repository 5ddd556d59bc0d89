"""The torch backend's multi-replica launch (xla_utils.runtime.torch_launch) with
``XLA_UTILS_CPU_REPLICAS=2``: two forked CPU processes over gloo, as two GPUs over NCCL."""
from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import xla_utils
from xla_utils import runtime as rt
from xla_utils.runtime import torch_launch
from xla_utils.runtime.placement import Placement
from xla_utils.env.gpu import GPUFacts, TorchDevices, torch_devices

T4 = GPUFacts("Tesla T4", (7, 5), 15360, 0, "GPU-a")


@pytest.fixture
def two_cpu_replicas(monkeypatch):
    monkeypatch.setenv("XLA_UTILS_CPU_REPLICAS", "2")


def test_torch_devices_counts_gpus_or_the_cpu_replicas():
    assert torch_devices({}, gpus=[T4, T4]) == TorchDevices(2, "cuda", (T4, T4), "nvidia-smi")
    assert torch_devices({}, gpus=[]).count == 1
    cpu = torch_devices({"XLA_UTILS_CPU_REPLICAS": "3"}, gpus=[T4, T4])
    assert (cpu.count, cpu.kind, cpu.gpus) == (3, "cpu", ())
    for bad in ("0", "two", "-1"):
        with pytest.raises(ValueError, match=f"XLA_UTILS_CPU_REPLICAS={bad!r}"):
            torch_devices({"XLA_UTILS_CPU_REPLICAS": bad})


def _on(cores, count: int, kind: str) -> Placement:
    return Placement("torch", kind, 1 if cores == 1 else count, cores == 1, None, count)


def test_when_a_torch_launch_starts_replica_processes():
    assert torch_launch.forks(_on("all", 2, "cuda"), cuda_used=False)
    assert torch_launch.forks(_on("all", 2, "cpu"), cuda_used=False)
    assert torch_launch.forks(_on("all", 2, "cuda"), cuda_used=True)  # fresh interpreters then
    assert not torch_launch.forks(_on("all", 1, "cuda"), cuda_used=False)  # one GPU: here
    # one replica on a 2-GPU machine: forked, so the notebook stays free of CUDA ...
    assert torch_launch.forks(_on(1, 2, "cuda"), cuda_used=False)
    # ... unless CUDA is in use here already; CPU replicas need no such care
    assert not torch_launch.forks(_on(1, 2, "cuda"), cuda_used=True)
    assert not torch_launch.forks(_on(1, 2, "cpu"), cuda_used=False)


@dataclass
class _Plan:
    model: torch.nn.Module
    loss: object


def _fit_like(plan: _Plan, epochs: int = 1):
    return plan


def test_what_cannot_travel_to_fresh_replicas_is_named():
    """Checked in this process, before any replica starts: the object's path from the
    function's parameters and its type."""
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    model.keep = threading.Lock()  # an attribute of a module, not a submodule
    with pytest.raises(rt.NotSendableError, match=r"plan\.model\.keep \(a _thread\.lock\)"
                       r".*this notebook initialised CUDA.*restart the kernel") as info:
        torch_launch.sendable_call(_fit_like, (_Plan(model, None), 3),
                                   "this notebook initialised CUDA")
    assert isinstance(info.value, TypeError)
    with pytest.raises(rt.NotSendableError, match=r"plan\.loss\[1\] \(a _thread\.RLock\)"):
        torch_launch.sendable_call(_fit_like, (_Plan(torch.nn.Linear(1, 1),
                                                     [1, threading.RLock()]),), "why")
    call = torch_launch.sendable_call(_fit_like, (_Plan(torch.nn.Linear(1, 1), None),), "why")
    fn, args = pickle.loads(call)
    assert fn is _fit_like and isinstance(args[0].model, torch.nn.Linear)


# A notebook: torch.cuda.is_available() first (on torch's CUDA wheel this poisons every
# later fork, GPU or not), then a model, a loss and a dataset defined in __main__.
_NOTEBOOK = """
import json, os, sys, threading
import torch
torch.cuda.is_available()
import xla_utils
from xla_utils import OneCycleTrainer, runtime
from torch import nn

class Digits(torch.utils.data.Dataset):
    def __init__(self, n):
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(n, 16, generator=g), torch.randint(0, 4, (n,), generator=g)
    def __len__(self):
        return len(self.x)
    def __getitem__(self, i):
        return self.x[i], self.y[i]

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(16, 32), nn.Linear(32, 4)
    def forward(self, x):
        return self.b(torch.relu(self.a(x)))

def loss(out, y):
    return nn.functional.cross_entropy(out, y)

def job():
    bad = torch.cuda._is_in_bad_fork()
    return {"bad_anywhere": runtime.all_reduce(float(bad)), "n": runtime.world_size(),
            "pid": os.getpid()}

os.environ["XLA_UTILS_CPU_REPLICAS"] = "2"
out = {"launch": xla_utils.launch(job, timeout=120), "parent": os.getpid()}
weights = {}
for cores, bs in (("all", 8), (1, 16)):
    t = OneCycleTrainer(Net(), loss, Digits(64), batch_size=bs, epochs=2, max_lr=0.3,
                        optimizer="sgd", lr_scaling="none", seed=1)
    h = t.fit(cores=cores, timeout=120)
    out[f"world_{cores}"] = h.world_size
    weights[cores] = t.model.state_dict()
out["keys"] = sorted(weights["all"])
out["max_diff"] = max(float((weights["all"][k] - weights[1][k]).abs().max()) for k in weights[1])
out["moved"] = float((weights[1]["a.weight"] - Net().a.weight).abs().max())
marker = sys.argv[1]
def locked_loss(out, y, _lock=threading.Lock()):
    open(marker, "w").write("a replica ran")
    return loss(out, y)
try:
    OneCycleTrainer(Net(), locked_loss, Digits(64), batch_size=8, epochs=1).fit(timeout=120)
except Exception as exc:
    out["refused"] = f"{type(exc).__name__}: {exc}"
print("RESULT " + json.dumps(out))
"""


@pytest.mark.slow
@pytest.mark.multicore
@pytest.mark.timeout(300)
def test_replicas_after_the_notebook_queried_cuda_start_fresh_and_train_as_one(tmp_path):
    """A notebook that called torch.cuda.is_available() before importing xla_utils: launch
    and fit start their replicas as fresh interpreters (none is in torch's bad fork), fit
    with a __main__ model, loss and dataset equals one replica at the global batch, and a
    loss that cannot be pickled is refused, named, before any replica runs."""
    script, marker = tmp_path / "notebook.py", tmp_path / "ran"
    script.write_text(_NOTEBOOK)
    env = {k: v for k, v in os.environ.items() if k != "PYTORCH_NVML_BASED_CUDA_CHECK"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(xla_utils.__file__).parents[1]),
                                         env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, str(script), str(marker)], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = json.loads(proc.stdout.split("RESULT ", 1)[1])
    assert out["launch"]["n"] == 2 and out["launch"]["bad_anywhere"] == 0.0
    assert out["launch"]["pid"] != out["parent"]
    assert proc.stdout.count("replicas started in fresh interpreters: this notebook queried "
                             "the CUDA driver") == 2  # launch, then fit on 2 (fit on 1: here)
    assert (out["world_all"], out["world_1"]) == (2, 1)
    assert out["keys"] == ["a.bias", "a.weight", "b.bias", "b.weight"]  # no "module." prefix
    assert out["moved"] > 1e-3 and out["max_diff"] < 1e-5
    assert out["refused"].startswith("NotSendableError: plan.loss (a builtins.function)")
    assert "_thread.lock" in out["refused"]
    assert not marker.exists()


def _world_job(steps: int):
    """A hand-written loop against runtime only: world, all_reduce, optimizer_step."""
    r, n, dev = rt.rank(), rt.world_size(), rt.device()
    total = rt.all_reduce(torch.tensor([float(r + 2)], device=dev))
    mean = rt.all_reduce(float(r), op="mean")
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8 * steps, 4, generator=g), torch.randn(8 * steps, 1, generator=g)
    per = 8 // n
    for s in range(steps):
        xs = x[8 * s + r * per: 8 * s + (r + 1) * per]
        ys = y[8 * s + r * per: 8 * s + (r + 1) * per]
        torch.nn.functional.mse_loss(model(xs.to(dev)), ys.to(dev)).backward()
        rt.optimizer_step(opt)
        opt.zero_grad()
    rt.rendezvous("end")
    return {"n": n, "rank": r, "total": float(total), "mean": mean, "pid": os.getpid(),
            "master": rt.is_master(), "weight": model.weight.detach().cpu()}


@pytest.mark.multicore
@pytest.mark.timeout(120)
def test_launch_gives_fn_two_replicas_and_averaged_gradients(two_cpu_replicas):
    out = xla_utils.launch(_world_job, 3, timeout=60)
    assert (out["n"], out["rank"], out["master"]) == (2, 0, True)
    assert out["total"] == 5.0 and out["mean"] == 0.5
    assert out["pid"] != os.getpid()
    here = xla_utils.launch(_world_job, 3, cores=1)  # one replica, the whole batch, here
    assert here["n"] == 1 and here["pid"] == os.getpid()
    moved = (here["weight"] - torch.nn.Linear(4, 1).weight).abs().max()
    assert moved > 1e-3
    torch.testing.assert_close(out["weight"], here["weight"], rtol=1e-5, atol=1e-6)


def _branch_job():
    """rank 1's forward skips the branch: only rank 0 has its gradient."""
    torch.manual_seed(0)
    trunk, branch = torch.nn.Linear(4, 1), torch.nn.Linear(4, 1)
    opt = torch.optim.SGD([*trunk.parameters(), *branch.parameters()], lr=0.1)
    x = torch.ones(2, 4)
    out = trunk(x) + (branch(x) if rt.rank() == 0 else 0)
    out.sum().backward()
    rt.optimizer_step(opt)
    return {"branch_grad": branch.weight.grad.clone(), "trunk_grad": trunk.weight.grad.clone()}


@pytest.mark.multicore
@pytest.mark.timeout(120)
def test_optimizer_step_averages_a_gradient_only_one_replica_has(two_cpu_replicas):
    """runtime.optimizer_step (a hand-written loop's): the replicas agree which parameters
    have gradients first, so the one that skipped the branch reduces zeros, no mismatch."""
    out = xla_utils.launch(_branch_job, timeout=60)
    torch.testing.assert_close(out["trunk_grad"], torch.full((1, 4), 2.0))
    torch.testing.assert_close(out["branch_grad"], torch.full((1, 4), 1.0))  # (2 + 0) / 2


def _raise_on_rank_1():
    if rt.rank() == 1:
        raise ValueError("replica one fails")
    rt.rendezvous("never")  # rank 0 would wait here forever without the error relay
    return "unreachable"


def _die_on_rank_1():
    if rt.rank() == 1:
        os._exit(7)
    rt.rendezvous("never")


@pytest.mark.multicore
@pytest.mark.timeout(120)
def test_a_failing_or_dying_replica_ends_the_launch(two_cpu_replicas):
    with pytest.raises(rt.ReplicaError) as info:
        xla_utils.launch(_raise_on_rank_1, timeout=60)
    assert info.value.rank == 1 and info.value.exc_type == "ValueError"
    assert "replica one fails" in info.value.remote_traceback
    assert "_raise_on_rank_1" in info.value.remote_traceback
    with pytest.raises(rt.ReplicaError, match="exit code 7") as info:
        xla_utils.launch(_die_on_rank_1, timeout=60)
    assert info.value.rank == 1


def _sleep():
    import time

    time.sleep(120)


@pytest.mark.multicore
@pytest.mark.timeout(120)
def test_timeout_kills_a_stuck_launch(two_cpu_replicas):
    with pytest.raises(TimeoutError, match="timed out after 3"):
        xla_utils.launch(_sleep, timeout=3)


def _loopback(addr_hex: str) -> bool:
    if len(addr_hex) == 8:  # IPv4, little-endian
        return addr_hex.endswith("7F")
    return addr_hex in ("00000000000000000000000001000000",  # ::1
                        "0000000000000000FFFF00000100007F")  # ::ffff:127.0.0.1


def _session_listeners():
    """Every listening TCP socket of the processes in this replica's session (the job and
    its replicas), after the process group has met: ``[(local address hex, port)]``."""
    rt.all_reduce(torch.ones(1))  # gloo's pairs are connected
    inodes = set()
    sid = os.getsid(0)
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.getsid(int(pid)) != sid:
                continue
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:  # some close while we look (the listing's own, a queue's pipe)
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:["):
                inodes.add(link[8:-1])
    listening = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                if cols[3] == "0A" and cols[9] in inodes:  # 0A: LISTEN
                    addr, port = cols[1].split(":")
                    listening.append((addr, int(port, 16)))
    rt.rendezvous("listed")
    return {"listening": listening, "sockets": len(inodes)}


@pytest.mark.multicore
@pytest.mark.timeout(120)
def test_rendezvous_listens_on_loopback_only(two_cpu_replicas):
    out = xla_utils.launch(_session_listeners, timeout=60)
    assert out["sockets"] > 0  # gloo's connections were seen
    assert out["listening"] == [l for l in out["listening"] if _loopback(l[0])], out
