"""``tpu_cache_ds``: build, inspect, verify, preview and benchmark image caches.

    tpu_cache_ds build SRC OUT --size 224 --variants 4 [--codec raw|jpeg] [--shard-size 256MB]
                       [--workers N] [--labels FILE.csv | --unlabeled] [--strict] [--overwrite] [--dry-run]
                       [--engine local|ray [--ray-address HOST:PORT]]      (OUT may be gs://bucket/prefix)
    tpu_cache_ds info OUT [--json]
    tpu_cache_ds verify OUT [--full]
    tpu_cache_ds preview OUT --out grid.png
    tpu_cache_ds bench OUT [--json]

Also ``python -m xla_utils.cache ...``. Exit status: 0 on success, 1 on a failed
build or a failed verification, 2 on bad arguments. ``build``, ``info`` and
``verify`` import neither torch nor torch_xla.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any, Sequence

from .cache import (BadImageError, BuildError, CacheConfig, build_cache, cache_info, parse_size, read_manifest,
                    verify_cache)
from .cache.builder import missing_rows_warning
from .cache.config import parse_bytes as _parse_bytes
from .cache.storage import StorageError
from .utils.suggest import did_you_mean
from .utils.units import format_bytes

__all__ = ["main", "parse_bytes"]

def parse_bytes(text: str) -> int:
    """Parse a byte count for argparse (:func:`xla_utils.cache.parse_bytes`).

    Raises:
        argparse.ArgumentTypeError: ``text`` is not such a size.
    """
    try:
        return _parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _size(text: str) -> tuple[int, int]:
    try:
        return parse_size(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size such as 224 or 256x224 (HxW)") from None


def _parser() -> argparse.ArgumentParser:
    """The ``tpu_cache_ds`` argument parser (its sub-commands and every option)."""
    p = argparse.ArgumentParser(prog="tpu_cache_ds", description="Sharded uint8 image caches for fast "
                                "TPU input pipelines (xla_utils).")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_build(sub)
    _add_inspect(sub)
    return p


def _add_build(sub: Any) -> None:
    d = CacheConfig()
    b = sub.add_parser("build", help="build or resume a cache from an image folder, a CSV or labels",
                       description="Build a cache; rerunning the same command resumes it.")
    b.add_argument("src", metavar="SRC", help="image folder or gs:// prefix (one sub-folder per class; "
                   "flat = unlabelled) "
                   "or a CSV of path,label rows (multi-label: space-separated labels)")
    b.add_argument("out", metavar="OUT", help="output directory, or a URL prefix such as gs://bucket/cache "
                   "(pip install 'xla_utils[gcs]')")
    b.add_argument("--size", type=_size, default=d.size, help="output size, 224 or HxW (default 224)")
    b.add_argument("--variants", type=int, default=d.variants,
                   help="stored variants per image; >1 means random-resized crops (default 1: plain)")
    b.add_argument("--codec", choices=("raw", "jpeg"), default=d.codec,
                   help="raw uint8 (fastest loading, default) or jpeg (about 8-10x smaller)")
    b.add_argument("--quality", type=int, default=d.quality, help="JPEG quality (default 90)")
    b.add_argument("--shard-size", type=parse_bytes, default=d.shard_size,
                   help="target shard size, e.g. 256MiB, 1GB (MB/GB decimal, MiB/GiB binary; default 256MiB)")
    b.add_argument("--workers", type=int, default=None, help="processes (default: all cores)")
    b.add_argument("--engine", choices=("local", "ray"), default="local",
                   help="local process pool (default) or one task per shard on a Ray cluster "
                   "(pip install 'xla_utils[ray]'; same bytes)")
    b.add_argument("--ray-address", metavar="HOST:PORT", default=None,
                   help="the Ray cluster for --engine ray (default: RAY_ADDRESS, else a local Ray)")
    b.add_argument("--labels", metavar="FILE.csv", help="CSV of path,label rows with paths relative to SRC")
    b.add_argument("--unlabeled", action="store_true", help="a test set: cache every image of SRC (or the "
                   "file names in a CSV's first column, e.g. sample_submission.csv) without labels; "
                   "image ids are recorded for predict() and write_submission()")
    b.add_argument("--task", choices=("classification", "regression"), default=None,
                   help="how labels are read (default: numbers that are not all integers are "
                   "regression targets, others class names)")
    b.add_argument("--classes-from", metavar="CACHE", help="reuse the class list of another cache "
                   "(e.g. the training cache when building the validation cache)")
    b.add_argument("--strict", action="store_true", help="stop at the first bad image instead of skipping it")
    b.add_argument("--overwrite", action="store_true", help="replace an existing cache in OUT")
    b.add_argument("--dry-run", action="store_true", help="estimate size, time and shards from a pilot; "
                   "write nothing")
    aug = b.add_mutually_exclusive_group()
    aug.add_argument("--augment", dest="augment", action="store_const", const=True, default=None,
                     help="random-resized-crop variants even with --variants 1")
    aug.add_argument("--plain", dest="augment", action="store_const", const=False,
                     help="plain resize (only with --variants 1)")
    b.add_argument("--resize", choices=("crop", "stretch"), default=d.resize,
                   help="plain variant: shorter side + centre crop (default) or exact stretch")
    b.add_argument("--scale", type=float, nargs=2, metavar=("MIN", "MAX"), default=d.scale,
                   help="random crop area fraction (default 0.25 1)")
    b.add_argument("--ratio", type=float, nargs=2, metavar=("MIN", "MAX"), default=d.ratio,
                   help="random crop aspect ratio w/h (default 0.75 1.333)")
    b.add_argument("--rotate", type=float, default=d.rotate, help="max rotation in degrees (default 0)")
    b.add_argument("--flip", action="store_true", help="bake random horizontal flips into variants "
                   "(usually better done on the device: images_to_float(flip=True))")
    b.add_argument("--seed", type=int, default=d.seed, help="augmentation seed (default 0)")
    b.add_argument("--resample", choices=("bilinear", "bicubic", "lanczos"), default=d.resample)
    b.add_argument("--small", choices=("upscale", "skip"), default=d.small,
                   help="images smaller than --size: upscale and list them (default) or skip them")
    b.add_argument("--max-pixels", type=int, default=d.max_pixels,
                   help="skip sources with more pixels (decompression bombs; default 89478485)")
    ml = b.add_mutually_exclusive_group()
    ml.add_argument("--multilabel", dest="multilabel", action="store_const", const=True, default=None,
                    help="CSV labels are multi-label even if every row has one")
    ml.add_argument("--single-label", dest="multilabel", action="store_const", const=False)
    b.add_argument("--quiet", action="store_true", help="no progress bar or summary")
    b.set_defaults(func=_cmd_build)


def _add_inspect(sub: Any) -> None:
    i = sub.add_parser("info", help="summary of a cache")
    i.add_argument("out", metavar="OUT")
    i.add_argument("--json", action="store_true", help="machine-readable output")
    i.set_defaults(func=_cmd_info)

    v = sub.add_parser("verify", help="check every shard's size and crc32 (exit 1 and name the bad file)")
    v.add_argument("out", metavar="OUT")
    v.add_argument("--full", action="store_true", help="also parse every shard and decode every JPEG")
    v.set_defaults(func=_cmd_verify)

    pv = sub.add_parser("preview", help="PNG grid: one row per image, one column per variant")
    pv.add_argument("out", metavar="OUT")
    pv.add_argument("--out", dest="png", required=True, metavar="GRID.png")
    pv.add_argument("--images", type=int, default=8, help="rows (default 8, spread over the cache)")
    pv.add_argument("--max-variants", type=int, default=8, help="columns at most (default 8)")
    pv.set_defaults(func=_cmd_preview)

    bn = sub.add_parser("bench", help="loader throughput (samples/s) of iterate_batches in this process")
    bn.add_argument("out", metavar="OUT")
    bn.add_argument("--batch-size", type=int, default=256)
    bn.add_argument("--workers", type=int, default=None, help="loader threads (default min(4, cores))")
    bn.add_argument("--seconds", type=float, default=5.0, help="timed duration after one warm-up pass")
    bn.add_argument("--json", action="store_true", help="machine-readable output")
    bn.set_defaults(func=_cmd_bench)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``tpu_cache_ds`` (and of ``python -m xla_utils.cache``).

    Args:
        argv: the arguments after the program name. Default: ``sys.argv[1:]``.

    Returns:
        The exit status: 0 on success, 1 on a failed build or verification, 130 when
        interrupted (argparse exits with 2 on bad arguments).
    """
    parser = _parser()
    args, extras = parser.parse_known_args(argv)
    if extras:
        _unrecognized(parser, args.command, extras)
    try:
        return args.func(args)
    except (BuildError, BadImageError, FileNotFoundError, ValueError, StorageError, ImportError) as e:
        print(f"tpu_cache_ds {args.command}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"tpu_cache_ds {args.command}: interrupted (finished shards are kept; rerun to resume)",
              file=sys.stderr)
        return 130


def _unrecognized(parser: argparse.ArgumentParser, command: str, extras: list[str]) -> None:
    """Exit 2 naming the unknown arguments of ``command``, each option with its nearest
    valid spelling (``--varients`` -> ``--variants``)."""
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
    options = [o for a in sub._actions for o in a.option_strings]
    hints = [f"{x}{did_you_mean(x.split('=', 1)[0], options, quote=False)}" if x.startswith("-") else x
             for x in extras]
    sub.error(f"unrecognized arguments: {' '.join(hints)}")


def _cmd_build(a: argparse.Namespace) -> int:
    classes = read_manifest(a.classes_from)["classes"] if a.classes_from else None
    cfg = CacheConfig(size=a.size, variants=a.variants, augment=a.augment, resize=a.resize, scale=tuple(a.scale),
                      ratio=tuple(a.ratio), rotate=a.rotate, flip=a.flip, seed=a.seed, codec=a.codec,
                      quality=a.quality, shard_size=a.shard_size, resample=a.resample, small=a.small,
                      max_pixels=a.max_pixels, multilabel=a.multilabel)
    report = build_cache(a.src, a.out, cfg, labels=a.labels, classes=classes, workers=a.workers,
                         strict=a.strict, overwrite=a.overwrite, dry_run=a.dry_run, verbose=not a.quiet,
                         unlabeled=a.unlabeled, engine=a.engine, ray_address=a.ray_address, task=a.task)
    warning = None if a.dry_run else missing_rows_warning(report)
    if warning and a.quiet:  # quiet hides the summary, not a submission's missing rows
        print(warning, file=sys.stderr)
    return 0


def _cmd_info(a: argparse.Namespace) -> int:
    info = cache_info(a.out)
    if a.json:
        print(json.dumps(info, indent=2))
        return 0
    h, w = info["image_size"]
    classes = info["classes"] or []
    shown = ", ".join(classes[:10]) + (f", ... ({len(classes) - 10} more)" if len(classes) > 10 else "")
    cfg = info["config"]
    lines = [
        f"cache:    {info['path']} ({'complete' if info['complete'] else 'INCOMPLETE: rerun the build'})",
        f"images:   {info['num_images']:,} of {info['num_sources']:,} sources ({len(info['skipped'])} skipped, "
        f"{info['upscaled']} upscaled), {info['num_variants']} variant(s) at {w}x{h}, {info['codec']}",
        ("labels:   none (unlabelled: a test set)" if info["unlabeled"] else
         f"labels:   regression targets: {', '.join(info['targets'])}" if info.get("targets") else
         f"labels:   {info['num_classes']} classes{' (multi-label)' if info['multilabel'] else ''}: {shown}"),
        f"files:    {info['files']} ({info['shards_done']}/{info['num_shards']} shards), {format_bytes(info['bytes'])}",
        f"augment:  {cfg['augment']} (scale {cfg['scale']}, ratio {[round(r, 3) for r in cfg['ratio']]}, "
        f"rotate {cfg['rotate']}, flip {cfg['flip']}, seed {cfg['seed']})",
        f"source:   {info['source']['kind']} {info['source']['path']}",
    ]
    lines += [f"skipped:  {e['path']}: {e['reason']}" for e in info["skipped"][:10]]
    print("\n".join(lines))
    return 0


def _cmd_verify(a: argparse.Namespace) -> int:
    r = verify_cache(a.out, full=a.full)
    if r.ok:
        print(f"OK: {r.checked_files} shards, {format_bytes(r.checked_bytes)} checked"
              + (" (full decode)" if a.full else " (size + crc32)"))
        return 0
    for line in r.problems:
        print(f"BAD {line}", file=sys.stderr)
    print(f"FAILED: {len(r.bad_files)} bad file(s): {', '.join(r.bad_files) or '-'}", file=sys.stderr)
    return 1


def _cmd_preview(a: argparse.Namespace) -> int:
    import numpy as np
    from PIL import Image, ImageDraw

    from .data import CachedImageDataset

    ds = CachedImageDataset(a.out)
    rows = sorted({int(round(x)) for x in np.linspace(0, len(ds) - 1, min(a.images, len(ds)))})
    cols = min(ds.num_variants, a.max_variants)
    h, w = ds.image_size
    pad, text = 4, 14
    grid = Image.new("RGB", (pad + cols * (w + pad), pad + len(rows) * (h + text + pad)), (255, 255, 255))
    draw = ImageDraw.Draw(grid)
    for r, i in enumerate(rows):
        y = pad + r * (h + text + pad)
        label = ds.label(i)
        if ds.task == "regression":
            name = " ".join(f"{v:.4g}" for v in np.atleast_1d(label))
        elif ds.multilabel:
            name = " ".join(ds.classes[c] for c in np.flatnonzero(label)) or "-"
        else:
            name = ds.classes[label] if 0 <= label < len(ds.classes) else "unlabelled"
        draw.text((pad, y), f"#{i} {name}"[: max(8, cols * w // 7)], fill=(0, 0, 0))
        for v in range(cols):
            grid.paste(Image.fromarray(ds.image(i, v)), (pad + v * (w + pad), y + text))
    grid.save(a.png)
    print(f"wrote {a.png}: {len(rows)} images x {cols} variant(s)")
    return 0


def _cmd_bench(a: argparse.Namespace) -> int:
    from .data import CachedImageDataset

    ds = CachedImageDataset(a.out)
    bs = min(a.batch_size, len(ds))
    result = bench_loader(ds, bs, a.workers, a.seconds)
    if a.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"{result['samples_per_s']:,.0f} samples/s ({result['mb_per_s']:,.0f} MB/s of uint8) over "
              f"{result['batches']} batches of {bs} at {result['image_size'][1]}x{result['image_size'][0]} "
              f"({result['codec']}, {result['workers']} threads, {result['seconds']:.1f} s after a warm-up pass)")
    return 0


def bench_loader(ds: Any, batch_size: int, workers: int | None, seconds: float) -> dict[str, Any]:
    """Loader throughput of :func:`~xla_utils.data.iterate_batches` over ``ds``.

    One untimed warm-up pass (bounded by ``seconds``) fills the page cache first.

    Args:
        ds: a :class:`~xla_utils.data.CachedImageDataset`.
        batch_size: samples per batch.
        workers: loader threads. Default (None): ``min(4, cores)``.
        seconds: timed duration, about.

    Returns:
        A JSON-ready dict: ``samples_per_s``, ``mb_per_s`` (of uint8 pixels), ``batches``,
        ``batch_size``, ``seconds``, ``workers``, ``codec``, ``image_size``, ``num_images``.
    """
    from .data import iterate_batches

    workers = workers if workers is not None else min(4, os.cpu_count() or 1)

    def timed(limit: float, epoch: int) -> tuple[int, float]:
        n, t0 = 0, time.perf_counter()
        for x, _, _ in iterate_batches(ds, batch_size, epoch=epoch, num_workers=workers, drop_last=True):
            n += x.shape[0]
            if time.perf_counter() - t0 > limit:
                break
        return n, time.perf_counter() - t0

    timed(seconds, 0)
    samples, elapsed, epoch = 0, 0.0, 1
    while elapsed < seconds:
        n, t = timed(seconds - elapsed, epoch)
        samples, elapsed, epoch = samples + n, elapsed + t, epoch + 1
    h, w = ds.image_size
    return {"samples_per_s": samples / elapsed, "mb_per_s": samples * h * w * 3 / elapsed / 1e6,
            "batches": samples // batch_size, "batch_size": batch_size, "seconds": elapsed,
            "workers": workers, "codec": ds.codec,
            "image_size": [h, w], "num_images": len(ds)}


if __name__ == "__main__":
    sys.exit(main())
