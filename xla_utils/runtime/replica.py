"""The replica side of a launch: what runs inside the job and its replicas.

:mod:`xla_utils.runtime.launcher` forks a TPU job into :func:`job_main`;
:mod:`xla_utils.simulate` runs simulated jobs from its clean interpreter and calls
:func:`simulate_threads` (thread simulation), :func:`enter_simulated_replica`
(process simulation) and :func:`dumps_cpu` here. Every replica reports through a
``results`` queue: ``put(("result" | "finished" | "error" | "done", rank, payload))``.
This module never imports :mod:`xla_utils.simulate` (dependencies run one way).
"""
from __future__ import annotations

import contextlib
import os
import pickle
import signal
import sys
import threading
import traceback
from typing import Any

from . import forksafe
from .state import STATE, SimGroup
from .world import rank, world_size
from .xla import load_xla

__all__ = ["ReplicaError", "dumps_cpu", "die_with_parent", "enter_simulated_replica", "job_main",
           "simulate_threads", "replica_main"]


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
    forksafe.guard_inherited()  # a no-op unless the zygote had an OpenMP team
    STATE.simulated_process = True
    STATE.local.backend, STATE.local.in_replica = "xla", True


def die_with_parent() -> None:
    """Linux: get SIGKILL when the process that forked us dies, so that a killed
    notebook kernel or test runner never leaves replicas running."""
    with contextlib.suppress(Exception):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def job_main(fn, args, one_core: bool, results) -> None:
    """Body of the forked job process on a TPU host: set the environment, then xmp.spawn."""
    os.setsid()  # so that _kill() reaches replicas forked by xmp.spawn
    die_with_parent()
    os.environ.setdefault("PJRT_DEVICE", "TPU")
    try:
        from .. import env

        env.prepare_spawn()
    except Exception as exc:  # never block a launch on a reporting helper
        print(f"xla_utils: environment preparation skipped: {exc}", file=sys.stderr)
    # This thread is a copy of the caller's, which may own an OpenMP team whose
    # workers do not exist here: the replicas (this process with cores=1, or its
    # forks) run from a new thread instead, at full intra-op parallelism.
    forksafe.run_in_fresh_thread(_spawn_job, fn, args, 1 if one_core else None, results)


def simulate_threads(fn, args, n: int, results) -> None:
    """Run a thread-simulated job (N replica threads on N XLA:CPU devices) in this
    process, which :mod:`xla_utils.simulate` forked from its clean interpreter.
    ``results`` takes ``put(("result" | "finished" | "error" | "done", rank, payload))``."""
    forksafe.guard_inherited()  # a no-op unless the zygote had an OpenMP team
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


def _prepare_thread_job(sim: SimGroup) -> None:
    """Set up, one thread at a time, the process-wide state that torch_xla and
    autograd create lazily and without a lock, before any replica thread runs.

    1. Every device's collective-token slot. torch_xla keeps the token that orders
       each device's collectives in one process-wide ``unordered_map``
       (``g_all_reduce_tokens``) without a lock; the first collective on a device
       inserts that device's entry. N replica threads doing their first
       ``all_reduce`` at once insert concurrently, and a rehash in one thread makes
       another read a null token: a segfault in
       ``std::vector<torch::lazy::Value>::_M_realloc_insert`` (about one thread job
       in 150 on a loaded machine, seen as ``BrokenProcessPool``). Inserting all N
       entries here leaves later accesses lookups only (the entry set to None is
       what ``xm.set_replication`` and every sync write too).
    2. The autograd engine. This process is a fork, so torch's fork handler has
       marked the engine for re-creation, which ``get_python_engine`` does on its
       next call; the first backward then starts one autograd thread per device
       (``Engine::start_device_threads``). A replica thread that reached the engine
       while another was inside ``start_device_threads`` re-created the engine under
       it: a segfault reading the cleared ``device_ready_queues_`` (null + 0x10 in
       ``start_device_threads``, seen in CI on the Kaggle stack as
       ``BrokenProcessPool`` at a thread job's first step). One CPU backward here
       does both, once, before any replica thread touches autograd.
    """
    with sim.lock:
        if sim.token_devices:
            return
        x = load_xla()
        devices = tuple(str(d) for d in x["xm"].get_xla_supported_devices())
        for d in devices:
            x["torch_xla"]._XLAC._set_all_reduce_token(d, None)
        import torch

        with torch.enable_grad():
            torch.ones(1, requires_grad=True).sum().backward()
        sim.token_devices = devices


def replica_main(index: int) -> None:
    fn, args, results = STATE.job
    if os.getpid() != STATE.job_pid:
        die_with_parent()
    STATE.local.backend, STATE.local.in_replica = "xla", True
    r = -1
    import torch

    if STATE.sim is not None:
        _prepare_thread_job(STATE.sim)

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
