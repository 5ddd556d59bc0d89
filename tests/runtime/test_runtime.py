"""xla_utils.runtime on real XLA:CPU (no mocks): launch, simulated cores, errors."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from xla_utils.env.gpu import cuda_available
from xla_utils import runtime as rt


def _reduce_job(steps: int):
    r, n, dev = rt.rank(), rt.world_size(), rt.device()
    x = torch.tensor([float(r + 2)], device=dev)  # never 0.0/1.0: those are graph constants
    sums = []
    for _ in range(steps):
        s = rt.all_reduce(x)
        rt.sync()
        sums.append(float(s.cpu()))
    onehot = torch.zeros(n)
    onehot[r] = 2.0
    seen = rt.all_reduce(onehot.to(dev))
    rt.sync()
    return {
        "n": n,
        "sums": sums,
        "ranks": (seen.cpu() / 2).tolist(),
        "number_sum": rt.all_reduce(r * 1.5),
        "number_mean": rt.all_reduce(float(r), op="mean"),
        "sim": rt.is_simulated(),
    }


def _launch_as(design: str, fn, *args, simulate: int, timeout: float | None = None):
    """``launch`` (replica processes) or the thread simulation xla_utils' own loops use."""
    if design == "processes":
        return rt.launch(fn, *args, simulate=simulate, timeout=timeout)
    return rt.launch_job(fn, args, placement=rt.resolve(simulate=simulate), timeout=timeout,
                         sim_threads=True)


@pytest.mark.slow
@pytest.mark.multicore
@pytest.mark.timeout(300)
@pytest.mark.parametrize("design", ["processes", "threads"])
def test_simulated_all_reduce_exact_20_times_after_a_caller_backward(design):
    # A caller-side backward once crashed forked replica threads natively (about 1
    # launch in 4); both designs now start from a clean interpreter.
    w = torch.ones(2, requires_grad=True)
    (w * 2).sum().backward()
    expected = float(sum(r + 2 for r in range(8)))
    for attempt in range(20):
        out = _launch_as(design, _reduce_job, 3, simulate=8, timeout=120)
        assert out["n"] == 8, attempt
        assert out["sums"] == [expected] * 3, attempt
        assert out["ranks"] == [1.0] * 8, attempt  # 8 distinct ranks 0..7
        assert out["number_sum"] == 1.5 * sum(range(8))
        assert out["number_mean"] == sum(range(8)) / 8
        assert out["sim"] is True


def _first_collective_at_once():
    from xla_utils.runtime.state import STATE

    slots = STATE.sim.token_devices  # created before any replica thread ran
    rt.rendezvous("all threads here")  # then every thread's first all_reduce at once
    s = rt.all_reduce(torch.tensor([float(rt.rank() + 2)], device=rt.device()))
    rt.sync()
    return {"slots": list(slots), "sum": float(s.cpu())}


@pytest.mark.multicore
@pytest.mark.timeout(300)
def test_thread_job_creates_every_devices_collective_token_before_replicas_run():
    # torch_xla's per-device token map has no lock: N threads inserting their
    # first entry at once crashed the thread job natively (BrokenProcessPool).
    out = _launch_as("threads", _first_collective_at_once, simulate=8, timeout=120)
    assert out["slots"] == [f"xla:{i}" for i in range(8)]
    assert out["sum"] == float(sum(r + 2 for r in range(8)))


def _autograd_threads_at_start():
    # Thread names as the kernel has them; torch names its per-device autograd
    # workers pt_autograd_<device>, from inside each new thread: under load a
    # worker started before fn ran may not have renamed itself yet (seen at load
    # 19), so look again for a few seconds (nothing in fn runs a backward).
    end = time.monotonic() + 5.0
    while True:
        names = []
        for tid in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{tid}/comm") as f:
                    names.append(f.read().strip())
            except OSError:  # the thread ended
                continue
        found = sorted(n for n in names if n.startswith("pt_autograd_"))
        if len(found) >= rt.world_size() or time.monotonic() > end:
            return found
        time.sleep(0.05)


@pytest.mark.multicore
@pytest.mark.timeout(300)
def test_thread_job_starts_autograd_before_replicas_run():
    # The job is a fork, so autograd re-creates its engine at the first backward;
    # a replica thread reaching the engine while another started its device
    # threads crashed the job natively (BrokenProcessPool, CI on the Kaggle stack).
    # The engine is started once, before any replica thread runs.
    out = _launch_as("threads", _autograd_threads_at_start, simulate=4, timeout=120)
    assert out == [f"pt_autograd_{i}" for i in range(4)]


def _fail_in_rank_3():
    r, dev = rt.rank(), rt.device()
    x = torch.tensor([3.0], device=dev)
    for step in range(50):
        if r == 3 and step == 2:
            raise ValueError("deliberate failure in rank three")
        x = rt.all_reduce(x) / 7.5
        rt.sync()
    return float(x.cpu())


@pytest.mark.multicore
@pytest.mark.timeout(90)
@pytest.mark.parametrize("design", ["processes", "threads"])
def test_exception_in_rank_3_reaches_caller_with_traceback(design):
    t0 = time.monotonic()
    with pytest.raises(rt.ReplicaError) as info:
        _launch_as(design, _fail_in_rank_3, simulate=8)
    err = info.value
    assert err.rank == 3
    assert err.exc_type == "ValueError"
    assert "deliberate failure in rank three" in err.remote_traceback
    assert "_fail_in_rank_3" in err.remote_traceback  # the replica's own frame
    assert time.monotonic() - t0 < 60


@pytest.mark.multicore
@pytest.mark.timeout(90)
@pytest.mark.parametrize("design", ["processes", "threads"])
def test_replica_process_crash_is_reported(design):
    def crash():
        if rt.rank() == 5:
            os._exit(3)
        for _ in range(3):
            rt.sync()

    with pytest.raises(rt.ReplicaError, match="died abruptly"):
        _launch_as(design, crash, simulate=8)


@pytest.mark.multicore
@pytest.mark.timeout(60)
def test_timeout_kills_job():
    def forever():
        while True:
            time.sleep(0.1)

    t0 = time.monotonic()
    with pytest.raises(TimeoutError):
        rt.launch(forever, simulate=2, timeout=3)
    assert time.monotonic() - t0 < 20


@pytest.mark.timeout(60)
def test_closure_and_cores_1():
    captured = {"k": 7}
    # A closure that plain pickle cannot send: cloudpickle sends it by value.
    out = rt.launch(lambda: (rt.world_size(), rt.rank(), str(rt.device()), captured["k"]),
                    cores=1, simulate=8)
    assert out[0] == 1 and out[1] == 0 and out[2].startswith("xla") and out[3] == 7


@pytest.mark.multicore
@pytest.mark.timeout(60)
def test_save_master_writes_all_meet(tmp_path):
    path = tmp_path / "ck.pt"

    def job():
        w = torch.full((3,), 2.5, device=rt.device()) * (rt.rank() + 2)
        rt.save({"w": w, "rank": rt.rank()}, path)
        return path.exists()  # every replica sees the file after save returns

    assert rt.launch(job, simulate=4) is True
    obj = torch.load(path)
    assert obj["rank"] == 0 and torch.equal(obj["w"], torch.full((3,), 5.0))
    assert not (tmp_path / "ck.pt.tmp").exists()


@pytest.mark.multicore
@pytest.mark.timeout(60)
def test_compile_count_stable_and_report():
    def job():
        dev = rt.device()
        w = torch.randn(4, 4).to(dev)
        counts = []
        before = rt.xla_counters()
        for _ in range(6):
            w = torch.tanh(w @ w.T * 0.5)
            rt.sync()
            counts.append(rt.xla_counters()["compiles"])
        return counts, rt.xla_counters_report(before, rt.xla_counters(), steps=6)

    counts, report = rt.launch(job, simulate=2)
    assert counts[0] >= 1 and counts[-1] == counts[1]  # compiled once, then cached
    assert "XLA compilations" in report and "No CPU-fallback ops" in report


@pytest.mark.multicore
@pytest.mark.timeout(120)
def test_reduce_gradients_then_the_step_alone_on_simulated_cores():
    """What grad_clip= does around its clip on XLA: reduce_gradients averages the replicas'
    gradients (1 and 2: 1.5 on both), optimizer_step(averaged=True) takes one step."""
    def job():
        w = torch.nn.Parameter(torch.zeros(3, device=rt.device()))
        opt = torch.optim.SGD([w], lr=1.0)
        (w * (rt.rank() + 1.0)).sum().backward()
        rt.reduce_gradients(opt)
        rt.optimizer_step(opt, averaged=True)
        rt.sync()
        return w.detach().cpu().tolist()

    assert rt.launch(job, simulate=2) == [-1.5] * 3


def test_torch_backend_in_process():
    # No TPU here and no simulate: plain torch, world size 1, in this process.
    out = rt.launch(lambda: (rt.backend(), rt.world_size(), rt.rank(), rt.device().type,
                             os.getpid()))
    assert out == ("torch", 1, 0, "cuda" if cuda_available() else "cpu", os.getpid())
    assert rt.all_reduce(3.0) == 3.0
    m = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    m(torch.ones(1, 2)).sum().backward()
    before = m.weight.detach().clone()
    rt.launch(rt.optimizer_step, opt)
    assert not torch.equal(before, m.weight)


def test_bad_arguments():
    with pytest.raises(ValueError, match="cores"):
        rt.launch(print, cores=4)
    with pytest.raises(ValueError, match="simulate"):
        rt.launch(print, simulate=0)


def _run_py(code: str, timeout: int = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, PJRT_DEVICE="CPU")
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=timeout, env=env)


@pytest.mark.slow
def test_launch_after_runtime_initialised_refuses_tpu_fork_allows_simulation():
    p = _run_py("""
        import torch_xla
        from xla_utils import runtime as rt
        torch_xla.device()  # initialises the runtime in this process
        # simulated replicas start from a clean interpreter: unaffected
        print("SIMULATED:", rt.launch(rt.world_size, simulate=2))
        rt.STATE.tpu_present = True  # as on a TPU host, where launch forks this process
        try:
            rt.launch(print)
        except rt.RuntimeAlreadyInitializedError as e:
            print("REFUSED:", e)
    """, timeout=300)
    assert "SIMULATED: 2" in p.stdout, p.stderr[-2000:]
    assert "REFUSED:" in p.stdout, p.stderr[-2000:]
    assert "restart" in p.stdout


@pytest.mark.slow
def test_simulated_launch_leaves_torch_xla_to_the_zygote():
    # The caller never imports torch_xla for a simulated launch (the zygote does,
    # 1.5-6 s saved on the first lr_find/fit/predict call), and a job starts from
    # the zygote's frozen imports (gc.freeze: its full collections skip torch's
    # objects) with the modules the library's jobs unpickle already imported.
    p = _run_py("""
        import sys
        from xla_utils import runtime as rt

        def probe():
            import gc
            return gc.get_freeze_count(), "xla_utils.train.lr_finder" in sys.modules, \\
                "PIL.Image" in sys.modules

        print("PROBE:", rt.launch(probe, simulate=1))
        print("CALLER HAS TORCH_XLA:", "torch_xla" in sys.modules)
        import torch
        from xla_utils import check, debug_run
        x, y = torch.randn(16, 4), torch.randint(0, 2, (16,))
        check(torch.nn.Linear(4, 2), (x[:8], y[:8]), steps=3, verbose=False)
        debug_run(torch.nn.Linear(4, 2), torch.nn.functional.cross_entropy,
                  torch.utils.data.TensorDataset(x, y), steps=3, print_report=False)
        print("AFTER CHECK AND DEBUG_RUN:", "torch_xla" in sys.modules)
    """, timeout=300)
    assert "CALLER HAS TORCH_XLA: False" in p.stdout, p.stdout + p.stderr[-2000:]
    assert "AFTER CHECK AND DEBUG_RUN: False" in p.stdout, p.stdout + p.stderr[-2000:]
    frozen, lr_finder, pil = eval(p.stdout.split("PROBE:")[1].splitlines()[0])
    assert frozen > 50_000 and lr_finder and pil, (frozen, lr_finder, pil)


def test_missing_torch_xla_message():
    p = _run_py("""
        import sys
        sys.modules['torch_xla'] = None  # behaves as not installed
        from xla_utils import runtime as rt
        try:
            rt.launch(print, simulate=2)
        except rt.XLAUnavailableError as e:
            print("MSG:", e)
    """)
    assert "MSG: torch_xla is not installed" in p.stdout, p.stderr[-2000:]
    assert "pip install" in p.stdout


@pytest.mark.timeout(120)
def test_backward_in_parent_before_launch():
    # A CPU backward here initialises autograd's device queues for 0 XLA devices.
    # Simulated replicas never inherit that state (they start from a clean
    # interpreter); tests/simulate/test_simulate.py repeats this 50 times on 2 replicas.
    w = torch.ones(2, requires_grad=True)
    (w * 2).sum().backward()

    def job():
        v = torch.ones(2, device=rt.device(), requires_grad=True)
        (v * 3.5).sum().backward()
        rt.sync()
        return float(v.grad.cpu().sum())

    for _ in range(5):
        assert rt.launch(job, simulate=1) == 7.0


@pytest.mark.timeout(60)
def test_device_prefetch_delivers_each_batch_when_loader_reuses_buffer():
    # (The transfer bug fixed in runtime.to_device showed only in full training
    # runs; tests/train/test_trainer.py's 8-vs-1 equivalence test is its regression test.)
    import numpy as np

    def job():
        buf = np.zeros((64, 64), dtype=np.float32)

        def reusing_loader():
            for k in range(12):
                buf[:] = k + 2  # the same host memory for every batch
                yield torch.from_numpy(buf)

        sums = []
        for x in rt.device_prefetch(reusing_loader(), depth=2):
            s = x.sum()
            rt.sync()
            sums.append(float(s.cpu()))
        return sums

    assert rt.launch(job, simulate=1) == [64 * 64 * (k + 2.0) for k in range(12)]


class _LateCopier:
    """Drives :func:`runtime.transfer.overlapped` as :class:`~xla_utils.runtime.transfer.CudaCopier`
    does, but each copy reads its host buffers only when it is finished: the latest moment a
    real asynchronous copy may read them, so a buffer refilled before then shows."""

    def __init__(self):
        self.tokens = []

    def copy(self, batch):
        token = {"host": batch, "value": None}
        self.tokens.append(token)
        return token

    def ready(self, token):
        return token  # the device batch: its value is whatever the copy will have read

    def finish(self, token):
        if token["value"] is None:
            token["value"] = tuple(t.clone() for t in token["host"])


@pytest.fixture(scope="module")
def ring_cache(tmp_path_factory):
    import numpy as np

    from xla_utils import CachedImageDataset, build_cache

    rng = np.random.default_rng(0)
    images = [(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8), i % 3) for i in range(30)]
    out = tmp_path_factory.mktemp("ring") / "cache"
    build_cache(images, out, size=8, verbose=False, workers=1)
    return CachedImageDataset(out)


def _same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("workers", [0, 3])
def test_overlapped_copies_never_read_a_refilled_ring_slot(ring_cache, workers):
    from xla_utils.data import iterate_batches
    from xla_utils.runtime.transfer import overlapped

    expected = [tuple(t.clone() for t in b) for b in iterate_batches(ring_cache, 2, seed=1, num_workers=0)]
    batches = iterate_batches(ring_cache, 2, seed=1, num_workers=workers)
    copier = _LateCopier()
    got = list(overlapped(batches, copier, depth=2, valid_for=batches.valid_for))
    assert len(got) == len(expected) == 15
    # every copy finished by the end of the pass, having read the batch it was issued for
    assert all(t["value"] is not None for t in copier.tokens)
    assert all(_same(t["value"], e) for t, e in zip(got, expected))


def test_overlapped_catches_a_source_that_refills_sooner_than_it_says(ring_cache):
    # The same late copies with a wrong promise (the ring refills a slot 3 batches on, with
    # no loader thread that is exactly at the 3rd request): most copies read a later batch.
    from xla_utils.data import RING_VALID_FOR, iterate_batches
    from xla_utils.runtime.transfer import overlapped

    expected = [tuple(t.clone() for t in b) for b in iterate_batches(ring_cache, 2, seed=1, num_workers=0)]
    got = list(overlapped(iterate_batches(ring_cache, 2, seed=1, num_workers=0), _LateCopier(),
                          depth=2, valid_for=RING_VALID_FOR + 2))
    assert sum(not _same(t["value"], e) for t, e in zip(got, expected)) >= 10
    # valid_for=0 (an unknown source): each copy finishes before the next batch is asked for
    got = list(overlapped(iterate_batches(ring_cache, 2, seed=1, num_workers=0), _LateCopier(),
                          depth=2, valid_for=0))
    assert all(_same(t["value"], e) for t, e in zip(got, expected))


def test_overlapped_stopped_early_finishes_its_copies(ring_cache):
    from xla_utils.data import iterate_batches
    from xla_utils.runtime.transfer import overlapped

    expected = [tuple(t.clone() for t in b) for b in iterate_batches(ring_cache, 2, seed=1, num_workers=0)]
    batches = iterate_batches(ring_cache, 2, seed=1, num_workers=2)
    copier = _LateCopier()
    it = overlapped(batches, copier, depth=2, valid_for=batches.valid_for)
    first = [next(it), next(it)]
    it.close()  # the consumer stops (on_nan="stop", an exception): copies in flight are waited for
    assert len(copier.tokens) == 4 and all(t["value"] is not None for t in copier.tokens)
    assert all(_same(t["value"], e) for t, e in zip(first, expected))
    # the ring's next pass (the same buffers) starts only now, and is whole
    again = [tuple(t.clone() for t in b) for b in batches]
    assert all(_same(a, e) for a, e in zip(again, expected))


_MKL_AFTER_FORK = """
import torch
torch.set_num_threads(2)          # gives MKL an explicit thread count, as notebooks often do
a = torch.randn(1024, 1024)
(a @ a).sum()                     # the caller's thread now owns an OpenMP team

from xla_utils import runtime as rt

def cpu_matmul():
    b = torch.randn(1024, 1024)   # MKL in the forked job: hung before the fix
    return float((b @ b).sum())

print("result", rt.launch(cpu_matmul, cores=1, simulate=1, timeout=120))
"""


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_cpu_matmul_in_a_forked_job_after_the_caller_set_torch_threads():
    env = dict(os.environ, PJRT_DEVICE="CPU")
    p = subprocess.run([sys.executable, "-c", _MKL_AFTER_FORK], capture_output=True, text=True,
                       timeout=280, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "result" in p.stdout


def test_state_is_one_object_with_a_per_thread_backend_and_a_reset():
    import threading

    from xla_utils.runtime.state import RuntimeState

    s = RuntimeState()
    s.tpu_present, s.host_sum_calls, s.simulated_process = True, 3, True
    s.local.backend = "xla"
    seen = []
    t = threading.Thread(target=lambda: seen.append(s.local.backend))
    t.start()
    t.join()
    assert seen == [None]  # each replica thread has its own backend
    s.reset()
    fresh = RuntimeState()
    for name in fresh.__dataclass_fields__:
        if name != "local":
            assert getattr(s, name) == getattr(fresh, name), name
    assert s.local.backend is None and not s.local.in_replica
    # launch() records the in-process replica's backend in the shared STATE
    assert rt.launch(lambda: (rt.STATE.local.backend, rt.STATE.local.in_replica)) == ("torch", True)
    assert rt.STATE.local.backend is None


def test_fast_cpu_compile_flags_adds_level_0_once_and_keeps_the_callers_level():
    flag = "--xla_backend_optimization_level=0"
    assert rt.fast_cpu_compile_flags(None) == flag
    assert rt.fast_cpu_compile_flags("") == flag
    assert rt.fast_cpu_compile_flags("--xla_dump_to=/tmp/d") == f"--xla_dump_to=/tmp/d {flag}"
    assert rt.fast_cpu_compile_flags(flag) == flag
    mine = "--xla_backend_optimization_level=2 --xla_dump_to=/tmp/d"
    assert rt.fast_cpu_compile_flags(mine) == mine
    # the test session runs under it (tests/conftest.py), so every process a test starts does
    assert "xla_backend_optimization_level" in os.environ["XLA_FLAGS"]


def test_replicas_are_named_by_their_device():
    """What a run's lines call its replicas: XLA's cores, GPUs, CPU processes."""
    assert [rt.replicas_word(n, "xla") for n in (1, 8)] == ["1 core", "8 cores"]
    assert [rt.replicas_word(n, "cuda") for n in (1, 2)] == ["1 GPU", "2 GPUs"]
    assert [rt.replicas_word(n, "cpu") for n in (1, 2)] == ["1 process", "2 processes"]
    assert [rt.replica_noun(t) for t in ("xla", "cuda", "cpu")] == ["core", "GPU", "process"]


def test_device_where_no_gpu_exists_leaves_later_forks_able_to_use_cuda():
    """``runtime.device()`` for an in-process run on torch's CUDA wheel where no GPU exists
    answers "cpu" without asking the CUDA driver: asking it (torch.cuda.is_available() without
    NVML) would make every later multi-replica launch of the process start fresh interpreters."""
    from xla_utils.env.gpu import cuda_possible

    if torch.version.cuda is None or cuda_possible():
        pytest.skip("needs torch's CUDA wheel on a machine without an NVIDIA driver")
    code = ("from xla_utils import runtime as rt\n"
            "from xla_utils.runtime.torch_launch import cuda_in_use\n"
            "import torch\n"
            "print(rt.device().type, cuda_in_use() is None)\n"
            "torch.cuda.is_available()\n"
            "print(cuda_in_use() is None)\n")
    env = {k: v for k, v in os.environ.items() if k != "XLA_UTILS_CPU_REPLICAS"}
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    # the device answered without poisoning; torch's own query then did (the probe sees it)
    assert p.stdout.split() == ["cpu", "True", "False"], p.stdout
