"""Simulated TPU cores: N XLA:CPU replica processes with host collectives.

Why one module of about 1,200 lines: the caller side (zygote, launch, runner) and
the replica side (patched torch_xla, host collectives) speak one private protocol
(the request dict, the store's keys and events); keeping both halves beside each
other keeps that protocol in one place.

``launch(fn, simulate=N)`` and the runner below run N replicas, each a process of
its own with one XLA:CPU device. (xla_utils' own loops, ``fit``/``predict``/
``evaluate``/``lr_find``/``check``, run ``threads=True`` jobs instead: N replica
threads of one job process, see ``runtime.replica.simulate_threads``.) torch_xla's
collectives (``xm.all_reduce``, ``all_gather``, ``reduce_scatter``, ``rendezvous``,
``mesh_reduce``, ``collective_broadcast`` and, through them, ``optimizer_step``,
``reduce_gradients``, ``broadcast_master_param``) and its world queries
(``xr.world_size``, ``xr.global_ordinal``, ``xr.local_ordinal``,
``xm.is_master_ordinal``, ``xm.save``) are replaced *inside the replicas only* by
versions that report the simulated world and exchange CPU copies of the tensors
through shared memory (``/dev/shm``), synchronised by a ``TCPStore``. Every other
torch_xla call is the real one. See docs/ARCHITECTURE.md ("Simulated cores").

Run an unmodified torch_xla script (entry point ``xmp.spawn(fn, args=...)`` or
``torch_xla.launch(fn, args=...)``) on N simulated cores::

    python -m xla_utils.simulate --cores 8 train.py --epochs 1

From a notebook: ``run_script("train.py", cores=8, args=[...])``, or wrap a cell
that calls ``xmp.spawn`` / ``torch_xla.launch`` in ``with simulated_spawn(cores=8):``.

How it starts (no state of the calling process reaches a replica): the first
simulated launch starts a *zygote*, a fresh ``python -m xla_utils.simulate
--zygote`` interpreter that imports torch and torch_xla (without initialising the
XLA runtime) and then waits. Each launch sends it ``fn`` and ``args`` pickled with
cloudpickle (so functions, lambdas and models defined in a notebook cell or in
``__main__`` work) together with the caller's ``sys.path``, working directory and
environment; the zygote forks a job process, which forks one replica per core.
The zygote lives as long as the caller (it dies with it) and is restarted if it
died.

Collective errors are named and bounded: before every collective a replica records
its arrival (sequence number, collective, shapes, caller's ``file:line``) in a
``TCPStore`` and waits for the others. A mismatch (rank 0 in ``xm.all_reduce``
while the others are in ``xm.mesh_reduce``), a peer that returned from ``fn`` or
died, or ``XLA_UTILS_COLLECTIVE_TIMEOUT`` seconds (default 30) without the others
arriving raises :class:`CollectiveError`, naming the collective and where every
rank is.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import pickle
import runpy
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

__all__ = ["CollectiveError", "run_script", "simulated_spawn", "main",
           "COLLECTIVE_TIMEOUT_S"]

# Seconds a replica waits in a collective for the others to arrive, when none of
# them has returned, died or reached a different collective (those end the wait
# at once). Override with the environment variable XLA_UTILS_COLLECTIVE_TIMEOUT.
COLLECTIVE_TIMEOUT_S = 30.0
# Seconds the zygote may take to import torch and torch_xla (cold disk: ~25 s).
_ZYGOTE_START_S = 300.0
# After the first replica error, how long the others get to report.
ERROR_GRACE_S = 3.0
_POLL_S = 0.05
_WAIT_SLICE_S = 0.25  # how often a replica waiting in a collective checks on its peers
_SEP = "\x1f"  # between the fields of an arrival record
# Frames in this folder are xla_utils.runtime's (a call site is the frame before them).
_RUNTIME_DIR = os.path.join("xla_utils", "runtime", "")


class CollectiveError(RuntimeError):
    """Simulated replicas did not meet in the same collective (rank-dependent code,
    a peer that returned early or died, or a timeout). The message names the
    collective and where each rank is."""


class _PeerFailed(RuntimeError):
    """This replica stopped because another replica failed first (secondary)."""


# ==========================================================================
# Caller side: the zygote and one launch
# ==========================================================================
def _send(sock: socket.socket, obj: Any) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    sock.sendall(struct.pack("!Q", len(data)) + data)


def _recv(sock: socket.socket) -> Any:
    def exact(n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            chunk = sock.recv(n - len(buf))
            if not chunk:
                raise EOFError("zygote connection closed")
            buf += chunk
        return bytes(buf)

    (n,) = struct.unpack("!Q", exact(8))
    return pickle.loads(exact(n))


class _Zygote:
    """The clean interpreter that forks simulated jobs for this process."""

    def __init__(self) -> None:
        parent, child = socket.socketpair()
        env = dict(os.environ, PJRT_DEVICE="CPU")
        # Replicas wait in the store in short slices; c10d logs a warning for each
        # slice that times out. Read once, when torch loads in the zygote.
        env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
        env["PYTHONPATH"] = os.pathsep.join(
            [str(Path(__file__).resolve().parents[1])] + [p for p in sys.path if p])
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
            threading.Thread(target=_forward, args=(stream, name, self.forwarding), daemon=True,
                             name=f"xla_utils-zygote-{name}").start()
        self.sock.settimeout(_ZYGOTE_START_S)
        try:
            msg = _recv(self.sock)
        except (EOFError, OSError, socket.timeout) as exc:
            self.close()
            raise RuntimeError(
                f"the simulated-core zygote ({sys.executable} -m xla_utils.simulate --zygote) "
                f"did not start ({type(exc).__name__}: {exc}); its error output is printed "
                "above. Check that `python -c 'import torch_xla'` works.") from None
        self.sock.settimeout(None)
        if msg[0] != "ready":
            self.close()
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
            _send(self.sock, ("launch", request))
            kind, value = _recv(self.sock)
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


def _forward(stream, name: str, lock: threading.Lock) -> None:
    import select

    fd = stream.fileno()
    while True:
        with contextlib.suppress(OSError, ValueError):
            select.select([fd], [], [])
        with lock:
            try:
                data = os.read(fd, 65536)
            except OSError:
                return
            if not data:
                return
            target = getattr(sys, name)
            try:
                target.write(data.decode("utf-8", "replace"))
                target.flush()
            except Exception:  # a closed or replaced stream must not kill forwarding
                with contextlib.suppress(Exception):
                    os.write(1 if name == "stdout" else 2, data)


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
    env.update(PJRT_DEVICE="CPU", CPU_NUM_DEVICES="1")
    return env


def run_replicas(fn: Callable[..., Any], args: tuple, n: int,
                 timeout: float | None = None, pass_index: bool = False,
                 threads: bool = False) -> Any:
    """Run ``fn(*args)`` (``fn(index, *args)`` with ``pass_index``) on ``n`` simulated
    cores and return rank 0's result; used by ``runtime.launch(simulate=N)``.

    ``threads=True`` runs the replicas as threads of one job process on N XLA:CPU
    devices (``runtime.replica.simulate_threads``; only for code that synchronises
    through ``runtime.sync``, i.e. xla_utils' own loops) instead of one process each.

    Raises ``runtime.ReplicaError`` (the root cause, preferred over replicas that
    stopped because of it) and ``TimeoutError`` after ``timeout`` seconds.
    """
    import cloudpickle
    import torch.distributed as dist

    from .runtime.replica import ReplicaError

    import shutil
    import tempfile

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
    shm = tempfile.mkdtemp(prefix="xla_utils-sim-",
                           dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=_td(60))
    request = {"n": n, "port": store.port, "payload": payload, "path": list(sys.path),
               "cwd": os.getcwd(), "env": _caller_env(), "pass_index": pass_index,
               "shm": shm, "threads": threads}
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        zygote = _zygote()
        job = zygote.start_job(request)
    except BaseException:
        del store  # see the note in the finally clause below
        shutil.rmtree(shm, ignore_errors=True)
        raise
    watch = _JobWatch(store, n)
    try:
        _watch_job(watch, job, timeout)
    except BaseException:
        _kill_job(job)
        raise
    finally:
        # Drop every reference to the store here, in this process: a traceback
        # that keeps this frame alive would otherwise leave the store to the
        # cyclic garbage collector, which may run it in a process the caller forks
        # later (a cache build's worker), where its destructor crashes.
        watch.store = watch.events.store = None
        del store
        shutil.rmtree(shm, ignore_errors=True)
    _kill_job(job)
    zygote.drain()
    if watch.first_error is not None:
        raise watch.first_error
    if not watch.got_result:
        raise ReplicaError(0, "replica 0 exited without returning a result", "ProcessDied")
    return watch.result


def _watch_job(watch: "_JobWatch", job: int, timeout: float | None) -> None:
    """Follow the job's events until it is over; ``TimeoutError`` after ``timeout`` s."""
    from .runtime.replica import ReplicaError

    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        # Look before reading: everything a job wrote before it ended is then
        # read below, in this same pass (reading first would race its exit).
        job_gone = not _pid_alive(job)
        watch.read()
        if watch.over():
            return
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError(f"launch() timed out after {timeout} s; all replicas were killed")
        if job_gone:
            if watch.first_error is None:
                watch.first_error = ReplicaError(
                    -1, "the simulated job process was killed (signal or out of memory) "
                    "before its replicas reported", "ProcessDied")
            return
        time.sleep(_POLL_S)


class _JobWatch:
    """What the caller has learnt from a running job's store events."""

    def __init__(self, store, n: int) -> None:
        self.store, self.n = store, n
        self.events = _EventReader(store)
        self.result, self.got_result = None, False
        self.finished: set[int] = set()
        self.exited: dict[int, int] = {}
        self.first_error = None  # runtime ReplicaError: the root cause once known
        self.error_deadline: float | None = None

    def read(self) -> None:
        for kind, r, value in self.events.poll():
            if kind == "result":
                self.result, self.got_result = pickle.loads(self.store.get("result")), True
            elif kind == "finished":
                self.finished.add(r)
            elif kind == "error":
                self._on_error(r)
            elif kind == "exit":
                self._on_exit(r, value)

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

    def _on_error(self, r: int) -> None:
        from .runtime.replica import ReplicaError

        tb, exc_type, secondary = pickle.loads(self.store.get(f"error/{r}"))
        err = ReplicaError(r, tb, exc_type)
        err._secondary = secondary
        self._blame(err)

    def _on_exit(self, r: int, value: int) -> None:
        from .runtime.replica import ReplicaError

        self.exited[r] = value
        if value == 0 or r in self.finished:
            return
        if self.first_error is not None and self.first_error.rank == r:
            return  # it reported its error before dying
        why = _describe_status(value)
        self.store.set("abort", f"replica {r} died ({why})")
        self._blame(ReplicaError(r, f"replica {r} died abruptly ({why}) without a Python "
                                 "traceback: a crash, os._exit, or the kernel's out-of-memory "
                                 "killer", "ProcessDied"))


class _EventReader:
    """Reads the append-only ``events`` key: lines ``kind rank value``."""

    def __init__(self, store) -> None:
        self.store, self.offset = store, 0

    def poll(self) -> Iterator[tuple[str, int, int]]:
        if not self.store.check(["events"]):
            return
        data = self.store.get("events")
        new, self.offset = data[self.offset:], len(data)
        for line in new.decode().splitlines():
            kind, r, value = line.split()
            yield kind, int(r), int(value)


def _td(seconds: float):
    from datetime import timedelta

    return timedelta(seconds=seconds)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie (exited, not yet reaped by the zygote) counts as dead.
    with contextlib.suppress(OSError):
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    return True


def _kill_job(job: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(job, signal.SIGKILL)


def _describe_status(status: int) -> str:
    if status < 0:
        name = signal.Signals(-status).name
        hint = " (SIGKILL usually means the host ran out of memory)" if -status == signal.SIGKILL else ""
        return f"killed by signal {name}{hint}"
    return f"exit code {status}"


# ==========================================================================
# The runner: xmp.spawn / torch_xla.launch on simulated cores
# ==========================================================================
@contextlib.contextmanager
def simulated_spawn(cores: int = 8, timeout: float | None = None) -> Iterator[None]:
    """Within the block, ``xmp.spawn(fn, args=...)`` and ``torch_xla.launch(fn, args=...)``
    run ``fn(index, *args)`` on ``cores`` simulated XLA:CPU cores (1, 2, 4 or 8).

    ``nprocs`` may be ``None``, ``1`` (one core, as torch_xla does) or ``cores``;
    anything else raises ``ValueError`` as torch_xla does. ``start_method`` is ignored
    (replicas always start from a clean interpreter). ``timeout`` in seconds, default
    none. Replica exceptions are raised as ``ReplicaError``.
    """
    if not isinstance(cores, int) or cores < 1:
        raise ValueError(f"cores must be a positive int, got {cores!r}")
    import torch_xla
    import torch_xla.distributed.xla_multiprocessing as xmp

    def spawn(fn, args=(), nprocs=None, join=True, daemon=False, start_method="spawn"):
        if nprocs not in (None, 1, cores):
            raise ValueError(f"Unsupported nprocs ({nprocs}): use nprocs=None (all {cores} "
                             "simulated cores) or 1, as torch_xla requires")
        return run_replicas(fn, tuple(args), 1 if nprocs == 1 else cores, timeout=timeout,
                            pass_index=True)

    def launch(fn, args=(), start_method="spawn", debug_single_process=False):
        return spawn(fn, args=args, nprocs=1 if debug_single_process else None)

    saved = (xmp.spawn, torch_xla.launch)
    xmp.spawn, torch_xla.launch = spawn, launch
    try:
        yield
    finally:
        xmp.spawn, torch_xla.launch = saved


def run_script(path: str | os.PathLike, cores: int = 8, args: Sequence[str] = (),
               timeout: float | None = None) -> int:
    """Run a torch_xla script as ``__main__`` with ``xmp.spawn`` / ``torch_xla.launch``
    on ``cores`` simulated cores (``%run``-like; ``args`` become ``sys.argv[1:]``).

    Returns the script's exit status (0 when it ends normally or calls
    ``sys.exit(0)``); a replica's exception propagates as ``ReplicaError``.
    """
    path = str(path)
    saved_argv, saved_path = sys.argv[:], sys.path[:]
    sys.argv = [path, *map(str, args)]
    sys.path.insert(0, str(Path(path).resolve().parent))
    try:
        with simulated_spawn(cores, timeout=timeout):
            runpy.run_path(path, run_name="__main__")
    except SystemExit as exc:
        code = exc.code
        if code is None:
            return 0
        if isinstance(code, int):
            return code
        print(code, file=sys.stderr)
        return 1
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m xla_utils.simulate --cores N script.py [args...]``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--zygote"]:
        _zygote_main(int(argv[1]))
        return 0
    p = argparse.ArgumentParser(
        prog="python -m xla_utils.simulate",
        description="Run a torch_xla script (xmp.spawn / torch_xla.launch) on N simulated "
                    "XLA:CPU cores.")
    p.add_argument("--cores", type=int, default=8, help="simulated cores: 1, 2, 4 or 8 (default 8)")
    p.add_argument("--timeout", type=float, default=None,
                   help="seconds after which the replicas are killed (default: none)")
    p.add_argument("script", help="path of the script to run as __main__")
    p.add_argument("args", nargs=argparse.REMAINDER, help="the script's own arguments")
    ns = p.parse_args(argv)
    if ns.cores < 1:
        p.error("--cores must be >= 1")
    from .runtime.replica import ReplicaError

    try:
        return run_script(ns.script, cores=ns.cores, args=ns.args, timeout=ns.timeout)
    except ReplicaError as exc:
        print(f"xla_utils.simulate: {exc}", file=sys.stderr)
        return 1


# ==========================================================================
# Zygote and job (run in the clean interpreter)
# ==========================================================================
def _die_with_parent() -> None:
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _zygote_main(fd: int) -> None:
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

        from .runtime import forksafe, replica  # noqa: F401
    except BaseException as exc:
        _send(sock, ("error", f"{type(exc).__name__}: {exc}"))
        raise
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # jobs are reaped automatically
    forksafe.mark_clean()  # no torch op ran here; jobs check for an OpenMP team against this
    _send(sock, ("ready", torch.__version__))
    while True:
        try:
            kind, request = _recv(sock)
        except (EOFError, OSError):
            os._exit(0)  # the caller is gone
        if kind != "launch":
            continue
        try:
            forksafe.check_before_fork()
            pid = os.fork()
        except OSError as exc:
            _send(sock, ("error", f"fork failed: {exc}"))
            continue
        if pid == 0:
            sock.close()
            try:
                _job_main(request)
            finally:
                os._exit(1)
        _send(sock, ("job", pid))


def _event(store, kind: str, rank: int, value: int = 0) -> None:
    store.append("events", f"{kind} {rank} {value}\n".encode())


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
    store = dist.TCPStore("127.0.0.1", request["port"], is_master=False, timeout=_td(60))
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
            _event(store, "exit", r, code)
    os._exit(0)


def _thread_job(request: dict) -> None:
    """A job whose replicas are threads of this process (``runtime.replica.simulate_threads``)."""
    _enter_caller_context(request)
    results = _StoreResults(request["port"], request["n"])
    try:
        import cloudpickle

        from .runtime import replica

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
                                           timeout=_td(60))
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
                    _event(store, "exit", i, 0)
            else:
                _event(store, kind, r)

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
class _World:
    """This replica's view of the simulated world (set by _replica_main)."""

    rank = 0
    size = 1
    store = None
    seq = 0
    pending_delete: str | None = None
    shm = ""  # folder (on /dev/shm) where replicas publish collective inputs
    files: dict = {}  # seq -> this rank's published files


def _replica_main(r: int, request: dict) -> int:
    _die_with_parent()
    _enter_caller_context(request)
    import cloudpickle
    import torch.distributed as dist

    from .runtime import replica

    n = request["n"]
    store = dist.TCPStore("127.0.0.1", request["port"], is_master=False, timeout=_td(60))
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
            _event(store, "result", r)
        store.set(f"finished/{r}", "1")
        _event(store, "finished", r)
        return 0
    except BaseException as exc:
        secondary = isinstance(exc, _PeerFailed)
        tb = traceback.format_exc()
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        with contextlib.suppress(Exception):
            if not secondary:
                store.set("abort", f"replica {r} raised {type(exc).__name__}")
            store.set(f"error/{r}", pickle.dumps((tb, type(exc).__name__, secondary)))
            _event(store, "error", r)
        return 1


_SYNCS: list = []


def _profile_sync() -> None:
    import torch_xla

    orig = torch_xla.sync

    def sync(*a, **k):
        t = time.perf_counter()
        orig(*a, **k)
        _SYNCS.append((t, time.perf_counter() - t))

    torch_xla.sync = sync


def _profile_report(rank: int) -> None:
    """XLA_UTILS_SIM_PROFILE=1: median phase times (ms) of the gradient all-reduces
    after the first 20 (steady state), printed to stderr."""
    import statistics

    rows = [r for r in _PROF if r[0] > 1 and len(r) == 8][20:]
    if not rows:
        return
    med = lambda i: 1000 * statistics.median(r[i] for r in rows)  # noqa: E731
    gaps = [rows[k + 1][1] - sum(rows[k + 1][2:5]) - rows[k][7] for k in range(len(rows) - 1)]
    syncs = [d for t, d in _SYNCS if t > rows[0][1]]
    print(f"[sim-profile rank {rank}] {len(rows)} grad all-reduces: materialize {med(2):.1f} "
          f"to-cpu {med(3):.1f} arrive(wait) {med(4):.1f} collect+reduce {med(5):.1f} "
          f"to-device {med(6):.1f}; between all-reduces {1000 * statistics.median(gaps):.1f}; "
          f"sync {1000 * statistics.median(syncs):.1f} ms", file=sys.stderr, flush=True)


def _timeout_s() -> float:
    return float(os.environ.get("XLA_UTILS_COLLECTIVE_TIMEOUT", COLLECTIVE_TIMEOUT_S))


def _call_site() -> tuple[str, str]:
    """(API name, user file:line) of the collective being entered: the outermost
    torch_xla / xla_utils.runtime frame and the frame that called it."""
    # Frames from _arrive's caller outwards, without reading source lines (this
    # runs at every collective of every replica).
    frames = traceback.StackSummary.extract(traceback.walk_stack(sys._getframe(2)),
                                            lookup_lines=False)
    frames.reverse()
    api, where = "collective", "?"
    for i in range(len(frames) - 1, -1, -1):
        f = frames[i]
        lib = ("torch_xla" in f.filename or f.filename.endswith("xla_utils/simulate.py")
               or _RUNTIME_DIR in f.filename)
        if not lib:
            where = f"{f.filename}:{f.lineno}"
            if i + 1 < len(frames):
                nxt = frames[i + 1]
                mod = "xla_utils.runtime" if _RUNTIME_DIR in nxt.filename else "xm"
                # our replacements of torch_xla's collectives are _sim_<name>
                api = f"{mod}.{nxt.name.removeprefix('_sim_')}"
            break
    return api, where


def _arrive(kind: str, signature: str, data: list | None = None) -> int:
    """Record this replica's arrival at its next collective and wait for all ranks.

    ``data`` (CPU tensors) is published for the others first (see _publish).
    Returns the collective's sequence number. Raises CollectiveError (mismatch,
    peers gone, timeout) or _PeerFailed (another replica failed first).
    """
    w = _World
    store, n, r = w.store, w.size, w.rank
    seq = w.seq = w.seq + 1
    api, where = _call_site()
    if data:
        _publish(seq, data)
    mine = _SEP.join((kind, signature, api, where))
    store.set(f"arr/{seq}/{r}", mine)
    keys = [f"arr/{seq}/{k}" for k in range(n)]
    timeout = _timeout_s()
    t0 = time.monotonic()
    gone_since = None
    while True:
        # Blocks in the store until the last rank arrives (no polling delay);
        # every _WAIT_SLICE_S it looks for failed, returned or missing peers.
        try:
            store.wait(keys, _td(_WAIT_SLICE_S))
            break
        except RuntimeError:  # DistStoreError: not all arrived yet
            if store.check(keys):
                break
        if store.check(["abort"]):
            raise _PeerFailed(f"stopped in {api} at {where}: "
                              f"{store.get('abort').decode()} (see that replica's error)")
        missing = [k for k in range(n) if not store.check([f"arr/{seq}/{k}"])]
        gone = [k for k in missing if store.check([f"finished/{k}"])]
        now = time.monotonic()
        if gone and gone_since is None:
            gone_since = now
        # A peer that returned never arrives; give the other missing ones a
        # moment to return too, so that the message says where everyone is.
        if (gone and (len(gone) == len(missing) or now - gone_since > 2.0)) \
                or now - t0 > timeout:
            raise CollectiveError(_where_message(seq, api, where, gone, now - t0, timeout))
    others = [v.decode() for v in _multi_get(store, keys)]
    sigs = {tuple(o.split(_SEP)[:2]) for o in others}
    if len(sigs) > 1:
        lines = []
        for k, o in enumerate(others):
            kd, sg, ap, wh = o.split(_SEP)
            lines.append(f"  rank {k}: {ap} ({f'{kd} {sg}'.strip()}) at {wh}")
        raise CollectiveError(
            f"simulated replicas reached different collectives as collective #{seq}: "
            "rank-dependent code (an `if` on the rank or on data around a collective), "
            "which hangs or corrupts a real multi-core run too. Where each rank is:\n"
            + "\n".join(lines))
    # Everyone has passed collective seq - 1 (and read its payloads and tensors):
    # free this rank's keys and files of it.
    for path in w.files.pop(seq - 1, ()):
        with contextlib.suppress(OSError):
            os.unlink(path)
    stale = [f"arr/{seq - 1}/{r}"] if seq > 1 else []
    if w.pending_delete:
        stale.append(w.pending_delete)
        w.pending_delete = None
    for key in stale:
        with contextlib.suppress(Exception):
            store.delete_key(key)
    return seq


def _multi_get(store, keys: list[str]) -> list[bytes]:
    if hasattr(store, "multi_get"):
        return store.multi_get(keys)
    return [store.get(k) for k in keys]


def _where_message(seq: int, api: str, where: str, gone: list[int], waited: float,
                   timeout: float) -> str:
    w = _World
    arrived = [k for k in range(w.size) if w.store.check([f"arr/{seq}/{k}"])]
    missing = [k for k in range(w.size) if k not in arrived]
    returned = [k for k in missing if w.store.check([f"finished/{k}"])]
    running = [k for k in missing if k not in returned]
    details = []
    if returned:
        details.append(f"ranks {returned} had returned from the replica function")
    if running:
        last = None
        prev = f"arr/{seq - 1}/{running[0]}"
        if seq > 1 and w.store.check([prev]):
            last = w.store.get(prev).decode().split(_SEP)
        details.append(f"ranks {running} are still running" + (
            f" (rank {running[0]}'s last collective was {last[2]} at {last[3]})" if last else
            " (no collective since)"))
    why = ("other ranks returned without reaching it" if gone else
           f"the others did not arrive within {timeout:g} s "
           "(XLA_UTILS_COLLECTIVE_TIMEOUT)")
    return (f"rank {w.rank} waited {waited:.1f} s in {api} at {where} (collective #{seq}); "
            f"{why}. Ranks arrived: {arrived}; missing: {missing}: " + "; ".join(details)
            + ". Every replica must call the same collectives in the same order: look for "
            "a collective inside a rank-dependent `if` (e.g. `if xm.is_master_ordinal():`).")


def _materialize() -> None:
    """Run the pending graph (without step closures), so that reading collective
    inputs is a transfer, not a recomputation of the forward/backward."""
    import torch_xla

    torch_xla._XLAC._xla_step_marker(torch_xla._XLAC._xla_get_default_device(), [], wait=False)


def _check_groups(groups, api: str) -> None:
    if groups and sorted(map(sorted, groups)) != [list(range(_World.size))]:
        raise NotImplementedError(
            f"{api}(groups={groups}): replica groups are not simulated; use groups=None "
            "(all replicas) on simulated cores")


def _sig(tensors: list) -> str:
    return ";".join(f"{tuple(t.shape)}:{str(t.dtype).replace('torch.', '')}" for t in tensors)


def _wire(t):
    """A CPU tensor as a numpy array (bfloat16 travels as its int16 bits)."""
    import torch

    t = t.detach().contiguous()
    return (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy()


def _publish(seq: int, data: list) -> None:
    """Write this rank's CPU tensors for collective ``seq`` to shared memory.

    Every rank reads every rank's file once all have arrived (one barrier, no
    ring of sequential messages: on a 2-core host the N replica processes then
    need not be scheduled one after another). Files are deleted by their writer
    after the next collective, when everyone has read them.
    """
    w = _World
    paths = w.files.setdefault(seq, [])
    for i, t in enumerate(data):
        path = os.path.join(w.shm, f"{seq}.{w.rank}.{i}")
        _wire(t).tofile(path)
        paths.append(path)


def _collect(seq: int, i: int, like) -> list:
    """Every rank's tensor ``i`` of collective ``seq`` (same shape/dtype as ``like``)."""
    import numpy as np
    import torch

    w = _World
    out = []
    for k in range(w.size):
        if k == w.rank:
            out.append(like)
            continue
        arr = np.fromfile(os.path.join(w.shm, f"{seq}.{k}.{i}"), dtype=_wire(like[:0]).dtype)
        t = torch.from_numpy(arr)
        out.append((t.view(torch.bfloat16) if like.dtype == torch.bfloat16 else t)
                   .view(like.shape))
    return out


def _to_cpu_batched(tensors: list) -> list:
    """CPU copies of ``tensors`` (XLA or CPU), the XLA ones in one batched transfer."""
    import torch_xla

    xla = [i for i, t in enumerate(tensors) if t.device.type == "xla"]
    out = [t.detach() if t.device.type == "cpu" else None for t in tensors]
    if xla:
        for i, c in zip(xla, torch_xla._XLAC._xla_get_cpu_tensors([tensors[i].detach()
                                                                   for i in xla])):
            out[i] = c
    return [o if o is not None else t.detach().to("cpu") for o, t in zip(out, tensors)]


def _flat_groups(tensors: list) -> tuple[list, list]:
    """CPU copies of ``tensors`` flattened into one buffer per dtype: (buffers, index lists)."""
    import torch

    by_dtype: dict = {}
    for i, t in enumerate(tensors):
        by_dtype.setdefault(t.dtype, []).append(i)
    # One batched device-to-host transfer for all tensors (not one per tensor).
    host = _to_cpu_batched(tensors)
    bufs, groups = [], []
    for idx in by_dtype.values():
        cpu = [host[i].reshape(-1) for i in idx]
        bufs.append(torch.cat(cpu) if len(cpu) > 1 else cpu[0].clone())
        groups.append(idx)
    return bufs, groups


def _reduce(reduce_type: str, parts: list):
    """Reduce the ranks' buffers in rank order (identical result on every rank)."""
    import torch

    dtype = parts[0].dtype
    acc_dtype = torch.float32 if dtype in (torch.bfloat16, torch.float16) else (
        torch.int32 if dtype == torch.bool else dtype)
    acc = parts[0].to(acc_dtype).clone()
    for p in parts[1:]:
        p = p.to(acc_dtype)
        if reduce_type == "sum":
            acc += p
        elif reduce_type == "mul":
            acc *= p
        elif reduce_type in ("min", "and"):
            acc = torch.minimum(acc, p)
        elif reduce_type in ("max", "or"):
            acc = torch.maximum(acc, p)
        else:
            raise ValueError(f"unknown reduce_type {reduce_type!r}")
    return acc


# XLA_UTILS_SIM_PROFILE=1: each replica times the phases of its gradient all-reduces
# and prints their medians to stderr when its function returns (a debugging aid).
_PROF: list | None = [] if os.environ.get("XLA_UTILS_SIM_PROFILE") else None


def _host_all_reduce(reduce_type: str, tensors: list, scale: float, api_sig: str) -> list:
    """Arrive at the collective, then all-reduce CPU copies of ``tensors``; CPU results."""
    if reduce_type not in ("sum", "mul", "min", "max", "and", "or"):
        raise ValueError(f"unknown reduce_type {reduce_type!r}")
    t0 = time.perf_counter()
    _materialize()
    t1 = time.perf_counter()
    bufs, groups = _flat_groups(tensors)
    t2 = time.perf_counter()
    seq = _arrive("all_reduce" if api_sig.startswith("all_reduce") else "reduce_scatter",
                  api_sig.split(":", 1)[1], bufs)
    t3 = time.perf_counter()
    if _PROF is not None:
        _PROF.append((len(tensors), t3, t1 - t0, t2 - t1, t3 - t2))
    out: list = [None] * len(tensors)
    for gi, (buf, idx) in enumerate(zip(bufs, groups)):
        work = _reduce(reduce_type, _collect(seq, gi, buf))
        if scale != 1.0:
            work = work * scale
        work = work.to(buf.dtype)
        pos = 0
        for i in idx:
            numel = tensors[i].numel()
            out[i] = work[pos:pos + numel].view(tensors[i].shape)
            pos += numel
    return out


def _to_device(cpu_tensors: list, device) -> list:
    import torch_xla.core.xla_model as xm

    return xm.send_cpu_data_to_device(list(cpu_tensors), device)


def _patch_torch_xla(rank: int, n: int) -> None:
    """Make this process's torch_xla report and reduce over the simulated world."""
    import torch_xla.core.xla_model as xm
    import torch_xla.runtime as xr

    xr.world_size = lambda: n
    xr.global_ordinal = lambda: rank
    xr.local_ordinal = lambda: rank
    xr.local_process_count = lambda: n
    xr.global_device_count = lambda: n
    xr._WORLD_SIZE, xr._ORDINAL = n, rank
    for name, value in (("get_ordinal", lambda local=False: rank),
                        ("xrt_world_size", lambda: n)):
        if hasattr(xm, name):
            setattr(xm, name, value)
    if n == 1:
        return  # torch_xla's own collectives are no-ops on one device
    _sim_rendezvous.__wrapped__ = xm.rendezvous
    xm.all_to_all = _unsupported("xm.all_to_all", "use xm.all_gather and slice instead")
    xm.collective_permute = _unsupported("xm.collective_permute",
                                         "use xm.all_gather and pick the source rank's part")
    xm.send = _unsupported("xm.send", "use xm.all_gather (or xm.rendezvous for bytes)")
    xm.recv = _unsupported("xm.recv", "use xm.all_gather (or xm.rendezvous for bytes)")
    xr.use_spmd = _unsupported("xr.use_spmd (SPMD)", "simulate the multi-process "
                               "(xmp.spawn) form of the code, or run SPMD on a real TPU")
    xm.all_reduce = _sim_all_reduce
    xm.all_gather = _sim_all_gather
    xm.reduce_scatter = _sim_reduce_scatter
    xm.rendezvous = _sim_rendezvous
    xm.xla_rendezvous = lambda payload=b"", ordinals=None, tag=None: _sim_rendezvous(
        tag or "", payload, ordinals or [])


def _unsupported(api: str, alternative: str) -> Callable[..., Any]:
    def fail(*args, **kwargs):
        raise NotImplementedError(
            f"{api} is not simulated on XLA:CPU replicas (it needs a real device mesh); "
            f"{alternative}")
    return fail


def _copy_into(output, single: bool, moved: list):
    """``output`` (a tensor or a list) filled in place with ``moved``; returned."""
    import torch

    outs = [output] if single else list(output)
    with torch.no_grad():
        for o, m in zip(outs, moved):
            o.copy_(m)
    return output


# torch_xla's signatures, replaced inside simulated replicas (see _patch_torch_xla).
def _sim_all_reduce(reduce_type, inputs, scale=1.0, groups=None, pin_layout=True):
    import torch

    _check_groups(groups, "xm.all_reduce")
    single = isinstance(inputs, torch.Tensor)
    tensors = [inputs] if single else list(inputs)
    if not tensors:
        return inputs
    cpu = _host_all_reduce(reduce_type, tensors, scale,
                           f"all_reduce:{reduce_type}|{scale}|{_sig(tensors)}")
    t4 = time.perf_counter()
    moved = _to_device(cpu, tensors[0].device)
    if single:
        return moved[0]
    _copy_into(inputs, False, moved)
    if _PROF is not None:
        _PROF[-1] += (t4 - _PROF[-1][1], time.perf_counter() - t4, time.perf_counter())
    return inputs


def _sim_all_gather(value, dim=0, groups=None, output=None, pin_layout=True, channel_id=None,
                    use_global_device_ids=None):
    import torch

    _check_groups(groups, "xm.all_gather")
    single = isinstance(value, torch.Tensor)
    tensors = [value] if single else list(value)
    _materialize()
    cpu = [t.detach().to("cpu").contiguous() for t in tensors]
    seq = _arrive("all_gather", f"{dim}|{_sig(tensors)}", cpu)
    results = [torch.cat(_collect(seq, i, c), dim=dim if dim >= 0 else c.dim() + dim)
               for i, c in enumerate(cpu)]
    moved = _to_device(results, tensors[0].device)
    if output is not None:
        return _copy_into(output, single, moved)
    return moved[0] if single else moved


def _sim_reduce_scatter(reduce_type, input, scale, scatter_dim, shard_count, groups=None,
                        output=None, pin_layout=True, channel_id=None,
                        use_global_device_ids=None):
    import torch

    n = _World.size
    _check_groups(groups, "xm.reduce_scatter")
    if shard_count != n:
        raise ValueError(f"xm.reduce_scatter(shard_count={shard_count}) on {n} simulated "
                         f"cores: shard_count must equal the world size ({n})")
    single = isinstance(input, torch.Tensor)
    tensors = [input] if single else list(input)
    reduced = _host_all_reduce(
        reduce_type, tensors, scale,
        f"reduce_scatter:{reduce_type}|{scale}|{scatter_dim}|{_sig(tensors)}")
    shards = [torch.chunk(c, n, dim=scatter_dim)[_World.rank].contiguous() for c in reduced]
    moved = _to_device(shards, tensors[0].device)
    if output is not None:
        return _copy_into(output, single, moved)
    return moved[0] if single else moved


def _sim_rendezvous(tag, payload=b"", replicas=[]):  # noqa: B006 (torch_xla's signature)
    import torch_xla

    n = _World.size
    if replicas and sorted(replicas) != list(range(n)):
        raise NotImplementedError(
            f"xm.rendezvous(replicas={replicas}): only a rendezvous of all replicas is "
            "supported (as on PJRT)")
    if not isinstance(payload, bytes):
        raise TypeError(f"`payload` must be bytes, not {type(payload)}")
    torch_xla.sync()  # as torch_xla's rendezvous does
    seq = _arrive("rendezvous", "")
    store = _World.store
    store.set(f"rdv/{seq}/{_World.rank}", payload)
    keys = [f"rdv/{seq}/{k}" for k in range(n)]
    store.wait(keys)
    out = _multi_get(store, keys)
    # rdv/seq/rank is freed when this rank reaches its next collective,
    # after everyone has read it (they all arrive there only after reading).
    _World.pending_delete = f"rdv/{seq}/{_World.rank}"
    return out


if __name__ == "__main__":
    sys.exit(main())
