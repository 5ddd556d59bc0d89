"""OpenMP fork safety: which forks can inherit a live OpenMP team, and what a forked child does.

GNU OpenMP (libgomp, which torch's Linux wheels use) is not fork-safe. A thread
that ran a parallel region keeps a *team* of worker threads; after a fork only
the forking thread exists in the child, and that thread's next parallel region
waits for the missing workers forever (seen as a hang in ``copy.deepcopy(model)``,
or in a CPU matmul through MKL). Threads that never ran a parallel region, and
threads started after the fork, have no team and are unaffected.

A launch forks in two places:

- Simulated jobs are forked from the zygote, a clean interpreter that never runs
  a torch op. It calls :func:`mark_clean` once its imports are done (numpy's BLAS
  pool is started by then) and :func:`check_before_fork` before every fork, which
  records, in memory the child inherits, every thread started since: a team's
  workers would be such threads. The child calls :func:`guard_inherited`: with no
  such thread it keeps full intra-op parallelism; otherwise it limits its forking
  thread to one OpenMP/MKL thread (correct but slower) and says so on stderr.
- A TPU job is forked from the caller's process, whose thread may own a team (any
  parallel torch op in the notebook, e.g. a large model's initialisation).
  :func:`run_in_fresh_thread` runs the job's work in a new thread, which has no
  team: full parallelism, and nothing to wait for.

``XLA_UTILS_TEST_ZYGOTE_OPENMP=1`` in the environment of a process whose zygote
starts makes the zygote run a parallel torch op before every fork (tests only:
it proves that :func:`check_before_fork` sees a team).
"""
from __future__ import annotations

import contextlib
import os
import sys
import threading
from typing import Any, Callable

__all__ = ["mark_clean", "check_before_fork", "guard_inherited", "inherited_report",
           "limit_openmp_to_one_thread", "run_in_fresh_thread", "thread_ids"]

TEST_HOOK_ENV = "XLA_UTILS_TEST_ZYGOTE_OPENMP"

_baseline: frozenset[int] | None = None  # the zygote's threads once its imports were done
# What the forking process saw right before the fork (inherited by the child).
_at_fork: dict[str, Any] = {"checked": False, "new_threads": ()}
_report: dict[str, Any] = {"checked": False, "new_threads": 0, "limited": False}


def thread_ids() -> set[int]:
    """The kernel thread ids of this process (empty where ``/proc`` is missing)."""
    with contextlib.suppress(OSError):
        return {int(t) for t in os.listdir("/proc/self/task")}
    return set()


def mark_clean() -> None:
    """Record this process's threads as those of a clean interpreter (the zygote,
    after its imports and before it ever runs a torch op)."""
    global _baseline
    _baseline = frozenset(thread_ids())


def check_before_fork() -> None:
    """Run in the zygote right before each fork: record the threads started since
    :func:`mark_clean` (an OpenMP team's workers would be among them) so that the
    child's :func:`guard_inherited` knows whether its thread has a team."""
    if os.environ.get(TEST_HOOK_ENV):
        _run_parallel_op()
    new = () if _baseline is None else tuple(sorted(thread_ids() - _baseline))
    _at_fork.update(checked=_baseline is not None, new_threads=new)


def _run_parallel_op() -> None:
    import torch

    torch.mm(torch.randn(512, 512), torch.randn(512, 512))  # MKL's team
    (torch.randn(1 << 20) * 2).sum()  # ATen's parallel_for


def guard_inherited() -> bool:
    """In a child forked after :func:`check_before_fork`: limit this thread to one
    OpenMP/MKL thread only when the parent had threads a clean interpreter does
    not have (possibly an OpenMP team); otherwise change nothing.

    Returns:
        Whether the limit was applied.
    """
    new = _at_fork["new_threads"]
    _report.update(checked=_at_fork["checked"], new_threads=len(new), limited=bool(new))
    if not new:
        return False
    limit_openmp_to_one_thread()
    print(f"xla_utils: the simulation's zygote had {len(new)} thread(s) more than a clean "
          "interpreter when it forked this job (an OpenMP team?); this job's main thread runs "
          "with one OpenMP/MKL thread so that it cannot hang. Please report this as a bug.",
          file=sys.stderr, flush=True)
    return True


def inherited_report() -> dict[str, Any]:
    """What :func:`guard_inherited` found in this process: ``checked`` (the parent
    checked before forking), ``new_threads`` (threads it had beyond a clean
    interpreter) and ``limited`` (whether the one-thread limit was applied)."""
    return dict(_report)


def limit_openmp_to_one_thread() -> None:
    """Keep the calling thread out of OpenMP parallel regions (and MKL's).

    ``torch.set_num_threads`` cannot be used after a fork (it asserts on torch's
    pthreadpool), so this sets the OpenMP runtime's own per-thread limit; ATen
    then runs parallel loops inline. MKL (linked into libtorch_cpu) asks OpenMP
    for its own thread count and ignores that limit, so its per-thread limit is
    set to 1 too. Threads started later keep their parallelism.
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


def run_in_fresh_thread(fn: Callable[..., Any], *args: Any, name: str = "xla_utils-job") -> Any:
    """``fn(*args)`` in a new thread, which owns no OpenMP team (see the module
    docstring); its result is returned and its exception re-raised here."""
    out: dict[str, Any] = {}

    def body() -> None:
        try:
            out["value"] = fn(*args)
        except BaseException as exc:  # re-raised in the calling thread
            out["error"] = exc

    t = threading.Thread(target=body, name=name)
    t.start()
    t.join()
    if "error" in out:
        raise out["error"]
    return out.get("value")
