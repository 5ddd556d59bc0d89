"""Batches for one rank and one epoch: :func:`iterate_batches`.

For a :class:`~.dataset.CachedImageDataset`, uint8 NHWC batches assembled by background
threads into a ring of preallocated (optionally pinned) buffers, no collate; for any other
map-style dataset, a torch ``DataLoader`` over the same sampler's batches. All per-pass
state lives in the iterator, and :func:`iterate_batches` takes ``epoch`` explicitly.
"""
from __future__ import annotations

import os
import threading
from typing import Any, Iterator

import numpy as np
import torch

from .dataset import CachedImageDataset
from .samplers import DistributedBatchSampler, ShardWindowSampler

__all__ = ["iterate_batches", "BatchIterable", "default_loader_threads", "RING_VALID_FOR"]

# A batch of a cache's ring stays valid while this many further batches are requested.
RING_VALID_FOR = 2


class BatchIterable:
    """One pass over ``(x, y, valid)`` batches; see :func:`iterate_batches`.

    Iterating again starts a new pass over the same epoch; :meth:`set_epoch` changes it.
    A pass yields the epoch's batches from batch ``start`` on (``len()`` counts those).
    """

    def __init__(self, dataset: Any, sampler: DistributedBatchSampler, epoch: int, num_workers: int | None,
                 pin_memory: bool = False, start: int = 0):
        self.dataset, self.sampler, self.epoch = dataset, sampler, int(epoch)
        self.num_workers, self.pin_memory, self.start = num_workers, pin_memory, int(start)

    @property
    def valid_for(self) -> int | None:
        """Further batches a yielded batch stays valid for before its buffers are refilled:
        2 for a cache's ring, None (never reused: fresh tensors) for a ``DataLoader``'s."""
        return RING_VALID_FOR if isinstance(self.dataset, CachedImageDataset) else None

    def __len__(self) -> int:
        return max(0, len(self.sampler) - self.start)

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch of the next pass."""
        self.epoch = int(epoch)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        if isinstance(self.dataset, CachedImageDataset):
            workers = self.num_workers if self.num_workers is not None else default_loader_threads()
            return _ring_batches(self.dataset, self.sampler, self.epoch, workers, self.pin_memory,
                                 self.start)
        return self._loader_batches()

    def _loader_batches(self) -> Iterator[tuple[Any, Any, torch.Tensor]]:
        from torch.utils.data import DataLoader

        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(self.epoch)
        batches = [idx for idx, _ in self.sampler.batches(self.epoch, self.start)]
        loader = DataLoader(self.dataset, batch_sampler=batches, num_workers=self.num_workers or 0,
                            pin_memory=self.pin_memory)
        for k, batch in enumerate(loader, self.start):
            if not isinstance(batch, (list, tuple)) or len(batch) != 2:
                raise TypeError("iterate_batches needs a dataset of (input, target) pairs; its collated "
                                f"batch is a {type(batch).__name__}")
            yield batch[0], batch[1], torch.from_numpy(self.sampler.valid_mask(k))


class _Ring:
    """``R`` preallocated batch slots (tensors, pinned when asked, and numpy views of them).

    Consecutive passes of one rank reuse the ring (allocating and first-touching
    ~200 MB per epoch costs more than loading it), continuing the slot sequence
    at ``base`` so that the previous pass's last batches keep their guarantee.
    """

    def __init__(self, ds: CachedImageDataset, batch_size: int, size: int, pin: bool = False):
        self.size, self.base, self.in_use = size, 0, False
        y = (size, batch_size, ds.num_classes) if ds.multilabel else (size, batch_size)
        t = [torch.empty(shape, dtype=dtype, pin_memory=pin) for shape, dtype in (
            ((size, batch_size, *ds.image_size, 3), torch.uint8),
            (y, torch.float32 if ds.multilabel else torch.int64), ((size, batch_size), torch.bool))]
        self.xs, self.ys, self.vs = (a.numpy() for a in t)
        self.slots = [tuple(a[r] for a in t) for r in range(size)]


class _Prefetch:
    """Downloads ahead for one pass over a remote cache: called with each requested batch ``m``,
    it starts the downloads of the shards this rank needs next, in order of first use, as far
    as the local budget allows without evicting a shard needed by batches ``m .. m + R``."""

    def __init__(self, ds: CachedImageDataset, batches: list[tuple[np.ndarray, np.ndarray]], R: int):
        self.cache, self.R = ds._remote, R
        first: dict[int, int] = {}
        last: dict[int, int] = {}
        for k, (idx, _) in enumerate(batches):
            for sh in np.unique(ds._shard_of[idx]).tolist():
                first.setdefault(sh, k)
                last[sh] = k
        self.uses = sorted((f, last[sh], sh) for sh, f in first.items())

    def __call__(self, m: int) -> None:
        live = [(f, last, sh) for f, last, sh in self.uses if last >= m]
        protect = {sh for f, _, sh in live if f <= m + self.R}
        self.cache.prefetch([sh for _, _, sh in live], protect)


def _take_ring(ds: CachedImageDataset, sampler: DistributedBatchSampler, size: int, pin: bool) -> _Ring:
    key = (sampler.rank, sampler.world_size, sampler.batch_size, size, pin)
    with ds._rings_lock:
        ring = ds._rings.get(key)
        if ring is None or ring.in_use:  # a concurrent pass of the same rank gets its own buffers
            ring = _Ring(ds, sampler.batch_size, size, pin)
            ds._rings.setdefault(key, ring)
        ring.in_use = True
        return ring


def _ring_batches(ds: CachedImageDataset, sampler: DistributedBatchSampler, epoch: int,
                  workers: int, pin: bool = False, start: int = 0
                  ) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Fill batches into a ring of ``R = workers + 3`` preallocated slots (pinned: ``pin``).

    Batch ``j`` (counted across the passes that share the ring) lives in slot
    ``j % R`` and is only overwritten by batch ``j + R``, which a thread may start
    once the consumer has asked for batch ``j + 3``: a yielded batch survives
    :data:`RING_VALID_FOR` (two) further requests.
    """
    batches = list(sampler.batches(epoch, start))
    nb, R = len(batches), workers + RING_VALID_FOR + 1
    ring = _take_ring(ds, sampler, R, pin)
    base = ring.base
    prefetch = _Prefetch(ds, batches, R) if ds._remote is not None else None

    def fill(k: int) -> None:
        idx, valid = batches[k]
        r = (base + k) % R
        ds.load_batch(idx, epoch, ring.xs[r])
        np.take(ds.labels, idx, axis=0, out=ring.ys[r])
        ring.vs[r] = valid

    cond = threading.Condition()
    st = {"next": 0, "requested": 0, "stop": False, "error": None}
    ready: set[int] = set()

    def worker() -> None:
        while True:
            with cond:
                k = st["next"]
                if st["stop"] or k >= nb:
                    return
                st["next"] = k + 1
                cond.wait_for(lambda: st["stop"] or st["requested"] >= k - R + RING_VALID_FOR + 2)
                if st["stop"]:
                    return
            try:
                fill(k)
            except BaseException as e:  # handed to the consumer
                with cond:
                    st["error"] = e
                    cond.notify_all()
                return
            with cond:
                ready.add(k)
                cond.notify_all()

    threads = [threading.Thread(target=worker, daemon=True, name=f"xla_utils-batches-{n}")
               for n in range(min(workers, nb))]
    for t in threads:
        t.start()
    try:
        for m in range(nb):
            if prefetch is not None:
                prefetch(m)
            with cond:
                st["requested"] = m + 1
                cond.notify_all()
                if threads:
                    cond.wait_for(lambda: m in ready or st["error"] is not None)
                    if st["error"] is not None:
                        raise st["error"]
                    ready.discard(m)
            if not threads:
                fill(m)
            yield ring.slots[(base + m) % R]
    finally:
        with cond:
            st["stop"] = True
            cond.notify_all()
        for t in threads:  # a thread may still be writing a slot; the next pass must not start before
            t.join()
        with ds._rings_lock:
            ring.base = base + max(st["next"], st["requested"])
            ring.in_use = False


def iterate_batches(dataset: Any, batch_size: int, *, world_size: int = 1, rank: int = 0, shuffle: bool = True,
                    seed: int = 0, epoch: int = 0, drop_last: bool = True,
                    num_workers: int | None = None, pin_memory: bool = False,
                    start: int = 0) -> BatchIterable:
    """Batches ``(x, y, valid)`` of host tensors for one rank and one epoch.

    The sampler is :class:`DistributedBatchSampler` (equal full batches on every
    rank; ``valid`` is ``bool[B]``, all True when ``drop_last=True``), or
    :class:`ShardWindowSampler` for a remote cache larger than its ``max_local_bytes``.

    * :class:`CachedImageDataset`: ``x`` is ``uint8[B, H, W, 3]``, ``y`` is
      ``int64[B]`` or ``float32[B, C]``, filled by ``num_workers`` background
      threads (default ``min(4, cores)``; 0 = in the caller) into a ring of
      preallocated buffers. A yielded batch stays valid until two further
      batches have been requested (``.valid_for``): copy it (or move it to the
      device, and wait for an asynchronous copy to finish) first.
    * any other map-style dataset of ``(input, target)``: a torch ``DataLoader``
      with the same batches, default collate and ``num_workers`` processes
      (default 0).

    Args:
        dataset: a :class:`CachedImageDataset` or any map-style dataset.
        batch_size: samples per batch on this rank.
        world_size, rank, shuffle, seed, drop_last: as :class:`DistributedBatchSampler`.
        epoch: the epoch (variant and permutation). Default 0.
        num_workers: loader threads (cache) or processes (other datasets); see above.
        pin_memory: batches in pinned (page-locked) host memory, for asynchronous copies
            to a GPU (needs CUDA). Default False.
        start: the epoch's first batch to yield (a run resumed inside an epoch: the batches
            before it are neither read nor decoded; the order and the variants are those of
            the whole epoch). Default 0.

    Returns:
        A :class:`BatchIterable`: each iteration is one pass; ``len()`` is its batch count.
    """
    if isinstance(dataset, CachedImageDataset) and dataset.shard_aware:
        sampler = ShardWindowSampler(dataset.shard_ids, dataset.shards_per_window, batch_size, world_size, rank,
                                     shuffle, seed, drop_last)
    else:
        sampler = DistributedBatchSampler(len(dataset), batch_size, world_size, rank, shuffle, seed, drop_last)
    return BatchIterable(dataset, sampler, epoch, num_workers, pin_memory, start)


def default_loader_threads() -> int:
    """Loader threads of a cache when ``num_workers`` is None: ``min(4, cores)``."""
    return min(4, os.cpu_count() or 1)
