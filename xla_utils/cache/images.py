"""Image operations of the cache builder: decode any source to RGB, cut the stored variants.

Pure functions of (image, config, index): the same inputs give the same pixels, which is
what makes a resumed build byte-identical.
"""
from __future__ import annotations

import io
import math
import os
from typing import Any

import numpy as np
from PIL import Image, ImageOps

from .config import CacheConfig

__all__ = ["decode_source", "make_variants", "encode_jpeg"]

_RESAMPLE = {
    "bilinear": Image.Resampling.BILINEAR,
    "bicubic": Image.Resampling.BICUBIC,
    "lanczos": Image.Resampling.LANCZOS,
}


def decode_source(item: Any, config: CacheConfig) -> tuple[Image.Image, tuple[int, int]]:
    """Open one source as an RGB image.

    Applies the EXIF orientation, converts any mode (L, LA, P, RGBA, CMYK, 16-bit...)
    to RGB (transparent pixels over white) and decodes large JPEGs at a reduced
    size (PIL ``draft``) that still covers the smallest crop the config can take.

    Args:
        item: a file path, an open binary file, a PIL image, or an HWC (or CHW) ``uint8``/``uint16`` array.
        config: the cache config (its ``size``, ``augment``, ``scale`` and
            ``max_pixels`` matter here).

    Returns:
        The RGB image and the source's original ``(width, height)`` in pixels, after
        orientation.

    Raises:
        OSError, ValueError: bad input (unreadable file, unsupported array, more
            pixels than ``config.max_pixels``); the builder records or raises it as a
            :class:`~xla_utils.cache.BadImageError`.
    """
    if isinstance(item, (str, os.PathLike)) or hasattr(item, "read"):
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
    """The stored versions of one decoded RGB image.

    Plain (``augment=False``): one centre crop (or stretch) of the whole image.
    Augmented: random-resized crops (area ``scale``, aspect ``ratio``), optionally
    rotated by up to ``rotate`` degrees about the crop centre and flipped.

    Args:
        image: an RGB image, as :func:`decode_source` returns it.
        config: the cache config.
        index: the image's position in the source order; with ``config.seed`` and the
            variant number it seeds each variant's random stream.

    Returns:
        ``config.variants`` arrays ``uint8[H, W, 3]`` (H, W = ``config.size``);
        deterministic per ``(config.seed, index, variant)``.
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


def encode_jpeg(arr: np.ndarray, quality: int) -> bytes:
    """``uint8[H, W, 3]`` pixels as a JPEG file of ``quality`` (1-100, 4:2:0 chroma)."""
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, "JPEG", quality=quality)
    return buf.getvalue()
