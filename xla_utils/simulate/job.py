"""The clean interpreter's side: the zygote, the job, and replica bootstrap.

The zygote (``python -m xla_utils.simulate --zygote FD``) imports torch and
torch_xla once and forks one job per launch. A job forks one replica process per
simulated core (:func:`_replica_main`: patched torch_xla, see :mod:`.collectives`)
or, for ``threads=True`` launches, runs ``runtime.replica.simulate_threads``
itself. Every report to the caller goes through :mod:`.protocol`.
"""
from __future__ import annotations

import contextlib
import os
import pickle
import signal
import socket
import sys
import threading
import traceback

from .collectives import _PROF, _World, _patch_torch_xla, _profile_report, _profile_sync
from .protocol import PeerFailed, event, recv_msg, send_msg, td


def _die_with_parent() -> None:
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def zygote_main(fd: int) -> None:
    _die_with_parent()
    sock = socket.socket(fileno=fd)
    try:
        # Import what every replica needs once, here, before any fork. The XLA
        # runtime itself is not initialised (each replica does that).
        import cloudpickle  # noqa: F401
        import numpy  # noqa: F401
        import torch
        import torch.distributed  # noqa: F401
        import torch_xla  # noqa: F401
        import torch_xla.core.xla_model  # noqa: F401
        import torch_xla.distributed.parallel_loader  # noqa: F401
        import torch_xla.distributed.xla_multiprocessing  # noqa: F401
        import torch_xla.runtime  # noqa: F401

        from ..runtime import replica  # noqa: F401
    except BaseException as exc:
        send_msg(sock, ("error", f"{type(exc).__name__}: {exc}"))
        raise
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # jobs are reaped automatically
    send_msg(sock, ("ready", torch.__version__))
    while True:
        try:
            kind, request = recv_msg(sock)
        except (EOFError, OSError):
            os._exit(0)  # the caller is gone
        if kind != "launch":
            continue
        try:
            pid = os.fork()
        except OSError as exc:
            send_msg(sock, ("error", f"fork failed: {exc}"))
            continue
        if pid == 0:
            sock.close()
            try:
                _job_main(request)
            finally:
                os._exit(1)
        send_msg(sock, ("job", pid))


def _job_main(request: dict) -> None:
    os.setsid()  # the caller kills the whole job with killpg
    _die_with_parent()
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    if request["threads"]:
        _thread_job(request)
    import torch.distributed as dist

    n = request["n"]
    pids = {}
    for r in range(n):
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                code = _replica_main(r, request)
            except BaseException:  # before the replica could report through the store
                traceback.print_exc()
            finally:
                with contextlib.suppress(Exception):
                    sys.stdout.flush()
                    sys.stderr.flush()
                # Skip interpreter and XLA runtime teardown (it can crash
                # natively at exit, after the work is done).
                os._exit(code)
        pids[pid] = r
    store = dist.TCPStore("127.0.0.1", request["port"], is_master=False, timeout=td(60))
    while pids:
        try:
            pid, status = os.wait()
        except ChildProcessError:
            break
        r = pids.pop(pid, None)
        if r is None:
            continue
        code = os.waitstatus_to_exitcode(status)
        with contextlib.suppress(Exception):
            event(store, "exit", r, code)
    os._exit(0)


def _thread_job(request: dict) -> None:
    """A job whose replicas are threads of this process (``runtime.replica.simulate_threads``)."""
    _enter_caller_context(request)
    results = _StoreResults(request["port"], request["n"])
    try:
        import cloudpickle

        from ..runtime import replica

        fn, args = cloudpickle.loads(request["payload"])
        replica.simulate_threads(fn, args, request["n"], results)
    except BaseException as exc:
        with contextlib.suppress(Exception):
            results.put(("error", -1, (traceback.format_exc(), type(exc).__name__)))
            results.put(("done", -1, None))
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(0)


class _StoreResults:
    """The ``results`` queue of ``runtime.replica.simulate_threads``, posting to the
    caller's store as the process replicas do. Each process (xmp.spawn forks
    one) opens its own connection."""

    def __init__(self, port: int, n: int) -> None:
        self.port, self.n = port, n
        self.pid, self.store = None, None
        self.lock = threading.Lock()

    def put(self, item: tuple) -> None:
        import torch.distributed as dist

        kind, r, payload = item
        with self.lock:
            if self.pid != os.getpid():
                self.store = dist.TCPStore("127.0.0.1", self.port, is_master=False,
                                           timeout=td(60))
                self.pid = os.getpid()
            store = self.store
            if kind == "result":
                store.set("result", payload)
            elif kind == "finished":
                store.set(f"finished/{r}", "1")
            elif kind == "error":
                tb, exc_type = payload
                secondary = "another simulated replica failed" in tb
                store.set(f"error/{r}", pickle.dumps((tb, exc_type, secondary)))
            if kind == "done":  # the job is over: every replica has exited
                for i in range(self.n):
                    event(store, "exit", i, 0)
            else:
                event(store, kind, r)

    def close(self) -> None:
        pass

    def join_thread(self) -> None:
        pass


def _enter_caller_context(request: dict) -> None:
    """The caller's environment, import path and working directory."""
    os.environ.clear()
    os.environ.update(request["env"])
    sys.path[:] = request["path"]
    with contextlib.suppress(OSError):
        os.chdir(request["cwd"])


# ==========================================================================
# Inside one replica
# ==========================================================================
def _replica_main(r: int, request: dict) -> int:
    _die_with_parent()
    _enter_caller_context(request)
    import cloudpickle
    import torch.distributed as dist

    from ..runtime import replica

    n = request["n"]
    store = dist.TCPStore("127.0.0.1", request["port"], is_master=False, timeout=td(60))
    _World.rank, _World.size, _World.store, _World.shm = r, n, store, request["shm"]
    try:
        _patch_torch_xla(r, n)
        replica.enter_simulated_replica()
        fn, args = cloudpickle.loads(request["payload"])
        if request["pass_index"]:
            args = (r, *args)
        if _PROF is not None:
            _profile_sync()
        out = fn(*args)
        if _PROF is not None:
            _profile_report(r)
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        if r == 0:
            store.set("result", replica.dumps_cpu(out))
            event(store, "result", r)
        store.set(f"finished/{r}", "1")
        event(store, "finished", r)
        return 0
    except BaseException as exc:
        secondary = isinstance(exc, PeerFailed)
        tb = traceback.format_exc()
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        with contextlib.suppress(Exception):
            if not secondary:
                store.set("abort", f"replica {r} raised {type(exc).__name__}")
            store.set(f"error/{r}", pickle.dumps((tb, type(exc).__name__, secondary)))
            event(store, "error", r)
        return 1


