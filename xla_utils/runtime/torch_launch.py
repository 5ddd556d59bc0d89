"""The torch backend's multi-replica launch: one process per GPU (NCCL), or per
``XLA_UTILS_CPU_REPLICAS`` CPU device (gloo).

:func:`xla_utils.runtime.launcher.launch_job` forks one job process into
:func:`torch_job_main` (as it does for a TPU job) and collects its replicas' reports
from the ``results`` queue: ``put(("result" | "finished" | "error" | "done", rank,
payload))``, the protocol of :mod:`.replica`. The job process starts the replicas from a
fresh thread (no OpenMP team to inherit, :mod:`.forksafe`), waits for them and reports
a replica that died without a Python traceback under its rank; the caller kills the job's
whole session after the first error or at the timeout, so no replica is left waiting in a
collective.

How the replicas start depends on what this process did with CUDA (:func:`cuda_in_use`):
a process that never touched the CUDA driver forks them (nothing is pickled); one that
initialised CUDA, or queried the driver so that torch poisoned every later fork
(``torch.cuda.is_available()`` without ``PYTORCH_NVML_BASED_CUDA_CHECK=1``, or with it on
a machine where NVML answers nothing), starts them as fresh interpreters instead
(:func:`fresh_replica_main`): ``fn`` and ``args`` travel by value with cloudpickle, checked
here before anything starts (:func:`sendable_call`), and reports come back over a pipe.
CPU replicas take the same decision as GPU ones, so that CI exercises the GPU path.

Each replica sets its device, then joins the process group through a ``FileStore`` in
the caller's private (0700) folder: the rendezvous opens no socket, and gloo's and NCCL's
own sockets are bound to the loopback interface (:data:`LOOPBACK_ENV`), so the replicas
meet on this machine only.
"""
from __future__ import annotations

import contextlib
import datetime
import inspect
import os
import pickle
import subprocess
import sys
import threading
import time
import traceback
import types
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from . import forksafe
from .fresh import child_env, read_call
from .relay import OutputTail, forward_output
from .replica import die_with_parent, dumps_cpu
from .state import STATE

if TYPE_CHECKING:
    from .placement import Placement

__all__ = ["LOOPBACK_ENV", "REPORTED_EXIT", "FreshStart", "NotSendableError", "cuda_in_use",
           "forks", "sendable_call", "torch_job_main", "torch_replica_main",
           "fresh_replica_main"]

# gloo's, NCCL's and tensorpipe's sockets bind the loopback interface, not the address the
# host name resolves to (set in each replica unless the user set them).
LOOPBACK_ENV = {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo", "TP_SOCKET_IFNAME": "lo"}
# The exit status of a replica that reported its exception itself (any other non-zero
# status means it died without a traceback, which the job reports for it).
REPORTED_EXIT = 3
# Seconds a collective may wait for the other replicas (torch's own default is 10-30
# minutes); a dead replica is noticed by the job long before.
COLLECTIVE_TIMEOUT_S = float(os.environ.get("XLA_UTILS_COLLECTIVE_TIMEOUT", "1800"))


class NotSendableError(TypeError):
    """Something a launch must send to fresh replica interpreters cannot be pickled."""


@dataclass(frozen=True)
class FreshStart:
    """Replicas started as fresh interpreters.

    Attributes:
        folder: The private folder holding the pickled call (:func:`.fresh.write_call`).
        why: Why they cannot be forked, in words (:func:`cuda_in_use`).
        started: ``time.time()`` when the launch began (the start-up cost is reported).
    """

    folder: str
    why: str
    started: float


def cuda_in_use() -> str | None:
    """Why replicas forked from this process could not use CUDA, or None when they can.

    ``torch.cuda.is_initialized()`` only reflects torch's lazy initialisation: a query of
    the driver (``torch.cuda.is_available()`` or ``device_count()`` without NVML) leaves it
    False yet registers torch's fork handler, and every process forked afterwards fails at
    its first CUDA call. A probe child reads ``torch.cuda._is_in_bad_fork()`` for that.
    """
    import torch

    if torch.cuda.is_initialized():
        return "this notebook initialised CUDA"
    if _fork_poisoned():
        return ("this notebook queried the CUDA driver (torch.cuda.is_available() or "
                "device_count()), which makes forked processes unable to use CUDA")
    return None


def _fork_poisoned() -> bool:
    """Whether a child forked now finds itself in torch's "bad fork" state (a CPU build of
    torch has no fork handler: False)."""
    import torch

    in_bad_fork = getattr(torch._C, "_cuda_isInBadFork", None)
    if in_bad_fork is None:
        return False
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the probe: reads one flag, runs nothing else
        os._exit(1 if in_bad_fork() else 0)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) != 0  # a probe that died: do not fork either


def forks(placement: Placement, cuda_used: bool) -> bool:
    """Whether a torch-backend launch on ``placement`` starts replica processes (else ``fn``
    runs here).

    Every device of a host with more than one (``cores="all"``) gets a process of its own
    (forked, or fresh interpreters when ``cuda_used``). A one-replica run (``cores=1``) on a
    machine with several GPUs forks one process too, so this process stays free of CUDA for
    a later multi-GPU run, unless CUDA is in use here already (then it runs here, as on a
    one-GPU machine).
    """
    if placement.host_devices <= 1:
        return False
    if not placement.one_core:
        return True
    return placement.kind == "cuda" and not cuda_used


def sendable_call(fn: Callable, args: tuple, why: str) -> bytes:
    """``(fn, args)`` cloudpickled for fresh replica interpreters.

    Raises:
        NotSendableError: naming the first object that cannot be pickled (by its path from
            ``fn``'s parameters, e.g. ``plan.loss``), why, and the fix.
    """
    import cloudpickle

    try:
        return cloudpickle.dumps((fn, tuple(args)), protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:  # noqa: BLE001 (named below)
        where, obj, err = _unpicklable(fn, "the function") or (None, None, exc)
        try:
            names = list(inspect.signature(fn).parameters)
        except (TypeError, ValueError):
            names = []
        for i, a in enumerate(args):
            name = names[i] if i < len(names) and not names[i].startswith("*") else f"args[{i}]"
            where, obj, err = _unpicklable(a, name) or (where, obj, err)
            if where is not None and where != "the function":
                break
    what = f"{where} (a {type(obj).__module__}.{type(obj).__qualname__})" if where else "the call"
    raise NotSendableError(
        f"{what} cannot be sent to the replicas: they start in fresh interpreters because "
        f"{why}, and receive what they run by value (cloudpickle), but it cannot be pickled "
        f"({type(err).__name__}: {err}). Fix: build it inside the model factory or the "
        "dataset instead of holding it (an open file, lock, socket, generator or CUDA "
        "stream), or restart the kernel and call fit()/launch() before any CUDA call so "
        "that the replicas are forked and nothing is pickled.") from err


def _unpicklable(obj: Any, path: str, depth: int = 0) -> tuple[str, Any, Exception] | None:
    """``(path, object, error)`` of the innermost part of ``obj`` that cannot be pickled,
    or None when ``obj`` pickles."""
    import cloudpickle

    try:
        cloudpickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        return None
    except Exception as exc:  # noqa: BLE001 (reported)
        found: tuple[str, Any, Exception] = (path, obj, exc)
    if depth >= 6:
        return found
    if isinstance(obj, (list, tuple)):
        parts = [(f"{path}[{i}]", v) for i, v in enumerate(obj)]
    elif isinstance(obj, dict):
        parts = [(f"{path}[{k!r}]", v) for k, v in obj.items()]
    elif hasattr(obj, "named_children"):  # a module: its submodules and plain attributes
        parts = [(f"{path}.{k}", v) for k, v in obj.named_children()] + [
            (f"{path}.{k}", v) for k, v in vars(obj).items() if not k.startswith("_")]
    elif hasattr(obj, "__dict__") and not isinstance(obj, (type, types.FunctionType,
                                                           types.MethodType)):
        parts = [(f"{path}.{k}", v) for k, v in vars(obj).items()]
    else:
        parts = []
    for p, v in parts:
        inner = _unpicklable(v, p, depth + 1)
        if inner is not None:
            return inner
    return found


def torch_job_main(fn: Callable, args: tuple, n: int, kind: str, store_path: str,
                   fresh: FreshStart | None, results) -> None:
    """Body of the forked job process: start ``n`` replicas (forked, or fresh interpreters
    with ``fresh``), wait for them, report deaths."""
    os.setsid()  # so that the caller's kill reaches every replica
    die_with_parent()
    if fresh is None:
        forksafe.run_in_fresh_thread(_run_replicas, fn, args, n, kind, store_path, results)
    else:
        forksafe.run_in_fresh_thread(_run_fresh_replicas, fresh, n, kind, store_path, results)


def _run_replicas(fn, args, n, kind, store_path, results) -> None:
    import multiprocessing as mp
    from multiprocessing.connection import wait

    ctx = mp.get_context("fork")
    procs = {}
    try:
        for r in range(n):
            p = ctx.Process(target=torch_replica_main,
                            args=(fn, args, r, n, kind, store_path, results),
                            name=f"xla_utils-replica-{r}", daemon=False)
            p.start()
            procs[p.sentinel] = (r, p)
        while procs:
            for sentinel in wait(list(procs)):
                r, p = procs.pop(sentinel)
                p.join()
                if p.exitcode not in (0, REPORTED_EXIT):
                    results.put(("error", r, (_death(p.exitcode), "ProcessDied")))
    except BaseException:
        results.put(("error", -1, (traceback.format_exc(), "LaunchError")))
    finally:
        _done(results)


def _done(results) -> None:
    results.put(("done", -1, None))
    results.close()
    results.join_thread()


def _run_fresh_replicas(fresh: FreshStart, n: int, kind: str, store_path: str, results) -> None:
    """Start ``n`` fresh replica interpreters, relay their reports (one pipe each) and
    output, and report a replica that died without a traceback (with its last lines)."""
    from multiprocessing.connection import wait

    live: dict[Any, tuple[int, subprocess.Popen, OutputTail, list]] = {}
    try:
        for r in range(n):
            conn, proc, tail, relays = _start_fresh(fresh, r, n, kind, store_path)
            live[conn] = (r, proc, tail, relays)
        while live:
            for conn in wait(list(live)):
                r, proc, tail, relays = live[conn]
                try:
                    results.put(conn.recv())
                    continue
                except (EOFError, OSError):
                    del live[conn]
                    conn.close()
                rc = proc.wait()
                for t in relays:
                    t.join(timeout=5)
                if rc not in (0, REPORTED_EXIT):
                    results.put(("error", r, (f"{_death(rc)}; the end of its output:\n"
                                              f"{tail.lines()}", "ProcessDied")))
    except BaseException:
        results.put(("error", -1, (traceback.format_exc(), "LaunchError")))
    finally:
        _done(results)


def _start_fresh(fresh: FreshStart, r: int, n: int, kind: str, store_path: str):
    """Replica ``r`` as a fresh interpreter in this job's session: its report pipe, its
    process, the tail of its output and the threads relaying that output here."""
    from multiprocessing.connection import Connection

    read_fd, write_fd = os.pipe()
    cmd = [sys.executable, "-c",
           "import sys; from xla_utils.runtime.torch_launch import fresh_replica_main; "
           "fresh_replica_main(*sys.argv[1:])",
           fresh.folder, str(r), str(n), kind, store_path, str(write_fd), repr(fresh.started),
           fresh.why]
    try:
        proc = subprocess.Popen(cmd, env=child_env(), cwd=os.getcwd(), stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                pass_fds=(write_fd,))
    finally:
        os.close(write_fd)
    lock, tail = threading.Lock(), OutputTail()
    relays = [threading.Thread(target=forward_output, args=(stream, name, lock),
                               kwargs={"tail": tail}, daemon=True,
                               name=f"xla_utils-replica-{r}-{name}")
              for stream, name in ((proc.stdout, "stdout"), (proc.stderr, "stderr"))]
    for t in relays:
        t.start()
    return Connection(read_fd, writable=False), proc, tail, relays


class _PipeReports:
    """A fresh replica's end of its report pipe, with the ``results`` queue's methods."""

    def __init__(self, fd: int) -> None:
        from multiprocessing.connection import Connection

        self._conn = Connection(fd, readable=False)

    def put(self, message: tuple) -> None:
        self._conn.send(message)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._conn.close()

    def join_thread(self) -> None:
        """Nothing to wait for: :meth:`put` writes before it returns."""


def fresh_replica_main(folder: str, r: str, n: str, kind: str, store_path: str, fd: str,
                       started: str, why: str) -> None:
    """A replica in a fresh interpreter (started by the job, :func:`_start_fresh`): the
    call from ``folder``, then :func:`torch_replica_main` reporting over pipe ``fd``; rank 0
    says first why and at what cost the replicas started this way."""
    results, rank = _PipeReports(int(fd)), int(r)
    try:
        fn, args = read_call(Path(folder))
    except BaseException as exc:
        _report_and_exit(results, rank, exc)
    note = f"replicas started in fresh interpreters: {why}; +{{:.1f}} s"
    torch_replica_main(fn, args, rank, int(n), kind, store_path, results,
                       note=(note, float(started)))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _report_and_exit(results, r: int, exc: BaseException) -> None:
    results.put(("error", r, (traceback.format_exc(), type(exc).__name__)))
    results.close()
    results.join_thread()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(REPORTED_EXIT)  # the others may be stuck in a collective: no teardown


def _death(exitcode: int) -> str:
    import signal

    if exitcode < 0:
        why = f"killed by signal {signal.Signals(-exitcode).name}"
        if -exitcode == signal.SIGKILL:
            why += " (SIGKILL usually means the host ran out of memory)"
    else:
        why = f"exit code {exitcode}"
    return f"the replica process died ({why}) without a Python traceback"


def torch_replica_main(fn: Callable, args: tuple, r: int, n: int, kind: str, store_path: str,
                       results, note: tuple[str, float] | None = None) -> None:
    """One replica: its device, the process group (``n > 1``), ``fn(*args)``, the report.

    ``note``: ``(line, launch time)``: rank 0 prints ``line`` formatted with the seconds
    since the launch began, once the group has met (how fresh replicas say what they cost).
    """
    die_with_parent()
    for var, value in LOOPBACK_ENV.items():
        os.environ.setdefault(var, value)
    os.environ.update(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(n))
    STATE.local.backend, STATE.local.in_replica = "torch", True
    import torch

    try:
        STATE.torch_device = _enter_device(kind, r)
        if n > 1:
            import torch.distributed as dist

            # gloo prints "[Gloo] Rank r is connected to ..." on file descriptor 1 as it meets
            with _quiet_stdout_fd() if kind != "cuda" else contextlib.nullcontext():
                dist.init_process_group(
                    "nccl" if kind == "cuda" else "gloo", store=dist.FileStore(store_path, n),
                    rank=r, world_size=n,
                    timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
        if note is not None and r == 0:
            print(note[0].format(time.time() - note[1]), flush=True)
        out = fn(*args)
        if r == 0:
            results.put(("result", 0, dumps_cpu(out)))
        results.put(("finished", r, n))
    except BaseException as exc:
        _report_and_exit(results, r, exc)
    results.close()
    results.join_thread()
    with contextlib.suppress(Exception):
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


@contextlib.contextmanager
def _quiet_stdout_fd():
    """File descriptor 1 goes to /dev/null inside the block (C++ output included)."""
    sys.stdout.flush()
    saved = os.dup(1)
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, 1)
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)
        os.close(null)


def _enter_device(kind: str, r: int) -> Any:
    """Replica ``r``'s device: ``cuda:r`` (made current) or the CPU."""
    import torch

    if kind != "cuda":
        return torch.device("cpu")
    try:
        torch.cuda.set_device(r)
    except RuntimeError as exc:
        raise RuntimeError(
            f"replica {r} could not start CUDA on GPU {r} ({str(exc).splitlines()[0]}). Fix: "
            "check that every GPU is visible (CUDA_VISIBLE_DEVICES, nvidia-smi) and free, or "
            "pass cores=1 to train on one GPU in this process.") from exc
    return torch.device("cuda", r)
