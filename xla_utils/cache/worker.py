"""The worker side of a build: tasks that run in the builder's process pool.

:func:`init_worker` stores the build's source and config in the worker process once;
:func:`build_shard` (a build) and :func:`pilot_item` (a dry run) are the tasks.
Workers publish only their own shard files (:meth:`Store.write`: complete or absent); the manifest
is the coordinator's (:mod:`xla_utils.cache.builder`).
"""
from __future__ import annotations

import contextlib
import signal
import sys
import time
from typing import Any

import numpy as np
from PIL import Image

from ..runtime import forksafe
from .config import CacheConfig
from .errors import BadImageError, Cancelled, describe
from .format import jpeg_shard_chunks, npy_header, shard_name
from .images import encode_jpeg, make_variants
from .sources import Source, load_item
from .storage import Store

__all__ = ["init_worker", "set_state", "build_shard", "pilot_item"]

# The build's state in a worker process, set once by init_worker.
_W: dict[str, Any] = {}


def init_worker(src: Source, cfg: CacheConfig, out: Store, strict: bool, counter: Any, stop_at: Any) -> None:
    """Process-pool initializer.

    Args:
        src: the build's source.
        cfg: the build's config.
        out: the cache folder or URL prefix.
        strict: raise :class:`BadImageError` at a bad item instead of skipping it.
        counter: shared ``multiprocessing.Value`` counting processed items (progress).
        stop_at: shared ``multiprocessing.Value``: the first source index no longer
            needed (lowered by a strict worker at a bad item, -1 to stop everything).
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the coordinator handles Ctrl-C
    if sys.platform == "linux":
        with contextlib.suppress(Exception):  # die with the coordinator (SIGKILL included)
            import ctypes
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    # A forked worker's one thread is a copy of the caller's, which owns an OpenMP team once it ran a
    # parallel torch op (it has, for a torch dataset: resolving the source reads item 0); the
    # worker's first parallel op would wait forever for that team's threads. One OpenMP/MKL thread
    # per worker cannot hang, and the pool's processes are the parallelism.
    forksafe.limit_openmp_to_one_thread()
    set_state(src, cfg, out, strict, counter, stop_at)


def set_state(src: Source, cfg: CacheConfig, out: Store, strict: bool, counter: Any, stop_at: Any) -> None:
    """Store the build's state in this process (the arguments of :func:`init_worker`), no signal setup:
    for runners whose workers live longer than one build (Ray)."""
    Image.MAX_IMAGE_PIXELS = max(cfg.max_pixels, Image.MAX_IMAGE_PIXELS or 0)
    _W.update(src=src, cfg=cfg, out=out, strict=strict, counter=counter, stop_at=stop_at)


def _process_item(src: Source, cfg: CacheConfig, i: int) -> tuple[list[np.ndarray], Any, dict | None]:
    """(variants, label, note) for item ``i``; note is an 'upscaled' record or None."""
    img, label, (w, h) = load_item(src, cfg, i)
    note = None
    if w < cfg.size[1] or h < cfg.size[0]:
        if cfg.small == "skip":
            raise ValueError(f"smaller than the target {cfg.size[1]}x{cfg.size[0]} ({w}x{h})")
        note = {"source_index": i, "path": src.name(i), "size": [w, h]}
    return make_variants(img, cfg, i), label, note


def build_shard(k: int, start: int, stop: int) -> dict[str, Any]:
    """Worker task: build shard ``k`` from source items ``[start, stop)`` and write it atomically.

    Returns:
        The shard's manifest entry, plus its ``skipped`` and ``upscaled`` records
        (the coordinator moves those to the manifest's top-level lists).

    Raises:
        Cancelled: the coordinator asked the workers to stop.
        BadImageError: a bad item in a strict build.
    """
    src, cfg, out, strict = _W["src"], _W["cfg"], _W["out"], _W["strict"]
    counter, stop_at = _W["counter"], _W["stop_at"]
    h, w = cfg.size
    V = cfg.variants
    pixels = np.empty((V, stop - start, h, w, 3), np.uint8) if cfg.codec == "raw" else None
    jpegs: list[list[bytes]] = [[] for _ in range(V)]
    labels, ids, skipped, upscaled = [], [], [], []
    for i in range(start, stop):
        if i >= stop_at.value:  # a bad item at or before i is known (strict), or the build stops
            raise Cancelled()
        try:
            variants, label, note = _process_item(src, cfg, i)
        except Exception as e:  # any failure of one item (decoder, user dataset) skips it
            if strict:
                with stop_at.get_lock():  # items after this one are no longer needed
                    stop_at.value = min(stop_at.value, i)
                raise BadImageError(src.name(i), describe(e), i) from None
            skipped.append({"source_index": i, "path": src.name(i), "id": src.item_id(i),
                            "reason": describe(e)})
        else:
            for v, arr in enumerate(variants):
                if pixels is not None:
                    pixels[v, len(labels)] = arr
                else:
                    jpegs[v].append(encode_jpeg(arr, cfg.quality))
            labels.append(label)
            ids.append(src.item_id(i))
            if note:
                upscaled.append(note)
        with counter.get_lock():
            counter.value += 1
    n = len(labels)
    if pixels is not None:
        chunks = [npy_header((V, n, h, w, 3))] + [pixels[v, :n] for v in range(V)]
    else:
        chunks = jpeg_shard_chunks([b for v in range(V) for b in jpegs[v]])
    name = shard_name(cfg.codec, k)
    nbytes, crc = out.write(name, chunks)
    entry = {"index": k, "file": name, "first_source": start, "num_sources": stop - start,
             "num_images": n, "bytes": nbytes, "crc32": crc, "labels": labels, "ids": ids,
             "skipped": skipped, "upscaled": upscaled}
    if out.is_url:  # the store's own checksum: a resumed build checks reused objects by listing
        crc32c = out.info(name).get("crc32c")
        if crc32c:
            entry["crc32c"] = crc32c
    return entry


def pilot_item(i: int) -> tuple[float, list[int] | str]:
    """Dry-run task: time and output size of item ``i``.

    Returns:
        ``(seconds to process it, encoded bytes per variant)``, or the reason it would
        be skipped in place of the sizes.
    """
    src, cfg = _W["src"], _W["cfg"]
    t0 = time.perf_counter()
    try:
        variants, _, _ = _process_item(src, cfg, i)
        sizes = [len(encode_jpeg(a, cfg.quality)) if cfg.codec == "jpeg" else a.nbytes for a in variants]
    except Exception as e:
        return time.perf_counter() - t0, describe(e)
    return time.perf_counter() - t0, sizes
