"""The on-disk format of an image cache: names, constants, the manifest and the shard layouts.

Both sides of the cache import this module and nothing else of each other: the builder
(:mod:`xla_utils.cache.builder`) writes what is described here, the reader
(:mod:`xla_utils.data`) and :mod:`xla_utils.cache.verify` read it.

Layout of a cache directory:

``manifest.json``
    format version, config and its fingerprint, source fingerprint, class names,
    per-shard file name / bytes / crc32 / labels / image ids, skipped images (with
    their ids: a test set remembers every id it was asked for) and upscaled images,
    and ``complete`` (false until the last shard and ``labels.npy`` are in place).
``labels.npy``
    labels in cache order: ``int64[N]`` class indices (-1 = unlabelled),
    ``uint8[N, C]`` multi-hot, or ``float32[N, k]`` regression targets (manifest
    ``"task": "regression"`` and ``"targets"``: the k targets' names; ``classes`` empty).
``shard-00000.npy`` ... (codec ``raw``, the default)
    a standard ``.npy`` array ``uint8[V, n, H, W, 3]``: every variant of a
    contiguous block of ``n`` source images, variant-major, so epoch ``e`` reads
    only slab ``e % V`` of each shard. ``np.load(f, mmap_mode="r")`` opens it.
``shard-00000.jpgs`` ... (codec ``jpeg``)
    ``b"XLUJPG01"``, uint64 count, uint64 offsets[count + 1] (absolute), then the
    concatenated JPEG files in the same (variant, image) order.

Only numpy, the standard library and :mod:`xla_utils.utils.suggest` are imported here, so the
reader stays light.
"""
from __future__ import annotations

import io
import json
import os
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from ..utils.suggest import by_similarity, similar_path

__all__ = ["FORMAT", "FORMAT_VERSION", "MANIFEST", "LABELS", "JPEG_MAGIC", "shard_name", "npy_header",
           "jpeg_shard_chunks", "read_jpeg_index", "manifest_text", "read_manifest", "parse_manifest",
           "cached_ids", "skipped_records", "requested_ids"]

FORMAT = "xla_utils-image-cache"
# 2: regression caches (manifest "task": "regression", "targets": names; float32 labels).
# Classification caches are still written as version 1, which every reader reads.
FORMAT_VERSION = 2
MANIFEST = "manifest.json"
LABELS = "labels.npy"
JPEG_MAGIC = b"XLUJPG01"
# Fields every manifest has (read_manifest refuses one without them).
MANIFEST_KEYS = ("complete", "num_images", "image_size", "num_variants", "codec", "multilabel", "classes",
                 "num_shards", "config", "config_fingerprint", "source", "skipped", "upscaled", "shards")


def shard_name(codec: str, k: int) -> str:
    """File name of shard ``k`` for ``codec`` (``"raw"`` or ``"jpeg"``), e.g. ``shard-00003.npy``."""
    return f"shard-{k:05d}." + ("npy" if codec == "raw" else "jpgs")


def npy_header(shape: tuple[int, ...]) -> bytes:
    """The ``.npy`` (version 1.0) header of a C-order ``uint8`` array of ``shape``."""
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, {"descr": "|u1", "fortran_order": False, "shape": shape})
    return buf.getvalue()


def jpeg_shard_chunks(jpegs: Sequence[bytes]) -> list[Any]:
    """The byte chunks of a JPEG shard holding ``jpegs`` in order: magic, count, offsets, files."""
    table = 8 + 8 + 8 * (len(jpegs) + 1)
    offsets = np.cumsum([table] + [len(b) for b in jpegs], dtype=np.uint64)
    return [JPEG_MAGIC, np.uint64(len(jpegs)).tobytes(), offsets.astype("<u8").tobytes(), *jpegs]


def read_jpeg_index(data: np.ndarray) -> np.ndarray:
    """The offset table of a JPEG shard.

    Args:
        data: the shard's bytes as a ``uint8`` array (a memory map is fine: only the
            header and the table are read).

    Returns:
        ``int64[count + 1]`` absolute byte offsets: entry ``k`` is
        ``data[offsets[k]:offsets[k + 1]]``.

    Raises:
        ValueError: ``data`` does not start with the JPEG shard magic or is too short
            for its table.
    """
    if len(data) < 16 or data[:8].tobytes() != JPEG_MAGIC:
        raise ValueError("not a JPEG shard (bad magic)")
    count = int(data[8:16].view("<u8")[0])
    table = data[16:16 + 8 * (count + 1)]
    if len(table) != 8 * (count + 1):
        raise ValueError(f"JPEG shard cut short: its table of {count} entries is incomplete")
    return np.array(table.view("<u8"), dtype=np.int64)


def cached_ids(manifest: dict[str, Any], where: str) -> list[str]:
    """The id of every cached image, in cache order (``CachedImageDataset.ids``).

    Caches built before ids were recorded: from a Python dataset the source indices are
    used; from files ``ValueError`` naming ``where`` (the cache), since guessing file
    names could silently misalign a submission.
    """
    shards = manifest["shards"]
    if all("ids" in s for s in shards):
        return [str(i) for s in shards for i in s["ids"]]
    if manifest["source"].get("kind") == "dataset":
        skipped = {e["source_index"] for e in manifest["skipped"]}
        return [str(i) for s in shards for i in range(s["first_source"], s["first_source"] + s["num_sources"])
                if i not in skipped]
    raise ValueError(f"the cache in {where} was built by an older xla_utils that did not record image "
                     "ids: rebuild it (build_cache(..., overwrite=True) or tpu_cache_ds build ... "
                     "--overwrite) to get CachedImageDataset.ids")


def skipped_records(manifest: dict[str, Any]) -> list[dict[str, Any]]:
    """The manifest's ``skipped`` records (``source_index``, ``path``, ``id``, ``reason``),
    in source order. Caches written before skipped ids were recorded get the id a cached
    image would have had: its relative path (folder and CSV sources) or its index
    (datasets)."""
    dataset = manifest["source"].get("kind") == "dataset"
    return [dict(e, id=str(e.get("id", e["source_index"] if dataset else e["path"])))
            for e in sorted(manifest["skipped"], key=lambda e: e["source_index"])]


def requested_ids(manifest: dict[str, Any], where: str) -> list[str]:
    """Every id the build was asked to cache, in source order: the cached images' and the
    skipped ones' (a test set's full list of ids, e.g. ``sample_submission.csv``'s)."""
    skipped = {e["source_index"]: e["id"] for e in skipped_records(manifest)}
    cached = iter(cached_ids(manifest, where))
    return [skipped[i] if i in skipped else next(cached) for s in manifest["shards"]
            for i in range(s["first_source"], s["first_source"] + s["num_sources"])]


def manifest_text(manifest: dict[str, Any]) -> str:
    """``manifest`` as JSON text, one line per entry of its list-of-dict fields.

    One JSON object per line keeps a 100k-label manifest readable and diffable.
    """
    def dump(v: Any) -> str:
        return json.dumps(v, separators=(",", ":"))

    lines = ["{"]
    items = list(manifest.items())
    for n, (k, v) in enumerate(items):
        comma = "," if n < len(items) - 1 else ""
        if isinstance(v, list) and v and all(isinstance(e, dict) for e in v):
            body = ",\n".join("    " + dump(e) for e in v)
            lines.append(f'  "{k}": [\n{body}\n  ]{comma}')
        else:
            lines.append(f'  "{k}": {json.dumps(v)}{comma}')
    lines.append("}\n")
    return "\n".join(lines)


def read_manifest(path: str | os.PathLike) -> dict[str, Any]:
    """Load and check ``path/manifest.json``.

    Args:
        path: a cache folder, or its ``manifest.json`` itself.

    Returns:
        The manifest as a dict (see the module docstring for its fields).

    Raises:
        FileNotFoundError: ``path`` does not exist, or is a folder without a
            manifest; the message names ``path`` and any caches one level below it.
        ValueError: the manifest is unreadable (not JSON, cut short, missing fields)
            or from a newer xla_utils; the message names the file and the fix.
    """
    p = Path(path).expanduser()
    if p.is_dir():
        mpath = p / MANIFEST
        if not mpath.is_file():
            raise FileNotFoundError(f"{p} is not an xla_utils image cache (it has no {MANIFEST})"
                                    + _caches_below(p) + _how_to_build(p))
    elif p.is_file():
        mpath = p
    else:
        raise FileNotFoundError(f"{p} does not exist" + _nearest_parent(p) + _how_to_build(p))
    with open(mpath, "rb") as f:
        return parse_manifest(f.read(), str(mpath))


def parse_manifest(data: bytes | str, where: str) -> dict[str, Any]:
    """Parse and check the text of a ``manifest.json`` read from ``where`` (a path or URL).

    Raises:
        ValueError: as :func:`read_manifest`; the message names ``where`` and the fix.
    """
    folder = where.rsplit("/", 1)[0] if "/" in where else "."
    fix = (f"the cache in {folder} is damaged or was copied incompletely: rebuild it with the same "
           "build command plus overwrite=True (--overwrite), or copy it again; `tpu_cache_ds verify "
           f"{folder}` checks the other files")
    try:
        m = json.loads(data)
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError
        raise ValueError(f"{where} is not valid JSON ({e}): {fix}") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise ValueError(f"{where} is not an xla_utils image cache manifest (no \"format\": \"{FORMAT}\")")
    if m.get("format_version", 0) > FORMAT_VERSION:
        raise ValueError(f"{where} has format version {m['format_version']}; this xla_utils reads up to "
                         f"{FORMAT_VERSION}: upgrade xla_utils")
    missing = [k for k in MANIFEST_KEYS if k not in m]
    if missing:
        raise ValueError(f"{where} lacks {', '.join(missing)}: {fix}")
    return m


def _caches_below(p: Path, near: str | None = None) -> str:
    """The caches one level below ``p``: the names most like ``near`` first (a typo's
    intended folder), else sorted."""
    found = sorted(m.parent for m in p.glob(f"*/{MANIFEST}"))
    if not found:
        return ""
    if near is not None:
        order = by_similarity(near, [f.name for f in found])
        found.sort(key=lambda f: order.index(f.name))
    more = f" and {len(found) - 3} more" if len(found) > 3 else ""
    return "; caches inside it: " + ", ".join(str(f) for f in found[:3]) + more


def _nearest_parent(p: Path) -> str:
    """Where a missing path goes wrong: a close folder name at that level, the nearest
    existing folder and the caches inside it, closest to the missing name first."""
    guess, parent = similar_path(p, folders_only=True)
    hint = f"; did you mean {guess}?" if guess is not None else ""
    missing = p.expanduser().absolute().relative_to(parent).parts[0]
    return f"{hint} (the nearest existing folder is {parent}{_caches_below(parent, missing)})"


def _how_to_build(p: Path) -> str:
    return (f". Check the path (Kaggle mounts attached data sets under /kaggle/input/<name>) or build the "
            f"cache first: build_cache(SRC, {str(p)!r}) or `tpu_cache_ds build SRC {p}`")
