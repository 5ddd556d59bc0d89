"""The torch backend's multi-replica launch: one forked process per GPU (NCCL), or per
``XLA_UTILS_CPU_REPLICAS`` CPU device (gloo).

:func:`xla_utils.runtime.launcher.launch_job` forks one job process into
:func:`torch_job_main` (as it does for a TPU job) and collects its replicas' reports
from the ``results`` queue: ``put(("result" | "finished" | "error" | "done", rank,
payload))``, the protocol of :mod:`.replica`. The job process forks the replicas from a
fresh thread (no OpenMP team to inherit, :mod:`.forksafe`), waits for them and reports
a replica that died without a Python traceback under its rank; the caller kills the job's
whole session after the first error or at the timeout, so no replica is left waiting in a
collective.

Each replica sets its device, then joins the process group through a ``FileStore`` in
the caller's private (0700) folder: the rendezvous opens no socket, and gloo's and NCCL's
own sockets are bound to the loopback interface (:data:`LOOPBACK_ENV`), so the replicas
meet on this machine only. The notebook process must not have initialised CUDA before
the fork (:func:`check_cuda_fork`).
"""
from __future__ import annotations

import contextlib
import datetime
import os
import sys
import traceback
from typing import Any, Callable

from . import forksafe
from .replica import die_with_parent, dumps_cpu
from .state import STATE
from .xla import RuntimeAlreadyInitializedError

__all__ = ["LOOPBACK_ENV", "REPORTED_EXIT", "CUDAInitializedError", "check_cuda_fork",
           "forks", "torch_job_main", "torch_replica_main"]

# gloo's, NCCL's and tensorpipe's sockets bind the loopback interface, not the address the
# host name resolves to (set in each replica unless the user set them).
LOOPBACK_ENV = {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo", "TP_SOCKET_IFNAME": "lo"}
# The exit status of a replica that reported its exception itself (any other non-zero
# status means it died without a traceback, which the job reports for it).
REPORTED_EXIT = 3
# Seconds a collective may wait for the other replicas (torch's own default is 10-30
# minutes); a dead replica is noticed by the job long before.
COLLECTIVE_TIMEOUT_S = float(os.environ.get("XLA_UTILS_COLLECTIVE_TIMEOUT", "1800"))


class CUDAInitializedError(RuntimeAlreadyInitializedError):
    """This process initialised CUDA, so it can no longer fork replicas that use the GPUs."""


def check_cuda_fork(cuda_initialized: bool, count: int) -> None:
    """Refuse to fork ``count`` GPU replicas from a process that initialised CUDA.

    Args:
        cuda_initialized: ``torch.cuda.is_initialized()`` in the calling process.
        count: GPU replicas about to be forked.

    Raises:
        CUDAInitializedError: naming what happened and the fix.
    """
    if cuda_initialized:
        raise CUDAInitializedError(
            f"this process has already initialised CUDA (a tensor or model was moved to a GPU, "
            f"or torch.cuda was queried, outside fit/launch), so it cannot fork the {count} "
            "GPU replica process(es): a forked child cannot use its parent's CUDA context. Fix: "
            "restart the kernel and keep CUDA calls inside fit/predict/launch (xla_utils moves "
            "the model itself); or pass cores=1 to run on one GPU in this process.")


def forks(cores: int | str, count: int, kind: str, cuda_initialized: bool) -> bool:
    """Whether a torch-backend launch forks its replicas (else ``fn`` runs in this process).

    ``cores="all"`` on ``count > 1`` devices forks one process per device. A one-replica
    run (``cores=1``) on a machine with several GPUs forks one process too, so this
    process stays free of CUDA for a later multi-GPU run, unless CUDA is in use here
    already (then it runs here, as on a one-GPU machine).
    """
    if count <= 1:
        return False
    if cores != 1:
        return True
    return kind == "cuda" and not cuda_initialized


def torch_job_main(fn: Callable, args: tuple, n: int, kind: str, store_path: str,
                   results) -> None:
    """Body of the forked job process: fork ``n`` replicas, wait for them, report deaths."""
    os.setsid()  # so that the caller's kill reaches every replica
    die_with_parent()
    forksafe.run_in_fresh_thread(_run_replicas, fn, args, n, kind, store_path, results)


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
        results.put(("done", -1, None))
        results.close()
        results.join_thread()


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
                       results) -> None:
    """One replica: its device, the process group (``n > 1``), ``fn(*args)``, the report."""
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
        out = fn(*args)
        if r == 0:
            results.put(("result", 0, dumps_cpu(out)))
        results.put(("finished", r, n))
    except BaseException as exc:
        results.put(("error", r, (traceback.format_exc(), type(exc).__name__)))
        results.close()
        results.join_thread()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(REPORTED_EXIT)  # the others may be stuck in a collective: no teardown
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
            f"replica {r} could not start CUDA on GPU {r} ({str(exc).splitlines()[0]}). When "
            "the notebook process touched the CUDA driver before the launch (for example "
            "torch.cuda.is_available() without PYTORCH_NVML_BASED_CUDA_CHECK=1 set), a forked "
            "process cannot use CUDA. Fix: restart the kernel and keep CUDA calls inside "
            "fit/predict/launch; or pass cores=1.") from exc
    return torch.device("cuda", r)
