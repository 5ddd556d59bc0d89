"""xla_utils.simulate.live: the simulated inference job kept alive across a trainer's calls
(real XLA:CPU, real digits, no mocks)."""
from __future__ import annotations

import copy
import gc
import os
import signal
import time

import numpy as np
import pytest
import torch
from torch import nn

from helpers import digit_gray_images, tiny_cnn

from xla_utils import CachedImageDataset, OneCycleTrainer, build_cache
from xla_utils.simulate.caller import _pid_exists
from xla_utils.simulate.live import live_job_for
from xla_utils.simulate.protocol import FOLDER_PREFIX

SIZE, CLASSES = 12, 5


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    items = digit_gray_images(40, classes=CLASSES)
    root = tmp_path_factory.mktemp("live")
    build_cache(items, root / "c", size=SIZE, verbose=False)
    return CachedImageDataset(root / "c")


def _trainer(data):
    model = tiny_cnn(CLASSES, size=SIZE, seed=0)
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


def _reference(model, data, state=None) -> np.ndarray:
    """What predict must return: the model (with ``state``) on the host, in torch."""
    from xla_utils.data import images_to_float

    net = copy.deepcopy(model)
    if state is not None:
        net.load_state_dict(state)
    x = torch.from_numpy(np.stack([data[i][0] for i in range(len(data))]))
    with torch.no_grad():
        return torch.softmax(net.eval()(images_to_float(x, (0.5,) * 3, (0.25,) * 3)), 1).numpy()


@pytest.mark.timeout(900)
def test_unchanged_weights_stay_in_the_live_job_and_every_change_reaches_it(digits, tmp_path):
    """Weights and caches are kept by the live job between calls (xla_utils.simulate.resident);
    a stale copy would be a silent wrong prediction, so every way of changing them is tried."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 10 * 10, 64),
                          nn.ReLU(), nn.Linear(64, CLASSES))
    t = OneCycleTrainer(model, nn.CrossEntropyLoss(), digits, batch_size=8,
                        mean=(0.5,) * 3, std=(0.25,) * 3)
    job = live_job_for(t, 1)
    head = t.model[3]
    weight_bytes = head.weight.numel() * 4  # 100 KB; the only tensor of MIN_BYTES or more

    def check(**kw):
        got = t.predict(digits, simulate=1, **kw)
        np.testing.assert_allclose(got, _reference(t.model, digits, kw.pop("state", None)),
                                   atol=2e-5)
        return got

    def predict_with(state, **kw):
        got = t.predict(digits, simulate=1, **kw)
        np.testing.assert_allclose(got, _reference(t.model, digits, state), atol=2e-5)

    check()
    assert job.last_sent["resident_sent"] == 2  # the head's weight and the cache
    assert job.last_sent["new_bytes"] > weight_bytes
    check()  # unchanged: nothing re-sent, the call carries keys only
    assert job.last_sent["resident_sent"] == 0 and job.last_sent["new_bytes"] == 0, job.last_sent
    assert job.last_sent["resident_reused"] == 2
    assert job.last_sent["payload_bytes"] < weight_bytes / 2, job.last_sent
    assert job.last_counters["compiles"] == 0

    with torch.no_grad():  # in place (version counter bumped)
        head.weight.add_(0.5)
    check()
    assert job.last_sent["resident_sent"] == 1 and job.last_sent["new_bytes"] > weight_bytes
    head.weight.data.mul_(-1.5)  # through .data: the version counter does NOT change
    check()
    assert job.last_sent["resident_sent"] == 1
    state = {k: v + 0.25 for k, v in t.model.state_dict().items()}
    t.model.load_state_dict(state)
    check()
    t.model = copy.deepcopy(t.model)  # a replaced model with equal weights ...
    check()
    with torch.no_grad():  # ... then changed
        t.model[0].weight.mul_(2)  # a small tensor (pickled with every call)
    check()

    ema = {k: v * 0.5 for k, v in t.model.state_dict().items()}
    t.ema_state = ema
    predict_with(ema)
    ema["3.weight"].add_(1.0)  # the EMA state changed in place
    predict_with(ema)
    t.ema_state = None

    a, b = tmp_path / "a.pt", tmp_path / "b.pt"
    sa = {k: v - 0.3 for k, v in t.model.state_dict().items()}
    sb = {k: v * -1 for k, v in t.model.state_dict().items()}
    torch.save(sa, a)
    torch.save(sb, b)
    predict_with(sa, weights=a)
    predict_with(sb, weights=b)
    sa2 = {k: v + 1 for k, v in sa.items()}
    torch.save(sa2, a)  # the same path, new weights
    predict_with(sa2, weights=a)

    before = check()
    t.config.epochs = 1
    t.fit(simulate=1)  # a new fit: its weights are copied into t.model
    after = check()
    assert np.abs(after - before).max() > 1e-4
    assert job.starts == 1


def _sum_of_ranks(scale: float):
    from xla_utils import runtime as rt

    x = rt.all_reduce(torch.tensor([float(rt.rank() + 1)], device=rt.device()) * scale)
    rt.sync()
    return float(x.cpu())


def _total_over_ranks(t: torch.Tensor):
    from xla_utils import runtime as rt

    x = rt.all_reduce(t.to(rt.device()).sum().reshape(1))
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
        big = torch.arange(2048, dtype=torch.float32)  # kept by both replicas between calls
        assert job.call(_total_over_ranks, (big,)) == 2 * float(big.sum())
        assert job.call(_total_over_ranks, (big,)) == 2 * float(big.sum())
        assert job.last_sent["resident_reused"] == 1 and job.last_sent["new_bytes"] == 0
        big.data.add_(1)
        assert job.call(_total_over_ranks, (big,)) == 2 * float(big.sum())
        assert job.last_sent["resident_sent"] == 1
        pid = job.pid
        with pytest.raises(ReplicaError, match="deliberate failure"):
            job.call(_fail_on_rank_1, ())
        assert not job.alive() and _wait_gone(pid)
        assert job.call(_sum_of_ranks, (1.0,)) == 3.0  # a new job
        assert job.starts == 2
    finally:
        job.close()
    assert _our_folders() == []
