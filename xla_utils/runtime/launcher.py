"""Launch: run a function on every replica (TPU cores, simulated cores, GPUs, or here).

``launch`` on a TPU forks one job process into
:func:`~xla_utils.runtime.replica.job_main`, which ``xmp.spawn``s the replicas;
simulated jobs are started by the :class:`Simulator` that :mod:`xla_utils.simulate`
registers here when it is imported (``import xla_utils`` imports it): simulate sits
above this package and calls into it, so nothing in ``runtime`` imports ``simulate``.
Without a TPU and without simulation the torch backend runs: on several GPUs (or
``XLA_UTILS_CPU_REPLICAS=N`` CPU devices) one job process forks a replica per device
(:func:`~xla_utils.runtime.torch_launch.torch_job_main`, torch.distributed); on one
device ``fn`` runs in-process. Every forked job reports through the same queue and is
collected, timed out and killed by :func:`run_forked_job`.
"""
from __future__ import annotations

import contextlib
import os
import pickle
import queue as queue_mod
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from .hosts import agreed, pod_agreed, run_joined, simulated_pod, torchrun_world
from .placement import Placement, resolve
from .replica import ReplicaError, job_main
from .state import STATE
from .fresh import write_call
from .torch_launch import FreshStart, cuda_in_use, forks, sendable_call, torch_job_main
from .xla import (RuntimeAlreadyInitializedError, load_xla, tpu_present, xla_installed,
                  xla_runtime_initialized)

__all__ = ["launch", "Simulator", "register_simulator", "run_forked_job", "same_everywhere"]

# After the first replica error, how long the others get to report before the
# whole job is killed.
ERROR_GRACE_S = 3.0


@dataclass(frozen=True)
class Simulator:
    """How simulated jobs run (registered by :mod:`xla_utils.simulate`).

    Attributes:
        run_replicas: ``run_replicas(fn, args, n, timeout=..., threads=...)``: ``fn(*args)``
            on ``n`` simulated cores; rank 0's result.
        prestart: Starts the simulation's clean interpreter in the background.
    """

    run_replicas: Callable[..., Any]
    prestart: Callable[[], None]


_SIMULATOR: Simulator | None = None


def register_simulator(run_replicas: Callable[..., Any], prestart: Callable[[], None]) -> None:
    """Make ``run_replicas`` / ``prestart`` the way simulated launches run (called by
    :mod:`xla_utils.simulate` when it is imported; a later call replaces them)."""
    global _SIMULATOR
    _SIMULATOR = Simulator(run_replicas=run_replicas, prestart=prestart)


def _simulator() -> Simulator:
    if _SIMULATOR is None:  # only when xla_utils' package face was bypassed
        raise RuntimeError("simulated cores run through xla_utils.simulate, which registers "
                           "itself with xla_utils.runtime when imported; `import xla_utils` "
                           "imports it. Fix: import xla_utils.simulate before launching")
    return _SIMULATOR


def launch(fn: Callable[..., Any], *args: Any, cores: int | str = "all",
           simulate: int | None = None, timeout: float | None = None) -> Any:
    """Run ``fn(*args)`` on every core and return the master replica's result.

    On a TPU the replicas run in a forked child process (``xmp.spawn`` with
    ``start_method='fork'``, so functions and models defined in a notebook
    work). Simulated replicas are processes forked from a clean interpreter;
    ``fn`` and ``args`` reach them through cloudpickle (notebook functions,
    lambdas and models work too). Either way the calling process stays free of
    XLA runtime state and can launch again later. Without a TPU and without
    ``simulate`` (or without torch_xla) the torch backend runs ``fn``: on a
    machine with k > 1 GPUs in k replica processes, one per GPU, over
    torch.distributed (NCCL), world size k: forked from this one, or, when this
    process initialised CUDA or queried its driver (after which forked processes
    cannot use CUDA), started as fresh interpreters that receive ``fn`` and ``args``
    by value (cloudpickle; the first line says so and what it cost).
    ``XLA_UTILS_CPU_REPLICAS=N`` runs N CPU processes over gloo instead (a rehearsal
    without GPUs, started the same way). On one GPU or the CPU ``fn`` runs here,
    in-process, with world size 1.

    On a multi-host TPU pod slice run the same script on every host (e.g.
    ``gcloud compute tpus tpu-vm ssh ... --worker=all --command "python
    train.py"``); ranks and world size are global. Under ``torchrun`` (one or several
    nodes) every torchrun process is one replica: ``fn`` runs there, in torchrun's process
    group, and every process gets global rank 0's result (``cores=1``: rank 0 alone runs it).

    Args:
        fn: The replica function; called as ``fn(*args)`` on every replica.
        *args: Its arguments.
        cores: ``"all"`` (default) for every TPU core or GPU of this host, or ``1``.
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
        NotSendableError: Replicas start as fresh interpreters and part of
            ``fn`` or ``args`` cannot be pickled (named; nothing started).
        XLAUnavailableError: ``simulate`` without a working torch_xla.
    """
    return launch_job(fn, args, placement=resolve(cores, simulate), timeout=timeout,
                      sim_threads=False)


def same_everywhere(value: Any, placement: Placement) -> Any:
    """``value`` as the global master has it, on every process of ``placement``'s world when
    other launchers started its processes (torchrun: each runs the script and decides on its
    own); ``value`` itself when this process is the world's only caller."""
    if placement.joined == "torchrun":
        return agreed(value, kind=placement.kind, world=torchrun_world())
    if placement.joined == "pod":
        return pod_agreed(value, simulated_pod())
    return value


def prestart_simulation(placement: Placement) -> None:
    """Start the simulation's clean interpreter in the background when a launch
    on simulated devices is coming (see :func:`xla_utils.simulate.prestart`)."""
    if placement.is_simulated and xla_installed():
        _simulator().prestart()


def prestart_if_simulation_likely() -> None:
    """Start the simulation's clean interpreter in the background when simulated
    cores are the only way this host runs XLA (torch_xla installed, no TPU), so that
    a later ``predict``/``evaluate``/``fit`` with ``simulate`` does not wait for it.
    Imports neither torch_xla nor anything heavy here."""
    import importlib.util

    if importlib.util.find_spec("torch_xla") is None or tpu_present():
        return
    _simulator().prestart()


def launch_job(fn: Callable[..., Any], args: tuple, *, placement: Placement,
               timeout: float | None, sim_threads: bool) -> Any:
    """:func:`launch` on ``placement`` (:func:`~xla_utils.runtime.placement.resolve`);
    ``sim_threads=True`` simulates cores as threads of one process (xla_utils' own loops,
    which synchronise only through :func:`sync`; see :mod:`xla_utils.runtime`)."""
    simulate = placement.simulated
    if placement.backend == "xla":
        if simulate is None or not xla_installed():
            # clear XLAUnavailableError before forking. A simulated launch only
            # checks that torch_xla is installed: its zygote imports it (a failed
            # import there is explained by load_xla here, see simulate.caller).
            load_xla()
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
        return _launch_xla(fn, args, placement, timeout=timeout, sim_threads=sim_threads)
    if STATE.local.in_replica:  # a replica's own launch (lr_find inside fit): here
        return fn(*args)
    if placement.joined == "torchrun":  # torchrun's processes are the replicas
        return run_joined(fn, args, kind=placement.kind, one_core=placement.one_core,
                          world=torchrun_world())
    if placement.host_devices > 1:
        # CPU replicas take the GPU replicas' decision (fork, or fresh interpreters)
        why = None if placement.one_core and placement.kind != "cuda" else cuda_in_use()
        if forks(placement, why is not None):
            return _launch_torch(fn, args, placement.replicas, placement.kind, timeout, why)
    # torch backend, in-process
    prev = STATE.local.backend, STATE.local.in_replica
    STATE.local.backend, STATE.local.in_replica = "torch", True
    try:
        return fn(*args)
    finally:
        STATE.local.backend, STATE.local.in_replica = prev


def _launch_xla(fn, args, placement: Placement, *, timeout, sim_threads) -> Any:
    if placement.joined == "pod":
        return _launch_pod(fn, args, placement, timeout=timeout, sim_threads=sim_threads)
    if placement.is_simulated:
        return _simulator().run_replicas(fn, tuple(args), placement.replicas,
                                         timeout=timeout, threads=sim_threads)
    return _launch_tpu(fn, args, placement, timeout=timeout)


def _launch_pod(fn, args, placement: Placement, *, timeout, sim_threads) -> Any:
    """A launch on a host of a rehearsed pod slice: this host's cores join the slice's world
    (every host gets global ordinal 0's result); ``cores=1`` (the LR finder): the master host
    runs it alone and every host gets its answer (or its error)."""
    pod = simulated_pod()
    run = _simulator().run_replicas
    if not placement.one_core:
        return run(fn, tuple(args), pod.cores, timeout=timeout, pod=pod)
    outcome = None
    if pod.is_master_host:
        try:
            outcome = ("result", run(fn, tuple(args), 1, timeout=timeout, threads=sim_threads))
        except BaseException as exc:
            pod_agreed(("error", f"{type(exc).__name__}: {exc}"), pod)
            raise
    what, value = pod_agreed(outcome, pod)
    if what == "error":
        raise RuntimeError(f"host {pod.master_host}, the master host, ran this one-core launch "
                           f"and failed ({value}); its traceback is in its own output")
    return value


def _launch_tpu(fn, args, placement: Placement, *, timeout) -> Any:
    """Fork one job process that ``xmp.spawn``s the TPU replicas; collect the result."""
    return run_forked_job(job_main, (fn, args, placement.one_core), timeout)


def _launch_torch(fn, args, n: int, kind: str, timeout, why: str | None) -> Any:
    """Fork one job process that starts ``n`` torch replicas (``kind``: ``"cuda"`` or
    ``"cpu"``), meeting through a file store in a private folder; collect the result.
    The replicas are forked, or fresh interpreters when ``why`` says why they cannot be
    (the call is pickled here first, so what cannot travel is refused before any start)."""
    started = time.time()
    folder = tempfile.mkdtemp(prefix="xla_utils-dist-")  # mode 0700
    try:
        fresh = None
        if why is not None:
            write_call(Path(folder), sendable_call(fn, args, why))
            fresh = FreshStart(folder, why, started)
        return run_forked_job(torch_job_main,
                              (fn, args, n, kind, os.path.join(folder, "store"), fresh), timeout)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def run_forked_job(target: Callable[..., None], target_args: tuple, timeout: float | None) -> Any:
    """Fork a job process running ``target(*target_args, results)`` and collect its
    replicas' reports from ``results``: rank 0's result, or the first replica's error
    (the others get :data:`ERROR_GRACE_S` to report, then the job's session is killed).

    Raises:
        ReplicaError: a replica raised or died.
        TimeoutError: ``timeout`` seconds passed; every replica was killed.
    """
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    results = ctx.Queue()
    job = ctx.Process(target=target, args=(*target_args, results),
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
                first_error = _cause(first_error, ReplicaError(r, *payload))
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
                        elif kind == "error":
                            first_error = _cause(first_error, ReplicaError(r, *payload))
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


def _cause(first: ReplicaError | None, new: ReplicaError) -> ReplicaError:
    """The error to raise: the first reported, unless a replica process died (a death is
    a cause; the others' errors, such as a collective's lost connection, follow from it
    and may be reported before the job notices the death)."""
    if first is None or (new.exc_type == "ProcessDied" and first.exc_type != "ProcessDied"):
        return new
    return first


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


