"""Runners of a build's shard tasks: one seam, :func:`run_shards`, and two engines behind it.

* ``"local"`` (default): a process pool on this machine (:func:`run_local`).
* ``"ray"``: tasks on a `Ray <https://docs.ray.io>`_ cluster (:func:`run_ray`): a laptop's
  local Ray, a cluster made with ``ray up`` on Google Cloud or KubeRay on GKE, or the hosts
  of a TPU VM. Ray is imported only here and only for this engine
  (``pip install 'xla_utils[ray]'``).

Every task is :func:`~xla_utils.cache.worker.build_shard`: shard ``k`` from source items
``[k * P, (k + 1) * P)``, published complete or not at all. A task that Ray retries on
another node (a lost worker) writes the same bytes under the same name, so a retry
neither duplicates nor loses an image. The coordinator (:mod:`xla_utils.cache.builder`)
records each finished shard's entry in the manifest; both runners call ``record`` and
``save`` on the driver as shards finish, and show one progress bar there.
"""
from __future__ import annotations

import contextlib
import multiprocessing as mp
import multiprocessing.context as mp_ctx
import os
import sys
import time
import warnings
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from typing import Any, Callable

from ..utils.progress import update_bar
from .config import CacheConfig
from .errors import BadImageError, BuildError, Cancelled, describe
from .sources import Source
from .storage import Store
from .worker import build_shard, init_worker, set_state

__all__ = ["ENGINES", "run_shards", "run_local", "run_ray", "mp_context"]

ENGINES = ("local", "ray")


def run_shards(engine: str, src: Source, cfg: CacheConfig, out: Store, todo: list[int], per_shard: int,
               total: int, workers: int, strict: bool, verbose: bool, record: Callable[[dict[str, Any]], None],
               save: Callable[[], None], ray_address: str | None = None) -> None:
    """Build shards ``todo`` with ``engine``; ``record(entry)`` and ``save()`` run on this process as
    each finishes. Raises :class:`BadImageError` (strict), :class:`BuildError` or ``KeyboardInterrupt``
    after the finished shards were recorded."""
    if engine == "ray":
        run_ray(src, cfg, out, todo, per_shard, total, strict, verbose, record, save, ray_address)
    else:
        run_local(src, cfg, out, todo, per_shard, total, workers, strict, verbose, record, save)


class _WorkerProcess(mp_ctx.ForkProcess):
    """A pool worker forked without Python 3.12+'s DeprecationWarning about forking a
    multi-threaded process (every process that imported numpy is: its BLAS pool). For these
    workers the warning's hazard is handled: the forking thread's OpenMP team is the one
    state a worker would wait on, and init_worker limits the worker to one OpenMP/MKL thread
    (tests/cache/test_cache.py builds a torch dataset that hung without it). Every other fork in
    the process still warns."""

    def start(self) -> None:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", r"This process .* is multi-threaded, use of fork\(\)",
                                    DeprecationWarning)
            super().start()


class _WorkerForkContext(mp_ctx.ForkContext):
    Process = _WorkerProcess


def mp_context() -> Any:
    """The multiprocessing context of the local pool: fork on Linux, else spawn."""
    # fork works from notebooks and with datasets defined in __main__
    if sys.platform == "linux" and "fork" in mp.get_all_start_methods():
        return _WorkerForkContext()
    return mp.get_context("spawn")


def run_local(src: Source, cfg: CacheConfig, out: Store, todo: list[int], per_shard: int, total: int,
              workers: int, strict: bool, verbose: bool, record: Callable[[dict[str, Any]], None],
              save: Callable[[], None]) -> None:
    """Build shards ``todo`` on ``workers`` processes, recording each one as it finishes.

    ``stop_at`` (shared) is the first source index that no longer needs building: a
    strict worker that meets a bad item lowers it to that item's index, so the others
    stop after the items before it (one of which may be an earlier bad file) and
    unstarted shards, later in source order, are cancelled. Once every task has
    ended, the bad item with the smallest index is raised: the same file whatever
    the worker count and timing. Any other stop sets ``stop_at`` to -1.
    """
    ctx = mp_context()
    counter, stop_at = ctx.Value("q", 0), ctx.Value("q", src.num_items)
    bar = update_bar(total, title=f"build_cache: {total} images on {workers} "
                     f"worker{'s' if workers > 1 else ''}") if verbose else None
    t_start = time.perf_counter()
    ex = ProcessPoolExecutor(workers, mp_context=ctx, initializer=init_worker,
                             initargs=(src, cfg, out, strict, counter, stop_at))
    shard_of = {ex.submit(build_shard, k, k * per_shard, min(src.num_items, (k + 1) * per_shard)): k
                for k in todo}
    pending = set(shard_of)
    recorded: set[Any] = set()
    bad: list[BadImageError] = []
    try:
        while pending:
            finished, pending = wait(pending, timeout=0.25, return_when=FIRST_COMPLETED)
            for f in sorted(finished, key=shard_of.__getitem__):
                if f.cancelled():
                    continue
                try:
                    record(f.result())
                    recorded.add(f)
                except Cancelled:
                    pass
                except BadImageError as e:
                    bad.append(e)
                    for p in pending:
                        p.cancel()
                except BrokenProcessPool as e:
                    raise BuildError("a worker process died (out of memory? each worker holds about one "
                                     "shard: try fewer workers or a smaller shard size); finished shards "
                                     "are kept, rerun to resume") from e
                except Exception as e:
                    raise BuildError(f"building shard {shard_of[f]} failed: {describe(e)}; finished shards "
                                     "are kept, rerun to resume") from e
            if finished:
                save()
            if bar is not None:
                n = counter.value
                rate = n / max(1e-9, time.perf_counter() - t_start)
                bar.comment = f"{rate:,.1f} images/s"
                bar.update(min(n, total))
    except BaseException:
        _end_line(bar)  # the error starts on its own line
        with stop_at.get_lock():
            stop_at.value = -1
        for f in pending:
            f.cancel()
        ex.shutdown(wait=True)
        for f in shard_of:  # keep every shard that did finish, also while we were stopping
            if f not in recorded and not f.cancelled() and f.exception() is None:
                record(f.result())
        with contextlib.suppress(OSError):  # a full disk may refuse this too: the last manifest stays
            save()
        raise
    ex.shutdown(wait=True)
    if bad:
        _end_line(bar)
        raise min(bad, key=lambda e: e.index)


def _end_line(bar: Any) -> None:
    """End a text bar's unfinished line (a notebook's widget needs nothing)."""
    if bar is not None and hasattr(bar, "close_line"):
        bar.close_line()


class _Flag:
    """A stand-in for the pool's shared ``multiprocessing.Value`` inside one Ray task."""

    def __init__(self, value: int):
        self.value = value

    def get_lock(self) -> contextlib.nullcontext:
        return contextlib.nullcontext()


def _ray_task(src: Source, cfg: CacheConfig, out: Store, strict: bool, k: int, start: int, stop: int) -> Any:
    """One shard on a Ray worker: the build's state set in this process, then build_shard."""
    set_state(src, cfg, out, strict, _Flag(0), _Flag(src.num_items))
    return build_shard(k, start, stop)


def _ray(address: str | None) -> tuple[Any, bool]:
    """The ray module, connected (``address``, else ``RAY_ADDRESS``, else a local Ray); and whether
    this call started the connection (so it should end it)."""
    try:
        import ray
    except ImportError:
        raise ImportError("engine='ray' (--engine ray) needs Ray: pip install 'xla_utils[ray]' "
                          "(or pip install ray)") from None
    if ray.is_initialized():
        return ray, False
    address = address or os.environ.get("RAY_ADDRESS") or None
    try:
        ray.init(address=address, ignore_reinit_error=True, log_to_driver=False, logging_level="ERROR",
                 include_dashboard=False)
    except (ConnectionError, RuntimeError) as e:
        raise BuildError(f"cannot reach the Ray cluster at {address} ({e}): start it (`ray start --head` or "
                         "`ray up cluster.yaml`) or pass its HOST:PORT as ray_address= (--ray-address)") from None
    return ray, True


def run_ray(src: Source, cfg: CacheConfig, out: Store, todo: list[int], per_shard: int, total: int, strict: bool,
            verbose: bool, record: Callable[[dict[str, Any]], None], save: Callable[[], None],
            address: str | None = None) -> None:
    """Build shards ``todo`` as Ray tasks (retried by Ray on a lost worker), recording each as it finishes.

    The output must be reachable by every node (a ``gs://`` prefix, or a shared folder)
    and so must the source. Progress advances by whole shards. A strict build cancels
    the other tasks at the first bad image and raises the one with the smallest index.
    """
    ray, started = _ray(address)
    try:
        task = ray.remote(max_retries=3, retry_exceptions=False, num_cpus=1)(_ray_task)
        src_ref = ray.put(src)
        refs = {task.remote(src_ref, cfg, out, strict, k, k * per_shard, min(src.num_items, (k + 1) * per_shard)): k
                for k in todo}
        _collect_ray(ray, refs, src, per_shard, total, verbose, record, save)
    finally:
        if started:
            ray.shutdown()


def _collect_ray(ray: Any, refs: dict[Any, int], src: Source, per_shard: int, total: int, verbose: bool,
                 record: Callable[[dict[str, Any]], None], save: Callable[[], None]) -> None:
    bar = update_bar(total, title=f"build_cache: {total} images on Ray") if verbose else None
    t_start, n = time.perf_counter(), 0
    pending, bad = list(refs), []
    try:
        while pending:
            finished, pending = ray.wait(pending, num_returns=len(pending), timeout=0.25)
            for ref in sorted(finished, key=refs.__getitem__):
                k = refs[ref]
                try:
                    record(ray.get(ref))
                except BadImageError as e:
                    bad.append(e)
                    for p in pending:
                        ray.cancel(p)
                except ray.exceptions.TaskCancelledError:
                    pass
                except Exception as e:
                    raise BuildError(f"building shard {k} on Ray failed: {describe(e)}; finished shards are kept, "
                                     "rerun to resume") from None
                n += min(src.num_items, (k + 1) * per_shard) - k * per_shard
            if finished:
                save()
            if bar is not None:
                bar.comment = f"{n / max(1e-9, time.perf_counter() - t_start):,.1f} images/s (Ray)"
                bar.update(min(n, total))
    except BaseException:
        _end_line(bar)
        for p in pending:
            with contextlib.suppress(Exception):
                ray.cancel(p)
        with contextlib.suppress(OSError):
            save()
        raise
    if bad:
        _end_line(bar)
        raise min(bad, key=lambda e: e.index)
