"""The one module that talks to torch_xla.

Everything else in xla_utils asks this module for the device, world size, rank,
step boundary (``sync``), gradient-averaging optimizer step, reductions, saving
and launching. Keeping every torch_xla call here means one place to adapt when
the API moves (``xm.xla_device`` -> ``torch_xla.device``, ``xm.mark_step`` ->
``torch_xla.sync``, and the announced TorchTPU successor).

Backends
--------
``"xla"``   torch_xla devices: TPU cores, or ``simulate=N`` XLA:CPU devices.
``"torch"`` plain PyTorch on one CUDA device or the CPU, world size 1. Used when
            no TPU is present and no simulation was asked for, and whenever
            torch_xla is missing.

Inside :func:`launch` each replica knows its backend. Outside it, the backend is
``"xla"`` on a TPU machine (calling :func:`device` then initialises the XLA
runtime in this process, after which :func:`launch` can no longer spawn) and
``"torch"`` elsewhere.

Simulated cores
---------------
Simulated jobs start from a clean interpreter (see :mod:`xla_utils.simulate`), in
one of two ways:

- ``launch(fn, simulate=N)`` runs N replica *processes*, each with one XLA:CPU
  device. Inside them torch_xla's world queries and collectives are the
  simulated world's, so any torch_xla idiom works and this module calls
  torch_xla exactly as on a TPU.
- xla_utils' own loops (``fit``, ``predict``, ``evaluate``, ``lr_find``, ``check``)
  run N replica *threads* of one process on N XLA:CPU devices
  (``CPU_NUM_DEVICES=N``): one compilation instead of N, so much faster on a
  small host (docs/BENCHMARKS.md). That only works because these loops
  synchronise solely through :func:`sync`: threads compiling the same graph
  concurrently would get different collective op ids ("Expected N threads to
  join the rendezvous"), so in thread simulation every :func:`sync` first meets
  the other replicas at a ``threading.Barrier`` and then compiles/launches the
  graph under one lock (execution stays asynchronous, so the collective itself
  still runs concurrently and cannot deadlock on the lock).
"""
from __future__ import annotations

import contextlib
import math
import os
import pickle
import queue as queue_mod
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

__all__ = [
    "XLAUnavailableError",
    "RuntimeAlreadyInitializedError",
    "ReplicaError",
    "xla_available",
    "backend",
    "device",
    "world_size",
    "rank",
    "local_rank",
    "is_master",
    "is_simulated",
    "sync",
    "optimizer_step",
    "all_reduce",
    "master_print",
    "rendezvous",
    "save",
    "to_device",
    "device_prefetch",
    "metrics",
    "metrics_report",
    "progress_bars",
    "set_seed",
    "launch",
]

# Seconds a thread-simulated replica waits at a step boundary for the others. A
# replica that is still compiling a large graph can legitimately lag, so this is
# long; it only exists so that a dead replica can never hang the rest forever.
BARRIER_TIMEOUT_S = float(os.environ.get("XLA_UTILS_BARRIER_TIMEOUT", "600"))
# After the first replica error, how long the others get to report before the
# whole job is killed.
ERROR_GRACE_S = 3.0


class XLAUnavailableError(ImportError):
    """torch_xla is missing, or does not match the installed torch."""


class RuntimeAlreadyInitializedError(RuntimeError):
    """The calling process already initialised the XLA runtime."""


class ReplicaError(RuntimeError):
    """An exception raised inside a replica started by :func:`launch`.

    ``rank`` is the replica's global rank and ``remote_traceback`` its formatted
    traceback (also part of the message).
    """

    def __init__(self, rank: int, remote_traceback: str, exc_type: str = "Exception"):
        self.rank = rank
        self.remote_traceback = remote_traceback
        self.exc_type = exc_type
        super().__init__(
            f"replica {rank} raised {exc_type}; its traceback:\n{remote_traceback.rstrip()}"
        )


# --------------------------------------------------------------------------
# torch_xla import, with one clear message when it is missing or mismatched
# --------------------------------------------------------------------------
_XLA: dict[str, Any] | None = None
_XLA_ERROR: str | None = None


def _fix_message(cause: str) -> str:
    try:
        from . import env

        return f"{cause}\n{env.xla_fix_message()}"
    except Exception:  # env must never mask the real cause
        return cause


def _load_xla() -> dict[str, Any]:
    """Import torch_xla lazily; raise :class:`XLAUnavailableError` with the fix."""
    global _XLA, _XLA_ERROR
    if _XLA is not None:
        return _XLA
    if _XLA_ERROR is not None:
        raise XLAUnavailableError(_XLA_ERROR)
    if "PJRT_DEVICE" not in os.environ and "torch_xla" not in sys.modules and not _tpu_present():
        os.environ["PJRT_DEVICE"] = "CPU"  # torch_xla's own default here, minus its warning
    try:
        import torch_xla
        import torch_xla.core.xla_model as xm
        import torch_xla.debug.metrics as met
        import torch_xla.distributed.xla_multiprocessing as xmp
        import torch_xla.runtime as xr
    except ModuleNotFoundError as exc:
        _XLA_ERROR = _fix_message(f"torch_xla is not installed ({exc}).")
        raise XLAUnavailableError(_XLA_ERROR) from None
    except (ImportError, OSError) as exc:
        # The classic symptom of a torch / torch_xla version mismatch is an
        # "undefined symbol" from _XLAC.so; never show that raw.
        _XLA_ERROR = _fix_message(
            f"torch_xla failed to import ({type(exc).__name__}: {str(exc)[:200]}). "
            "This almost always means torch and torch_xla are different versions."
        )
        raise XLAUnavailableError(_XLA_ERROR) from None
    _XLA = {"torch_xla": torch_xla, "xm": xm, "xr": xr, "xmp": xmp, "met": met}
    return _XLA


def xla_available() -> bool:
    """True when torch_xla imports cleanly (imports it on first call)."""
    try:
        _load_xla()
        return True
    except XLAUnavailableError:
        return False


def _xla_runtime_initialized() -> bool:
    """Whether *this process* already initialised the XLA runtime (no side effects)."""
    if "torch_xla" not in sys.modules:
        return False
    xla = _load_xla()
    xr = xla["xr"]
    for probe in (
        lambda: xr.is_runtime_initialized(),  # not in every release
        lambda: xla["torch_xla"]._XLAC._xla_runtime_is_initialized(),
    ):
        try:
            return bool(probe())
        except AttributeError:
            continue
    return False


# --------------------------------------------------------------------------
# Per-process / per-replica state
# --------------------------------------------------------------------------
@dataclass
class _Sim:
    """Shared by the N replica threads of a thread-simulated job."""

    n: int
    barrier: threading.Barrier
    lock: threading.Lock = field(default_factory=threading.Lock)
    values: dict = field(default_factory=dict)  # rank -> number, for _host_sum


class _State(threading.local):
    # Filled in by launch() inside each replica thread/process. Thread-local
    # because a TPU v2/v3 process runs one replica thread per core.
    backend: str | None = None
    in_replica: bool = False


_state = _State()
# True in a simulated replica process (one replica per process: every thread of
# the process, e.g. a loader's, belongs to it).
_simulated_process = False
_sim: _Sim | None = None  # thread simulation: process-global, the threads share it
_job: tuple | None = None  # (fn, args, result queue) inside a launched job
_job_pid: int | None = None
_TPU_PRESENT: bool | None = None


def _tpu_present() -> bool:
    global _TPU_PRESENT
    if _TPU_PRESENT is None:
        try:
            from . import env

            _TPU_PRESENT = env.detect().accelerator == "tpu"
        except Exception:
            _TPU_PRESENT = False
    return _TPU_PRESENT


def backend() -> str:
    """``"xla"`` or ``"torch"`` for the calling replica (see the module docstring)."""
    if _state.backend is not None:
        return _state.backend
    if _simulated_process:
        return "xla"
    return "xla" if _tpu_present() and xla_available() else "torch"


def is_simulated() -> bool:
    """True inside a ``launch(..., simulate=N)`` replica."""
    return _simulated_process or (_sim is not None and backend() == "xla")


def device():
    """The calling replica's device (``torch.device``)."""
    import torch

    if backend() == "xla":
        x = _load_xla()
        tx = x["torch_xla"]
        return tx.device() if hasattr(tx, "device") else x["xm"].xla_device()
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def world_size() -> int:
    """Number of replicas over all hosts (1 on the torch backend)."""
    if backend() != "xla":
        return 1
    return int(_load_xla()["xr"].world_size())


def rank() -> int:
    """Global rank of the calling replica, 0 .. world_size()-1."""
    if backend() != "xla":
        return 0
    return int(_load_xla()["xr"].global_ordinal())


def local_rank() -> int:
    """Rank of the calling replica on this host."""
    if backend() != "xla":
        return 0
    return int(_load_xla()["xr"].local_ordinal())


def is_master() -> bool:
    """True on global rank 0."""
    return rank() == 0


def sync() -> None:
    """End the step: compile (if new) and launch the pending XLA graph.

    Every replica must call it the same number of times. In thread simulation
    it also meets the other replicas first (see the module docstring). No-op on
    the torch backend.
    """
    if backend() != "xla":
        return
    x = _load_xla()
    tx = x["torch_xla"]
    do_sync = tx.sync if hasattr(tx, "sync") else x["xm"].mark_step
    sim = _sim
    if sim is None:
        do_sync()
        return
    _sim_wait(sim)
    with sim.lock:
        do_sync()


def _sim_wait(sim: _Sim) -> None:
    try:
        sim.barrier.wait(timeout=BARRIER_TIMEOUT_S)
    except threading.BrokenBarrierError:
        raise RuntimeError(
            "another simulated replica failed or timed out at a step boundary; "
            "this replica stops too"
        ) from None


def optimizer_step(optimizer, barrier: bool = False) -> None:
    """Average gradients over replicas, then ``optimizer.step()``.

    ``barrier=True`` also ends the step (the single-core debug idiom
    ``xm.optimizer_step(opt, barrier=True)``); without it call :func:`sync`.
    """
    if backend() != "xla":
        optimizer.step()
        return
    xm = _load_xla()["xm"]
    if _sim is not None and barrier:
        xm.optimizer_step(optimizer)
        sync()
    else:
        xm.optimizer_step(optimizer, barrier=barrier)


def all_reduce(value, op: str = "sum"):
    """Sum or mean of a tensor or a Python number over all replicas.

    Tensors are reduced lazily on the device (no host sync; the result is
    materialised at the next :func:`sync`). Python numbers are reduced on the
    host and returned as a float; call it from every replica, outside hot loops.
    """
    import torch

    if op not in ("sum", "mean"):
        raise ValueError(f"all_reduce op must be 'sum' or 'mean', got {op!r}")
    n = world_size()
    if not isinstance(value, torch.Tensor):
        total = _host_sum(float(value)) if n > 1 else float(value)
        return total / n if op == "mean" else total
    if n > 1:
        value = _load_xla()["xm"].all_reduce(_load_xla()["xm"].REDUCE_SUM, value)
    return value / n if op == "mean" else value


def _host_sum(v: float) -> float:
    sim = _sim
    if sim is not None and backend() == "xla":
        # Threads of one process: exchange through memory, no XLA graph (a
        # rank-dependent scalar would give each replica a different graph).
        r = rank()
        sim.values[r] = v
        _sim_wait(sim)
        total = math.fsum(sim.values[i] for i in range(sim.n))
        _sim_wait(sim)  # nobody overwrites values before all have read them
        return total
    _host_sum.calls = getattr(_host_sum, "calls", 0) + 1
    return float(_load_xla()["xm"].mesh_reduce(f"xla_utils.sum.{_host_sum.calls}", v, math.fsum))


def master_print(*args, **kwargs) -> None:
    """``print`` on global rank 0 only (flushes)."""
    if is_master():
        kwargs.setdefault("flush", True)
        print(*args, **kwargs)


def rendezvous(tag: str) -> None:
    """All replicas meet here before any goes on."""
    if backend() != "xla" or world_size() == 1:
        return
    if _sim is not None:
        _sim_wait(_sim)
        return
    _load_xla()["xm"].rendezvous(tag)


def save(obj: Any, path: str | os.PathLike) -> None:
    """Checkpoint from every replica: all sync, the master writes, all meet.

    Call it on every rank (never inside ``if is_master()``). Tensors are moved to
    the CPU; the file is written to ``path + '.tmp'`` and renamed, so a crash
    never leaves a half-written checkpoint under ``path``.
    """
    import torch

    path = Path(path)
    sync()
    if is_master():
        cpu_obj = _to_cpu(obj)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "wb") as f:
            torch.save(cpu_obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    rendezvous(f"xla_utils.save:{path}")


def _to_cpu(obj: Any) -> Any:
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


def to_device(batch: Any, dev=None) -> Any:
    """Move a tensor or a (nested) tuple/list/dict of tensors to the device.

    On XLA this is ``xm.send_cpu_data_to_device`` (what ``MpDeviceLoader``
    uses): it copies the host data before returning. A plain ``tensor.to(xla)``
    may still read the host buffer later, when a loader has already freed or
    reused it (seen on XLA:CPU as silently wrong batches).
    """
    import torch

    dev = dev or device()
    if dev.type == "xla":
        moved = _load_xla()["xm"].send_cpu_data_to_device(batch, dev)
        # it wraps a bare tensor in a list
        return moved[0] if isinstance(batch, torch.Tensor) else moved
    if isinstance(batch, torch.Tensor):
        return batch.to(dev, non_blocking=dev.type == "cuda")
    if isinstance(batch, dict):
        return {k: to_device(v, dev) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(v, dev) for v in batch)
    return batch


def device_prefetch(batches: Iterable, depth: int = 2) -> Iterator:
    """Yield ``batches`` already on the device, transferring ahead in a thread.

    Unlike torch_xla's ``MpDeviceLoader`` it never ends the step itself: the
    training loop owns its step boundary (:func:`sync`), which is what makes
    the simulated-core recipe and exact compile accounting possible.
    ``depth`` batches are in flight at most (default 2). On the torch backend
    batches are moved inline, one at a time.
    """
    dev = device()
    if depth <= 0 or dev.type != "xla":
        # Only XLA transfers copy; on CPU/CUDA a batch handed over early could be
        # a loader's reused buffer by the time it is used (and prefetching on
        # the host's own cores gains nothing).
        for b in batches:
            yield to_device(b, dev)
        return
    q: queue_mod.Queue = queue_mod.Queue(maxsize=depth)
    done = object()
    stop = threading.Event()
    xla_state = (_state.backend, _state.in_replica)

    def worker() -> None:
        _state.backend, _state.in_replica = xla_state
        try:
            for b in batches:
                if stop.is_set():
                    return
                q.put(to_device(b, dev))
            q.put(done)
        except BaseException as exc:  # re-raised in the consumer
            q.put(_Raise(exc))

    t = threading.Thread(target=worker, daemon=True, name="xla_utils-prefetch")
    t.start()
    try:
        while True:
            item = q.get()
            if item is done:
                return
            if isinstance(item, _Raise):
                raise item.exc
            yield item
    finally:
        stop.set()
        with contextlib.suppress(queue_mod.Empty):
            while True:
                q.get_nowait()


@dataclass
class _Raise:
    exc: BaseException


def progress_bars():
    """``(master_bar, progress_bar)`` from fastprogress that can draw here.

    A forked XLA replica cannot draw notebook widgets, so there the console
    bars are used (their text reaches the notebook through stdout).
    """
    from fastprogress import fastprogress as fp

    if backend() == "xla":
        return fp.force_console_behavior()
    return fp.master_bar, fp.progress_bar


def set_seed(seed: int) -> None:
    """Seed Python, NumPy, torch and (on XLA) the device RNG of this replica."""
    import random

    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed % 2**32)
    if _sim is None:  # the host RNG is shared by simulated threads
        torch.manual_seed(seed)
    if backend() == "xla":
        _load_xla()["xm"].set_rng_state(int(seed), device=device())


# --------------------------------------------------------------------------
# Metrics
# --------------------------------------------------------------------------
def metrics() -> dict[str, Any]:
    """A snapshot of this process's XLA counters (zeros on the torch backend).

    Keys: ``compiles`` (graphs compiled, ``UncachedCompile``), ``compile_s``,
    ``executions`` (graphs run), ``to_device`` and ``to_host`` (transfers),
    ``fallback_ops`` (``{"aten::op": count}`` run on the host CPU).
    """
    snap = {"compiles": 0, "compile_s": 0.0, "executions": 0, "to_device": 0,
            "to_host": 0, "fallback_ops": {}}
    if backend() != "xla":
        return snap
    met = _load_xla()["met"]

    def count(name: str) -> int:
        v = met.counter_value(name)
        return int(v) if v is not None else 0

    def metric_count_sum(name: str) -> tuple[int, float]:
        data = met.metric_data(name)
        return (int(data[0]), float(data[1])) if data else (0, 0.0)

    snap["compiles"] = count("UncachedCompile")
    snap["compile_s"] = metric_count_sum("CompileTime")[1] / 1e9
    snap["executions"] = metric_count_sum("ExecuteTime")[0]
    snap["to_device"] = metric_count_sum("TransferToDeviceTime")[0]
    snap["to_host"] = metric_count_sum("TransferFromDeviceTime")[0]
    snap["fallback_ops"] = {
        n: count(n) for n in met.counter_names() if n.startswith("aten::")
    }
    return snap


def metrics_report(before: dict[str, Any], after: dict[str, Any], steps: int) -> str:
    """Explain in words what happened between two :func:`metrics` snapshots."""
    d = {k: after[k] - before[k] for k in ("compiles", "compile_s", "executions",
                                          "to_device", "to_host")}
    steps = max(int(steps), 1)
    lines = [
        f"{steps} steps: {d['compiles']} XLA compilations "
        f"({d['compile_s']:.1f} s compiling), {d['executions']} graph executions "
        f"({d['executions'] / steps:.1f} per step), {d['to_device']} host->device and "
        f"{d['to_host']} device->host transfers ({d['to_host'] / steps:.1f} per step)."
    ]
    fb = {k: after["fallback_ops"].get(k, 0) - before["fallback_ops"].get(k, 0)
          for k in after["fallback_ops"]}
    fb = {k: v for k, v in fb.items() if v > 0}
    if fb:
        ops = ", ".join(f"{k} x{v}" for k, v in sorted(fb.items(), key=lambda kv: -kv[1]))
        lines.append(f"CPU fallbacks (ops XLA could not lower, run on the host): {ops}.")
    else:
        lines.append("No CPU-fallback ops.")
    if d["to_host"] > steps:
        lines.append(
            "More than one device->host transfer per step: a .item(), print or "
            "Python condition on a tensor forces the host to wait every step."
        )
    return "\n".join(lines)


# --------------------------------------------------------------------------
# launch
# --------------------------------------------------------------------------
def launch(fn: Callable[..., Any], *args: Any, cores: int | str = "all",
           simulate: int | None = None, timeout: float | None = None) -> Any:
    """Run ``fn(*args)`` on every core and return the master replica's result.

    Parameters
    ----------
    cores:
        ``"all"`` (default) for every TPU core of this host, or ``1``.
    simulate:
        Run on N simulated XLA:CPU cores (world size N) instead of a TPU, e.g.
        ``simulate=8`` to exercise 8-core code without TPU quota. Needs torch_xla.
        With ``cores=1`` a single XLA:CPU device is used. Replica code may use
        this module or torch_xla's own idioms (``xm.all_reduce``,
        ``xm.optimizer_step``, ``MpDeviceLoader``, ``xm.mesh_reduce``, ...); see
        :mod:`xla_utils.simulate`.
    timeout:
        Seconds after which the job is killed and ``TimeoutError`` raised
        (default: none).

    On a TPU the replicas run in a forked child process (``xmp.spawn`` with
    ``start_method='fork'``, so functions and models defined in a notebook
    work). Simulated replicas are processes forked from a clean interpreter;
    ``fn`` and ``args`` reach them through cloudpickle (notebook functions,
    lambdas and models work too). Either way the calling process stays free of
    XLA runtime state and can launch again later. An exception in any replica is raised here as
    :class:`ReplicaError` carrying that replica's traceback, and the other
    replicas are killed rather than left hanging. Without a TPU and without
    ``simulate`` (or without torch_xla), ``fn`` runs here, in-process, on one
    CUDA device or the CPU with world size 1.

    On a multi-host TPU pod slice run the same script on every host (e.g.
    ``gcloud compute tpus tpu-vm ssh ... --worker=all --command "python
    train.py"``); ranks and world size are global.
    """
    return _launch(fn, args, cores=cores, simulate=simulate, timeout=timeout, sim_threads=False)


def _prestart_simulation(simulate: int | None) -> None:
    """Start the simulation's clean interpreter in the background when a launch
    with ``simulate`` is coming (see :func:`xla_utils.simulate.prestart`)."""
    if simulate is not None and xla_available():
        from . import simulate as sim

        sim.prestart()


def _launch(fn: Callable[..., Any], args: tuple, *, cores: int | str, simulate: int | None,
            timeout: float | None, sim_threads: bool) -> Any:
    """:func:`launch`; ``sim_threads=True`` simulates cores as threads of one
    process (xla_utils' own loops, which synchronise only through :func:`sync`;
    see the module docstring)."""
    if cores not in ("all", 1):
        raise ValueError(f"cores must be 'all' or 1, got {cores!r} (TPUs run 1 or all cores)")
    if simulate is not None and (not isinstance(simulate, int) or simulate < 1):
        raise ValueError(f"simulate must be a positive int (number of XLA:CPU devices), got {simulate!r}")
    use_xla = simulate is not None or (_tpu_present() and xla_available())
    if use_xla:
        _load_xla()  # clear XLAUnavailableError before forking
        # Simulated replicas start from a clean interpreter: this process's XLA
        # state does not matter to them. A TPU launch forks this process.
        if simulate is None and _xla_runtime_initialized():
            raise RuntimeAlreadyInitializedError(
                "this process has already initialised the XLA runtime (something called "
                "torch_xla.device(), xm.xla_device(), xr.world_size() or moved a tensor "
                "to XLA outside launch()), so it cannot spawn replicas any more. Fix: "
                "restart the kernel/process and keep every XLA call inside the function "
                "passed to launch() (or OneCycleTrainer.fit / lr_find, which do that)."
            )
        return _launch_xla(fn, args, cores=cores, simulate=simulate, timeout=timeout,
                           sim_threads=sim_threads)
    # torch backend, in-process
    prev = _state.backend, _state.in_replica
    _state.backend, _state.in_replica = "torch", True
    try:
        return fn(*args)
    finally:
        _state.backend, _state.in_replica = prev


def _launch_xla(fn, args, *, cores, simulate, timeout, sim_threads) -> Any:
    if simulate is not None:
        from . import simulate as sim

        return sim.run_replicas(fn, tuple(args), 1 if cores == 1 else simulate, timeout=timeout,
                                threads=sim_threads)
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    results = ctx.Queue()
    job = ctx.Process(target=_job_main, args=(fn, args, cores, results),
                      name="xla_utils-launch", daemon=False)
    # Flush so that buffered notebook output is not duplicated by the fork.
    sys.stdout.flush()
    sys.stderr.flush()
    job.start()
    deadline = None if timeout is None else time.monotonic() + timeout
    first_error: ReplicaError | None = None
    error_deadline = None
    result: Any = None
    got_result = False
    finished: set[int] = set()
    try:
        while True:
            try:
                kind, r, payload = results.get(timeout=0.2)
            except queue_mod.Empty:
                kind = None
            if kind == "result":
                result, got_result = pickle.loads(payload), True
            elif kind == "error":
                tb, exc_type = payload
                if first_error is None:
                    first_error = ReplicaError(r, tb, exc_type)
                if error_deadline is None:
                    error_deadline = time.monotonic() + ERROR_GRACE_S
            elif kind == "finished":
                finished.add(r)
                # Every replica's fn has returned: the job has nothing left to do
                # but tear down the XLA runtime, which can crash natively at exit
                # ("pure virtual method called") under load. Do not wait for it.
                if got_result and first_error is None and len(finished) == payload:
                    break
            elif kind == "done":
                break
            if kind is None and not job.is_alive():
                # drain anything sent just before exit
                with contextlib.suppress(queue_mod.Empty):
                    while True:
                        kind, r, payload = results.get(timeout=0.5)
                        if kind == "result":
                            result, got_result = pickle.loads(payload), True
                        elif kind == "error" and first_error is None:
                            first_error = ReplicaError(r, *payload)
                break
            now = time.monotonic()
            if error_deadline is not None and now > error_deadline:
                break
            if deadline is not None and now > deadline:
                _kill(job)
                raise TimeoutError(f"launch() timed out after {timeout} s; all replicas were killed")
    except KeyboardInterrupt:
        _kill(job)
        raise
    if job.is_alive():
        job.join(timeout=0.5 if first_error is not None or finished else ERROR_GRACE_S)
    if job.is_alive():
        _kill(job)
    if first_error is not None:
        raise first_error
    if job.exitcode not in (0, None) and not got_result:
        sig = -job.exitcode if job.exitcode < 0 else None
        why = f"killed by signal {signal.Signals(sig).name}" if sig else f"exit code {job.exitcode}"
        hint = " (SIGKILL usually means the host ran out of memory)" if sig == signal.SIGKILL else ""
        raise ReplicaError(-1, f"the replica process died ({why}){hint} without a Python traceback",
                           "ProcessDied")
    return result


def _kill(job) -> None:
    """Kill the job process and everything it started (its own session)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(job.pid, signal.SIGKILL)
    with contextlib.suppress(Exception):
        job.kill()
    job.join(timeout=5)


def _dumps_cpu(obj: Any) -> bytes:
    """Pickle ``obj`` with every device tensor turned into a CPU tensor.

    Unpickling an XLA tensor in the caller would initialise the XLA runtime
    there and make every later launch() impossible. cloudpickle (when present)
    also carries functions and classes defined inside the replica.
    """
    import io

    import torch

    try:
        import cloudpickle

        base = cloudpickle.Pickler
    except ImportError:  # the TPU path works without it
        base = pickle.Pickler

    class CPUPickler(base):
        def reducer_override(self, o):
            if isinstance(o, torch.Tensor) and o.device.type != "cpu":
                cpu = o.detach().cpu()
                if isinstance(o, torch.nn.Parameter):
                    cpu = torch.nn.Parameter(cpu, requires_grad=o.requires_grad)
                return cpu.__reduce_ex__(pickle.HIGHEST_PROTOCOL)
            parent = getattr(super(), "reducer_override", None)
            return parent(o) if parent is not None else NotImplemented

    buf = io.BytesIO()
    CPUPickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return buf.getvalue()


def _enter_simulated_replica() -> None:
    """Called by :mod:`xla_utils.simulate` in each simulated replica process."""
    global _simulated_process
    _simulated_process = True
    _state.backend, _state.in_replica = "xla", True


def _die_with_parent() -> None:
    """Linux: get SIGKILL when the process that forked us dies, so that a killed
    notebook kernel or test runner never leaves replicas running."""
    with contextlib.suppress(Exception):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def _openmp_single_thread() -> None:
    """Keep this (forked) thread out of OpenMP parallel regions.

    GNU OpenMP is not fork-safe: if the caller's thread ever ran a parallel
    torch op, its team's worker threads do not exist in the child, and the
    child's next parallel region waits for them forever (seen as a hang in
    ``copy.deepcopy(model)``). ``torch.set_num_threads`` cannot be used after a
    fork (it asserts on torch's pthreadpool), so this sets the OpenMP runtime's
    own per-thread limit; ATen then runs parallel loops inline. MKL (linked into
    libtorch_cpu) asks OpenMP for its own thread count and ignores that limit,
    so a CPU matmul in the child (e.g. ``check``'s CPU pass) hung the same way:
    its per-thread MKL limit is set to 1 too. Threads started later get fresh
    teams and keep their parallelism.
    """
    import ctypes

    with contextlib.suppress(OSError):
        with open("/proc/self/maps") as f:
            libs = {line.split()[-1] for line in f
                    if any(k in line for k in ("libgomp", "libiomp", "libtorch_cpu", "libmkl"))}
        for lib in libs:
            handle = None
            with contextlib.suppress(OSError):
                handle = ctypes.CDLL(lib)
            # MKL_Set_Num_Threads_Local is MKL's by-value C entry point (the lower-case
            # name is the Fortran one, which takes a pointer).
            for name in ("omp_set_num_threads", "MKL_Set_Num_Threads_Local"):
                with contextlib.suppress(AttributeError):
                    getattr(handle, name)(1)


def _job_main(fn, args, cores, results) -> None:
    """Body of the forked job process on a TPU host: set the environment, then xmp.spawn."""
    os.setsid()  # so that _kill() reaches replicas forked by xmp.spawn
    _die_with_parent()
    _openmp_single_thread()
    os.environ.setdefault("PJRT_DEVICE", "TPU")
    try:
        from . import env

        env.prepare_spawn()
    except Exception as exc:  # never block a launch on a reporting helper
        print(f"xla_utils: environment preparation skipped: {exc}", file=sys.stderr)
    _spawn_job(fn, args, 1 if cores == 1 else None, results)


def _simulate_threads(fn, args, n: int, results) -> None:
    """Run a thread-simulated job (N replica threads on N XLA:CPU devices) in this
    process, which :mod:`xla_utils.simulate` forked from its clean interpreter.
    ``results`` takes ``put(("result" | "finished" | "error" | "done", rank, payload))``."""
    _openmp_single_thread()
    os.environ["PJRT_DEVICE"] = "CPU"
    os.environ["CPU_NUM_DEVICES"] = str(n)
    # Every replica's execution of a collective blocks a thread until all N
    # have joined. The asynchronous PJRT CPU client runs executions on a pool
    # sized by the host's cores (2 here), so N > 2 replicas deadlock until XLA
    # aborts the process. The synchronous client executes on torch_xla's own
    # pool, which XLA_THREAD_POOL_SIZE makes big enough.
    os.environ["PJRT_CPU_ASYNC_CLIENT"] = "0"
    pool = int(os.environ.get("XLA_THREAD_POOL_SIZE", "0") or 0)
    os.environ["XLA_THREAD_POOL_SIZE"] = str(max(pool, 2 * n, 8))
    global _sim
    _sim = _Sim(n, threading.Barrier(n)) if n > 1 else None
    _spawn_job(fn, args, 1 if n == 1 else None, results)


def _spawn_job(fn, args, nprocs: int | None, results) -> None:
    global _job, _job_pid
    # xmp.spawn pickles its args; a Queue (and a notebook lambda) cannot be
    # pickled, so replicas find the job in this module global, inherited by fork.
    _job = (fn, args, results)
    _job_pid = os.getpid()
    xmp = _load_xla()["xmp"]
    try:
        xmp.spawn(_replica_main, nprocs=nprocs, start_method="fork")
    except BaseException as exc:
        # Replica exceptions were already reported by _replica_main; this
        # catches spawn's own failures and replica processes that died.
        tb = traceback.format_exc()
        if type(exc).__name__ == "BrokenProcessPool":
            tb = ("a replica process died abruptly (a crash, os._exit, or the kernel's "
                  "out-of-memory killer); no Python traceback exists.\n" + tb)
        results.put(("error", -1, (tb, type(exc).__name__)))
    finally:
        results.put(("done", -1, None))
        results.close()
        results.join_thread()


def _replica_main(index: int) -> None:
    fn, args, results = _job
    if os.getpid() != _job_pid:
        _die_with_parent()
    _state.backend, _state.in_replica = "xla", True
    r = -1
    import torch

    try:
        r = rank()
        # Autograd sizes its per-device worker queues once per process, at the
        # first backward. A parent that ran any backward before forking passes
        # on queues sized for zero XLA devices, and every replica's backward
        # then fails an internal assert. Running backward on the calling thread
        # (thread-local switch) needs no such queues. (TPU v2/v3 run several
        # replica threads per process; simulated cores never fork the caller.)
        with torch.autograd.set_multithreading_enabled(False):
            out = fn(*args)
        if r == 0:
            results.put(("result", 0, _dumps_cpu(out)))
        results.put(("finished", r, world_size()))
    except BaseException as exc:
        results.put(("error", r, (traceback.format_exc(), type(exc).__name__)))
        if _sim is not None:
            _sim.barrier.abort()
        elif os.getpid() != _job_pid:
            # A replica process of its own: flush the report before dying
            # (the job process, where nprocs=1 runs, still needs the queue).
            results.close()
            results.join_thread()
        raise


# --------------------------------------------------------------------------
# Helpers for xla_utils.check (issue 12). Kept in one block at the end so that
# work on launch() above merges cleanly.
# --------------------------------------------------------------------------
__all__ += ["graph_text"]


def graph_text(tensors: Iterable[Any]) -> str:
    """The pending XLA IR of ``tensors`` as text ("" on the torch backend).

    Call it before :func:`sync`; it neither compiles nor executes anything.
    Comparing it between steps names what changed when a step compiles again.
    """
    if backend() != "xla":
        return ""
    return _load_xla()["torch_xla"]._XLAC._get_xla_tensors_text(list(tensors))
