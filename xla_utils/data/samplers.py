"""Which samples each rank reads, batch by batch: :class:`DistributedBatchSampler` (one
exact global shuffle per epoch, cut into the same number of full batches on every rank, so
no ragged batch and no recompile; ``drop_last=False`` pads the tail and marks the padding
invalid) and :class:`ShardWindowSampler` (the shard-aware shuffle of a remote cache larger
than its local budget). NumPy only."""
from __future__ import annotations

import math
from typing import Iterator

import numpy as np

__all__ = ["DistributedBatchSampler", "ShardWindowSampler"]


class DistributedBatchSampler:
    """Exact global shuffle cut into equal full batches per rank.

    Every epoch draws one permutation of all ``num_samples`` (seeded by
    ``(seed, epoch)``, identical on every rank and independent of the world size).
    Global batch ``k`` is positions ``[k * B * W, (k + 1) * B * W)`` of it and rank
    ``r`` takes the ``r``-th block of ``B``. ``drop_last=True`` drops the last
    ``num_samples % (B * W)`` samples of the permutation (different ones each
    epoch); ``drop_last=False`` pads the tail by repeating the permutation from its
    start and marks those slots invalid, so every sample appears exactly once
    among the valid slots of all ranks. ``len()`` is the batch count per rank.

    Args:
        num_samples: dataset length.
        batch_size: samples per batch on each rank (``B``).
        world_size: number of ranks (``W``). Default 1.
        rank: this rank, in ``[0, world_size)``. Default 0.
        shuffle: permute every epoch (else the identity order). Default True.
        seed: seed of the permutations, >= 0. Default 0.
        drop_last: drop the ragged tail (True, default) or pad it (False).

    Raises:
        ValueError: an argument is out of range, or ``drop_last`` leaves no full batch.
    """

    def __init__(self, num_samples: int, batch_size: int, world_size: int = 1, rank: int = 0,
                 shuffle: bool = True, seed: int = 0, drop_last: bool = True):
        if num_samples < 1 or batch_size < 1 or world_size < 1:
            raise ValueError(f"num_samples={num_samples}, batch_size={batch_size} and world_size={world_size} "
                             "must be >= 1")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank={rank} must be in [0, world_size={world_size})")
        if seed < 0:
            raise ValueError(f"seed={seed} must be >= 0")
        if drop_last and num_samples < batch_size * world_size:
            raise ValueError(f"batch_size {batch_size} x world_size {world_size} > {num_samples} samples: no full "
                             "batch; lower batch_size (or, using this sampler directly, pass drop_last=False)")
        self.num_samples, self.batch_size = int(num_samples), int(batch_size)
        self.world_size, self.rank = int(world_size), int(rank)
        self.shuffle, self.seed, self.drop_last = shuffle, int(seed), drop_last
        self.epoch = 0

    def __len__(self) -> int:
        g = self.batch_size * self.world_size
        return self.num_samples // g if self.drop_last else math.ceil(self.num_samples / g)

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch that ``iter(sampler)`` and :meth:`batches` (by default) use."""
        self.epoch = int(epoch)

    def order(self, epoch: int) -> np.ndarray:
        """The global sample order of ``epoch`` (same on every rank)."""
        if epoch < 0:
            raise ValueError(f"epoch={epoch} must be >= 0")
        if not self.shuffle:
            return np.arange(self.num_samples, dtype=np.int64)
        return np.random.default_rng([self.seed, int(epoch)]).permutation(self.num_samples).astype(np.int64)

    def batches(self, epoch: int | None = None, start: int = 0
                ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """This rank's batches of ``epoch``, from global batch ``start`` on.

        Args:
            epoch: default: the epoch set by :meth:`set_epoch`.
            start: batches to skip (a run resumed inside an epoch); default 0. The skipped
                ones are not drawn, only the permutation is.

        Yields:
            ``(indices int64[B], valid bool[B])`` per batch.
        """
        epoch = self.epoch if epoch is None else epoch
        n = len(self)
        g = self.batch_size * self.world_size
        order = np.resize(self.order(epoch), n * g)  # np.resize repeats from the start
        for k in range(start, n):
            a = k * g + self.rank * self.batch_size
            yield order[a:a + self.batch_size], self.valid_mask(k)

    def valid_mask(self, batch: int) -> np.ndarray:
        """``bool[B]``: which slots of this rank's batch ``batch`` are real samples."""
        a = batch * self.batch_size * self.world_size + self.rank * self.batch_size
        return np.arange(a, a + self.batch_size) < self.num_samples

    def __iter__(self) -> Iterator[np.ndarray]:
        for idx, _ in self.batches():
            yield idx


class ShardWindowSampler(DistributedBatchSampler):
    """The shard-aware shuffle of a remote cache larger than its local budget.

    Each epoch (seeded by ``(seed, epoch)``, identical on every rank) the shards are put
    in a random order and cut into windows of ``shards_per_window``; the samples of
    each window are permuted together and the windows follow one another. Cutting into
    batches and ranks, ``drop_last`` and padding are those of
    :class:`DistributedBatchSampler`. So every sample is seen once per epoch and only
    one window (plus the next one, downloading) needs to be on the local disk.

    Effect on randomness: a batch mixes samples of one window (or two at a boundary),
    not of the whole cache. Shards hold consecutive source images, and a folder source
    is ordered by class, so with few shards per window a batch sees few classes: give
    ``max_local_bytes`` room for many shards (or build from a CSV in random order).
    While the cache fits its budget this sampler is not used.

    Args:
        shard_ids: ``int64[N]``, the shard of each sample (``CachedImageDataset.shard_ids``).
        shards_per_window: shards shuffled together (>= 1).
        batch_size, world_size, rank, shuffle, seed, drop_last: as :class:`DistributedBatchSampler`.
    """

    def __init__(self, shard_ids: np.ndarray, shards_per_window: int, batch_size: int, world_size: int = 1,
                 rank: int = 0, shuffle: bool = True, seed: int = 0, drop_last: bool = True):
        super().__init__(len(shard_ids), batch_size, world_size, rank, shuffle, seed, drop_last)
        self.shard_ids = np.asarray(shard_ids, dtype=np.int64)
        self.shards_per_window = max(1, int(shards_per_window))

    def order(self, epoch: int) -> np.ndarray:
        """The global sample order of ``epoch``: windows of shards, shuffled within each."""
        if epoch < 0:
            raise ValueError(f"epoch={epoch} must be >= 0")
        if not self.shuffle:
            return np.arange(self.num_samples, dtype=np.int64)
        rng = np.random.default_rng([self.seed, int(epoch), 1])
        by_shard = np.argsort(self.shard_ids, kind="stable")
        shards, starts, counts = np.unique(self.shard_ids[by_shard], return_index=True, return_counts=True)
        members = {int(sh): by_shard[a:a + c] for sh, a, c in zip(shards, starts, counts)}
        perm = rng.permutation(shards)
        w = self.shards_per_window
        parts = [rng.permutation(np.concatenate([members[int(sh)] for sh in perm[k:k + w]]))
                 for k in range(0, len(perm), w)]
        return np.concatenate(parts).astype(np.int64)
