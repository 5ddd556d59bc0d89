"""The cache config: every choice that decides the bytes of a cache."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from ..utils.suggest import choice

__all__ = ["CacheConfig", "parse_size", "parse_bytes", "RESAMPLE_FILTERS", "MIN_SHARDS",
           "MIN_SHARD_BYTES"]

# A build whose shards would be smaller than shard_size is split into up to this many shards
# so that every worker has one to build, but none holds under MIN_SHARD_BYTES of pixels:
# a small folder (40 test images, 6 MiB of pixels at 224) is one shard, as a reader of a
# few large shards expects, and a 1 GiB build still has 16.
MIN_SHARDS = 16
MIN_SHARD_BYTES = 32 * 2**20
# Expected size of a q90 JPEG relative to raw pixels; fixes how many images a
# JPEG shard holds so that shards come out near ``shard_size``.
JPEG_RATIO_GUESS = 8
# Names accepted by CacheConfig.resample (the images module maps them to Pillow filters).
RESAMPLE_FILTERS = ("bilinear", "bicubic", "lanczos")


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
        shard_size: target shard size in bytes, or the command line's notation
            (``"256MiB"``, ``"1GB"``; see :func:`parse_bytes`). Default 256 MiB.
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
    shard_size: int | str = 256 * 2**20
    resample: str = "bilinear"
    small: str = "upscale"
    max_pixels: int = 89_478_485
    multilabel: bool | None = None

    def __post_init__(self) -> None:
        h, w = parse_size(self.size)
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731 (frozen dataclass)
        set_("size", (h, w))
        if isinstance(self.shard_size, str):
            set_("shard_size", parse_bytes(self.shard_size))
        set_("scale", tuple(float(x) for x in self.scale))
        set_("ratio", tuple(float(x) for x in self.ratio))
        if self.augment is None:
            set_("augment", self.variants > 1)
        problems = []
        for name, options in (("resize", ("crop", "stretch")), ("codec", ("raw", "jpeg")),
                              ("resample", RESAMPLE_FILTERS), ("small", ("upscale", "skip"))):
            try:  # any case and surrounding spaces, as every string option of xla_utils
                value = choice(getattr(self, name), options, name)
            except ValueError as exc:
                problems.append(str(exc))
                continue
            if value in options:
                set_(name, value)
            else:  # not a string
                problems.append(f"{name} must be one of {options}, got {value!r}")
        if not isinstance(self.variants, int) or self.variants < 1:
            problems.append(f"variants={self.variants!r} must be an int >= 1")
        elif self.variants > 1 and not self.augment:
            problems.append(f"variants={self.variants} with augment=False would store identical copies")
        if len(self.scale) != 2 or not 0 < self.scale[0] <= self.scale[1] <= 1:
            problems.append(f"scale={self.scale!r} must be (min, max) with 0 < min <= max <= 1")
        if len(self.ratio) != 2 or not 0 < self.ratio[0] <= self.ratio[1]:
            problems.append(f"ratio={self.ratio!r} must be (min, max) with 0 < min <= max")
        if not 0 <= self.rotate <= 45:
            problems.append(f"rotate={self.rotate!r} must be between 0 and 45 degrees")
        if not 1 <= self.quality <= 100:
            problems.append(f"quality={self.quality!r} must be between 1 and 100")
        if self.shard_size < 1:
            problems.append(f"shard_size={self.shard_size!r} must be a positive number of bytes")
        if self.max_pixels < 1:
            problems.append(f"max_pixels={self.max_pixels!r} must be positive")
        if problems:
            raise ValueError("invalid CacheConfig: " + "; ".join(problems))

    def to_dict(self) -> dict[str, Any]:
        """The config as a JSON-ready dict (tuples become lists), as stored in the manifest."""
        return json.loads(json.dumps(dataclasses.asdict(self)))

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CacheConfig:
        """The config of a manifest's ``config`` dict; unknown keys are ignored."""
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: (tuple(v) if isinstance(v, list) else v) for k, v in d.items() if k in known})

    def fingerprint(self) -> str:
        """16 hex digits of the SHA-256 of :meth:`to_dict`: equal iff the configs are equal."""
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()[:16]

    @property
    def sample_bytes(self) -> int:
        """Raw bytes of one stored variant (H * W * 3)."""
        return self.size[0] * self.size[1] * 3

    def images_per_shard(self, num_items: int) -> int:
        """Source items per shard for a source of ``num_items`` items.

        ``shard_size`` bytes worth of images; a smaller build is split into at most
        :data:`MIN_SHARDS` shards (work for every build worker) of at least
        :data:`MIN_SHARD_BYTES` of pixels each, so a small folder is one shard.
        """
        pixels = self.variants * self.sample_bytes  # the decoding and resizing each image costs
        per_image = max(1, pixels // JPEG_RATIO_GUESS) if self.codec == "jpeg" else pixels
        by_size = max(1, self.shard_size // per_image)
        shards = max(1, min(MIN_SHARDS, num_items * pixels // MIN_SHARD_BYTES))
        return max(1, min(by_size, math.ceil(num_items / shards)))


def parse_size(size: int | str | Sequence[int]) -> tuple[int, int]:
    """Parse an image size.

    Args:
        size: ``224``, ``"224"``, ``"256x224"`` (HxW) or ``(256, 224)``.

    Returns:
        ``(height, width)`` in pixels.

    Raises:
        ValueError: a side is not a positive integer.
    """
    if isinstance(size, str):
        parts = size.lower().replace("*", "x").split("x")
        size = [int(p) for p in parts] if len(parts) > 1 else int(parts[0])
    if isinstance(size, (int, np.integer)):
        size = (int(size), int(size))
    h, w = (int(s) for s in size)
    if h < 1 or w < 1:
        raise ValueError(f"size must be positive, got {size!r}")
    return h, w


_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 2**10, "m": 10**6, "mb": 10**6, "mib": 2**20,
          "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12, "tib": 2**40}


def parse_bytes(text: str | int) -> int:
    """Parse a byte count (the notation of ``--shard-size`` and ``max_local_bytes``).

    Args:
        text: an int, or a number with an optional unit: ``"256MiB"`` -> 268435456,
            ``"256MB"`` -> 256000000, ``"1.5G"`` -> 1500000000, ``"4096"`` -> 4096
            (MB/GB decimal, MiB/GiB binary).

    Returns:
        The number of bytes.

    Raises:
        ValueError: ``text`` is not such a size.
    """
    if isinstance(text, (int, np.integer)) and not isinstance(text, bool):
        return int(text)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"{text!r} is not a size such as 256MiB, 256MB, 1G or 4096")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])
