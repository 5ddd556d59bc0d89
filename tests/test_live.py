"""xla_utils.simulate.live: the simulated inference job kept alive across a trainer's calls
(real XLA:CPU, real digits, no mocks)."""
from __future__ import annotations

import gc
import os
import signal
import time

import numpy as np
import pytest
import torch
from torch import nn

from xla_utils import CachedImageDataset, OneCycleTrainer, build_cache
from xla_utils.simulate.caller import _pid_exists
from xla_utils.simulate.live import live_job_for
from xla_utils.simulate.protocol import FOLDER_PREFIX

SIZE, CLASSES = 12, 5


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    from sklearn.datasets import load_digits

    d = load_digits()
    items = [(np.repeat((im * 15).astype(np.uint8)[..., None], 3, axis=2), int(t) % CLASSES)
             for im, t in zip(d.images[:40], d.target[:40])]
    root = tmp_path_factory.mktemp("live")
    build_cache(items, root / "c", size=SIZE, verbose=False)
    return CachedImageDataset(root / "c")


def _trainer(data):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(),
                          nn.Linear(4 * 10 * 10, CLASSES))
    return OneCycleTrainer(model, nn.CrossEntropyLoss(), data, batch_size=8,
                           mean=(0.5,) * 3, std=(0.25,) * 3)


def _our_folders() -> list[str]:
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    if base is None:
        return []
    return [n for n in os.listdir(base) if n.startswith(f"{FOLDER_PREFIX}{os.getpid()}-")]


def _wait_gone(pid: int, limit_s: float = 20.0) -> bool:
    end = time.monotonic() + limit_s
    while time.monotonic() < end:
        if not _pid_exists(pid):
            return True
        time.sleep(0.05)
    return False


@pytest.mark.timeout(600)
def test_later_predict_calls_reuse_the_live_jobs_graphs_and_a_killed_job_is_replaced(digits):
    t = _trainer(digits)
    p1 = t.predict(digits, simulate=1)
    job = live_job_for(t, 1)
    assert job.alive() and job.starts == 1
    assert job.last_counters["compiles"] >= 1  # the first call compiles

    p2 = t.predict(digits, simulate=1)
    np.testing.assert_array_equal(p2, p1)
    assert job.last_counters["compiles"] == 0, job.last_counters  # same graphs, reused
    assert job.last_counters["executions"] >= 1
    assert job.starts == 1

    with torch.no_grad():  # new weights travel with the call; the graph stays the same
        t.model[-1].bias.add_(torch.arange(CLASSES, dtype=torch.float32))
    p3 = t.predict(digits, simulate=1)
    assert np.abs(p3 - p1).max() > 1e-3
    assert job.last_counters["compiles"] == 0, job.last_counters
    ev = t.evaluate(digits, simulate=1)
    assert ev["samples"] == len(digits)

    pid = job.pid
    os.killpg(pid, signal.SIGKILL)  # dies between calls: found and replaced
    assert _wait_gone(pid)
    p4 = t.predict(digits, simulate=1)
    np.testing.assert_allclose(p4, p3, atol=1e-6)
    assert job.starts == 2 and job.pid != pid

    pid = job.pid
    del t, job
    gc.collect()  # the trainer's finalizer closes its live job
    assert _wait_gone(pid), "the live job outlived its trainer"
    end = time.monotonic() + 10
    while _our_folders() and time.monotonic() < end:
        time.sleep(0.05)
    assert _our_folders() == []


def _sum_of_ranks(scale: float):
    from xla_utils import runtime as rt

    x = rt.all_reduce(torch.tensor([float(rt.rank() + 1)], device=rt.device()) * scale)
    rt.sync()
    return float(x.cpu())


def _fail_on_rank_1():
    from xla_utils import runtime as rt

    if rt.rank() == 1:
        raise ValueError("deliberate failure in a live call")
    rt.rendezvous("never completed")


@pytest.mark.multicore
@pytest.mark.timeout(600)
def test_live_job_on_2_threads_reuses_graphs_and_a_failing_call_ends_it():
    from xla_utils.runtime.replica import ReplicaError
    from xla_utils.simulate.live import LiveJob

    job = LiveJob(2)
    try:
        assert job.call(_sum_of_ranks, (1.5,)) == 1.5 * 3
        assert job.call(_sum_of_ranks, (2.5,)) == 2.5 * 3  # a new scale is device data
        assert job.last_counters["compiles"] == 0, job.last_counters
        pid = job.pid
        with pytest.raises(ReplicaError, match="deliberate failure"):
            job.call(_fail_on_rank_1, ())
        assert not job.alive() and _wait_gone(pid)
        assert job.call(_sum_of_ranks, (1.0,)) == 3.0  # a new job
        assert job.starts == 2
    finally:
        job.close()
    assert _our_folders() == []
