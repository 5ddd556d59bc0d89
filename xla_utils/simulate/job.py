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
import signal
import socket
import sys
import threading
import traceback

from .collectives import _PROF, _World, _patch_torch_xla, _profile_report, _profile_sync
from .pod_link import UP
from .protocol import (ABORT, JOB_STATUS, PeerFailed, Reporter, TransportError, connect, event,
                       recv_msg, send_msg, write_payload)


def _die_with_parent() -> None:
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def zygote_main(fd: int) -> None:
    """The zygote: import torch and torch_xla once, then fork one job per request."""
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

        from ..runtime import forksafe, replica  # noqa: F401
    except BaseException as exc:
        send_msg(sock, ("error", f"{type(exc).__name__}: {exc}"))
        raise
    _import_job_modules()
    jobs: dict[int, str] = {}  # job pid -> its folder, where its exit status goes
    signal.signal(signal.SIGCHLD, lambda *_: _reap_jobs(jobs))
    forksafe.mark_clean()  # no torch op ran here; jobs check for an OpenMP team against this
    _freeze_imports()
    send_msg(sock, ("ready", torch.__version__))
    while True:
        try:
            kind, request = recv_msg(sock)
        except (EOFError, OSError):
            os._exit(0)  # the caller is gone
        if kind != "launch":
            continue
        forksafe.check_before_fork()
        # A job that dies at once must find itself in `jobs` when SIGCHLD is handled.
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})
        try:
            pid = os.fork()
        except OSError as exc:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})
            send_msg(sock, ("error", f"fork failed: {exc}"))
            continue
        if pid == 0:
            sock.close()
            try:
                _job_main(request)
            finally:
                os._exit(1)
        jobs[pid] = request["status"]
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})
        send_msg(sock, ("job", pid))


# What the library's own thread jobs (lr_find, fit, predict, evaluate) import when
# they unpickle their function and arguments (the fed dataset pulls in PIL and
# xla_utils.cache; their progress bars, fastprogress): imported once here, before
# mark_clean, instead of in every job (about 0.1-0.2 s per job on a quiet 2-core
# host, fastprogress alone 0.1 s). None runs a torch op.
_JOB_MODULES = ("torch.utils.serialization", "xla_utils.step.inputs", "xla_utils.data",
                "xla_utils.train.lr_finder", "xla_utils.train.trainer", "fastprogress.fastprogress")


def _import_job_modules() -> None:
    import importlib

    for name in _JOB_MODULES:
        with contextlib.suppress(Exception):  # the job imports (and reports) it again
            importlib.import_module(name)


def _freeze_imports() -> None:
    """Move every object the imports made (torch, torch_xla, xla_utils: several
    hundred thousand) to the garbage collector's permanent generation, so that a
    job's full collections scan only the job's own objects. Without this a job's
    first full collection (due in the second call of a live predict job, or
    during an lr_find sweep) scans them all: 0.3-0.7 s on a 2-core host. Forked
    jobs also keep sharing these pages instead of copying them when the
    collector writes their headers (Python's gc.freeze documentation)."""
    import gc

    gc.collect()
    gc.freeze()


def _reap_jobs(jobs: dict[int, str]) -> None:
    """SIGCHLD in the zygote: write each ended job's exit status (negative: the
    signal) to its folder, *then* reap it, so that a caller who sees the job's
    pid gone can read its status."""
    while True:
        try:
            info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return
        if info is None:
            return
        killed = info.si_code in (os.CLD_KILLED, os.CLD_DUMPED)
        code = -info.si_status if killed else info.si_status
        folder = jobs.pop(info.si_pid, None)
        if folder is not None:
            with contextlib.suppress(Exception):
                write_payload(folder, JOB_STATUS, str(code).encode())
        with contextlib.suppress(ChildProcessError):
            os.waitpid(info.si_pid, 0)


def _job_main(request: dict) -> None:
    os.setsid()  # the caller kills the whole job with killpg
    _die_with_parent()
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})
    if request["threads"]:
        _thread_job(request)
    pids = {}
    for local, r in enumerate(request["ranks"]):
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                code = _replica_main(r, local, request)
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
    store = _connect(request)
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
    results = _StoreResults(request["port"], request["shm"], request["n"])
    try:
        import cloudpickle

        from ..runtime import replica

        fn, args = cloudpickle.loads(request["payload"])
        replica.simulate_threads(fn, args, request["n"], results)
    except BaseException as exc:
        results.put(("error", -1, (traceback.format_exc(), type(exc).__name__)))
        results.put(("done", -1, None))
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(0)


class _StoreResults:
    """The ``results`` queue of ``runtime.replica.simulate_threads``: each item goes
    to :func:`_report`, as the process replicas' reports do. Each process
    (xmp.spawn forks one) opens its own connection."""

    def __init__(self, port: int, folder: str, n: int) -> None:
        self.port, self.folder, self.n = port, folder, n
        self.pid, self.reporter = None, None
        self.lock = threading.Lock()

    def put(self, item: tuple) -> None:
        """Report ``(kind, rank, payload)``; an error payload is ``(traceback, type name)``.

        Raises:
            TransportError: A result could not be handed over (``runtime.replica``
                then reports that as the replica's error).
        """
        kind, r, payload = item
        if kind == "error":
            tb, exc_type = payload
            payload = (tb, exc_type, "another simulated replica failed" in tb)
        with self.lock:
            if self.pid != os.getpid():
                try:
                    self.reporter = Reporter(connect(self.port), self.folder, self.n)
                except Exception as exc:  # reports then go to files (_report)
                    self.reporter = Reporter(None, self.folder, self.n,
                                             why=f"{type(exc).__name__}: {exc}")
                self.pid = os.getpid()
            _report(self.reporter, kind, r, payload)

    def close(self) -> None:
        pass

    def join_thread(self) -> None:
        pass


def _report(reporter: Reporter, kind: str, r: int, payload=None) -> None:
    """Report to the caller; when the store connection fails, leave the report
    as a file the caller reads when the job is gone. A result that cannot be
    written raises ``TransportError`` (the replica reports that instead)."""
    try:
        reporter.report(kind, r, payload)
    except TransportError:
        if kind == "result":
            raise
        reporter.lost(r, _lost_text(kind, payload, traceback.format_exc()))
    except Exception:
        reporter.lost(r, _lost_text(kind, payload, traceback.format_exc()))


def _lost_text(kind: str, payload, failure: str) -> str:
    head = f"its connection to the caller's store failed while reporting {kind!r}:\n{failure}"
    if kind == "error":
        head += f"\nThe report it could not send ({payload[1]}):\n{payload[0]}"
    return head


def _enter_caller_context(request: dict) -> None:
    """The caller's environment, import path, ``sys.argv`` and working directory."""
    os.environ.clear()
    os.environ.update(request["env"])
    sys.path[:] = request["path"]
    sys.argv[:] = request.get("argv", sys.argv)  # a forked replica's, as on a TPU
    with contextlib.suppress(OSError):
        os.chdir(request["cwd"])


# ==========================================================================
# Inside one replica
# ==========================================================================
# glibc malloc arenas a replica process may create (unless the caller's environment sets
# MALLOC_ARENA_MAX): by default each thread that allocates may get an arena of its own (up
# to 8 per core), whose freed pages stay with it. DDP's ResNet-18 on 8 simulated cores:
# 10.3 -> 8.8 GiB in all (docs/BENCHMARKS.md, "Simulated DDP footprint").
REPLICA_MALLOC_ARENAS = 2


def _limit_malloc_arenas() -> None:
    if "MALLOC_ARENA_MAX" in os.environ:
        return
    with contextlib.suppress(Exception):  # not glibc: nothing to limit
        import ctypes

        ctypes.CDLL(None).mallopt(-8, REPLICA_MALLOC_ARENAS)  # M_ARENA_MAX


def _connect(request: dict):
    """A client of the caller's store (under the launch's prefix on a pod slice's)."""
    store = connect(request["port"])
    if request["prefix"]:
        import torch.distributed as dist

        store = dist.PrefixStore(request["prefix"], store)
    return store


def _meet_hosts(store, world: int) -> None:
    """On a rehearsed pod slice: wait until every host's replicas have started (a host may
    start late, or its interpreter slowly), so that the first collective's timeout measures
    only the replicas' own skew. Raises ``PeerFailed`` when the launch is aborted first (a
    host was lost)."""
    import time

    store.add(UP, 1)
    while store.add(UP, 0) < world:
        if store.check([ABORT]):
            raise PeerFailed(f"the pod slice's launch was aborted before every host's replicas "
                             f"started: {store.get(ABORT).decode()}")
        time.sleep(0.05)


def _replica_main(r: int, local: int, request: dict) -> int:
    _die_with_parent()
    _enter_caller_context(request)
    _limit_malloc_arenas()
    import cloudpickle

    from ..runtime import replica

    n = request["world"]
    store = _connect(request)
    _World.rank, _World.size, _World.store, _World.shm = r, n, store, request["shm"]
    reporter = Reporter(store, request["shm"], n)
    try:
        if request["prefix"]:
            _meet_hosts(store, n)
        _patch_torch_xla(r, n, local, request["n"], request["host"])
        replica.enter_simulated_replica()
        fn, args = cloudpickle.loads(request["payload"])
        if request["pass_index"]:
            args = (local if request["prefix"] else r, *args)  # xmp.spawn passes the local index
        if _PROF is not None:
            _profile_sync()
        out = fn(*args)
        if _PROF is not None:
            _profile_report(r)
        _flush()
        if r == 0:
            _report(reporter, "result", r, replica.dumps_cpu(out))
        _report(reporter, "finished", r)
        return 0
    except BaseException as exc:
        secondary = isinstance(exc, PeerFailed)
        tb = traceback.format_exc()
        _flush()
        if not secondary:
            with contextlib.suppress(Exception):
                store.set(ABORT, f"replica {r} raised {type(exc).__name__}")
        _report(reporter, "error", r, (tb, type(exc).__name__, secondary))
        return 1


def _flush() -> None:
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()
