"""The dataset of a cache built by :mod:`xla_utils.cache`: :class:`CachedImageDataset`.

Map-style ``(uint8 HxWx3 image, label)`` over the memory-mapped shards (8 processes share
one copy in the page cache), or over a bounded local copy of a cache in a bucket; epoch
``e`` shows variant ``e % num_variants`` of every image. Read-only after construction, so
safe to share between threads (but for :meth:`CachedImageDataset.set_epoch`, which only
affects ``ds[i]``). Imports neither torch nor torch_xla.
"""
from __future__ import annotations

import io
import os
import shutil
import threading
import warnings
from pathlib import Path
from typing import Any, Sequence

import numpy as np
from PIL import Image

from ..runtime.hosts import slice_host
from ..cache.fetch import LocalBudgetError, ShardCache, default_local_cache
from ..cache.format import (LABELS, cached_ids, read_jpeg_index, read_manifest, requested_ids,
                           skipped_records)
from ..cache.storage import Store, is_url, load_manifest

__all__ = ["CachedImageDataset"]


class CachedImageDataset:
    """Map-style dataset over a complete cache directory.

    ``ds[i]`` is ``(image, label)``: ``image`` a ``uint8[H, W, 3]`` array (a copy),
    ``label`` an ``int`` class index (-1 = unlabelled), for multi-label caches a
    ``float32[num_classes]`` multi-hot array, for regression caches a
    ``float32[num_targets]`` array of targets. Indices follow the source order with
    skipped images left out (``source_indices`` maps back to the source).

    Attributes:
        task: ``"classification"`` (single- or multi-label) or ``"regression"`` (a cache
            built from numeric targets, see ``build_cache(task=...)``).
        classes: class names (``list[str]``; empty for regression); ``num_classes`` is
            their count (None for regression).
        targets, num_targets: a regression cache's target names and their count (None
            for classification).
        multilabel: labels are multi-hot vectors.
        unlabeled: a test set: every label is -1.
        image_size: ``(H, W)`` in pixels.
        num_variants: stored variants per image; ``codec``: ``"raw"`` or ``"jpeg"``.
        labels: ``int64[N]``, ``float32[N, C]`` (multi-label) or ``float32[N, k]``
            (regression).
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
            xla_utils.cache.fetch.LocalBudgetError: (a ``ValueError``) ``max_local_bytes`` has
                no room for two shards; the message gives the least budget that works.
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
        try:  # errors name the fix
            m = load_manifest(self.path) if self.is_remote else read_manifest(self.path)
        except FileNotFoundError as exc:
            raise FileNotFoundError(f"{exc}{_other_hosts_hint()}") from None
        if not m["complete"]:
            raise ValueError(f"the cache in {self.path} is incomplete ({len(m['shards'])}/{m['num_shards']} "
                             "shards): rerun the same build command to finish it")
        try:
            self._open_files(m)
        except LocalBudgetError:
            raise  # a setting to change (max_local_bytes), not a damaged cache
        except (OSError, ValueError, EOFError) as e:
            raise ValueError(f"the cache in {self.path} is damaged ({type(e).__name__}: {e}): run "
                             f"`tpu_cache_ds verify {self.path}` to find the bad files, then rerun the same "
                             "build command (it rebuilds missing shards) or rebuild with overwrite=True "
                             "(--overwrite)") from e

    def _open_files(self, m: dict[str, Any]) -> None:
        self.manifest = m
        self.task: str = m.get("task", "classification")
        regression = self.task == "regression"
        self.classes: list[str] = list(m["classes"] or [])
        self.num_classes: int | None = None if regression else len(self.classes)
        self.targets: list[str] | None = list(m["targets"]) if regression else None
        self.num_targets: int | None = len(self.targets) if regression else None
        self.multilabel: bool = bool(m["multilabel"])
        self.image_size: tuple[int, int] = tuple(m["image_size"])
        self.num_variants: int = int(m["num_variants"])
        self.codec: str = m["codec"]
        if self.is_remote:
            labels = np.load(io.BytesIO(Store(self.path).read_bytes(LABELS)))
        else:
            labels = np.load(self.path / LABELS)
        floats = self.multilabel or regression
        self.labels = labels.astype(np.float32) if floats else labels.astype(np.int64)
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
        # batch buffers reused by consecutive passes: the loader's rings (loader._ring_batches)
        self._rings: dict[tuple, Any] = {}
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
        kind = ("unlabelled" if self.unlabeled else f"regression, {self.num_targets} target(s)"
                if self.task == "regression" else f"{self.num_classes} classes")
        return (f"CachedImageDataset({str(self.path)!r}: {self._n} images, {w}x{h}, "
                f"{self.num_variants} variant(s), {self.codec}, {kind}"
                f"{', multi-label' if self.multilabel else ''})")

    def float_targets(self, shape: Sequence[int]) -> "CachedImageDataset":
        """This cache with each label as ``float32`` of ``shape`` (``(1,)``: a one-logit
        binary model's 0./1. targets, or a regression target per output): a view sharing
        the memory maps (no image copied); itself when its labels already are that."""
        shape = tuple(int(d) for d in shape)
        if self.labels.dtype == np.float32 and self.labels.shape[1:] == shape:
            return self
        return _FloatTargets(self, shape)

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
        """Label of image ``i``: a class index (-1 = unlabelled), or a copy of its row of
        :attr:`labels` (multi-hot, regression targets)."""
        i = self._check(i)
        return self.labels[i].copy() if self.labels.dtype.kind == "f" else int(self.labels[i])

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


class _FloatTargets(CachedImageDataset):
    """A cache whose labels are fed as float32 of one shape (:meth:`CachedImageDataset.float_targets`)."""

    def __init__(self, parent: CachedImageDataset, shape: tuple[int, ...]):  # noqa: D107 (no super().__init__)
        self.__dict__.update(parent.__dict__)
        self._parent, self._shape = parent, shape
        self.labels = parent.labels.astype(np.float32).reshape(len(parent), *shape)
        self._rings, self._rings_lock = {}, threading.Lock()

    @property
    def ids(self) -> list[str]:
        """The parent's ids (a view of a subset has the subset's)."""
        return self._parent.ids

    @property
    def skipped(self) -> list[dict[str, Any]]:
        """The parent's skipped images."""
        return self._parent.skipped

    @property
    def requested_ids(self) -> list[str]:
        """The parent's requested ids."""
        return self._parent.requested_ids

    def __repr__(self) -> str:
        return f"{self._parent!r} with float32{list(self._shape)} targets"

    def __getstate__(self) -> dict[str, Any]:
        return {"parent": self._parent, "shape": self._shape, "epoch": self.epoch}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["parent"], state["shape"])
        self.epoch = state["epoch"]


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


def _other_hosts_hint() -> str:
    """What a missing local cache means on one host of several (each has its own disk)."""
    where = slice_host()
    if where is None:
        return ""
    return (f"\nThis is host {where[0]} of {where[1]}: each host of a pod slice (or torchrun "
            "node) has its own disk, so a local cache folder built on one host does not exist "
            "on the others. Fix: build the cache into a bucket (build_cache(src, "
            "'gs://bucket/cache/train')) and read that URL on every host, or build it on every "
            "host")
