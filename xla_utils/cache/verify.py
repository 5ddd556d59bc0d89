"""Inspecting a built cache: :func:`cache_info` (a summary) and :func:`verify_cache` (integrity).

Reads only; needs the format (:mod:`xla_utils.cache.format`) and nothing of the builder.
"""
from __future__ import annotations

import io
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from .errors import describe
from .format import LABELS, MANIFEST, read_jpeg_index
from .storage import Store, load_manifest

__all__ = ["cache_info", "VerifyReport", "verify_cache"]


def cache_info(path: str | os.PathLike) -> dict[str, Any]:
    """Summary of a cache (complete or not).

    Args:
        path: the cache folder or URL prefix (``gs://...``).

    Returns:
        A JSON-ready dict: ``path``, ``complete``, ``num_images``, ``num_sources``,
        ``image_size`` (H, W), ``num_variants``, ``codec``, ``num_shards``,
        ``shards_done``, ``files``, ``bytes`` (on disk), ``multilabel``, ``unlabeled``,
        ``num_classes``, ``classes``, ``task`` (``"classification"`` or ``"regression"``),
        ``targets`` (a regression cache's target names, else None), ``skipped`` (records),
        ``upscaled`` (a count),
        ``config``, ``source`` and ``software`` (versions that built it).

    Raises:
        FileNotFoundError, ValueError: as :func:`~xla_utils.cache.read_manifest`.
    """
    out = Store(path)
    m = load_manifest(out)
    sizes = out.sizes()
    files = [MANIFEST, LABELS] + [s["file"] for s in m["shards"]]
    present = [f for f in files if f in sizes]
    return {
        "path": out.root,
        "complete": m["complete"],
        "num_images": m["num_images"] if m["complete"] else sum(s["num_images"] for s in m["shards"]),
        "num_sources": m["source"]["num_items"],
        "image_size": m["image_size"],
        "num_variants": m["num_variants"],
        "codec": m["codec"],
        "num_shards": m["num_shards"],
        "shards_done": len(m["shards"]),
        "files": len(present),
        "bytes": sum(sizes[f] for f in present),
        "multilabel": m["multilabel"],
        "unlabeled": bool(m.get("unlabeled", False)),
        "num_classes": len(m["classes"] or []),
        "classes": m["classes"],
        "task": m.get("task", "classification"),
        "targets": m.get("targets"),
        "skipped": m["skipped"],
        "upscaled": len(m["upscaled"]),
        "config": m["config"],
        "source": m["source"],
        "software": m["software"],
    }


@dataclass
class VerifyReport:
    """Outcome of :func:`verify_cache`.

    Attributes:
        ok: False when anything is wrong.
        problems: one line per problem.
        bad_files: file names (relative to the cache) that are missing or damaged.
        checked_files: shard files whose crc32 was computed.
        checked_bytes: bytes read for those.
    """

    ok: bool
    problems: list[str]
    bad_files: list[str]
    checked_files: int
    checked_bytes: int


def verify_cache(path: str | os.PathLike, full: bool = False) -> VerifyReport:
    """Check a cache: manifest, every shard's presence, size and crc32, and the labels.

    Reads every byte of the cache (crc32 runs at disk speed).

    Args:
        path: the cache folder or URL prefix (``gs://...``; shards are streamed, and
            downloaded one at a time to a temporary file for ``full``).
        full: also parse every shard (npy header shape, JPEG offset table) and decode
            every JPEG. Default False.

    Returns:
        A :class:`VerifyReport`; an incomplete build is a problem.

    Raises:
        FileNotFoundError, ValueError: the manifest is missing or unreadable (as
            :func:`~xla_utils.cache.read_manifest`).
    """
    out = Store(path)
    problems: list[str] = []
    bad: list[str] = []
    m = load_manifest(out)
    if not m["complete"]:
        problems.append(f"incomplete build: {len(m['shards'])}/{m['num_shards']} shards done "
                        "(rerun the build command to finish it)")
    expected = set(range(m["num_shards"]))
    checked, nbytes = 0, 0
    sizes = out.sizes()
    for s in m["shards"]:
        expected.discard(s["index"])
        err, read = _check_shard(out, s, sizes.get(s["file"]), m, full)
        checked, nbytes = checked + read, nbytes + (s["bytes"] if read else 0)
        if err:
            problems.append(f"{s['file']}: {err}")
            bad.append(s["file"])
    if m["complete"]:
        if expected:
            problems.append(f"manifest lacks shards {sorted(expected)[:10]}")
        try:
            lab = np.load(io.BytesIO(out.read_bytes(LABELS)))
            if len(lab) != m["num_images"]:
                problems.append(f"{LABELS}: {len(lab)} labels for {m['num_images']} images")
                bad.append(LABELS)
        except (OSError, ValueError) as e:
            problems.append(f"{LABELS}: unreadable ({e})")
            bad.append(LABELS)
    return VerifyReport(ok=not problems, problems=problems, bad_files=bad, checked_files=checked,
                        checked_bytes=nbytes)


def _check_shard(out: Store, s: dict[str, Any], size: int | None, m: dict[str, Any],
                 full: bool) -> tuple[str | None, bool]:
    """(what is wrong with shard entry ``s`` of manifest ``m`` or None, whether its crc32 was
    computed); ``size`` is its listed size (None: not listed)."""
    if size is None:
        return "missing", False
    if size != s["bytes"]:
        return f"{size} bytes, manifest says {s['bytes']}", False
    crc = out.crc32(s["file"])
    if crc != s["crc32"]:
        return f"crc32 {crc:08x} != manifest {s['crc32']:08x} (corrupted)", True
    if not full:
        return None, True
    h, w = m["image_size"]
    args = (m["codec"], m["num_variants"], s["num_images"], h, w)
    if not out.is_url:
        return _check_shard_contents(out.local(s["file"]), *args), True
    with tempfile.TemporaryDirectory(prefix="xla_utils-verify-") as tmp:
        f = Path(tmp, s["file"])
        out.download(s["file"], f, s["bytes"], s["crc32"])
        return _check_shard_contents(f, *args), True


def _check_shard_contents(f: Path, codec: str, V: int, n: int, h: int, w: int) -> str | None:
    """What is wrong inside shard file ``f`` of ``V`` variants x ``n`` images of ``h`` x ``w``
    (``None`` when nothing is): array shape (raw), offset table and every JPEG (jpeg)."""
    if codec == "raw":
        arr = np.load(f, mmap_mode="r") if n else None
        if arr is not None and arr.shape != (V, n, h, w, 3):
            return f"array shape {arr.shape} != {(V, n, h, w, 3)}"
        return None
    data = np.fromfile(f, dtype=np.uint8)
    try:
        offsets = read_jpeg_index(data)
    except ValueError:
        return "bad JPEG shard header"
    count = len(offsets) - 1
    if count != V * n:
        return "bad JPEG shard header"
    if np.any(np.diff(offsets) <= 0) or int(offsets[-1]) != len(data):
        return "bad JPEG offset table"
    for k in range(count):
        try:
            with Image.open(io.BytesIO(data[offsets[k]:offsets[k + 1]].tobytes())) as im:
                if im.size != (w, h):
                    return f"entry {k}: {im.size} != {(w, h)}"
                im.load()
        except Exception as e:
            return f"entry {k} does not decode ({describe(e)})"
    return None
