"""Launch: run a function on every replica (TPU cores, simulated cores, or here).

``launch`` on a TPU forks one job process that ``xmp.spawn``s the replicas;
simulated jobs are started by :mod:`xla_utils.simulate` from its clean
interpreter, which calls back into :func:`simulate_threads`,
:func:`enter_simulated_replica` and :func:`dumps_cpu` here. Without a TPU and
without simulation, ``fn`` runs in-process on the torch backend.
"""
from __future__ import annotations

import contextlib
import os
import pickle
import queue as queue_mod
import signal
import sys
import threading
import time
import traceback
from typing import Any, Callable

from .state import STATE, SimGroup
from .world import rank, world_size
from .xla import (RuntimeAlreadyInitializedError, load_xla, tpu_present, xla_available,
                  xla_runtime_initialized)

__all__ = ["ReplicaError", "launch"]

# After the first replica error, how long the others get to report before the
# whole job is killed.
ERROR_GRACE_S = 3.0


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


def launch(fn: Callable[..., Any], *args: Any, cores: int | str = "all",
           simulate: int | None = None, timeout: float | None = None) -> Any:
    """Run ``fn(*args)`` on every core and return the master replica's result.

    On a TPU the replicas run in a forked child process (``xmp.spawn`` with
    ``start_method='fork'``, so functions and models defined in a notebook
    work). Simulated replicas are processes forked from a clean interpreter;
    ``fn`` and ``args`` reach them through cloudpickle (notebook functions,
    lambdas and models work too). Either way the calling process stays free of
    XLA runtime state and can launch again later. Without a TPU and without
    ``simulate`` (or without torch_xla), ``fn`` runs here, in-process, on one
    CUDA device or the CPU with world size 1.

    On a multi-host TPU pod slice run the same script on every host (e.g.
    ``gcloud compute tpus tpu-vm ssh ... --worker=all --command "python
    train.py"``); ranks and world size are global.

    Args:
        fn: The replica function; called as ``fn(*args)`` on every replica.
        *args: Its arguments.
        cores: ``"all"`` (default) for every TPU core of this host, or ``1``.
        simulate: Run on N simulated XLA:CPU cores (world size N) instead of a
            TPU, e.g. ``simulate=8`` to exercise 8-core code without TPU quota.
            Needs torch_xla. With ``cores=1`` a single XLA:CPU device is used.
            Replica code may use :mod:`xla_utils.runtime` or torch_xla's own
            idioms (``xm.all_reduce``, ``xm.optimizer_step``, ``MpDeviceLoader``,
            ``xm.mesh_reduce``, ...); see :mod:`xla_utils.simulate`. Default
            ``None``: no simulation.
        timeout: Seconds after which the job is killed (default: none).

    Returns:
        What ``fn`` returned on rank 0 (device tensors arrive as CPU tensors).

    Raises:
        ReplicaError: An exception in any replica, carrying that replica's
            traceback; the other replicas are killed rather than left hanging.
        TimeoutError: ``timeout`` passed; every replica was killed.
        RuntimeAlreadyInitializedError: On a TPU, this process already
            initialised the XLA runtime and can no longer fork replicas.
        XLAUnavailableError: ``simulate`` without a working torch_xla.
    """
    return _launch(fn, args, cores=cores, simulate=simulate, timeout=timeout, sim_threads=False)


def _prestart_simulation(simulate: int | None) -> None:
    """Start the simulation's clean interpreter in the background when a launch
    with ``simulate`` is coming (see :func:`xla_utils.simulate.prestart`)."""
    if simulate is not None and xla_available():
        from .. import simulate as sim

        sim.prestart()


def _launch(fn: Callable[..., Any], args: tuple, *, cores: int | str, simulate: int | None,
            timeout: float | None, sim_threads: bool) -> Any:
    """:func:`launch`; ``sim_threads=True`` simulates cores as threads of one
    process (xla_utils' own loops, which synchronise only through :func:`sync`;
    see :mod:`xla_utils.runtime`)."""
    if cores not in ("all", 1):
        raise ValueError(f"cores must be 'all' or 1, got {cores!r} (TPUs run 1 or all cores)")
    if simulate is not None and (not isinstance(simulate, int) or simulate < 1):
        raise ValueError(f"simulate must be a positive int (number of XLA:CPU devices), got {simulate!r}")
    use_xla = simulate is not None or (tpu_present() and xla_available())
    if use_xla:
        load_xla()  # clear XLAUnavailableError before forking
        # Simulated replicas start from a clean interpreter: this process's XLA
        # state does not matter to them. A TPU launch forks this process.
        if simulate is None and xla_runtime_initialized():
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
    prev = STATE.local.backend, STATE.local.in_replica
    STATE.local.backend, STATE.local.in_replica = "torch", True
    try:
        return fn(*args)
    finally:
        STATE.local.backend, STATE.local.in_replica = prev


def _launch_xla(fn, args, *, cores, simulate, timeout, sim_threads) -> Any:
    if simulate is not None:
        from .. import simulate as sim

        return sim.run_replicas(fn, tuple(args), 1 if cores == 1 else simulate, timeout=timeout,
                                threads=sim_threads)
    return _launch_tpu(fn, args, cores=cores, timeout=timeout)


def _launch_tpu(fn, args, *, cores, timeout) -> Any:
    """Fork one job process that ``xmp.spawn``s the TPU replicas; collect the result."""
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
        raise _died(job.exitcode)
    return result


def _died(exitcode: int) -> ReplicaError:
    """The error for a job process that exited with ``exitcode`` and no traceback."""
    sig = -exitcode if exitcode < 0 else None
    why = f"killed by signal {signal.Signals(sig).name}" if sig else f"exit code {exitcode}"
    hint = " (SIGKILL usually means the host ran out of memory)" if sig == signal.SIGKILL else ""
    return ReplicaError(-1, f"the replica process died ({why}){hint} without a Python traceback",
                        "ProcessDied")


def _kill(job) -> None:
    """Kill the job process and everything it started (its own session)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(job.pid, signal.SIGKILL)
    with contextlib.suppress(Exception):
        job.kill()
    job.join(timeout=5)


def dumps_cpu(obj: Any) -> bytes:
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


def enter_simulated_replica() -> None:
    """Called by :mod:`xla_utils.simulate` in each simulated replica process."""
    STATE.simulated_process = True
    STATE.local.backend, STATE.local.in_replica = "xla", True


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
        from .. import env

        env.prepare_spawn()
    except Exception as exc:  # never block a launch on a reporting helper
        print(f"xla_utils: environment preparation skipped: {exc}", file=sys.stderr)
    _spawn_job(fn, args, 1 if cores == 1 else None, results)


def simulate_threads(fn, args, n: int, results) -> None:
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
    STATE.sim = SimGroup(n, threading.Barrier(n)) if n > 1 else None
    _spawn_job(fn, args, 1 if n == 1 else None, results)


def _spawn_job(fn, args, nprocs: int | None, results) -> None:
    # xmp.spawn pickles its args; a Queue (and a notebook lambda) cannot be
    # pickled, so replicas find the job in STATE.job, inherited by fork.
    STATE.job = (fn, args, results)
    STATE.job_pid = os.getpid()
    xmp = load_xla()["xmp"]
    try:
        xmp.spawn(replica_main, nprocs=nprocs, start_method="fork")
    except BaseException as exc:
        # Replica exceptions were already reported by replica_main; this
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


def replica_main(index: int) -> None:
    fn, args, results = STATE.job
    if os.getpid() != STATE.job_pid:
        _die_with_parent()
    STATE.local.backend, STATE.local.in_replica = "xla", True
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
            results.put(("result", 0, dumps_cpu(out)))
        results.put(("finished", r, world_size()))
    except BaseException as exc:
        results.put(("error", r, (traceback.format_exc(), type(exc).__name__)))
        if STATE.sim is not None:
            STATE.sim.barrier.abort()
        elif os.getpid() != STATE.job_pid:
            # A replica process of its own: flush the report before dying
            # (the job process, where nprocs=1 runs, still needs the queue).
            results.close()
            results.join_thread()
        raise
