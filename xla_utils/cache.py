"""Sharded uint8 image cache: format, config, builder, verify and info.

Build once on any CPU machine (no TPU, no torch, no torch_xla), then train from
a handful of large memory-mapped files::

    from xla_utils import build_cache
    build_cache("train_images/", "cache/train", size=224, variants=4)   # or the
    # ``tpu_cache_ds build train_images/ cache/train --size 224 --variants 4`` command

Layout of a cache directory
---------------------------
``manifest.json``
    format version, config and its fingerprint, source fingerprint, class names,
    per-shard file name / bytes / crc32 / labels, skipped and upscaled images,
    and ``complete`` (false until the last shard and ``labels.npy`` are in place).
``labels.npy``
    labels in cache order: ``int64[N]`` class indices (-1 = unlabelled) or
    ``uint8[N, C]`` multi-hot.
``shard-00000.npy`` ... (codec ``raw``, the default)
    a standard ``.npy`` array ``uint8[V, n, H, W, 3]``: every variant of a
    contiguous block of ``n`` source images, variant-major, so epoch ``e`` reads
    only slab ``e % V`` of each shard. ``np.load(f, mmap_mode="r")`` opens it.
``shard-00000.jpgs`` ... (codec ``jpeg``)
    ``b"XLUJPG01"``, uint64 count, uint64 offsets[count + 1] (absolute), then the
    concatenated JPEG files in the same (variant, image) order.

Shard ``k`` holds source items ``[k * P, (k + 1) * P)`` where ``P``
(``images_per_shard``) follows from the config and the source length alone, so
a rerun knows which shards exist, rebuilds only the missing ones and produces
byte-identical files. Skipped images take no space; every shard records how
many images it kept. The file count is ``ceil(N / P) + 2``: it grows with bytes
over the shard size (and is at least ``min(N, 16)`` shards so that every core
has work on small data sets), never with the number of samples.

Crash safety: workers write each shard to a temporary file, fsync and rename
it; only the coordinator writes ``manifest.json`` (temp file, fsync, rename).
A finished shard is never touched again, so a failure can only lose work in
progress. Byte-identical rebuilds assume the same Pillow / numpy versions
(recorded in the manifest under ``software``).
"""
from __future__ import annotations

import contextlib
import csv
import dataclasses
import errno
import hashlib
import io
import json
import math
import multiprocessing as mp
import os
import signal
import sys
import time
import zlib
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np
from PIL import Image, ImageOps

__all__ = [
    "CacheConfig",
    "BuildReport",
    "DryRunEstimate",
    "VerifyReport",
    "BuildError",
    "BadImageError",
    "build_cache",
    "read_manifest",
    "cache_info",
    "verify_cache",
    "decode_source",
    "make_variants",
    "parse_size",
    "IMAGE_EXTENSIONS",
]

FORMAT = "xla_utils-image-cache"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
LABELS = "labels.npy"
JPEG_MAGIC = b"XLUJPG01"
# Small data sets still get this many shards so that every core has work.
MIN_SHARDS = 16
# Expected size of a q90 JPEG relative to raw pixels; fixes how many images a
# JPEG shard holds so that shards come out near ``shard_size``.
JPEG_RATIO_GUESS = 8
IMAGE_EXTENSIONS = frozenset(
    ".jpg .jpeg .jpe .jfif .png .bmp .gif .tif .tiff .webp .ppm .pgm .pbm .pnm".split()
)
_RESAMPLE = {
    "bilinear": Image.Resampling.BILINEAR,
    "bicubic": Image.Resampling.BICUBIC,
    "lanczos": Image.Resampling.LANCZOS,
}


class BuildError(RuntimeError):
    """The build cannot start or finish (bad source, config clash, locked output...)."""


class BadImageError(ValueError):
    """One source image cannot be cached; ``path`` names it, ``reason`` says why and
    ``index`` is its position in the source order (``None`` when unknown)."""

    def __init__(self, path: str, reason: str, index: int | None = None):
        super().__init__(f"{path}: {reason}")
        self.path, self.reason, self.index = path, reason, index

    def __reduce__(self):  # keep every field across the process-pool boundary
        return (type(self), (self.path, self.reason, self.index))


class _Cancelled(Exception):
    """A worker stopped because the coordinator asked it to."""


# --------------------------------------------------------------------------- config


@dataclass(frozen=True)
class CacheConfig:
    """Everything that decides the bytes of a cache (its fingerprint covers all fields).

    Attributes:
        size: output size in pixels, ``int`` (square) or ``(height, width)``. Default 224.
        variants: stored versions of each image (epoch ``e`` shows variant ``e % variants``).
            Default 1.
        augment: random-resized-crop (+ optional rotation/flip) variants; ``None`` means
            ``variants > 1``. Plain variants (``False``) use ``resize``.
        resize: plain variant: ``"crop"`` = shorter side to ``size`` then centre crop
            (no distortion, default) or ``"stretch"`` = exact resize to ``size``.
        scale: random crop area as a fraction of the image, ``(min, max)``. Default
            ``(0.25, 1.0)``: milder than torchvision's 0.08 because few variants are stored.
        ratio: random crop aspect ratio (width / height) range. Default ``(3/4, 4/3)``.
        rotate: maximum absolute rotation in degrees (uniform, crops stay inside the
            image). Default 0 (off).
        flip: bake random horizontal flips into variants. Default False: flip on the
            device with ``images_to_float(flip=True)`` instead, which costs nothing.
        seed: seed for the per-(image, variant) random streams. Default 0.
        codec: ``"raw"`` (uint8 pixels, fastest to load, default) or ``"jpeg"``
            (about 8-10x smaller, to ship a cache as a Kaggle data set).
        quality: JPEG quality for ``codec="jpeg"`` (4:2:0 chroma). Default 90.
        shard_size: target shard size in bytes. Default 256 MiB.
        resample: ``"bilinear"`` (torchvision's default, default), ``"bicubic"`` or
            ``"lanczos"``; downscaling is always antialiased.
        small: images smaller than ``size``: ``"upscale"`` (default; listed in the
            manifest under ``upscaled``) or ``"skip"`` (listed under ``skipped``).
        max_pixels: sources with more pixels (width x height, read from the header
            before decoding) are skipped as decompression bombs. Default: Pillow's
            limit, 89,478,485.
        multilabel: CSV labels: ``None`` = multi-label iff some row has several
            space-separated labels.
    """

    size: int | tuple[int, int] = 224
    variants: int = 1
    augment: bool | None = None
    resize: str = "crop"
    scale: tuple[float, float] = (0.25, 1.0)
    ratio: tuple[float, float] = (3 / 4, 4 / 3)
    rotate: float = 0.0
    flip: bool = False
    seed: int = 0
    codec: str = "raw"
    quality: int = 90
    shard_size: int = 256 * 2**20
    resample: str = "bilinear"
    small: str = "upscale"
    max_pixels: int = 89_478_485
    multilabel: bool | None = None

    def __post_init__(self) -> None:
        h, w = parse_size(self.size)
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731 (frozen dataclass)
        set_("size", (h, w))
        set_("scale", tuple(float(x) for x in self.scale))
        set_("ratio", tuple(float(x) for x in self.ratio))
        if self.augment is None:
            set_("augment", self.variants > 1)
        problems = []
        if not isinstance(self.variants, int) or self.variants < 1:
            problems.append(f"variants={self.variants!r} must be an int >= 1")
        elif self.variants > 1 and not self.augment:
            problems.append(f"variants={self.variants} with augment=False would store identical copies")
        if self.resize not in ("crop", "stretch"):
            problems.append(f"resize={self.resize!r} must be 'crop' or 'stretch'")
        if len(self.scale) != 2 or not 0 < self.scale[0] <= self.scale[1] <= 1:
            problems.append(f"scale={self.scale!r} must be (min, max) with 0 < min <= max <= 1")
        if len(self.ratio) != 2 or not 0 < self.ratio[0] <= self.ratio[1]:
            problems.append(f"ratio={self.ratio!r} must be (min, max) with 0 < min <= max")
        if not 0 <= self.rotate <= 45:
            problems.append(f"rotate={self.rotate!r} must be between 0 and 45 degrees")
        if self.codec not in ("raw", "jpeg"):
            problems.append(f"codec={self.codec!r} must be 'raw' or 'jpeg'")
        if not 1 <= self.quality <= 100:
            problems.append(f"quality={self.quality!r} must be between 1 and 100")
        if self.shard_size < 1:
            problems.append(f"shard_size={self.shard_size!r} must be a positive number of bytes")
        if self.resample not in _RESAMPLE:
            problems.append(f"resample={self.resample!r} must be one of {sorted(_RESAMPLE)}")
        if self.small not in ("upscale", "skip"):
            problems.append(f"small={self.small!r} must be 'upscale' or 'skip'")
        if self.max_pixels < 1:
            problems.append(f"max_pixels={self.max_pixels!r} must be positive")
        if problems:
            raise ValueError("invalid CacheConfig: " + "; ".join(problems))

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (tuples become lists)."""
        return json.loads(json.dumps(dataclasses.asdict(self)))

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CacheConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: (tuple(v) if isinstance(v, list) else v) for k, v in d.items() if k in known})

    def fingerprint(self) -> str:
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()[:16]

    @property
    def sample_bytes(self) -> int:
        """Raw bytes of one stored variant (H * W * 3)."""
        return self.size[0] * self.size[1] * 3

    def images_per_shard(self, num_items: int) -> int:
        """Source items per shard: ``shard_size`` worth of images, but at least
        ``min(num_items, 16)`` shards."""
        per_image = self.variants * self.sample_bytes
        if self.codec == "jpeg":
            per_image = max(1, per_image // JPEG_RATIO_GUESS)
        by_size = max(1, self.shard_size // per_image)
        return max(1, min(by_size, math.ceil(num_items / MIN_SHARDS)))


def parse_size(size: int | str | Sequence[int]) -> tuple[int, int]:
    """``224`` / ``"224"`` / ``"256x224"`` (HxW) / ``(256, 224)`` -> ``(height, width)``."""
    if isinstance(size, str):
        parts = size.lower().replace("*", "x").split("x")
        size = [int(p) for p in parts] if len(parts) > 1 else int(parts[0])
    if isinstance(size, (int, np.integer)):
        size = (int(size), int(size))
    h, w = (int(s) for s in size)
    if h < 1 or w < 1:
        raise ValueError(f"size must be positive, got {size!r}")
    return h, w


# --------------------------------------------------------------------------- decode + variants


def decode_source(item: Any, config: CacheConfig) -> tuple[Image.Image, tuple[int, int]]:
    """Open one source (file path, PIL image or HWC uint8 array) as an RGB image.

    Applies the EXIF orientation, converts any mode (L, LA, P, RGBA, CMYK, 16-bit...)
    to RGB (transparent pixels over white) and decodes large JPEGs at a reduced
    size (PIL ``draft``) that still covers the smallest crop the config can take.
    Returns the image and the source's original ``(width, height)`` after orientation.
    Raises ``BadImageError``-worthy exceptions (OSError, ValueError...) on bad input.
    """
    if isinstance(item, (str, os.PathLike)):
        with Image.open(item) as img:  # leaving the block closes the file, not the pixels
            return _prepare(img, config)
    if isinstance(item, Image.Image):
        return _prepare(item, config)
    return _prepare(Image.fromarray(_hwc_uint8(np.asarray(item))), config)


def _hwc_uint8(arr: np.ndarray) -> np.ndarray:
    if arr.ndim == 3 and arr.shape[0] in (1, 3, 4) and arr.shape[2] not in (1, 3, 4):
        arr = arr.transpose(1, 2, 0)  # CHW tensor layout
    if arr.ndim == 3 and arr.shape[2] == 1:
        arr = arr[:, :, 0]
    if arr.ndim not in (2, 3) or (arr.ndim == 3 and arr.shape[2] not in (3, 4)):
        raise ValueError(f"array of shape {arr.shape} is not an HxW, HxWx1, HxWx3 or HxWx4 image")
    if arr.dtype == np.uint16:
        arr = (arr.astype(np.uint32) * 255 + 32767) // 65535
    elif arr.dtype == bool:
        arr = arr * 255
    elif arr.dtype != np.uint8:
        raise ValueError(f"array images must be uint8 (or uint16), got {arr.dtype}")
    return np.ascontiguousarray(arr.astype(np.uint8, copy=False))


def _prepare(img: Image.Image, cfg: CacheConfig) -> tuple[Image.Image, tuple[int, int]]:
    w, h = img.size
    if w * h > cfg.max_pixels:
        raise ValueError(
            f"decompression bomb guard: {w}x{h} = {w * h / 1e6:.0f} Mpx exceeds max_pixels "
            f"({cfg.max_pixels / 1e6:.0f} Mpx)")
    try:
        orientation = img.getexif().get(0x0112, 1)
    except Exception:  # corrupt EXIF should not cost an otherwise good image
        orientation = 1
    if orientation in (5, 6, 7, 8):
        w, h = h, w
    if img.format == "JPEG":
        # Smallest crop side we may cut is sqrt(scale_min) of the image; decode at
        # least that crop at output resolution (slight upscaling of extreme aspect
        # ratios is accepted: draft only steps by powers of two).
        need = max(cfg.size)
        if cfg.augment:
            need = math.ceil(need / math.sqrt(cfg.scale[0]))
        img.draft("RGB", (need, need))
    img.load()
    if orientation in range(2, 9):
        img = ImageOps.exif_transpose(img)
    return _to_rgb(img), (w, h)


def _to_rgb(img: Image.Image) -> Image.Image:
    mode = img.mode
    if mode == "RGB":
        return img
    if mode.startswith("I") or mode == "F":  # 16/32-bit integer or float grey
        a = np.asarray(img, dtype=np.float64)
        if mode.startswith("I;16") or (mode == "I" and a.max(initial=0) > 255):
            a = a / 257.0
        elif mode == "F" and a.max(initial=0) <= 1.0:
            a = a * 255.0
        return Image.fromarray(np.clip(a + 0.5, 0, 255).astype(np.uint8)).convert("RGB")
    if mode == "P":
        img = img.convert("RGBA" if "transparency" in img.info else "RGB")
        mode = img.mode
    if mode in ("RGBA", "LA", "PA", "RGBa", "La"):
        rgba = img.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return img.convert("RGB")  # L, 1, CMYK, YCbCr, LAB, HSV


def make_variants(image: Image.Image, config: CacheConfig, index: int) -> list[np.ndarray]:
    """The ``config.variants`` stored versions of one decoded RGB image, as
    ``uint8[H, W, 3]`` arrays. Deterministic per ``(config.seed, index, variant)``.

    Plain (``augment=False``): one centre crop (or stretch) of the whole image.
    Augmented: random-resized crops (area ``scale``, aspect ``ratio``), optionally
    rotated by up to ``rotate`` degrees about the crop centre and flipped.
    """
    h_out, w_out = config.size
    resample = _RESAMPLE[config.resample]
    w, h = image.size
    if not config.augment:
        if config.resize == "stretch":
            box = (0.0, 0.0, float(w), float(h))
        else:
            bw, bh = min(w, h * w_out / h_out), min(h, w * h_out / w_out)
            box = ((w - bw) / 2, (h - bh) / 2, (w + bw) / 2, (h + bh) / 2)
        return [np.asarray(image.resize((w_out, h_out), resample, box=box, reducing_gap=3.0))]
    out = []
    for v in range(config.variants):
        rng = np.random.default_rng([config.seed, index, v])
        cx, cy, bw, bh, angle = _sample_crop(rng, w, h, config)
        arr = np.asarray(_render(image, cx, cy, bw, bh, angle, (w_out, h_out), resample))
        if config.flip and rng.random() < 0.5:
            arr = arr[:, ::-1]
        out.append(np.ascontiguousarray(arr))
    return out


def _sample_crop(rng: np.random.Generator, w: int, h: int, cfg: CacheConfig):
    """torchvision's RandomResizedCrop sampling (10 tries, then a centre crop),
    extended so that the rotated crop's bounding box stays inside the image."""
    angle = float(rng.uniform(-cfg.rotate, cfg.rotate)) if cfg.rotate else 0.0
    c, s = abs(math.cos(math.radians(angle))), abs(math.sin(math.radians(angle)))
    log_r = (math.log(cfg.ratio[0]), math.log(cfg.ratio[1]))
    for _ in range(10):
        area = w * h * rng.uniform(*cfg.scale)
        r = math.exp(rng.uniform(*log_r))
        bw, bh = math.sqrt(area * r), math.sqrt(area / r)
        ew, eh = bw * c + bh * s, bw * s + bh * c
        if ew <= w and eh <= h:
            return rng.uniform(ew / 2, w - ew / 2), rng.uniform(eh / 2, h - eh / 2), bw, bh, angle
    r_img = w / h
    if r_img < cfg.ratio[0]:
        bw, bh = w, w / cfg.ratio[0]
    elif r_img > cfg.ratio[1]:
        bw, bh = h * cfg.ratio[1], h
    else:
        bw, bh = w, h
    return w / 2, h / 2, bw, bh, 0.0


def _render(img, cx, cy, bw, bh, angle, out_size, resample) -> Image.Image:
    w_out, h_out = out_size
    if not angle:
        return img.resize(out_size, resample, box=(cx - bw / 2, cy - bh / 2, cx + bw / 2, cy + bh / 2),
                          reducing_gap=3.0)
    # Downscale the rotated crop's bounding box isotropically (antialiased), then
    # one affine pass does the rotation and the remaining (< ratio) anisotropy.
    t = math.radians(angle)
    c, s = math.cos(t), math.sin(t)
    ew, eh = bw * abs(c) + bh * abs(s), bw * abs(s) + bh * abs(c)
    k = min(1.0, max(w_out / bw, h_out / bh))  # never upscale in the first step
    rw, rh = max(1, math.ceil(ew * k)), max(1, math.ceil(eh * k))
    region = img.resize((rw, rh), resample, box=(cx - ew / 2, cy - eh / 2, cx + ew / 2, cy + eh / 2),
                        reducing_gap=3.0)
    kx, ky = rw / ew, rh / eh  # region pixels per source pixel
    sx, sy = bw / w_out, bh / h_out  # source pixels per output pixel
    # output (x, y) -> source offset from the crop centre (rotate) -> region coordinates
    a, b = c * sx * kx, -s * sy * kx
    d, e = s * sx * ky, c * sy * ky
    x0, y0 = w_out / 2, h_out / 2
    coeffs = (a, b, rw / 2 - a * x0 - b * y0, d, e, rh / 2 - d * x0 - e * y0)
    return region.transform(out_size, Image.Transform.AFFINE, coeffs, Image.Resampling.BILINEAR)


def _encode_jpeg(arr: np.ndarray, quality: int) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, "JPEG", quality=quality)
    return buf.getvalue()


# --------------------------------------------------------------------------- sources


@dataclass
class _Source:
    kind: str  # "folder" | "csv" | "dataset"
    description: str
    num_items: int
    paths: list[str] | None = None  # absolute file paths (folder / csv)
    names: list[str] | None = None  # relative names for reports
    labels: list[Any] | None = None  # int, list[int] (multi-label) or -1
    errors: dict[int, str] = field(default_factory=dict)  # item -> reason it will be skipped
    classes: list[str] | None = None
    multilabel: bool = False
    fingerprint: str = ""
    ignored: list[str] = field(default_factory=list)
    dataset: Any = None
    unlabeled: bool = False  # no labels at all (a test set, or a flat folder without labels=)

    def name(self, i: int) -> str:
        return self.names[i] if self.names is not None else f"dataset[{i}]"

    def item_id(self, i: int) -> str:
        """The id recorded for item ``i``: its path relative to the source folder,
        the CSV's first-column value as written, or the dataset index."""
        return self.names[i] if self.names is not None else str(i)

    def to_dict(self) -> dict[str, Any]:
        d = {"kind": self.kind, "path": self.description, "num_items": self.num_items,
             "fingerprint": self.fingerprint}
        if self.ignored:
            d["ignored_files"] = len(self.ignored)
            d["ignored_examples"] = self.ignored[:10]
        return d


def _resolve_source(source: Any, labels_csv: str | os.PathLike | None, cfg: CacheConfig,
                    classes: Sequence[str] | None, unlabeled: bool = False) -> _Source:
    if unlabeled and labels_csv is not None:
        raise BuildError("unlabeled=True (--unlabeled) and labels= (--labels) contradict each other: "
                         "pass the test set's CSV of file names as the source instead")
    if isinstance(source, (str, os.PathLike)):
        p = Path(source).expanduser().resolve()
        if labels_csv is not None:
            if not p.is_dir():
                raise BuildError(f"source {p} must be the image folder the CSV {labels_csv} refers to")
            return _csv_source(Path(labels_csv).expanduser().resolve(), p, cfg, classes)
        if p.is_file() and p.suffix.lower() in (".csv", ".tsv", ".txt"):
            return _csv_source(p, p.parent, cfg, classes, unlabeled)
        if p.is_dir():
            return _folder_source(p, classes, unlabeled)
        raise BuildError(f"source {p} is neither a folder nor a CSV file (does it exist?)")
    if hasattr(source, "__getitem__") and hasattr(source, "__len__"):
        if labels_csv is not None:
            raise BuildError("labels=FILE.csv only applies to folder sources")
        return _dataset_source(source, classes, unlabeled)
    raise TypeError(f"source must be a folder, a CSV file or a map-style dataset, got {type(source).__name__}")


def _is_image_name(name: str) -> bool:
    return Path(name).suffix.lower() in IMAGE_EXTENSIONS


def _walk_files(root: Path) -> list[Path]:
    out = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=True):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        out.extend(Path(dirpath) / f for f in sorted(filenames) if not f.startswith("."))
    return out


def _folder_source(root: Path, classes: Sequence[str] | None, unlabeled: bool = False) -> _Source:
    subdirs = sorted(d.name for d in root.iterdir() if d.is_dir() and not d.name.startswith("."))
    src = _Source(kind="folder", description=str(root), num_items=0, paths=[], names=[], labels=[])
    top_files = sorted(f for f in root.iterdir() if f.is_file() and not f.name.startswith("."))
    if unlabeled:  # every image below root, sub-folders included; ids are relative paths
        src.classes, src.unlabeled = (list(classes) if classes is not None else []), True
        for f in _walk_files(root):
            rel = f.relative_to(root).as_posix()
            if _is_image_name(f.name):
                src.paths.append(str(f))
                src.names.append(rel)
                src.labels.append(-1)
            else:
                src.ignored.append(rel)
    elif subdirs:  # one sub-folder per class (torchvision ImageFolder layout)
        src.classes = list(classes) if classes is not None else subdirs
        index = {c: i for i, c in enumerate(src.classes)}
        src.ignored = [f.name for f in top_files]
        for d in subdirs:
            for f in _walk_files(root / d):
                rel = f.relative_to(root).as_posix()
                if not _is_image_name(f.name):
                    src.ignored.append(rel)
                    continue
                if d not in index:
                    src.errors[len(src.paths)] = f"class folder {d!r} is not in the given classes"
                src.paths.append(str(f))
                src.names.append(rel)
                src.labels.append(index.get(d, -1))
    else:  # flat folder without labels=: unlabelled images, said loudly in the build summary
        src.classes, src.unlabeled = (list(classes) if classes is not None else []), True
        for f in top_files:
            if _is_image_name(f.name):
                src.paths.append(str(f))
                src.names.append(f.name)
                src.labels.append(-1)
            else:
                src.ignored.append(f.name)
    return _finish_file_source(src)


def _csv_source(csv_path: Path, root: Path, cfg: CacheConfig, classes: Sequence[str] | None,
                unlabeled: bool = False) -> _Source:
    if not csv_path.is_file():
        raise BuildError(f"labels CSV {csv_path} does not exist")
    with open(csv_path, newline="", encoding="utf-8-sig") as f:
        sample = f.read(4096)
        f.seek(0)
        delimiter = "\t" if sample.count("\t") > sample.count(",") else ","
        rows = [r for r in csv.reader(f, delimiter=delimiter) if r and any(c.strip() for c in r)]
    first = rows[0][0].strip() if rows else ""
    if rows and not _csv_path(root, first).exists() and (
            first.lower() in _HEADER_NAMES or (len(rows) > 1 and _csv_path(root, rows[1][0].strip()).exists())):
        rows = rows[1:]  # a header such as "image,labels"
    if not rows:
        raise BuildError(f"labels CSV {csv_path} has no rows")
    cells = [(r[0].strip(), r[1].strip() if len(r) > 1 and not unlabeled else "") for r in rows]
    if unlabeled:  # a test set's CSV (e.g. sample_submission.csv): first column = file name / id
        src = _Source(kind="csv", description=str(csv_path), num_items=0, paths=[], names=[], labels=[],
                      classes=list(classes) if classes is not None else [], unlabeled=True)
        for rel, _ in cells:
            src.paths.append(str(_csv_path(root, rel)))
            src.names.append(rel)
            src.labels.append(-1)
        return _finish_file_source(src)
    token_lists = [cell.split() for _, cell in cells]
    multi = cfg.multilabel
    if multi is None:
        multi = any(len(t) > 1 for t in token_lists)
    elif not multi:
        for n, t in enumerate(token_lists):
            if len(t) > 1:
                raise BuildError(f"{csv_path} row {n + 1} has several labels {' '.join(t)!r} "
                                 "but multilabel=False")
    tokens = {t for ts in token_lists for t in ts}
    if classes is not None:
        class_list = list(classes)
    elif tokens and all(t.isdigit() for t in tokens):
        class_list = [str(i) for i in range(max(int(t) for t in tokens) + 1)]
    else:
        class_list = sorted(tokens)
    index = {c: i for i, c in enumerate(class_list)}
    src = _Source(kind="csv", description=str(csv_path), num_items=0, paths=[], names=[], labels=[],
                  classes=class_list, multilabel=multi)
    for n, ((rel, _), ts) in enumerate(zip(cells, token_lists)):
        p = _csv_path(root, rel)
        unknown = [t for t in ts if t not in index]
        if unknown:
            src.errors[n] = f"label {unknown[0]!r} is not in the given classes"
        if multi:
            src.labels.append(sorted({index[t] for t in ts if t in index}))
        else:
            src.labels.append(index[ts[0]] if ts and ts[0] in index else -1)
        src.paths.append(str(p))
        src.names.append(rel)
    return _finish_file_source(src)


_HEADER_NAMES = {"path", "paths", "file", "filename", "file_name", "filepath", "fname", "image", "images",
                 "image_id", "image_name", "img", "id", "name"}


def _csv_path(root: Path, rel: str) -> Path:
    p = root / rel
    if not p.exists() and not p.suffix:  # CSVs often list ids without the extension
        for ext in (".jpg", ".png", ".jpeg"):
            if p.with_name(p.name + ext).exists():
                return p.with_name(p.name + ext)
    return p


def _finish_file_source(src: _Source) -> _Source:
    src.num_items = len(src.paths)
    h = hashlib.sha256()
    for name, path, label in zip(src.names, src.paths, src.labels):
        try:
            size = os.stat(path).st_size
        except OSError:
            size = -1
        h.update(f"{name}\0{size}\0{label}\n".encode())
    h.update(json.dumps([src.classes, src.multilabel, sorted(src.errors.items())]).encode())
    # (src.unlabeled is not hashed: a flat folder built without unlabeled=True and
    # rebuilt with it is the same cache, and the rerun finds it complete)
    src.fingerprint = h.hexdigest()[:16]
    return src


def _dataset_source(ds: Any, classes: Sequence[str] | None, unlabeled: bool = False) -> _Source:
    desc = f"{type(ds).__module__}.{type(ds).__qualname__}"
    if unlabeled:  # items are images, or tuples whose first element is the image
        n = len(ds)
        fp = hashlib.sha256(f"{desc}\0{n}\0unlabeled\0{list(classes or [])}".encode())
        return _Source(kind="dataset", description=desc, num_items=n, dataset=ds, unlabeled=True,
                       classes=list(classes or []), fingerprint=fp.hexdigest()[:16])
    if classes is None:
        found = getattr(ds, "classes", None)
        if isinstance(found, (list, tuple)) and all(isinstance(c, str) for c in found):
            classes = found
    n = len(ds)
    multi = False
    if n:  # the first item's label says single- or multi-label (and the multi-hot width)
        try:
            first = np.asarray(_as_numpy(ds[0][1]))
        except Exception:
            first = np.asarray(0)
        multi = first.ndim == 1
        if multi and classes is None:
            classes = [str(i) for i in range(first.shape[0])]
    fp = hashlib.sha256(f"{desc}\0{n}\0{multi}\0{list(classes) if classes is not None else None}".encode())
    return _Source(kind="dataset", description=desc, num_items=n, dataset=ds, multilabel=multi,
                   classes=list(classes) if classes is not None else None, fingerprint=fp.hexdigest()[:16])


def _as_numpy(x: Any) -> Any:
    if hasattr(x, "detach"):  # a torch tensor from the user's dataset
        return x.detach().cpu().numpy()
    return x


def _dataset_label(label: Any, multilabel: bool) -> int | list[int]:
    """int-like -> int; a 1-D multi-hot vector -> sorted indices of its positives."""
    arr = np.asarray(-1 if label is None else _as_numpy(label))
    if arr.ndim == 0 and not multilabel:
        return int(arr)
    if arr.ndim == 1 and multilabel:
        return [int(i) for i in np.flatnonzero(arr > 0.5)]
    kind = "a multi-hot vector" if multilabel else "a class index"
    raise ValueError(f"label of shape {arr.shape} is not {kind} like the first item's")


# --------------------------------------------------------------------------- worker side

_W: dict[str, Any] = {}


def _init_worker(src: _Source, cfg: CacheConfig, out: str, strict: bool, counter, stop_at) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the coordinator handles Ctrl-C
    if sys.platform == "linux":
        with contextlib.suppress(Exception):  # die with the coordinator (SIGKILL included)
            import ctypes
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    Image.MAX_IMAGE_PIXELS = max(cfg.max_pixels, Image.MAX_IMAGE_PIXELS or 0)
    _W.update(src=src, cfg=cfg, out=Path(out), strict=strict, counter=counter, stop_at=stop_at)


def _load_item(src: _Source, cfg: CacheConfig, i: int):
    """Decode source item ``i``: (rgb image, label, (w, h)). Raises on bad input."""
    if i in src.errors:
        raise ValueError(src.errors[i])
    if src.dataset is not None:
        item = src.dataset[i]
        if src.unlabeled:
            img, wh = decode_source(item[0] if isinstance(item, (tuple, list)) and item else item, cfg)
            return img, -1, wh
        if not isinstance(item, (tuple, list)) or len(item) < 2:
            raise ValueError(f"dataset items must be (image, label) pairs, got {type(item).__name__}")
        img, wh = decode_source(item[0], cfg)
        return img, _dataset_label(item[1], src.multilabel), wh
    img, wh = decode_source(src.paths[i], cfg)
    return img, src.labels[i], wh


def _describe(e: BaseException) -> str:
    if isinstance(e, FileNotFoundError):
        return "file not found"
    if isinstance(e, IsADirectoryError):
        return "is a directory"
    msg = str(e).replace("\n", " ")
    return f"{type(e).__name__}: {msg}"[:300]


def _process_item(src: _Source, cfg: CacheConfig, i: int):
    """(variants, label, note) for item ``i``; note is an 'upscaled' record or None."""
    img, label, (w, h) = _load_item(src, cfg, i)
    note = None
    if w < cfg.size[1] or h < cfg.size[0]:
        if cfg.small == "skip":
            raise ValueError(f"smaller than the target {cfg.size[1]}x{cfg.size[0]} ({w}x{h})")
        note = {"source_index": i, "path": src.name(i), "size": [w, h]}
    return make_variants(img, cfg, i), label, note


def _shard_name(cfg: CacheConfig, k: int) -> str:
    return f"shard-{k:05d}." + ("npy" if cfg.codec == "raw" else "jpgs")


def _npy_header(shape: tuple[int, ...]) -> bytes:
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, {"descr": "|u1", "fortran_order": False, "shape": shape})
    return buf.getvalue()


def _build_shard(k: int, start: int, stop: int) -> dict[str, Any]:
    """Worker task: build shard ``k`` from source items [start, stop) and write it atomically."""
    src, cfg, out, strict = _W["src"], _W["cfg"], _W["out"], _W["strict"]
    counter, stop_at = _W["counter"], _W["stop_at"]
    h, w = cfg.size
    V = cfg.variants
    pixels = np.empty((V, stop - start, h, w, 3), np.uint8) if cfg.codec == "raw" else None
    jpegs: list[list[bytes]] = [[] for _ in range(V)]
    labels, ids, skipped, upscaled = [], [], [], []
    for i in range(start, stop):
        if i >= stop_at.value:  # a bad item at or before i is known (strict), or the build stops
            raise _Cancelled()
        try:
            variants, label, note = _process_item(src, cfg, i)
        except Exception as e:  # any failure of one item (decoder, user dataset) skips it
            if strict:
                with stop_at.get_lock():  # items after this one are no longer needed
                    stop_at.value = min(stop_at.value, i)
                raise BadImageError(src.name(i), _describe(e), i) from None
            skipped.append({"source_index": i, "path": src.name(i), "reason": _describe(e)})
        else:
            for v, arr in enumerate(variants):
                if pixels is not None:
                    pixels[v, len(labels)] = arr
                else:
                    jpegs[v].append(_encode_jpeg(arr, cfg.quality))
            labels.append(label)
            ids.append(src.item_id(i))
            if note:
                upscaled.append(note)
        with counter.get_lock():
            counter.value += 1
    n = len(labels)
    if pixels is not None:
        chunks = [_npy_header((V, n, h, w, 3))] + [pixels[v, :n] for v in range(V)]
    else:
        flat = [b for v in range(V) for b in jpegs[v]]
        table = 8 + 8 + 8 * (len(flat) + 1)
        offsets = np.cumsum([table] + [len(b) for b in flat], dtype=np.uint64)
        chunks = [JPEG_MAGIC, np.uint64(len(flat)).tobytes(), offsets.astype("<u8").tobytes()] + flat
    name = _shard_name(cfg, k)
    nbytes, crc = _atomic_write(out / name, chunks)
    return {"index": k, "file": name, "first_source": start, "num_sources": stop - start,
            "num_images": n, "bytes": nbytes, "crc32": crc, "labels": labels, "ids": ids,
            "skipped": skipped, "upscaled": upscaled}


def _atomic_write(path: Path, chunks: Sequence[Any]) -> tuple[int, int]:
    """Write chunks to ``path`` via temp file + fsync + rename. Returns (bytes, crc32)."""
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    crc, nbytes = 0, 0
    with open(tmp, "wb") as f:
        for c in chunks:
            if not len(c):  # an empty slab (every image of the shard skipped) cannot be cast
                continue
            mv = memoryview(c).cast("B") if not isinstance(c, bytes) else c
            f.write(mv)
            crc = zlib.crc32(mv, crc)
            nbytes += len(mv)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return nbytes, crc


def _pilot_item(i: int) -> tuple[float, list[int] | str]:
    """Dry-run task: seconds to process item ``i`` and its encoded bytes per variant
    (or the reason it would be skipped)."""
    src, cfg = _W["src"], _W["cfg"]
    t0 = time.perf_counter()
    try:
        variants, _, _ = _process_item(src, cfg, i)
        sizes = [len(_encode_jpeg(a, cfg.quality)) if cfg.codec == "jpeg" else a.nbytes for a in variants]
    except Exception as e:
        return time.perf_counter() - t0, _describe(e)
    return time.perf_counter() - t0, sizes


# --------------------------------------------------------------------------- coordinator


@dataclass
class BuildReport:
    """Outcome of :func:`build_cache`. Sizes in bytes, times in seconds."""

    path: str
    num_sources: int
    num_images: int
    num_shards: int
    shards_built: int
    shards_reused: int
    sources_built: int
    bytes: int
    files: int
    seconds: float
    skipped: list[dict[str, Any]]
    upscaled: list[dict[str, Any]]
    unlabeled: bool = False  # the cache has no labels (a test set); see CachedImageDataset.unlabeled

    @property
    def images_per_s(self) -> float:
        """Source images processed per second by this run (reused shards excluded)."""
        return self.sources_built / self.seconds if self.seconds > 0 else 0.0

    def __repr__(self) -> str:
        # Short on purpose: a notebook cell ending in build_cache(...) prints this, and
        # the skipped/upscaled lists can hold thousands of entries (see .skipped).
        lines = [
            f"BuildReport({self.path!r}: {self.num_images:,} of {self.num_sources:,} images, "
            f"{self.num_shards} shards ({self.shards_built} built, {self.shards_reused} reused), "
            f"{self.files} files, {_fmt_bytes(self.bytes)}, {self.seconds:.1f} s"
            + (", UNLABELLED" if self.unlabeled else ""),
            f"  skipped {len(self.skipped):,}, upscaled {len(self.upscaled):,} (full lists: .skipped, .upscaled)",
        ]
        lines += [f"  e.g. {e['path']}: {e['reason']}"[:160] for e in self.skipped[:3]]
        return "\n".join(lines) + ")"


@dataclass
class DryRunEstimate:
    """What a build would produce, extrapolated from a pilot of ``pilot_images`` sources."""

    num_sources: int
    num_shards: int
    images_per_shard: int
    estimated_bytes: int
    estimated_seconds: float
    estimated_skipped: int
    pilot_images: int
    pilot_seconds_per_image: float
    workers: int
    existing: str


def _default_workers() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:
        return max(1, os.cpu_count() or 1)


def _mp_context():
    # fork works from notebooks and with datasets defined in __main__; workers only
    # use PIL/numpy, so forking a parent that has torch threads is safe here.
    if sys.platform == "linux" and "fork" in mp.get_all_start_methods():
        return mp.get_context("fork")
    return mp.get_context("spawn")


def build_cache(source: Any, out: str | os.PathLike, config: CacheConfig | None = None, *,
                labels: str | os.PathLike | None = None, classes: Sequence[str] | None = None,
                workers: int | None = None, strict: bool = False, overwrite: bool = False,
                dry_run: bool = False, verbose: bool = True, unlabeled: bool = False,
                **config_fields: Any) -> BuildReport | DryRunEstimate:
    """Build (or resume) a sharded uint8 image cache in ``out``.

    Args:
        source: an image folder (one sub-folder per class; a flat folder is cached
            unlabelled), a CSV of ``path,label`` rows (multi-label: space-separated
            labels; paths relative to the CSV's folder), or any map-style dataset
            returning ``(PIL image | HWC uint8 array | file path, label)`` where label
            is an int or a multi-hot vector.
        out: output directory (created). Rerunning the same build resumes it (finished
            shards are kept); a different config or source (relative paths, file sizes,
            labels) raises :class:`BuildError` unless ``overwrite``.
        config: a :class:`CacheConfig`; keyword arguments (``size=224, variants=4``...)
            override its fields.
        labels: a CSV of ``path,label`` rows whose paths are relative to ``source``.
        classes: fix the class list (e.g. a validation set reusing the training
            cache's ``classes``); items with other labels are skipped.
        workers: processes (default: all cores). Each holds about one shard in memory.
        strict: stop at the first bad image with :class:`BadImageError` naming it
            (finished shards are kept); default skips and lists bad images.
        overwrite: replace an existing cache in ``out`` (only cache files are removed).
            Without it, a complete cache of the same config and source is recognised
            before anything is written, so a rerun also works on a read-only copy
            (``/kaggle/input/...``); building into a read-only folder raises
            :class:`BuildError` naming the folder.
        dry_run: write nothing; estimate size, time and shard count from a pilot.
        verbose: show a progress bar (images/s, ETA) and a summary.
        unlabeled: cache a test set on purpose: every image of a folder (sub-folders
            included) or the file names in a CSV's first column (e.g. the competition's
            ``sample_submission.csv``; other columns are ignored), with no labels. A
            flat folder without ``labels=`` is also cached unlabelled, but the summary
            then warns and says how to add labels; training refuses unlabelled caches.

    Every cache records each image's id (``CachedImageDataset.ids``): its path
    relative to ``source`` (folders), the CSV's first-column value as written, or
    the index as a string (datasets).
    """
    cfg = dataclasses.replace(config, **config_fields) if config else CacheConfig(**config_fields)
    workers = workers or _default_workers()
    if workers < 1:
        raise ValueError(f"workers={workers} must be >= 1")
    src = _resolve_source(source, labels, cfg, classes, unlabeled)
    if src.num_items == 0:
        raise BuildError(f"no images found in {src.description}")
    out = Path(out).expanduser().resolve()
    if dry_run:
        return _dry_run(src, cfg, out, workers, verbose)
    if not overwrite and out.is_dir():
        # A finished identical build needs no lock and no write (read-only mounts).
        t0 = time.perf_counter()
        state, old = _existing_state(out, src, cfg)
        if state == "complete":
            return _labels_note(_complete_report(out, old, t0, verbose), src, unlabeled, verbose)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        err = _write_error(out, e, src, cfg)
        if err is None:
            raise
        raise err from e
    with _locked(out, src, cfg):
        report = _build(src, cfg, out, workers, strict, overwrite, verbose)
    return _labels_note(report, src, unlabeled, verbose)


def _labels_note(report: BuildReport, src: _Source, intended: bool, verbose: bool) -> BuildReport:
    """Mark an unlabelled cache on its report and, when verbose, say so and how to add labels."""
    report.unlabeled = src.unlabeled
    if verbose and src.unlabeled:
        print(_unlabeled_note(src, intended))
    return report


def _unlabeled_note(src: _Source, intended: bool) -> str:
    if intended:
        return ("unlabelled cache (unlabeled=True): image ids recorded for predict() and "
                "write_submission(); it cannot be used as training data")
    return (f"WARNING: this cache is UNLABELLED: {src.description} is a flat folder and no labels "
            "were given, so it cannot be used as training data (OneCycleTrainer refuses it). "
            "To train on it, rebuild with labels=\"train.csv\" (tpu_cache_ds build ... --labels "
            "train.csv; rows of file,label) and overwrite=True (--overwrite), or put the images in one "
            "sub-folder per class. For a test set pass unlabeled=True (--unlabeled) to say so.")


_READ_ONLY_ERRNOS = (errno.EACCES, errno.EPERM, errno.EROFS)


def _write_error(out: Path, e: OSError, src: _Source, cfg: CacheConfig) -> BuildError | None:
    """A clear :class:`BuildError` for an output folder we may not write to (None for other errors)."""
    if e.errno not in _READ_ONLY_ERRNOS:
        return None
    there = ""
    with contextlib.suppress(OSError):  # the folder may not even be listable
        state, old = _existing_state(out, src, cfg) if out.is_dir() else ("empty", None)
        if state == "compatible":
            there = " It holds an unfinished (or damaged) build of this cache, which cannot be finished here."
        elif state == "different" and old is not None:
            there = f" It holds a cache built with another config or source ({_difference(old, src, cfg)})."
        elif state == "broken":
            there = f" Its {MANIFEST} is unreadable."
    return BuildError(
        f"cannot write to {out} ({e.strerror or e}): the folder is read-only (Kaggle mounts /kaggle/input "
        f"read-only).{there} Build into a writable folder instead, e.g. /kaggle/working/{out.name} on "
        f"Kaggle or /content/{out.name} on Colab (a complete cache can be read from anywhere). "
        "Nothing was written.")


@contextlib.contextmanager
def _locked(out: Path, src: _Source, cfg: CacheConfig):
    lock_path = out / ".lock"
    try:
        fd = os.open(lock_path, os.O_CREAT | os.O_RDWR, 0o644)
    except OSError as e:
        err = _write_error(out, e, src, cfg)
        if err is None:
            raise
        raise err from e
    try:
        try:
            import fcntl
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except ImportError:  # non-POSIX: no inter-process lock
            pass
        except OSError:
            raise BuildError(f"another build is writing {out} (lock {lock_path} is held)") from None
        try:
            yield
        finally:
            with contextlib.suppress(OSError):
                os.unlink(lock_path)
    finally:
        os.close(fd)


def _new_manifest(src: _Source, cfg: CacheConfig, per_shard: int) -> dict[str, Any]:
    from . import __version__
    import PIL

    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "complete": False,
        "num_images": None,
        "image_size": list(cfg.size),
        "num_variants": cfg.variants,
        "codec": cfg.codec,
        "multilabel": src.multilabel,
        "unlabeled": src.unlabeled,
        "classes": src.classes,
        "images_per_shard": per_shard,
        "num_shards": math.ceil(src.num_items / per_shard),
        "labels_file": LABELS,
        "config": cfg.to_dict(),
        "config_fingerprint": cfg.fingerprint(),
        "source": src.to_dict(),
        "software": {"xla_utils": __version__, "pillow": PIL.__version__, "numpy": np.__version__},
        "skipped": [],
        "upscaled": [],
        "shards": [],
    }


def _cache_files(out: Path) -> list[Path]:
    pats = ("shard-*.npy", "shard-*.jpgs", "shard-*.tmp-*", MANIFEST, MANIFEST + ".tmp", LABELS, LABELS + ".tmp-*")
    return sorted({p for pat in pats for p in out.glob(pat)})


def _existing_state(out: Path, src: _Source, cfg: CacheConfig) -> tuple[str, dict[str, Any] | None]:
    """('empty'|'compatible'|'complete'|'foreign'|'broken'|'different', manifest or None).

    'complete' also needs every shard and the labels file present at their recorded
    sizes; a complete manifest with a lost file is 'compatible' (a rerun rebuilds it).
    Reads only.
    """
    mpath = out / MANIFEST
    if not mpath.exists():
        others = [p for p in out.iterdir() if not p.name.startswith(".")] if out.is_dir() else []
        return ("foreign" if others else "empty"), None
    try:
        m = read_manifest(out)
    except (ValueError, OSError):
        return "broken", None
    if m["config_fingerprint"] != cfg.fingerprint() or m["source"]["fingerprint"] != src.fingerprint:
        return "different", m
    if not m["complete"]:
        return "compatible", m
    intact = (out / LABELS).is_file() and all(
        (out / s["file"]).is_file() and (out / s["file"]).stat().st_size == s["bytes"] for s in m["shards"])
    return ("complete" if intact else "compatible"), m


def _difference(m: dict[str, Any], src: _Source, cfg: CacheConfig) -> str:
    old = m.get("config", {})
    new = cfg.to_dict()
    diffs = [f"{k}: {old.get(k)!r} -> {v!r}" for k, v in new.items() if old.get(k) != v]
    if m["source"]["fingerprint"] != src.fingerprint:
        diffs.append(f"source: {m['source'].get('path')} ({m['source'].get('num_items')} items) -> "
                     f"{src.description} ({src.num_items} items) or its files/labels changed")
    return "; ".join(diffs) or "format details differ"


def _build(src: _Source, cfg: CacheConfig, out: Path, workers: int, strict: bool, overwrite: bool,
           verbose: bool) -> BuildReport:
    t0 = time.perf_counter()
    state, old = _existing_state(out, src, cfg)
    if state in ("foreign", "broken", "different") and not overwrite:
        if state == "foreign":
            raise BuildError(f"{out} is not empty and holds no cache manifest: choose an empty "
                             "directory or pass overwrite=True (--overwrite)")
        if state == "broken":
            raise BuildError(f"{out / MANIFEST} is unreadable (damaged or cut short): pass overwrite=True "
                             "(--overwrite) to rebuild the cache from scratch")
        raise BuildError(f"{out} holds a cache built with a different config or source "
                         f"({_difference(old, src, cfg)}); pass overwrite=True (--overwrite) to "
                         "replace it or choose another output directory")
    if overwrite:
        for p in _cache_files(out):
            p.unlink()
        old = None
    elif state == "complete":  # finished by another process since build_cache looked
        return _complete_report(out, old, t0, verbose)
    for p in out.glob("*.tmp-*"):  # leftovers of a killed run (we hold the lock)
        p.unlink()

    per_shard = cfg.images_per_shard(src.num_items)
    manifest = _new_manifest(src, cfg, per_shard)
    num_shards = manifest["num_shards"]
    done: dict[int, dict[str, Any]] = {}
    if old is not None:
        for s in old["shards"]:
            p = out / s["file"]
            if p.is_file() and p.stat().st_size == s["bytes"]:
                done[s["index"]] = s
        keep = lambda e: any(  # noqa: E731
            s["first_source"] <= e["source_index"] < s["first_source"] + s["num_sources"]
            for s in done.values())
        manifest["skipped"] = [e for e in old["skipped"] if keep(e)]
        manifest["upscaled"] = [e for e in old["upscaled"] if keep(e)]
    reused = len(done)
    todo = [k for k in range(num_shards) if k not in done]
    sources_built = sum(min(src.num_items, (k + 1) * per_shard) - k * per_shard for k in todo)

    def record(res: dict[str, Any]) -> None:
        manifest["skipped"].extend(res.pop("skipped"))
        manifest["upscaled"].extend(res.pop("upscaled"))
        done[res["index"]] = res

    def save() -> None:
        manifest["shards"] = [done[k] for k in sorted(done)]
        manifest["skipped"].sort(key=lambda e: e["source_index"])
        manifest["upscaled"].sort(key=lambda e: e["source_index"])
        _write_manifest(out, manifest)

    if todo:
        save()
        _run_pool(src, cfg, out, todo, per_shard, sources_built, min(workers, len(todo)), strict,
                  verbose, record, save)
    _finish(out, manifest, done, src)
    save()
    report = _report(out, manifest, reused, sources_built, time.perf_counter() - t0)
    if verbose:
        print(_summary(report, manifest))
    return report


def _complete_report(out: Path, manifest: dict[str, Any], t0: float, verbose: bool) -> BuildReport:
    """Report of a rerun that found the identical cache complete (writes nothing)."""
    report = _report(out, manifest, manifest["num_shards"], 0, time.perf_counter() - t0)
    if verbose:
        print(_summary(report, manifest))
    return report


def _run_pool(src, cfg, out, todo, per_shard, total, workers, strict, verbose, record, save) -> None:
    """Build shards ``todo`` on ``workers`` processes, recording each one as it finishes.

    ``stop_at`` (shared) is the first source index that no longer needs building: a
    strict worker that meets a bad item lowers it to that item's index, so the others
    stop after the items before it (one of which may be an earlier bad file) and
    unstarted shards, later in source order, are cancelled. Once every task has
    ended, the bad item with the smallest index is raised: the same file whatever
    the worker count and timing. Any other stop sets ``stop_at`` to -1.
    """
    ctx = _mp_context()
    counter, stop_at = ctx.Value("q", 0), ctx.Value("q", src.num_items)
    bar = _progress(total) if verbose else None
    t_start = time.perf_counter()
    ex = ProcessPoolExecutor(workers, mp_context=ctx, initializer=_init_worker,
                             initargs=(src, cfg, str(out), strict, counter, stop_at))
    shard_of = {ex.submit(_build_shard, k, k * per_shard, min(src.num_items, (k + 1) * per_shard)): k
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
                except _Cancelled:
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
                    raise BuildError(f"building shard {shard_of[f]} failed: {_describe(e)}; finished shards "
                                     "are kept, rerun to resume") from e
            if finished:
                save()
            if bar is not None:
                n = counter.value
                rate = n / max(1e-9, time.perf_counter() - t_start)
                bar.comment = f"{rate:,.1f} images/s"
                bar.update(min(n, total))
    except BaseException:
        with stop_at.get_lock():
            stop_at.value = -1
        for f in pending:
            f.cancel()
        ex.shutdown(wait=True)
        for f in shard_of:  # keep every shard that did finish, also while we were stopping
            if f not in recorded and not f.cancelled() and f.exception() is None:
                record(f.result())
        save()
        raise
    ex.shutdown(wait=True)
    if bad:
        raise min(bad, key=lambda e: e.index)


def _progress(total: int):
    try:
        from fastprogress.fastprogress import progress_bar
    except ImportError:
        return None
    bar = progress_bar(range(total), total=total)
    bar.update(0)
    return bar


def _finish(out: Path, manifest: dict[str, Any], done: dict[int, dict[str, Any]], src: _Source) -> None:
    """Labels file, class list, counts; then the manifest can say complete."""
    labels = [lab for k in sorted(done) for lab in done[k]["labels"]]
    n = len(labels)
    classes = manifest["classes"]
    if manifest["multilabel"]:
        arr = np.zeros((n, len(classes)), np.uint8)
        for r, lab in enumerate(labels):
            arr[r, lab] = 1
    else:
        arr = np.asarray(labels, dtype=np.int64).reshape(n)
        if classes is None:
            classes = [str(i) for i in range(int(arr.max(initial=-1)) + 1)]
        elif n and arr.max() >= len(classes):
            raise BuildError(f"label {int(arr.max())} is out of range for {len(classes)} classes")
    if n == 0:
        raise BuildError(f"every one of the {src.num_items} source images was skipped; first reasons: "
                         + "; ".join(f"{e['path']}: {e['reason']}" for e in manifest["skipped"][:3]))
    buf = io.BytesIO()
    np.save(buf, arr)
    _atomic_write(out / LABELS, [buf.getvalue()])
    manifest.update(classes=classes, num_images=n, complete=True)


def _write_manifest(out: Path, manifest: dict[str, Any]) -> None:
    # One JSON object per line for list-of-dict entries keeps a 100k-label
    # manifest readable and diffable.
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
    _atomic_write(out / MANIFEST, ["\n".join(lines).encode()])
    with contextlib.suppress(OSError, AttributeError):  # persist the renames
        fd = os.open(out, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _report(out: Path, manifest: dict[str, Any], reused: int, sources_built: int,
            seconds: float) -> BuildReport:
    files = [out / MANIFEST, out / LABELS] + [out / s["file"] for s in manifest["shards"]]
    return BuildReport(
        path=str(out), num_sources=manifest["source"]["num_items"], num_images=manifest["num_images"],
        num_shards=manifest["num_shards"], shards_built=manifest["num_shards"] - reused,
        shards_reused=reused, sources_built=sources_built, bytes=sum(f.stat().st_size for f in files),
        files=len(files), seconds=seconds, skipped=manifest["skipped"], upscaled=manifest["upscaled"])


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n} B"


def _summary(r: BuildReport, m: dict[str, Any]) -> str:
    h, w = m["image_size"]
    lines = [
        f"cached {r.num_images:,} of {r.num_sources:,} images x {m['num_variants']} variant(s) at {w}x{h} "
        f"({m['codec']}) in {r.path}: {r.num_shards} shards, {r.files} files, {_fmt_bytes(r.bytes)}; "
        f"{r.seconds:.1f} s ({r.shards_built} shards built, {r.shards_reused} reused"
        + (f", {r.images_per_s:,.1f} images/s)" if r.shards_built else ")")]
    if r.skipped:
        lines.append(f"skipped {len(r.skipped)} image(s) (manifest.json 'skipped'):")
        lines += [f"  {e['path']}: {e['reason']}" for e in r.skipped[:10]]
        if len(r.skipped) > 10:
            lines.append(f"  ... and {len(r.skipped) - 10} more")
    if r.upscaled:
        lines.append(f"upscaled {len(r.upscaled)} image(s) smaller than {w}x{h} (manifest.json 'upscaled')")
    ignored = m["source"].get("ignored_files")
    if ignored:
        lines.append(f"ignored {ignored} non-image file(s) in the source folder, e.g. "
                     + ", ".join(m["source"]["ignored_examples"][:3]))
    return "\n".join(lines)


def _dry_run(src: _Source, cfg: CacheConfig, out: Path, workers: int, verbose: bool) -> DryRunEstimate:
    n_pilot = min(src.num_items, 32)
    idx = sorted({int(round(x)) for x in np.linspace(0, src.num_items - 1, n_pilot)})
    ctx = _mp_context()
    with ProcessPoolExecutor(min(workers, len(idx)), mp_context=ctx, initializer=_init_worker,
                             initargs=(src, cfg, str(out), False, ctx.Value("q", 0),
                                       ctx.Value("q", src.num_items))) as ex:
        results = list(ex.map(_pilot_item, idx))
    ok = [sizes for _, sizes in results if not isinstance(sizes, str)]
    sec = float(np.mean([t for t, _ in results]))
    good_frac = len(ok) / len(results)
    per_image = float(np.mean([sum(s) for s in ok])) if ok else 0.0
    per_shard = cfg.images_per_shard(src.num_items)
    num_shards = math.ceil(src.num_items / per_shard)
    state = _existing_state(out, src, cfg)[0] if out.is_dir() else "empty"
    est = DryRunEstimate(
        num_sources=src.num_items, num_shards=num_shards, images_per_shard=per_shard,
        estimated_bytes=int(per_image * good_frac * src.num_items + num_shards * 128),
        estimated_seconds=sec * src.num_items / workers,
        estimated_skipped=round((1 - good_frac) * src.num_items), pilot_images=len(idx),
        pilot_seconds_per_image=sec, workers=workers,
        existing={"empty": "empty (a fresh build)", "compatible": "a compatible partial build (would resume)",
                  "complete": "a complete identical build (nothing to do)",
                  "different": "a cache with another config (needs --overwrite)",
                  "broken": "a cache with an unreadable manifest.json (needs --overwrite)",
                  "foreign": "other files (needs --overwrite)"}[state])
    if verbose:
        h, w = cfg.size
        print(f"dry run (pilot of {est.pilot_images} images, {sec * 1000:.0f} ms each on one core): "
              f"{src.num_items:,} images x {cfg.variants} variant(s) at {w}x{h} ({cfg.codec}) -> "
              f"~{_fmt_bytes(est.estimated_bytes)} in {num_shards} shards of {per_shard} images, "
              f"~{est.estimated_seconds / 60:.1f} min with {workers} workers, "
              f"~{est.estimated_skipped} skipped; output directory: {est.existing}")
    return est


# --------------------------------------------------------------------------- read side


_MANIFEST_KEYS = ("complete", "num_images", "image_size", "num_variants", "codec", "multilabel", "classes",
                  "num_shards", "config", "config_fingerprint", "source", "skipped", "upscaled", "shards")


def read_manifest(path: str | os.PathLike) -> dict[str, Any]:
    """Load and check ``path/manifest.json`` (``path`` may also be the file itself).

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
    fix = (f"the cache in {mpath.parent} is damaged or was copied incompletely: rebuild it with the same "
           "build command plus overwrite=True (--overwrite), or copy it again; `tpu_cache_ds verify "
           f"{mpath.parent}` checks the other files")
    try:
        with open(mpath, encoding="utf-8") as f:
            m = json.load(f)
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError
        raise ValueError(f"{mpath} is not valid JSON ({e}): {fix}") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise ValueError(f"{mpath} is not an xla_utils image cache manifest (no \"format\": \"{FORMAT}\")")
    if m.get("format_version", 0) > FORMAT_VERSION:
        raise ValueError(f"{mpath} has format version {m['format_version']}; this xla_utils reads up to "
                         f"{FORMAT_VERSION}: upgrade xla_utils")
    missing = [k for k in _MANIFEST_KEYS if k not in m]
    if missing:
        raise ValueError(f"{mpath} lacks {', '.join(missing)}: {fix}")
    return m


def _caches_below(p: Path) -> str:
    found = sorted(str(m.parent) for m in p.glob(f"*/{MANIFEST}"))
    if not found:
        return ""
    more = f" and {len(found) - 3} more" if len(found) > 3 else ""
    return "; caches inside it: " + ", ".join(found[:3]) + more


def _nearest_parent(p: Path) -> str:
    parent = p.absolute().parent
    while not parent.is_dir() and parent != parent.parent:
        parent = parent.parent
    return f" (the nearest existing folder is {parent}{_caches_below(parent)})"


def _how_to_build(p: Path) -> str:
    return (f". Check the path (Kaggle mounts attached data sets under /kaggle/input/<name>) or build the "
            f"cache first: build_cache(SRC, {str(p)!r}) or `tpu_cache_ds build SRC {p}`")


def cache_info(path: str | os.PathLike) -> dict[str, Any]:
    """Summary of a cache: counts, sizes (bytes), config, classes, skipped images."""
    out = Path(path)
    m = read_manifest(out)
    files = [out / MANIFEST, out / LABELS] + [out / s["file"] for s in m["shards"]]
    present = [f for f in files if f.exists()]
    return {
        "path": str(out.resolve()),
        "complete": m["complete"],
        "num_images": m["num_images"] if m["complete"] else sum(s["num_images"] for s in m["shards"]),
        "num_sources": m["source"]["num_items"],
        "image_size": m["image_size"],
        "num_variants": m["num_variants"],
        "codec": m["codec"],
        "num_shards": m["num_shards"],
        "shards_done": len(m["shards"]),
        "files": len(present),
        "bytes": sum(f.stat().st_size for f in present),
        "multilabel": m["multilabel"],
        "unlabeled": bool(m.get("unlabeled", False)),
        "num_classes": len(m["classes"] or []),
        "classes": m["classes"],
        "skipped": m["skipped"],
        "upscaled": len(m["upscaled"]),
        "config": m["config"],
        "source": m["source"],
        "software": m["software"],
    }


@dataclass
class VerifyReport:
    """Outcome of :func:`verify_cache`: ``ok`` is False when anything is wrong."""

    ok: bool
    problems: list[str]
    bad_files: list[str]
    checked_files: int
    checked_bytes: int


def verify_cache(path: str | os.PathLike, full: bool = False) -> VerifyReport:
    """Check a cache: manifest, every shard's presence, size and crc32, and the labels.

    ``full`` also parses every shard (npy header shape, JPEG offset table) and
    decodes every JPEG. Reads every byte of the cache (crc32 runs at disk speed).
    """
    out = Path(path)
    problems: list[str] = []
    bad: list[str] = []
    m = read_manifest(out)
    if not m["complete"]:
        problems.append(f"incomplete build: {len(m['shards'])}/{m['num_shards']} shards done "
                        "(rerun the build command to finish it)")
    expected = set(range(m["num_shards"]))
    checked, nbytes = 0, 0
    h, w = m["image_size"]
    for s in m["shards"]:
        expected.discard(s["index"])
        f = out / s["file"]
        if not f.exists():
            problems.append(f"{s['file']}: missing")
            bad.append(s["file"])
            continue
        size = f.stat().st_size
        if size != s["bytes"]:
            problems.append(f"{s['file']}: {size} bytes, manifest says {s['bytes']}")
            bad.append(s["file"])
            continue
        crc = 0
        with open(f, "rb") as fh:
            while chunk := fh.read(8 << 20):
                crc = zlib.crc32(chunk, crc)
        checked += 1
        nbytes += size
        if crc != s["crc32"]:
            problems.append(f"{s['file']}: crc32 {crc:08x} != manifest {s['crc32']:08x} (corrupted)")
            bad.append(s["file"])
            continue
        if full:
            err = _check_shard_contents(f, m["codec"], m["num_variants"], s["num_images"], h, w)
            if err:
                problems.append(f"{s['file']}: {err}")
                bad.append(s["file"])
    if m["complete"]:
        if expected:
            problems.append(f"manifest lacks shards {sorted(expected)[:10]}")
        try:
            lab = np.load(out / LABELS)
            if len(lab) != m["num_images"]:
                problems.append(f"{LABELS}: {len(lab)} labels for {m['num_images']} images")
                bad.append(LABELS)
        except (OSError, ValueError) as e:
            problems.append(f"{LABELS}: unreadable ({e})")
            bad.append(LABELS)
    return VerifyReport(ok=not problems, problems=problems, bad_files=bad, checked_files=checked,
                        checked_bytes=nbytes)


def _check_shard_contents(f: Path, codec: str, V: int, n: int, h: int, w: int) -> str | None:
    if codec == "raw":
        arr = np.load(f, mmap_mode="r") if n else None
        if arr is not None and arr.shape != (V, n, h, w, 3):
            return f"array shape {arr.shape} != {(V, n, h, w, 3)}"
        return None
    data = np.fromfile(f, dtype=np.uint8)
    count = int(data[8:16].view("<u8")[0])
    if data[:8].tobytes() != JPEG_MAGIC or count != V * n:
        return "bad JPEG shard header"
    offsets = data[16:16 + 8 * (count + 1)].view("<u8")
    if np.any(np.diff(offsets.astype(np.int64)) <= 0) or int(offsets[-1]) != len(data):
        return "bad JPEG offset table"
    for k in range(count):
        try:
            with Image.open(io.BytesIO(data[offsets[k]:offsets[k + 1]].tobytes())) as im:
                if im.size != (w, h):
                    return f"entry {k}: {im.size} != {(w, h)}"
                im.load()
        except Exception as e:
            return f"entry {k} does not decode ({_describe(e)})"
    return None


if __name__ == "__main__":
    from xla_utils.cli import main

    sys.exit(main())
