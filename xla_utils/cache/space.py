"""Disk space for a build: refuse before writing when the cache cannot fit, and one line when the disk fills.

The estimate is the ``--dry-run`` figure without its pilot: exact for ``codec="raw"``
(pixels plus a ``.npy`` header per shard; skipped images make the cache smaller), and
the raw size divided by :data:`~xla_utils.cache.config.JPEG_RATIO_GUESS` for
``codec="jpeg"``. Object stores (``gs://``) have no free-space figure and are not checked.
"""
from __future__ import annotations

import dataclasses
import errno
from typing import Any

from ..utils.units import format_bytes

from .config import JPEG_RATIO_GUESS, CacheConfig
from .errors import BuildError

__all__ = ["DiskFullError", "estimate_bytes", "check_space", "is_disk_full"]

_HEADER = 128  # per shard: the .npy header
_FIXED = 2**16  # labels.npy and manifest.json, about


class DiskFullError(BuildError):
    """The disk filled during the build (temporary files removed; rerun to resume once space is freed)."""


def estimate_bytes(cfg: CacheConfig, num_items: int, num_shards: int) -> int:
    """Bytes that ``num_items`` source images in ``num_shards`` shards take with ``cfg``."""
    raw = num_items * cfg.variants * cfg.sample_bytes
    if cfg.codec == "jpeg":
        raw //= JPEG_RATIO_GUESS
    return raw + num_shards * _HEADER + _FIXED


def is_disk_full(e: BaseException) -> bool:
    """True for ENOSPC / EDQUOT (a full disk or an exhausted quota)."""
    return isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT)


def _options(cfg: CacheConfig, num_items: int, num_shards: int, free: int) -> list[str]:
    """Changes of the build that would fit into ``free`` bytes, in words."""
    fits = lambda c: estimate_bytes(c, num_items, num_shards) <= free  # noqa: E731
    found = []
    if cfg.codec == "raw" and fits(dataclasses.replace(cfg, codec="jpeg")):
        found.append("codec='jpeg' (--codec jpeg, about 8x smaller)")
    for v in range(cfg.variants - 1, 0, -1):
        c = dataclasses.replace(cfg, variants=v, augment=cfg.augment if v > 1 else False)
        if fits(c):
            found.append(f"variants={v} (--variants {v})")
            break
    h, w = cfg.size
    for side in (448, 384, 320, 256, 224, 192, 160, 128, 96, 64, 32):
        if side < min(h, w) and fits(dataclasses.replace(cfg, size=side)):
            found.append(f"size={side} (--size {side})")
            break
    return found


def check_space(where: str, free: int | None, cfg: CacheConfig, num_items: int, num_shards: int) -> None:
    """Refuse a build whose estimate does not fit into ``free`` bytes (``None``: not known).

    Args:
        where: the output folder, for the message.
        free: its free bytes.
        cfg: the build's config.
        num_items, num_shards: source images and shards still to write.

    Raises:
        BuildError: with the estimate, the free space and the options that fit.
    """
    if free is None or not num_items:
        return
    need = estimate_bytes(cfg, num_items, num_shards)
    if need <= free:
        return
    opts = _options(cfg, num_items, num_shards, free)
    hint = ("; options that fit: " + ", ".join(opts)) if opts else ""
    raise BuildError(f"not enough space in {where}: this build needs about {format_bytes(need)} ({need:,} bytes; "
                     f"the --dry-run estimate) and the disk has {format_bytes(free)} ({free:,} bytes) free{hint}; "
                     "or free space, build into another disk or into a gs:// bucket. Nothing was written.")


def disk_full(where: str, done: int, total: int, still_needed: int, cause: Any = None) -> DiskFullError:
    """The one-line :class:`DiskFullError` of a build whose disk filled."""
    return DiskFullError(f"{where}: disk full ({done}/{total} shards written, about {format_bytes(still_needed)} "
                         f"= {still_needed:,} bytes still needed): free space and rerun the same command "
                         "to resume (temporary files were removed, finished shards are kept)")
