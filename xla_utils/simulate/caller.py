"""The caller's side of a simulated launch: the zygote, one job, its watch.

:func:`run_replicas` (``launch(fn, simulate=N)``, ``fit(simulate=N)`` and the
runner) sends ``fn`` and its arguments to this process's zygote, which forks the
job (:mod:`.job`), then follows the job's events in the store until every
replica has reported or the job is gone.
"""
from __future__ import annotations

import contextlib
import glob
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any, Callable

from .dist import LOOPBACK_ENV
from .footprint import ReplicaMeter, check_fits, record
from .protocol import (ABORT, ERROR_GRACE_S, FOLDER_PREFIX, JOB_STATUS, POLL_S, RESULT, EventReader,
                       TransportError, describe_status, lost_name, read_error, read_payload,
                       recv_msg, send_msg, serve_store)
from ..runtime.fresh import child_env
from ..runtime.hosts import HostLost, PodWorld, pod_lost
from .pod_link import pod_launch
from ..runtime.relay import forward_output

# Seconds the zygote may take to import torch and torch_xla (cold disk: ~25 s).
_ZYGOTE_START_S = 300.0


class _Zygote:
    """The clean interpreter that forks simulated jobs for this process."""

    def __init__(self) -> None:
        parent, child = socket.socketpair()
        # The zygote sets each job's devices itself (_caller_env).
        env = child_env(None, {"PJRT_DEVICE": "CPU"})
        # Replicas wait in the store in short slices; c10d logs a warning for each
        # slice that times out. Read once, when torch loads in the zygote.
        env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
        # No inductor compile-worker pool in the zygote (its jobs fork from it): see child_env.
        env.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
        self.owner = os.getpid()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "xla_utils.simulate", "--zygote", str(child.fileno())],
            pass_fds=(child.fileno(),), env=env, stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, close_fds=True)
        child.close()
        self.sock = parent
        self.lock = threading.Lock()
        # Replica output goes through pipes and is re-printed here, so that it
        # reaches a notebook (whose sys.stdout is not file descriptor 1).
        self.forwarding = threading.Lock()
        for stream, name in ((self.proc.stdout, "stdout"), (self.proc.stderr, "stderr")):
            threading.Thread(target=forward_output, args=(stream, name, self.forwarding),
                             daemon=True, name=f"xla_utils-zygote-{name}").start()
        self.sock.settimeout(_ZYGOTE_START_S)
        try:
            msg = recv_msg(self.sock)
        except (EOFError, OSError, socket.timeout) as exc:
            self.close()
            raise RuntimeError(
                f"the simulated-core zygote ({sys.executable} -m xla_utils.simulate --zygote) "
                f"did not start ({type(exc).__name__}: {exc}); its error output is printed "
                "above. Check that `python -c 'import torch_xla'` works.") from None
        self.sock.settimeout(None)
        if msg[0] != "ready":
            self.close()
            # The caller no longer imports torch_xla before a simulated launch:
            # a missing or mismatched torch_xla gets load_xla's message and fix.
            from ..runtime.xla import load_xla

            load_xla()
            raise RuntimeError(f"the simulated-core zygote failed to start: {msg[1]}")

    def drain(self, limit_s: float = 2.0) -> None:
        """Wait until replica output already written to the pipes has been re-printed."""
        import select

        fds = [self.proc.stdout.fileno(), self.proc.stderr.fileno()]
        end = time.monotonic() + limit_s
        while time.monotonic() < end:
            with contextlib.suppress(OSError, ValueError):
                if not select.select(fds, [], [], 0)[0]:
                    with self.forwarding:  # a chunk being written finishes first
                        return
            time.sleep(0.01)

    def alive(self) -> bool:
        return self.owner == os.getpid() and self.proc.poll() is None

    def start_job(self, request: dict) -> int:
        with self.lock:
            self.sock.settimeout(60)
            send_msg(self.sock, ("launch", request))
            kind, value = recv_msg(self.sock)
            self.sock.settimeout(None)
        if kind != "job":
            raise RuntimeError(f"the simulated-core zygote could not fork a job: {value}")
        return int(value)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.sock.close()
        with contextlib.suppress(Exception):
            self.proc.kill()
            self.proc.wait(timeout=5)


_ZYGOTE: _Zygote | None = None
_ZYGOTE_LOCK = threading.Lock()


_OWNER: tuple | None = None  # (pid, request queue) of the thread that starts zygotes


def _zygote() -> _Zygote:
    global _ZYGOTE
    with _ZYGOTE_LOCK:
        if _ZYGOTE is None or not _ZYGOTE.alive():
            _ZYGOTE = _start_zygote()
        return _ZYGOTE


def _start_zygote() -> _Zygote:
    """Start a zygote from one long-lived thread: the zygote's parent-death signal
    (PR_SET_PDEATHSIG) fires when the *thread* that started it exits, so a zygote
    started by a short-lived thread (a background prestart, a worker thread of
    the caller) would be killed with it."""
    import concurrent.futures
    import queue

    global _OWNER
    if _OWNER is None or _OWNER[0] != os.getpid():
        requests: queue.Queue = queue.Queue()

        def serve() -> None:
            while True:
                fut = requests.get()
                try:
                    fut.set_result(_Zygote())
                except BaseException as exc:
                    fut.set_exception(exc)

        threading.Thread(target=serve, daemon=True, name="xla_utils-zygote-owner").start()
        _OWNER = (os.getpid(), requests)
    fut: concurrent.futures.Future = concurrent.futures.Future()
    _OWNER[1].put(fut)
    return fut.result()


def prestart() -> None:
    """Start this process's zygote in the background (no-op when it runs), so that
    its interpreter start overlaps the caller's own preparation. A failure is
    raised by the next launch instead."""
    if _ZYGOTE is not None and _ZYGOTE.alive():
        return

    def start() -> None:
        with contextlib.suppress(Exception):
            _zygote()

    threading.Thread(target=start, daemon=True, name="xla_utils-zygote-start").start()


def _caller_env() -> dict[str, str]:
    env = dict(os.environ)
    # The replicas are XLA:CPU devices whatever this machine has.
    for k in ("TPU_NUM_DEVICES", "TPU_VISIBLE_CHIPS", "TPU_PROCESS_BOUNDS",
              "TPU_CHIPS_PER_PROCESS_BOUNDS", "PJRT_LOCAL_PROCESS_RANK",
              "PJRT_LOCAL_PROCESS_COUNT", "XRT_TPU_CONFIG", "COLAB_TPU_ADDR"):
        env.pop(k, None)
    env.update(PJRT_DEVICE="CPU", CPU_NUM_DEVICES="1", **LOOPBACK_ENV)
    return env


def run_replicas(fn: Callable[..., Any], args: tuple, n: int,
                 timeout: float | None = None, pass_index: bool = False,
                 threads: bool = False, detect_spmd: bool = True,
                 program: str | None = None, pod: PodWorld | None = None) -> Any:
    """Run ``fn(*args)`` (``fn(index, *args)`` with ``pass_index``) on ``n`` simulated
    cores and return rank 0's result; used by ``runtime.launch(simulate=N)``.

    ``threads=True`` runs the replicas as threads of one job process on N XLA:CPU
    devices (``runtime.replica.simulate_threads``; only for code that synchronises
    through ``runtime.sync``, i.e. xla_utils' own loops) instead of one process each.
    With ``detect_spmd`` (default), a function whose code uses SPMD (``use_spmd``,
    ``Mesh``, ``mark_sharding``, ...) runs once in one process with ``n`` XLA:CPU
    devices instead (:mod:`.spmd_fn`).

    ``pod`` (a host of a rehearsed pod slice, :mod:`.pod`): this host's ``pod.cores``
    replica processes join the slice's world of ``pod.world_size`` (``n`` is ignored): their
    collectives meet the other hosts' through the slice's store and folder, and every host
    gets global ordinal 0's result.

    Before ``n`` replica processes start, their memory is checked against what the
    machine has left (:func:`.footprint.check_fits`), from the figure recorded for
    ``program`` (default: ``fn``'s file and name) in its last run.

    Raises ``runtime.ReplicaError`` (the root cause, preferred over replicas that
    stopped because of it; a job that died names what killed it),
    ``TimeoutError`` after ``timeout`` seconds and
    ``footprint.SimulatedMemoryError`` when the replicas would not fit.
    """
    import cloudpickle

    from ..runtime.replica import ReplicaError
    from .forms import fn_uses_spmd
    from .spmd_fn import run_spmd_fn

    why = fn_uses_spmd(fn) if detect_spmd and not threads else None
    if why:  # one program owning every device: one process with n XLA:CPU devices
        return run_spmd_fn(fn, args, n, why, timeout=timeout, pass_index=pass_index)
    try:
        payload = cloudpickle.dumps((fn, args), protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:
        raise TypeError(
            f"simulated replicas are processes started from a clean interpreter, so "
            f"{getattr(fn, '__qualname__', fn)!r} and its arguments are sent with cloudpickle, "
            f"which failed: {type(exc).__name__}: {exc}. Something the function uses (a "
            "global or closure variable, or an argument) cannot be pickled: create it "
            "inside the function, or pass only what it needs (e.g. not a whole namespace "
            "dict)") from exc
    program = program or _program_of(fn)
    if pod is not None:
        n, threads = pod.cores, False
    if not threads:
        check_fits(program, n, zygote_running=_ZYGOTE is not None and _ZYGOTE.alive())
    store, request = _job_request(n, pod, payload, pass_index, threads)
    shm, status, ranks, world = (request[k] for k in ("shm", "status", "ranks", "world"))
    sys.stdout.flush()
    sys.stderr.flush()
    job = None
    try:
        zygote = _zygote()
        job = zygote.start_job(request)
        watch = _JobWatch(store, shm, world, status, None if pod is None else set(ranks))
        meter = None if threads else ReplicaMeter(job, shm, n)
        try:
            _watch_job(watch, job, timeout, meter)
        finally:
            if meter is not None and meter.peak:
                record(program, meter.peak, n)
            # Drop every reference to the store here, in this process: a traceback
            # that keeps this frame alive would otherwise leave the store to the
            # cyclic garbage collector, which may run it in a process the caller forks
            # later (a cache build's worker), where its destructor crashes.
            watch.store = watch.events.store = None
    finally:
        del store
        _end_job(job, shm if pod is None else None)  # a slice's folder is the slice's
    zygote.drain()
    return _outcome(watch, pod)


def _outcome(watch: "_JobWatch", pod: PodWorld | None) -> Any:
    """Rank 0's result, or the job's error (on a pod slice that lost a host: that first)."""
    from ..runtime.replica import ReplicaError

    if watch.first_error is not None:
        lost = pod_lost(pod) if pod is not None else None
        if lost is not None:
            raise HostLost(f"{lost}; host {pod.host} stopped too (its first replica error "
                           "follows)") from watch.first_error
        raise watch.first_error
    if not watch.got_result:
        raise ReplicaError(0, "replica 0 exited without returning a result", "ProcessDied")
    return watch.result


def _job_request(n: int, pod: PodWorld | None, payload: bytes, pass_index: bool,
                 threads: bool) -> tuple[Any, dict]:
    """The job's store (this process's server, or the pod slice's under the launch's prefix)
    and the request the zygote forks the job from."""
    if pod is None:
        shm, store, prefix, ranks = _new_job_folder(), serve_store(), "", list(range(n))
        status, port, world = shm, store.port, n
    else:
        shm, store, prefix, status = pod_launch(pod)
        ranks, port, world = [pod.ordinal(i) for i in range(n)], pod.port, pod.world_size
    return store, {"n": n, "port": port, "payload": payload, "path": list(sys.path),
                   "argv": list(sys.argv),
                   "cwd": os.getcwd(), "env": _caller_env(), "pass_index": pass_index,
                   "shm": shm, "threads": threads, "prefix": prefix, "ranks": ranks,
                   "world": world, "host": 0 if pod is None else pod.host, "status": status}


def _new_job_folder() -> str:
    """A fresh folder for one job's payload files (on /dev/shm where there is one);
    folders left by callers that were killed are removed first."""
    import tempfile

    base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    with contextlib.suppress(OSError):
        for name in os.listdir(base):
            pid, _, rest = name[len(FOLDER_PREFIX):].partition("-")  # <pid>-<random>
            if (name.startswith(FOLDER_PREFIX) and pid.isdigit() and rest
                    and not _pid_alive(int(pid))):
                shutil.rmtree(os.path.join(base, name), ignore_errors=True)
    return tempfile.mkdtemp(prefix=f"{FOLDER_PREFIX}{os.getpid()}-", dir=base)


def _end_job(job: int | None, shm: str | None) -> None:
    """Kill what is left of the job, wait until the zygote has reaped it (it
    writes the job's status to ``shm`` first), then remove ``shm`` (None: keep it)."""
    if job is not None:
        _kill_job(job)
        end = time.monotonic() + 5.0
        while time.monotonic() < end and _pid_exists(job):
            time.sleep(0.005)
    if shm is not None:
        shutil.rmtree(shm, ignore_errors=True)


def _program_of(fn: Callable[..., Any]) -> str:
    """What names a replica function's program in the footprint records."""
    code = getattr(fn, "__code__", None)
    where = (os.path.abspath(code.co_filename) if code is not None
             and not code.co_filename.startswith("<") else getattr(fn, "__module__", "?"))
    return f"{where}:{getattr(fn, '__qualname__', type(fn).__name__)}"


def _watch_job(watch: "_JobWatch", job: int, timeout: float | None,
               meter: ReplicaMeter | None) -> None:
    """Follow the job's events until it is over; ``TimeoutError`` after ``timeout`` s.
    ``meter`` samples the replicas' memory meanwhile."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        if meter is not None:
            meter.sample()
        # Look before reading: everything a job wrote before it ended is then
        # read below, in this same pass (reading first would race its exit).
        job_gone = not _pid_alive(job)
        watch.read()
        if watch.over():
            return
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError(f"launch() timed out after {timeout} s; all replicas were killed")
        if job_gone and not watch.others_pending():
            if watch.first_error is None:
                watch.first_error = _job_died(job, watch.folder, watch.status)
            return
        time.sleep(POLL_S)


def _job_died(job: int, folder: str, status_folder: str | None = None):
    """The ``ReplicaError`` for a job that ended before its replicas reported:
    a report its store connection could not carry (in ``folder``), else its exit status
    (in ``status_folder``)."""
    from ..runtime.replica import ReplicaError

    for path in sorted(glob.glob(os.path.join(folder, "lost.*"))):
        err = _lost_report(folder, int(path.rsplit(".", 1)[1]))
        if err is not None:
            return err
    end = time.monotonic() + 5.0  # the zygote writes the status before reaping the job
    while time.monotonic() < end and _pid_exists(job):
        time.sleep(0.005)
    try:
        status = int(read_payload(status_folder or folder, JOB_STATUS))
    except (TransportError, ValueError) as exc:
        return ReplicaError(-1, "the simulated job process ended before its replicas reported, "
                            f"and its exit status is unknown ({exc})", "ProcessDied")
    if status < 0:
        return ReplicaError(-1, f"the simulated job process was {describe_status(status)} "
                            "before its replicas reported", "ProcessDied")
    return ReplicaError(-1, f"the simulated job process ended with {describe_status(status)} "
                        "before its replicas reported, and left no report (its error output, "
                        "if any, is printed above)", "ProcessDied")


def _lost_report(folder: str, rank: int):
    """The ``ReplicaError`` of a report rank ``rank`` left as a file because the
    store could not take it (``protocol.Reporter.lost``), or None."""
    from ..runtime.replica import ReplicaError

    try:
        text = read_payload(folder, lost_name(rank)).decode("utf-8", "replace")
    except TransportError:
        return None
    return ReplicaError(rank, f"replica {rank} could not report: {text}", "TransportError")


class _JobWatch:
    """What the caller has learnt from a running job's store events."""

    def __init__(self, store, folder: str, n: int, status: str | None = None,
                 local: set[int] | None = None) -> None:
        # status: where the zygote writes the job's exit status (default: folder); local: on
        # a pod slice, the ranks of this host's replicas (None: every rank is)
        self.store, self.folder, self.n, self.local = store, folder, n, local
        self.status = status or folder
        self.events = EventReader(store)
        self.result, self.got_result = None, False
        self.finished: set[int] = set()
        self.errored: set[int] = set()  # ranks that reported their error
        self.exited: dict[int, int] = {}
        self.first_error = None  # runtime ReplicaError: the root cause once known
        self.error_deadline: float | None = None

    def read(self) -> None:
        for kind, r, value in self.events.poll():
            if kind == "result":
                self._on_result(r)
            elif kind == "finished":
                self.finished.add(r)
            elif kind == "error":
                self._on_error(r, value)
            elif kind == "exit":
                self._on_exit(r, value)

    def _on_result(self, r: int) -> None:
        from ..runtime.replica import ReplicaError

        try:
            data = read_payload(self.folder, RESULT)
            try:
                self.result = pickle.loads(data)
            except (pickle.UnpicklingError, EOFError) as exc:
                raise TransportError(
                    f"the result file {os.path.join(self.folder, RESULT)} ({len(data):,} "
                    f"bytes) is corrupt: {type(exc).__name__}: {exc}") from exc
            self.got_result = True
        except TransportError as exc:
            self._blame(ReplicaError(r, f"replica {r} returned, but its result could not be "
                                     f"handed back: {exc}", "TransportError"))

    def others_pending(self) -> bool:
        """On a pod slice: this host's replicas all finished and exited, the other hosts'
        have not yet reported (their reports, or the slice's loss, end the watch)."""
        if self.local is None or self.first_error is not None:
            return False
        if not self.local <= self.finished or not self.local <= set(self.exited):
            return False
        return not self.store.check([ABORT])  # aborted: a host was lost

    def over(self) -> bool:
        """All replicas finished, all exited, or the grace after the first error ran out."""
        if self.first_error is None and self.got_result and len(self.finished) == self.n:
            return True
        if len(self.exited) == self.n:
            return True
        return self.error_deadline is not None and time.monotonic() > self.error_deadline

    def _blame(self, err) -> None:
        """Keep the root cause: a replica's own error replaces a secondary one (a
        replica that stopped only because a peer failed)."""
        if self.first_error is None or (getattr(self.first_error, "_secondary", False)
                                        and not getattr(err, "_secondary", False)):
            self.first_error = err
        if self.error_deadline is None:
            self.error_deadline = time.monotonic() + ERROR_GRACE_S

    def _on_error(self, r: int, value: int) -> None:
        from ..runtime.replica import ReplicaError

        try:
            tb, exc_type, secondary = read_error(self.store, self.folder, r, value)
        except TransportError as exc:
            tb, exc_type, secondary = (f"replica {r} reported an error, but the report could "
                                       f"not be handed over: {exc}", "TransportError", False)
        err = ReplicaError(r, tb, exc_type)
        err._secondary = secondary
        self.errored.add(r)
        self._blame(err)

    def _on_exit(self, r: int, value: int) -> None:
        from ..runtime.replica import ReplicaError

        self.exited[r] = value
        if value == 0 or r in self.finished:
            return
        if r in self.errored:
            return  # it reported its error before dying
        why = describe_status(value)
        self.store.set("abort", f"replica {r} died ({why})")
        lost = _lost_report(self.folder, r)
        if lost is not None:  # its report is a file: the store connection failed
            self._blame(lost)
            return
        self._blame(ReplicaError(r, f"replica {r} died abruptly ({why}) without a Python "
                                 "traceback: a crash, os._exit, or the kernel's out-of-memory "
                                 "killer", "ProcessDied"))


def _pid_exists(pid: int) -> bool:
    """Whether ``pid`` exists at all (a zombie not yet reaped does)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _pid_alive(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie (exited, not yet reaped by the zygote)."""
    if not _pid_exists(pid):
        return False
    with contextlib.suppress(OSError):
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    return True


def _kill_job(job: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(job, signal.SIGKILL)
