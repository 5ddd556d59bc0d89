"""The reader's bounded local copy of a cache in a bucket: :class:`ShardCache`.

:class:`xla_utils.data.CachedImageDataset` on a URL (``gs://...``) reads shards from a
local folder that this class fills: several whole-shard downloads at once, ahead of
use (:meth:`ShardCache.prefetch`), each checked against the manifest's size and crc32
and fetched again when short or corrupt (:meth:`xla_utils.cache.storage.Store.download`),
and at most ``max_bytes`` on disk: a shard that no reader holds is evicted, least
recently used first, when another needs its room. A process fetches only the shards
that its own samples need.

Shards already in the folder from an earlier run of the same cache (same manifest) are
kept and reused; a folder holding another cache is emptied first. The processes of one
host (one per TPU core) share the default folder: a shard another process has already
published there is used, not downloaded again (files appear only complete and
checked); the budget is counted per process.

Only the standard library and :mod:`xla_utils.cache.storage` are imported here.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Iterable

from ..utils.atomic import atomic_write
from .storage import Store

__all__ = ["ShardCache", "LocalBudgetError", "default_local_cache", "local_folder", "DOWNLOADS"]

# Concurrent shard downloads per process.
DOWNLOADS = 4
_STAMP = ".xla_utils-manifest-sha256"


class LocalBudgetError(ValueError):
    """``max_local_bytes`` is too small for the cache's shards: a setting to change, not a
    damaged cache (the message gives the shard size and the least budget that works)."""


def default_local_cache(url: str) -> Path:
    """The default local folder for the cache at ``url``: :func:`local_folder` ``"remote"``."""
    return local_folder(url, "remote")


def local_folder(url: str, kind: str) -> Path:
    """A local folder of this session's for what lives at ``url``: under ``/kaggle/working`` on
    Kaggle, ``/content`` on Colab, else ``~/.cache/xla_utils``; then
    ``<kind>/<bucket>_<prefix>-<hash>``, so that two URLs never share one (``kind``:
    ``"remote"`` for a cache's bounded copy, ``"checkpoints"`` for a checkpoint folder's)."""
    for base in (Path("/kaggle/working"), Path("/content")):
        if base.is_dir() and os.access(base, os.W_OK):
            root = base / ".xla_utils" / kind
            break
    else:
        root = Path.home() / ".cache" / "xla_utils" / kind
    tail = re.sub(r"[^A-Za-z0-9._-]+", "_", url.split("://", 1)[-1]).strip("_")[-80:]
    return root / f"{tail}-{hashlib.sha256(url.encode()).hexdigest()[:8]}"


def _in_flight(name: str) -> bool:
    """Whether a file of the folder is another process's write in progress: a shard's
    download (``.part-``) or the stamp's atomic write (``<stamp>.tmp-``), which the processes
    of one host (one per core) adopting the folder at once must not delete under each other."""
    return ".part-" in name or name.startswith(_STAMP + ".tmp-")


class ShardCache:
    """Shards of one remote cache, downloaded on demand into a folder of bounded size.

    Thread-safe: the loader threads :meth:`acquire` a shard (waiting for its download),
    read it and :meth:`release` it; a held shard is never evicted.

    Args:
        store: the remote cache.
        manifest: its manifest (the shard entries give names, sizes and crc32s).
        folder: the local folder (created).
        max_bytes: most bytes of shards on disk at once (downloads in flight included).
        opener: turns a downloaded shard's path into the object readers use (a memory
            map); called once per download, dropped at eviction.
        downloads: concurrent downloads. Default :data:`DOWNLOADS`.

    Raises:
        LocalBudgetError: ``max_bytes`` is smaller than two of the largest shards (or the
            whole cache, when smaller): the message gives the sizes and the least budget.
    """

    def __init__(self, store: Store, manifest: dict[str, Any], folder: str | os.PathLike, max_bytes: int,
                 opener: Callable[[Path], Any], downloads: int = DOWNLOADS):
        self.store, self.folder, self.max_bytes = store, Path(folder), int(max_bytes)
        self.entries = {s["index"]: s for s in manifest["shards"] if s["num_images"]}
        biggest = max((s["bytes"] for s in self.entries.values()), default=0)
        total = sum(s["bytes"] for s in self.entries.values())
        if self.max_bytes < min(2 * biggest, total):
            raise LocalBudgetError(
                f"max_local_bytes={self.max_bytes:,} is too small for {store.root}: its largest "
                f"shard is {biggest:,} bytes, and the local copy needs room for two (one downloads "
                f"while the other is read). Fix: max_local_bytes={min(2 * biggest, total):,} or more "
                "(the whole cache: "
                f"{total:,} bytes), or max_local_bytes=None (90% of the free disk)")
        self.opener = opener
        self.fits = sum(s["bytes"] for s in self.entries.values()) <= self.max_bytes  # nothing is ever evicted
        self.biggest = biggest
        self._cond = threading.Condition()
        self._resident: OrderedDict[int, Any] = OrderedDict()  # shard -> opened object, LRU first
        self._inflight: set[int] = set()
        self._errors: dict[int, BaseException] = {}
        self._refs: dict[int, int] = {}
        self._used = 0  # bytes of resident shards plus reserved for downloads in flight
        self._pool = ThreadPoolExecutor(max(1, downloads), thread_name_prefix="xla_utils-fetch")
        self.downloaded = 0  # shard downloads completed (for tests and benchmarks)
        self._adopt(manifest)

    def _path(self, s: int) -> Path:
        return self.folder / self.entries[s]["file"]

    def _adopt(self, manifest: dict[str, Any]) -> None:
        """Keep the shards of an earlier run of the same cache; empty the folder otherwise."""
        self.folder.mkdir(parents=True, exist_ok=True)
        stamp = hashlib.sha256(json.dumps(manifest, sort_keys=True).encode()).hexdigest()
        stamp_file = self.folder / _STAMP
        same = stamp_file.is_file() and stamp_file.read_text() == stamp
        wanted = {e["file"]: s for s, e in self.entries.items()}
        for p in sorted(self.folder.iterdir()):
            s = wanted.get(p.name) if same else None
            if s is not None and p.stat().st_size == self.entries[s]["bytes"] and \
                    self._used + p.stat().st_size <= self.max_bytes:
                self._resident[s] = None  # opened on first use
                self._used += p.stat().st_size
            elif p.name != _STAMP and p.is_file() and (
                    not _in_flight(p.name) or time.time() - p.stat().st_mtime > 3600):
                with contextlib.suppress(FileNotFoundError):  # another process's download stays
                    p.unlink()
        atomic_write(stamp_file, stamp)

    def local_bytes(self) -> int:
        """Bytes of files in the folder now (partial downloads included)."""
        return sum(p.stat().st_size for p in self.folder.iterdir() if p.is_file() and p.name != _STAMP)

    # ----------------------------------------------------------------- readers

    def acquire(self, s: int) -> Any:
        """Shard ``s``'s opened object, downloading it first if needed; hold it until :meth:`release`."""
        with self._cond:
            while True:
                if s in self._errors:
                    raise self._errors.pop(s)
                if s in self._resident:
                    self._resident.move_to_end(s)
                    self._refs[s] = self._refs.get(s, 0) + 1
                    obj = self._resident[s]
                    if obj is None:
                        try:
                            obj = self._resident[s] = self.opener(self._path(s))
                        except FileNotFoundError:  # evicted by another process sharing the folder
                            self._refs[s] -= 1
                            if not self._refs[s]:
                                del self._refs[s]
                            self._resident.pop(s)
                            self._used -= self.entries[s]["bytes"]
                            continue
                    return obj
                if s not in self._inflight:
                    self._reserve(s, protect=set(), wait=True)
                    self._start(s)
                self._cond.wait()

    def release(self, s: int) -> None:
        """Let shard ``s`` be evicted again (once every :meth:`acquire` is released)."""
        with self._cond:
            self._refs[s] -= 1
            if not self._refs[s]:
                del self._refs[s]
                self._cond.notify_all()

    def prefetch(self, shards: Iterable[int], protect: set[int]) -> None:
        """Start downloading ``shards`` in order, as far as room allows without evicting ``protect``."""
        with self._cond:
            for s in shards:
                if s in self._resident or s in self._inflight or s not in self.entries:
                    continue
                if not self._reserve(s, protect, wait=False):
                    return
                self._start(s)

    def close(self) -> None:
        """Stop the download threads (the folder's shards stay for the next run)."""
        self._pool.shutdown(wait=True, cancel_futures=True)

    # ----------------------------------------------------------------- internals (hold _cond)

    def _reserve(self, s: int, protect: set[int], wait: bool) -> bool:
        need = self.entries[s]["bytes"]
        while self._used + need > self.max_bytes:
            victim = next((v for v in self._resident if v not in self._refs and v not in protect), None)
            if victim is not None:
                self._evict(victim)
            elif not wait:
                return False
            else:
                self._cond.wait()
        self._used += need
        return True

    def _evict(self, s: int) -> None:
        self._resident.pop(s)
        with contextlib.suppress(FileNotFoundError):
            self._path(s).unlink()  # open memory maps stay valid until dropped
        self._used -= self.entries[s]["bytes"]

    def _start(self, s: int) -> None:
        self._inflight.add(s)
        self._pool.submit(self._download, s)

    def _download(self, s: int) -> None:
        e = self.entries[s]
        try:
            done = self._path(s)
            if not (done.is_file() and done.stat().st_size == e["bytes"]):  # else another process fetched it
                self.store.download(e["file"], done, e["bytes"], e["crc32"])
        except BaseException as err:  # handed to the reader waiting for it
            with self._cond:
                self._inflight.discard(s)
                self._used -= e["bytes"]
                self._errors[s] = err
                self._cond.notify_all()
            return
        with self._cond:
            self._inflight.discard(s)
            self._resident[s] = None
            self.downloaded += 1
            self._cond.notify_all()
