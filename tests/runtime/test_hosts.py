"""Several hosts (xla_utils.runtime.hosts): a world another launcher started. Under torchrun
each process is one replica of fit(), predict() and the LR finder, over all its nodes."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import xla_utils
from xla_utils.runtime import resolve
from xla_utils.runtime.hosts import TorchrunWorld, torchrun_world

SCRIPT = Path(__file__).parents[1] / "fixtures" / "hosts" / "torchrun_fit.py"
STRATEGIES = Path(__file__).parents[2] / "docs" / "STRATEGIES.md"
TORCHRUN = {"TORCHELASTIC_RUN_ID": "t", "RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1",
            "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1"}


def test_torchrun_world_reads_torchrun_variables():
    assert torchrun_world({}) is None
    assert torchrun_world({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}) is None  # not torchrun
    assert torchrun_world(TORCHRUN) == TorchrunWorld(rank=3, world_size=4, local_rank=1,
                                                     local_world_size=2, host=1, hosts=2)
    with pytest.raises(ValueError, match=r"torchrun's variables disagree: RANK=3, WORLD_SIZE=4, "
                       r"LOCAL_RANK=1, LOCAL_WORLD_SIZE=3.*same K everywhere"):
        torchrun_world({**TORCHRUN, "LOCAL_WORLD_SIZE": "3"})


def test_a_run_under_torchrun_joins_its_world(monkeypatch):
    for k, v in TORCHRUN.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("XLA_UTILS_CPU_REPLICAS", raising=False)
    p = resolve()
    assert (p.backend, p.replicas, p.host_devices, p.hosts, p.host, p.joined) == \
        ("torch", 4, 2, 2, 1, "torchrun")
    assert resolve(1).replicas == 1 and resolve(1).joined == "torchrun"
    assert resolve(simulate=2).joined is None  # simulated cores are a world of their own


def _run(cmd: list[str], env: dict, cwd: Path, timeout: int) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc


@pytest.mark.slow
@pytest.mark.multicore
@pytest.mark.timeout(400)
@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare") or not shutil.which("ip"),
                    reason="the two agents run in a network namespace of their own (root, "
                           "unshare, ip)")
def test_two_torchrun_nodes_train_as_one_four_replica_run(tmp_path):
    """`torchrun --nnodes 2 --nproc-per-node 2` as two agents (a c10d rendezvous on
    127.0.0.1, in a network namespace that has only loopback: nothing can listen elsewhere),
    each running a script that calls fit(max_lr="find"): the same weights, losses and LR as
    the same script on 4 CPU replicas of one machine; the LR finder swept once, every process
    got its answer; one run id, one checkpoint file per epoch."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(Path(xla_utils.__file__).parents[1]), os.environ.get("PYTHONPATH", "")])}
    env.pop("XLA_UTILS_CPU_REPLICAS", None)
    ref, two = tmp_path / "ref", tmp_path / "two"
    ref.mkdir(), two.mkdir()
    _run([sys.executable, str(SCRIPT), str(ref)], {**env, "XLA_UTILS_CPU_REPLICAS": "4"},
         tmp_path, 200)
    # docs/STRATEGIES.md's command, on this machine (tests/test_readme.py counts it as run here)
    doc = next(b for b in re.findall(r"```bash\n(.*?)```", STRATEGIES.read_text(), re.S)
               if b.startswith("torchrun"))
    agent = (doc.replace("\\\n", " ").strip().replace("torchrun", f"{sys.executable} -m "
             "torch.distributed.run", 1).replace("--nproc-per-node 4", "--nproc-per-node 2")
             .replace("HOST_OF_NODE_0", "127.0.0.1").replace("my-run", "rehearsal")
             .replace("--node-rank N", "--node-rank {n}").replace("train.py", f"{SCRIPT} {two}")
             + f" > {two}/agent{{n}}.log 2>&1")
    assert "127.0.0.1:29500" in agent and "--nnodes 2" in agent and "{n} " in agent, agent
    _run(["unshare", "--net", "sh", "-c", "ip link set lo up && { "
          + agent.format(n=0) + " & " + agent.format(n=1) + " & wait %1 && wait %2; }"],
         {**env, "GLOO_SOCKET_IFNAME": "lo"}, tmp_path, 300)
    logs = "".join((two / f"agent{n}.log").read_text() for n in (0, 1))
    want = json.loads((ref / "out-0.json").read_text())
    w0 = torch.load(ref / "weights-0.pt")
    outs = [json.loads((two / f"out-{r}.json").read_text()) for r in range(4)]
    assert want["world"] == 4 and all(o["world"] == 4 for o in outs)
    assert len({o["pid"] for o in outs}) == 4
    assert len({o["run_id"] for o in outs}) == 1  # one run, agreed
    for r, o in enumerate(outs):
        assert o["base_lr"] == want["base_lr"] and o["losses"] == pytest.approx(want["losses"], abs=1e-6)
        w = torch.load(two / f"weights-{r}.pt")
        assert max(float((w[k] - w0[k]).abs().max()) for k in w0) <= 1e-5
    assert logs.count("4 micro-batches on one core |█████████████████████████| 100%") == 1
    epochs = sorted(p.name for p in (two / "ckpt").glob("epoch_*.pt"))
    assert epochs == [f"epoch_00{e}-{outs[0]['run_id']}.pt" for e in (1, 2)]
