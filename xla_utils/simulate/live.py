"""A simulated job kept alive across calls, so that later calls reuse its compiled graphs.

``predict(simulate=N)`` / ``evaluate(simulate=N)`` used to fork a fresh job per
call, which started an XLA:CPU client and compiled every graph again (XLA:CPU
cannot load compiled graphs from the persistent cache). A :class:`LiveJob` is one
thread-simulated job (``run_replicas(threads=True)``) whose replicas run
:func:`_serve`: a loop that takes ``(fn, args)`` requests from the caller over a
socket, runs ``fn(*args)`` on every replica thread and sends rank 0's result
back. Graphs built by a later call with the same shapes hit torch_xla's
in-memory computation cache: no compilation. Unchanged weights and image caches
stay in the job between calls and are not sent again (:mod:`.resident`).

Lifetime: the job belongs to the object that owns the :class:`LiveJob` (the
trainer); :meth:`LiveJob.close` ends it (called by a ``weakref.finalize`` of the
owner and at interpreter exit). A job that died (killed, or gone with a restarted
zygote) is found at the next call (the socket is closed) and replaced by a new
one, which reruns that call. An exception in ``fn`` ends the job (its replicas
may be stuck in a collective) and is raised as ``runtime.ReplicaError``.
The job keeps the environment variables, ``sys.path`` and working directory of
the call that started it (a fresh launch takes them from every call).
"""
from __future__ import annotations

import contextlib
import os
import pickle
import signal
import socket
import threading
import time
import traceback
import weakref
from typing import TYPE_CHECKING, Any, Callable

from .protocol import recv_msg, send_msg
from .resident import CallPickler, load_call, mark_live_job

if TYPE_CHECKING:
    from ..runtime.placement import Placement

__all__ = ["LiveJob", "close_all", "live_job_for", "live_or_launch"]

_START_S = 300.0  # longest wait for a new job to connect (zygote start included)


class LiveJob:
    """One simulated job of ``n`` replica threads serving calls (see the module docstring).

    Attributes:
        n: Simulated cores (replica threads).
        starts: Jobs started so far (a replaced job counts again).
        last_counters: ``{"compiles": int, "executions": int}`` of the last call,
            counted in the job's rank-0 replica (``runtime.xla_counters`` deltas).
        pid: The live job's process id (its process group), or None.
        last_sent: Of the last call: ``payload_bytes`` (the pickled call, resident
            objects as keys), ``new_bytes`` (resident objects the job did not hold),
            ``resident_sent`` and ``resident_reused`` (how many of each).
    """

    def __init__(self, n: int) -> None:
        self.n = n
        self.starts = 0
        self.last_counters: dict[str, int] | None = None
        self.pid: int | None = None
        self.last_sent: dict[str, int] | None = None
        self._held: set[tuple] = set()  # keys of the resident objects the job holds
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def alive(self) -> bool:
        """Whether a job is connected and its launch has not ended."""
        return self._sock is not None and self._thread is not None and self._thread.is_alive()

    def call(self, fn: Callable[..., Any], args: tuple) -> Any:
        """``fn(*args)`` on every replica of the live job; rank 0's result.

        Raises:
            runtime.ReplicaError: ``fn`` raised in a replica (the job is ended).
            RuntimeError: the job died twice in a row during this call.
        """
        payload, used = CallPickler.dumps((fn, args))
        with self._lock:
            for attempt in (0, 1):
                if not self.alive():
                    self._close_locked()
                    self._start()
                new = {k: o for k, o in used.items() if k not in self._held}
                new_blob = _dumps(new) if new else None
                self._held = set()  # unknown until the job answers
                self.last_sent = {"payload_bytes": len(payload),
                                  "new_bytes": len(new_blob) if new_blob else 0,
                                  "resident_sent": len(new),
                                  "resident_reused": len(used) - len(new)}
                try:
                    send_msg(self._sock, ("run", (payload, new_blob, tuple(used))))
                    kind, value, counters = recv_msg(self._sock)
                except (EOFError, OSError) as exc:
                    self._close_locked()
                    if attempt:
                        raise RuntimeError(f"the live simulated job died twice during one call "
                                           f"({type(exc).__name__}: {exc})") from None
                    continue
                self.last_counters = counters
                if kind == "ok":
                    self._held = set(used)
                if kind == "error":
                    self._close_locked()
                    from ..runtime.replica import ReplicaError

                    raise ReplicaError(0, value[0], value[1])
                return pickle.loads(value)
        raise AssertionError("unreachable")

    def _start(self) -> None:
        from .caller import run_replicas

        srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        srv.bind(("127.0.0.1", 0))
        srv.listen(1)
        srv.settimeout(0.2)
        outcome: dict[str, Any] = {}

        def launch() -> None:
            try:
                run_replicas(_serve, (srv.getsockname()[1],), self.n, threads=True)
            except BaseException as exc:  # reported by _start when it never connected
                outcome["error"] = exc

        thread = threading.Thread(target=launch, daemon=True, name="xla_utils-live-job")
        thread.start()
        end = time.monotonic() + _START_S
        try:
            while True:
                try:
                    conn, _ = srv.accept()
                    break
                except socket.timeout:
                    if not thread.is_alive() or time.monotonic() > end:
                        err = outcome.get("error")
                        raise RuntimeError(f"the live simulated job did not start: {err!r}") from err
        finally:
            srv.close()
        conn.settimeout(None)
        self.pid = recv_msg(conn)
        self._sock, self._thread = conn, thread
        self.starts += 1

    def close(self) -> None:
        """End the job (idempotent); its launch then removes its folders."""
        with self._lock:
            self._close_locked()

    def _close_locked(self) -> None:
        sock, thread, pid = self._sock, self._thread, self.pid
        self._sock = self._thread = self.pid = None
        self._held = set()
        if sock is not None:
            with contextlib.suppress(OSError):
                send_msg(sock, ("close", None))
            with contextlib.suppress(OSError):
                sock.close()
        if thread is not None:
            thread.join(timeout=10)
            if thread.is_alive() and pid is not None:  # stuck: kill it, its launch cleans up
                with contextlib.suppress(OSError):
                    os.killpg(pid, signal.SIGKILL)
                thread.join(timeout=10)


def _dumps(obj: Any) -> bytes:
    import cloudpickle

    return cloudpickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


_JOBS: "weakref.WeakKeyDictionary[Any, LiveJob]" = weakref.WeakKeyDictionary()


def live_job_for(owner: Any, n: int) -> LiveJob:
    """The live job of ``owner`` (e.g. a trainer) for ``n`` cores, started at its first call.

    A different ``n`` closes the previous one. The job is closed when ``owner`` is
    garbage collected and at interpreter exit. (Kept here, not on ``owner``, which
    is pickled into every call.)
    """
    job = _JOBS.get(owner)
    if job is not None and job.n == n:
        return job
    if job is not None:
        job.close()
    job = LiveJob(n)
    _JOBS[owner] = job
    weakref.finalize(owner, job.close)  # also runs at interpreter exit (atexit=True)
    return job


def close_all() -> None:
    """End every live job of this process (their owners start new ones when called)."""
    for job in list(_JOBS.values()):
        job.close()


def live_or_launch(owner: Any, fn: Callable[..., Any], args: tuple,
                   placement: Placement) -> Any:
    """``runtime.launch``-like on ``placement``: a simulated call goes to ``owner``'s
    live job (:func:`live_job_for`); anything else (a TPU, the torch backend, a host of a
    rehearsed pod slice, whose call meets the other hosts') to a fresh launch."""
    from .. import runtime

    if placement.is_simulated and placement.joined is None:  # a pod slice's hosts: a launch
        return live_job_for(owner, placement.replicas).call(fn, args)
    return runtime.launch_job(fn, args, placement=placement, timeout=None, sim_threads=True)


# ==========================================================================
# Inside the job: every replica thread runs _serve
# ==========================================================================
class _Mailbox:
    """Rank 0 posts each request here; the other replica threads of the process read them in order."""

    cond = threading.Condition()
    # [message, replicas yet to read it]; the payload is dropped once all have it, so a
    # long-lived job does not keep every call's weights
    msgs: list[list] = []
    stores: dict[int, dict] = {}  # per rank: the resident objects of the last call (.resident)
    errors: list = []  # (traceback, type name, secondary) of failed calls, in order


def _post(msg: tuple) -> None:
    from .. import runtime

    readers = runtime.world_size() - 1  # rank 0 posts it and has it already
    with _Mailbox.cond:
        _Mailbox.msgs.append([msg if readers > 0 else None, readers])
        _Mailbox.cond.notify_all()


def _serve(port: int) -> None:
    from .. import runtime

    r = runtime.rank()
    mark_live_job()
    sock = None
    if r == 0:
        sock = socket.create_connection(("127.0.0.1", port))
        send_msg(sock, os.getpgid(0))  # the job's process group (the job called setsid)
    seen = 0
    while True:
        if r == 0:
            try:
                msg = recv_msg(sock)
            except (EOFError, OSError):
                msg = ("close", None)
            _post(msg)
        else:
            with _Mailbox.cond:
                _Mailbox.cond.wait_for(lambda: len(_Mailbox.msgs) > seen)
                entry = _Mailbox.msgs[seen]
                msg = entry[0]
                entry[1] -= 1
                if entry[1] == 0:
                    entry[0] = None
        seen += 1
        kind, payload = msg
        if kind != "run":
            return None
        try:
            _run_one(sock, payload)
        except BaseException:
            if r == 0:
                _post(("close", None))  # replicas that never got into the call end too
            raise


def _run_one(sock: socket.socket | None, request: tuple) -> None:
    """One request ``(payload, new resident objects, their keys)`` on this replica
    thread; rank 0 (``sock`` set) sends the reply."""
    from .. import runtime
    from ..runtime.replica import dumps_cpu

    before = runtime.xla_counters()
    try:
        store = _Mailbox.stores.setdefault(runtime.rank(), {})
        fn, args = load_call(store, *request)
        reply = ("ok", dumps_cpu(fn(*args)))
    except BaseException as exc:
        tb = traceback.format_exc()
        with _Mailbox.cond:  # before runtime.replica aborts the others' barrier
            _Mailbox.errors.append((tb, type(exc).__name__, "another simulated replica" in tb))
            # rank 0 reports the root cause: the first error that is not a consequence
            root = next((e for e in _Mailbox.errors if not e[2]), _Mailbox.errors[0])
        reply = ("error", root[:2])
    if sock is not None:
        after = runtime.xla_counters()
        counters = {k: after[k] - before[k] for k in ("compiles", "executions")}
        send_msg(sock, (*reply, counters))
    if reply[0] == "error":
        raise RuntimeError("a live simulated call failed; the job ends")
