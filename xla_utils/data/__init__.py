"""Reading an image cache built by :mod:`xla_utils.cache`.

* :class:`CachedImageDataset` - map-style ``(uint8 HxWx3 image, label)`` over the
  memory-mapped shards (8 processes share one copy in the page cache); epoch
  ``e`` shows variant ``e % num_variants`` of every image.
* :class:`DistributedBatchSampler` - one exact global shuffle per epoch, cut into
  the same number of full batches on every rank (no ragged batch, so no
  recompiles); ``drop_last=False`` pads the tail and marks the padding invalid.
* :func:`iterate_batches` - uint8 NHWC batches assembled by background threads
  into a ring of preallocated (optionally pinned) buffers: no collate.
* :func:`images_to_float`, :func:`image_layout` - the device transforms, defined in
  :mod:`xla_utils.data.transforms` and importable from here too.

Everything here is safe to share between threads: the dataset is read-only
after construction and all per-pass state lives in the iterator. (The one
exception is :meth:`CachedImageDataset.set_epoch`, which only affects
``ds[i]``; :func:`iterate_batches` takes ``epoch`` explicitly.) torch_xla is
never imported here.
"""
from __future__ import annotations

import io
import math
import os
import shutil
import threading
import warnings
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np
import torch
from PIL import Image

from ..cache.fetch import ShardCache, default_local_cache
from ..cache.format import (LABELS, cached_ids, read_jpeg_index, read_manifest, requested_ids,
                           skipped_records)
from ..cache.storage import Store, is_url, load_manifest
# The device transforms live in .transforms; their names stay importable from here.
from .transforms import IMAGE_CHANNELS, IMAGENET_MEAN, IMAGENET_STD, image_layout, images_to_float

__all__ = [
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "CachedImageDataset",
    "DistributedBatchSampler",
    "ShardWindowSampler",
    "BatchIterable",
    "iterate_batches",
    "default_loader_threads",
    "RING_VALID_FOR",
    "images_to_float",
    "image_layout",
    "IMAGE_CHANNELS",
]

# A batch of a cache's ring stays valid while this many further batches are requested.
RING_VALID_FOR = 2


class CachedImageDataset:
    """Map-style dataset over a complete cache directory.

    ``ds[i]`` is ``(image, label)``: ``image`` a ``uint8[H, W, 3]`` array (a copy),
    ``label`` an ``int`` class index (-1 = unlabelled) or, for multi-label caches, a
    ``float32[num_classes]`` multi-hot array. Indices follow the source order with
    skipped images left out (``source_indices`` maps back to the source).

    Attributes:
        classes: class names (``list[str]``); ``num_classes`` is their count.
        multilabel: labels are multi-hot vectors.
        unlabeled: a test set: every label is -1.
        image_size: ``(H, W)`` in pixels.
        num_variants: stored variants per image; ``codec``: ``"raw"`` or ``"jpeg"``.
        labels: ``int64[N]`` or ``float32[N, C]``.
        ids: each image's id (see the property); ``skipped`` and ``requested_ids``: the
            images the build skipped and every id it was asked for.
        source_indices: ``int64[N]``, each image's index in the build's source.
        manifest: the cache's manifest dict; ``path``: its folder.
        epoch: the epoch whose variant ``ds[i]`` shows (see :meth:`set_epoch`).
    """

    def __init__(self, path: str | os.PathLike, epoch: int = 0, *, local_cache: str | os.PathLike | None = None,
                 max_local_bytes: int | str | None = None):
        """Open the cache in folder ``path`` (memory maps; nothing is read into RAM).

        A URL (``gs://bucket/cache``; ``pip install 'xla_utils[gcs]'``) is read through a
        bounded local copy: shards are downloaded whole, several at once and ahead of
        use, into ``local_cache``, checked against the manifest's crc32 (a short or
        corrupt download is fetched again; transient errors are retried with backoff),
        and evicted when no longer needed once ``max_local_bytes`` is reached. While the
        whole cache fits, samples and their order are exactly those of a local folder;
        beyond it, :func:`iterate_batches` switches to a shard-aware shuffle
        (:class:`ShardWindowSampler`).

        Args:
            path: a complete cache folder, or its URL.
            epoch: the initial :attr:`epoch`. Default 0.
            local_cache: URLs only: the local folder for downloaded shards. Default: under
                ``/kaggle/working``, ``/content`` or ``~/.cache/xla_utils`` (one folder per URL).
            max_local_bytes: URLs only: most bytes kept in ``local_cache`` (an int or
                ``"20GiB"``). Default: the whole cache, or 90% of the free disk if less.

        Raises:
            FileNotFoundError: ``path`` does not exist or holds no cache (the message
                names ``path``, the nearest existing folder name for a typo, the caches
                beside it, nearest first, and how to build one).
            ValueError: the cache is incomplete or damaged (unreadable ``manifest.json``,
                missing or cut-short shard / ``labels.npy``); the message names the file
                and the fix.
            ImportError: a URL whose protocol is not installed (the message names the package).
            xla_utils.cache.storage.StorageError: a missing bucket or credentials (named
                with the fix), before any device time.
        """
        self._remote_args = (local_cache, max_local_bytes)
        self.path: Path | str = str(path).rstrip("/") if is_url(path) else Path(path).expanduser().resolve()
        self.epoch = epoch
        self._open()

    @property
    def is_remote(self) -> bool:
        """The cache is read from a URL through a bounded local copy."""
        return isinstance(self.path, str)

    def _file(self, name: str) -> str:
        return f"{self.path}/{name}"

    def _open(self) -> None:
        self._remote: ShardCache | None = None
        m = load_manifest(self.path) if self.is_remote else read_manifest(self.path)  # errors name the fix
        if not m["complete"]:
            raise ValueError(f"the cache in {self.path} is incomplete ({len(m['shards'])}/{m['num_shards']} "
                             "shards): rerun the same build command to finish it")
        try:
            self._open_files(m)
        except (OSError, ValueError, EOFError) as e:
            raise ValueError(f"the cache in {self.path} is damaged ({type(e).__name__}: {e}): run "
                             f"`tpu_cache_ds verify {self.path}` to find the bad files, then rerun the same "
                             "build command (it rebuilds missing shards) or rebuild with overwrite=True "
                             "(--overwrite)") from e

    def _open_files(self, m: dict[str, Any]) -> None:
        self.manifest = m
        self.classes: list[str] = list(m["classes"])
        self.num_classes = len(self.classes)
        self.multilabel: bool = bool(m["multilabel"])
        self.image_size: tuple[int, int] = tuple(m["image_size"])
        self.num_variants: int = int(m["num_variants"])
        self.codec: str = m["codec"]
        if self.is_remote:
            labels = np.load(io.BytesIO(Store(self.path).read_bytes(LABELS)))
        else:
            labels = np.load(self.path / LABELS)
        self.labels = labels.astype(np.float32) if self.multilabel else labels.astype(np.int64)
        counts = np.array([s["num_images"] for s in m["shards"]], dtype=np.int64)
        self._n = int(counts.sum())
        # Caches written before the flag existed: unlabelled iff single-label and all -1.
        self.unlabeled: bool = bool(m.get("unlabeled", not self.multilabel and self._n > 0
                                          and bool((self.labels < 0).all())))
        self._ids: list[str] | None = None
        if len(self.labels) != self._n:
            raise ValueError(f"{self._file(LABELS)} has {len(self.labels)} labels for {self._n} images")
        self._shard_of = np.repeat(np.arange(len(counts), dtype=np.int64), counts)
        starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
        self._local = np.arange(self._n, dtype=np.int64) - starts[self._shard_of]
        skipped = {e["source_index"] for e in m["skipped"]}
        self.source_indices = np.array(
            [i for s in m["shards"] for i in range(s["first_source"], s["first_source"] + s["num_sources"])
             if i not in skipped], dtype=np.int64)
        # raw: per variant, per shard, a uint8[n, H, W, 3] view of the memory map.
        # jpeg: per shard, (memory map, int64 offsets, images in the shard).
        self._slabs: list[list[np.ndarray | None]] = []
        self._jpeg: list[tuple[np.memmap, np.ndarray, int] | None] = []
        if self.is_remote:
            self._remote = _open_remote(self.path, m, *self._remote_args, opener=self._open_shard)
        else:
            opened = [self._open_shard(self.path / s["file"]) if s["num_images"] else None for s in m["shards"]]
            if self.codec == "raw":
                self._slabs = [[o[v] if o is not None else None for o in opened] for v in range(self.num_variants)]
            else:
                self._jpeg = opened
        self._rings: dict[tuple, _Ring] = {}  # batch buffers reused by consecutive passes (see _ring_batches)
        self._rings_lock = threading.Lock()

    def _open_shard(self, f: Path) -> Any:
        """raw: the shard's per-variant ``uint8[n, H, W, 3]`` views; jpeg: (memory map, offsets, n)."""
        if self.codec == "raw":
            # plain ndarray views: indexing an np.memmap subclass costs more per sample
            return list(np.load(f, mmap_mode="r").view(np.ndarray))
        mm = np.memmap(f, dtype=np.uint8, mode="r")
        try:
            offsets = read_jpeg_index(mm)
        except ValueError as e:
            raise ValueError(f"{f}: {e}") from None
        return mm, offsets, (len(offsets) - 1) // self.num_variants

    def __getstate__(self) -> dict[str, Any]:  # memory maps are reopened, not pickled
        return {"path": self.path, "epoch": self.epoch, "remote_args": self._remote_args}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.path, self.epoch = state["path"], state["epoch"]
        self._remote_args = state.get("remote_args", (None, None))
        self._open()

    @property
    def shard_aware(self) -> bool:
        """A remote cache larger than ``max_local_bytes``: :func:`iterate_batches` shuffles
        within windows of shards (see :class:`ShardWindowSampler`)."""
        return self._remote is not None and not self._remote.fits

    @property
    def shards_per_window(self) -> int:
        """Shards shuffled together by :class:`ShardWindowSampler`: half the local budget's
        worth, so that the next window downloads while this one is read."""
        if self._remote is None:
            return len(self.manifest["shards"])
        return max(1, self._remote.max_bytes // (2 * max(1, self._remote.biggest)))

    @property
    def shard_ids(self) -> np.ndarray:
        """``int64[N]``: the shard holding each image."""
        return self._shard_of

    def __len__(self) -> int:
        return self._n

    @property
    def ids(self) -> list[str]:
        """Each image's id, in dataset order (``list[str]``, ``len(ds)`` long): its path
        relative to the source folder (``"test/0a1b.jpg"`` style, ``/`` separators), the
        first-column value of the source CSV as written, or the source index as a string
        for caches built from a Python dataset. These are the ids
        :func:`xla_utils.write_submission` writes.

        Caches built before ids were recorded: from a Python dataset the source indices
        are used; from files ``ValueError`` (rebuild with ``overwrite=True``), since
        guessing file names could silently misalign a submission.
        """
        if self._ids is None:
            ids = cached_ids(self.manifest, str(self.path))
            if len(ids) != self._n:
                raise ValueError(f"{self._file('manifest.json')} lists {len(ids)} ids for {self._n} images")
            self._ids = ids
        return list(self._ids)

    @property
    def skipped(self) -> list[dict[str, Any]]:
        """The images the build was asked for but could not cache (a truncated file, an
        unknown label...), in source order: ``source_index``, ``path``, ``id`` (the id it
        would have had) and ``reason``. They are not in the dataset, so a test set's
        predictions have no row for them (:func:`xla_utils.write_submission` says so)."""
        return skipped_records(self.manifest)

    @property
    def requested_ids(self) -> list[str]:
        """Every id the build was asked to cache, in source order: :attr:`ids` plus the
        :attr:`skipped` ones in their places (for a test set: every row a submission needs)."""
        return requested_ids(self.manifest, str(self.path))

    def __repr__(self) -> str:
        h, w = self.image_size
        kind = "unlabelled" if self.unlabeled else f"{self.num_classes} classes"
        return (f"CachedImageDataset({str(self.path)!r}: {self._n} images, {w}x{h}, "
                f"{self.num_variants} variant(s), {self.codec}, {kind}"
                f"{', multi-label' if self.multilabel else ''})")

    def set_epoch(self, epoch: int) -> None:
        """Select the variant that ``ds[i]`` shows (``epoch % num_variants``)."""
        self.epoch = int(epoch)

    def variant(self, epoch: int) -> int:
        """Variant shown in ``epoch``."""
        return int(epoch) % self.num_variants

    def _check(self, i: int) -> int:
        i = int(i)
        if i < 0:
            i += self._n
        if not 0 <= i < self._n:
            raise IndexError(f"index {i} out of range for {self._n} images")
        return i

    def label(self, i: int) -> int | np.ndarray:
        """Label of image ``i``: a class index (-1 = unlabelled) or a ``float32[C]`` multi-hot copy."""
        i = self._check(i)
        return self.labels[i].copy() if self.multilabel else int(self.labels[i])

    def image(self, i: int, variant: int = 0) -> np.ndarray:
        """Variant ``variant`` of image ``i`` as a new ``uint8[H, W, 3]`` array."""
        i = self._check(i)
        out = np.empty((*self.image_size, 3), np.uint8)
        self._read(int(self._shard_of[i]), variant % self.num_variants, int(self._local[i]), out)
        return out

    def _read(self, s: int, v: int, j: int, out: np.ndarray) -> None:
        if self._remote is not None:
            shard = self._remote.acquire(s)
            try:
                self._read_from(shard, v, j, out)
            finally:
                self._remote.release(s)
        elif self.codec == "raw":
            out[...] = self._slabs[v][s][j]
        else:
            self._read_from(self._jpeg[s], v, j, out)

    def _read_from(self, shard: Any, v: int, j: int, out: np.ndarray) -> None:
        if self.codec == "raw":
            out[...] = shard[v][j]
            return
        mm, offsets, n = shard
        e = v * n + j
        with Image.open(io.BytesIO(mm[offsets[e]:offsets[e + 1]])) as im:
            out[...] = np.asarray(im)

    def __getitem__(self, i: int) -> tuple[np.ndarray, int | np.ndarray]:
        return self.image(i, self.variant(self.epoch)), self.label(i)

    def __getitems__(self, indices: Sequence[int]) -> list[tuple[np.ndarray, Any]]:
        """Batched fetch used by ``torch.utils.data.DataLoader``.

        One gather into one array, returned as per-sample views so the default collate
        still works.
        """
        idx = np.asarray(indices, dtype=np.int64)
        x = np.empty((len(idx), *self.image_size, 3), np.uint8)
        self.load_batch(idx, self.epoch, x)
        return [(x[k], self.label(i)) for k, i in enumerate(idx)]

    def load_batch(self, indices: np.ndarray, epoch: int, out: np.ndarray) -> None:
        """Copy images ``indices`` (variant of ``epoch``) into ``out`` (``uint8[B, H, W, 3]``)."""
        idx = np.asarray(indices, dtype=np.int64)
        if idx.size and (idx.min() < 0 or idx.max() >= self._n):
            raise IndexError(f"indices out of range for {self._n} images")
        v = self.variant(epoch)
        if self._remote is not None:
            self._load_remote(idx, v, out)
            return
        shards, local = self._shard_of[idx].tolist(), self._local[idx].tolist()
        if self.codec == "raw":
            slabs = self._slabs[v]
            for k, (s, j) in enumerate(zip(shards, local)):
                out[k] = slabs[s][j]
        else:
            for k, (s, j) in enumerate(zip(shards, local)):
                self._read(s, v, j, out[k])

    def _load_remote(self, idx: np.ndarray, v: int, out: np.ndarray) -> None:
        """load_batch from the local copy: one shard held at a time, in the batch's shard order."""
        shards = self._shard_of[idx]
        for s in dict.fromkeys(shards.tolist()):
            rows = np.flatnonzero(shards == s)
            shard = self._remote.acquire(s)
            try:
                for k in rows.tolist():
                    self._read_from(shard, v, int(self._local[idx[k]]), out[k])
            finally:
                self._remote.release(s)


def _open_remote(url: str, m: dict[str, Any], local_cache: str | os.PathLike | None,
                 max_local_bytes: int | str | None, opener: Any) -> ShardCache:
    """The bounded local copy of the remote cache ``url`` (manifest ``m``)."""
    from ..cache.config import parse_bytes

    folder = Path(local_cache).expanduser() if local_cache is not None else default_local_cache(url)
    total = sum(s["bytes"] for s in m["shards"])
    if max_local_bytes is None:
        p = folder
        while not p.exists() and p != p.parent:
            p = p.parent
        budget = min(total, int(0.9 * (shutil.disk_usage(p).free + _folder_bytes(folder))))
        if budget < total:
            warnings.warn(f"{url} ({total:,} bytes) does not fit in {folder} (90% of its free disk: {budget:,} "
                          "bytes): reading it with a shard-aware shuffle (see ShardWindowSampler); pass "
                          "local_cache= on a bigger disk or max_local_bytes= to choose", stacklevel=3)
    else:
        budget = parse_bytes(max_local_bytes)
    return ShardCache(Store(url), m, folder, budget, opener)


def _folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.iterdir() if p.is_file()) if folder.is_dir() else 0


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

    def batches(self, epoch: int | None = None) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """This rank's batches of ``epoch``.

        Args:
            epoch: default: the epoch set by :meth:`set_epoch`.

        Yields:
            ``(indices int64[B], valid bool[B])`` per batch.
        """
        epoch = self.epoch if epoch is None else epoch
        n = len(self)
        g = self.batch_size * self.world_size
        order = np.resize(self.order(epoch), n * g)  # np.resize repeats from the start
        for k in range(n):
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


class BatchIterable:
    """One pass over ``(x, y, valid)`` batches; see :func:`iterate_batches`.

    Iterating again starts a new pass over the same epoch; :meth:`set_epoch` changes it.
    """

    def __init__(self, dataset: Any, sampler: DistributedBatchSampler, epoch: int, num_workers: int | None,
                 pin_memory: bool = False):
        self.dataset, self.sampler, self.epoch = dataset, sampler, int(epoch)
        self.num_workers, self.pin_memory = num_workers, pin_memory

    @property
    def valid_for(self) -> int | None:
        """Further batches a yielded batch stays valid for before its buffers are refilled:
        2 for a cache's ring, None (never reused: fresh tensors) for a ``DataLoader``'s."""
        return RING_VALID_FOR if isinstance(self.dataset, CachedImageDataset) else None

    def __len__(self) -> int:
        return len(self.sampler)

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch of the next pass."""
        self.epoch = int(epoch)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        if isinstance(self.dataset, CachedImageDataset):
            workers = self.num_workers if self.num_workers is not None else default_loader_threads()
            return _ring_batches(self.dataset, self.sampler, self.epoch, workers, self.pin_memory)
        return self._loader_batches()

    def _loader_batches(self) -> Iterator[tuple[Any, Any, torch.Tensor]]:
        from torch.utils.data import DataLoader

        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(self.epoch)
        batches = [idx for idx, _ in self.sampler.batches(self.epoch)]
        loader = DataLoader(self.dataset, batch_sampler=batches, num_workers=self.num_workers or 0,
                            pin_memory=self.pin_memory)
        for k, batch in enumerate(loader):
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
                  workers: int, pin: bool = False) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Fill batches into a ring of ``R = workers + 3`` preallocated slots (pinned: ``pin``).

    Batch ``j`` (counted across the passes that share the ring) lives in slot
    ``j % R`` and is only overwritten by batch ``j + R``, which a thread may start
    once the consumer has asked for batch ``j + 3``: a yielded batch survives
    :data:`RING_VALID_FOR` (two) further requests.
    """
    batches = list(sampler.batches(epoch))
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
                    num_workers: int | None = None, pin_memory: bool = False) -> BatchIterable:
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

    Returns:
        A :class:`BatchIterable`: each iteration is one pass; ``len()`` is its batch count.
    """
    if isinstance(dataset, CachedImageDataset) and dataset.shard_aware:
        sampler = ShardWindowSampler(dataset.shard_ids, dataset.shards_per_window, batch_size, world_size, rank,
                                     shuffle, seed, drop_last)
    else:
        sampler = DistributedBatchSampler(len(dataset), batch_size, world_size, rank, shuffle, seed, drop_last)
    return BatchIterable(dataset, sampler, epoch, num_workers, pin_memory)


def default_loader_threads() -> int:
    """Loader threads of a cache when ``num_workers`` is None: ``min(4, cores)``."""
    return min(4, os.cpu_count() or 1)
