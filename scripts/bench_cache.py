#!/usr/bin/env python
"""Benchmark the xla_utils image cache against the naive alternatives, side by side.

    python scripts/bench_cache.py [--work /tmp/xla_utils_bench] [--images 300] [--write-doc]

1. Generates ``--images`` large JPEGs (3000x2000, q92, textured: scikit-image
   sample photos upscaled plus film-grain noise, about 2 MB each) in 4 class
   folders (kept in ``--work`` for later runs).
2. Build throughput: ``build_cache`` (all cores, one decode per image, all
   variants from it) vs a naive builder (one process, a full decode for every
   variant, one ``.npy`` file per sample) on a subset.
3. Loader throughput in one process, from the page cache: ``iterate_batches``
   over raw and JPEG caches vs an on-the-fly torchvision ``ImageFolder`` + PIL
   decode / random-resized-crop / flip loader on the large JPEGs, and vs a
   one-``.pt``-file-per-sample loader (uint8, and float32 as the old torch_xla
   ``CachedDataset`` stored). The loader caches hold 6,000 samples made from the
   built cache, so that an epoch is long enough to time.
4. Bytes on disk and file counts.

Medians over ``--repeats`` runs. ``--write-doc`` replaces the ``## Cached dataset``
section of docs/BENCHMARKS.md with the results.
"""
from __future__ import annotations

import argparse
import datetime
import multiprocessing as mp
import os
import platform
import re
import resource
import shutil
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from xla_utils.cache import CacheConfig, build_cache  # noqa: E402
from xla_utils.cache.images import _sample_crop  # noqa: E402

W, H = 3000, 2000


# ----------------------------------------------------------------------------- sources


_BANK: np.ndarray | None = None
_PHOTOS: list[np.ndarray] = []


def _make_jpeg(args):
    i, path = args
    global _BANK
    if _BANK is None:  # per-pixel film grain, shifted per image
        import skimage.data as sd

        _BANK = np.random.default_rng(123).normal(0, 7, (H + 64, W + 64)).astype(np.int16)
        _PHOTOS.extend([sd.astronaut(), sd.coffee(), sd.chelsea(), sd.rocket(), sd.hubble_deep_field()])
    photos = _PHOTOS
    rng = np.random.default_rng(i)
    p = photos[i % len(photos)]
    ph, pw = p.shape[:2]
    cw = int(pw * rng.uniform(0.6, 1.0))
    ch = min(ph, int(cw * 2 / 3))
    cw = int(ch * 1.5)
    x0, y0 = rng.integers(0, pw - cw + 1), rng.integers(0, ph - ch + 1)
    base = Image.fromarray(p).resize((W, H), Image.BICUBIC, box=(x0, y0, x0 + cw, y0 + ch))
    a = np.asarray(base).astype(np.int16)
    dx, dy = rng.integers(0, 64, 2)
    a += _BANK[dy:dy + H, dx:dx + W, None]
    Image.fromarray(np.clip(a, 0, 255).astype(np.uint8)).save(path, "JPEG", quality=92)


def make_sources(src: Path, n: int) -> list[Path]:
    paths = [src / f"class_{i % 4}" / f"img_{i:05d}.jpg" for i in range(n)]
    todo = [(i, p) for i, p in enumerate(paths) if not p.exists()]
    for c in range(4):
        (src / f"class_{c}").mkdir(parents=True, exist_ok=True)
    if todo:
        print(f"generating {len(todo)} {W}x{H} JPEGs in {src} ...", flush=True)
        with mp.get_context("fork").Pool(os.cpu_count()) as pool:
            pool.map(_make_jpeg, todo, chunksize=4)
    return paths


# ----------------------------------------------------------------------------- baselines


def naive_build(paths: list[Path], out: Path, size: int, variants: int) -> None:
    """One process, a full decode per variant, one file per sample."""
    cfg = CacheConfig(size=size, variants=variants)
    out.mkdir(parents=True, exist_ok=True)
    for i, p in enumerate(paths):
        for v in range(variants):
            img = Image.open(p).convert("RGB")
            cx, cy, bw, bh, _ = _sample_crop(np.random.default_rng([0, i, v]), img.width, img.height, cfg)
            crop = img.resize((size, size), Image.BILINEAR, box=(cx - bw / 2, cy - bh / 2, cx + bw / 2, cy + bh / 2))
            np.save(out / f"{i:06d}_{v}.npy", np.asarray(crop))


def time_loader(batches, repeats: int) -> list[float]:
    """samples/s of each of ``repeats`` timed passes, after one untimed warm-up pass."""
    rates = []
    for r in range(repeats + 1):
        n, t0 = 0, time.perf_counter()
        for b in batches(r):
            n += len(b[0])
        if r:
            rates.append(n / (time.perf_counter() - t0))
    return rates


class PtFiles:
    """The old way: one torch.save file per sample."""

    def __init__(self, files):
        self.files = files

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        import torch

        return torch.load(self.files[i]), 0


def cpu_seconds() -> float:
    """CPU time of this process and its reaped children (the build workers)."""
    s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime


# ----------------------------------------------------------------------------- main


def du(path: Path) -> tuple[int, int]:
    files = [p for p in path.rglob("*") if p.is_file() and not p.name.startswith(".")]
    return sum(p.stat().st_size for p in files), len(files)


def machine() -> str:
    cpu = "unknown CPU"
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    with open("/proc/meminfo") as f:
        mem = int(f.readline().split()[1]) / 2**20
    import PIL
    import torch

    return (f"{cpu}, {len(os.sched_getaffinity(0))} cores, {mem:.0f} GiB RAM; Python {platform.python_version()}, "
            f"Pillow {PIL.__version__}, numpy {np.__version__}, torch {torch.__version__}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", type=Path, default=Path("/tmp/xla_utils_bench"))
    ap.add_argument("--images", type=int, default=300)
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument("--variants", type=int, default=4)
    ap.add_argument("--naive-images", type=int, default=16, help="subset for the naive builder")
    ap.add_argument("--otf-samples", type=int, default=64, help="samples per pass of the on-the-fly loader")
    ap.add_argument("--loader-samples", type=int, default=6000)
    ap.add_argument("--pt-samples", type=int, default=1500)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--write-doc", action="store_true", help="update the '## Cached dataset' section")
    a = ap.parse_args()

    import torch
    from torch.utils.data import DataLoader

    from xla_utils.data import CachedImageDataset, iterate_batches

    work, size, V, R = a.work, a.size, a.variants, a.repeats
    paths = make_sources(work / "src", a.images)
    src_bytes, src_files = du(work / "src")
    cores = len(os.sched_getaffinity(0))
    res: dict[str, object] = {}
    load_before = os.getloadavg()

    # ---- build throughput (wall clock, and CPU seconds per image, which other load does not distort)
    def timed_build(out, codec):
        t0, c0 = time.perf_counter(), cpu_seconds()
        build_cache(work / "src", out, size=size, variants=V, codec=codec, overwrite=True, verbose=False)
        return a.images / (time.perf_counter() - t0), (cpu_seconds() - c0) / a.images

    # interleaved, so that all three see the same background load
    raw_rates, jpg_rates, naive_rates, raw_cpu, jpg_cpu, naive_cpu = [], [], [], [], [], []
    for r in range(R):
        rate, c = timed_build(work / "cache_raw", "raw")
        raw_rates.append(rate)
        raw_cpu.append(c)
        print(f"build raw : {rate:6.1f} images/s, {c * 1000:.0f} CPU-ms/image", flush=True)
        rate, c = timed_build(work / "cache_jpeg", "jpeg")
        jpg_rates.append(rate)
        jpg_cpu.append(c)
        print(f"build jpeg: {rate:6.1f} images/s, {c * 1000:.0f} CPU-ms/image", flush=True)
        subset = paths[r * a.naive_images:(r + 1) * a.naive_images]
        shutil.rmtree(work / "naive", ignore_errors=True)
        t0, c0 = time.perf_counter(), cpu_seconds()
        naive_build(subset, work / "naive", size, V)
        naive_rates.append(len(subset) / (time.perf_counter() - t0))
        naive_cpu.append((cpu_seconds() - c0) / len(subset))
        print(f"build naive: {naive_rates[-1]:6.2f} images/s, {naive_cpu[-1] * 1000:.0f} CPU-ms/image", flush=True)
    naive_bytes, naive_files = du(work / "naive")
    naive_per_image = naive_bytes / a.naive_images

    # ---- JPEG fidelity
    ds_raw, ds_jpg = CachedImageDataset(work / "cache_raw"), CachedImageDataset(work / "cache_jpeg")
    psnrs = []
    for i in range(0, len(ds_raw), max(1, len(ds_raw) // 50)):
        for v in range(V):
            mse = np.mean((ds_raw.image(i, v).astype(np.float64) - ds_jpg.image(i, v)) ** 2)
            psnrs.append(10 * np.log10(255**2 / max(mse, 1e-12)))

    # ---- loader caches long enough to time (6,000 samples copied from the built cache)
    class Replay:
        def __init__(self, ds, n):
            self.ds, self.n = ds, n

        def __len__(self):
            return self.n

        def __getitem__(self, i):
            return self.ds.image(i % len(self.ds), (i // len(self.ds)) % V), int(self.ds.labels[i % len(self.ds)])

    replay = Replay(ds_raw, a.loader_samples)
    for codec in ("raw", "jpeg"):
        build_cache(replay, work / f"loader_{codec}", size=size, codec=codec, verbose=False)
    ld_raw, ld_jpg = CachedImageDataset(work / "loader_raw"), CachedImageDataset(work / "loader_jpeg")
    bs = 256

    def ours(ds, workers):
        return lambda r: iterate_batches(ds, bs, epoch=r, num_workers=workers)

    rates = {
        "raw_threads": time_loader(ours(ld_raw, None), R + 2),
        "raw_sync": time_loader(ours(ld_raw, 0), R + 2),
        "jpeg_threads": time_loader(ours(ld_jpg, None), R),
    }
    print({k: [round(x) for x in v] for k, v in rates.items()}, flush=True)

    import torchvision.transforms as T
    from torchvision.datasets import ImageFolder

    tf = T.Compose([T.RandomResizedCrop(size), T.RandomHorizontalFlip(), T.PILToTensor()])
    folder = ImageFolder(str(work / "src"), transform=tf)
    g = torch.Generator().manual_seed(0)
    for workers, key in ((0, "otf_1proc"), (cores, "otf_workers")):
        # one long-lived iterator, timed in windows of --otf-samples after a warm-up batch
        dl = DataLoader(folder, batch_size=32, shuffle=True, num_workers=workers, generator=g)
        it = iter(dl)
        next(it)
        rates[key] = []
        for _ in range(R):
            n, t0 = 0, time.perf_counter()
            while n < a.otf_samples:
                try:
                    n += len(next(it)[0])
                except StopIteration:
                    it = iter(dl)
            rates[key].append(n / (time.perf_counter() - t0))
        del it
        print(key, [round(x, 1) for x in rates[key]], flush=True)

    for dtype, key in ((torch.uint8, "pt_uint8"), (torch.float32, "pt_float32")):
        pt_dir = work / key
        shutil.rmtree(pt_dir, ignore_errors=True)
        pt_dir.mkdir()
        files = []
        mean = torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1)
        std = torch.tensor([0.229, 0.224, 0.225]).view(3, 1, 1)
        for i in range(a.pt_samples):
            t = torch.from_numpy(ld_raw.image(i)).permute(2, 0, 1).contiguous()
            if dtype == torch.float32:
                t = (t.float() / 255 - mean) / std
            files.append(pt_dir / f"{i:06d}.pt")
            torch.save(t, files[-1])
        res[f"{key}_bytes"], res[f"{key}_files"] = du(pt_dir)
        dl = DataLoader(PtFiles(files), batch_size=bs, shuffle=True, num_workers=0, drop_last=True)
        rates[key] = time_loader(lambda r, dl=dl: dl, R)
        print(key, [round(x) for x in rates[key]], flush=True)
        shutil.rmtree(pt_dir)

    med = {k: statistics.median(v) for k, v in rates.items()}
    b_raw, b_jpg, b_naive = (statistics.median(x) for x in (raw_rates, jpg_rates, naive_rates))
    c_raw, c_jpg, c_naive = (statistics.median(x) * 1000 for x in (raw_cpu, jpg_cpu, naive_cpu))
    load_after = os.getloadavg()
    raw_bytes, raw_files = du(work / "cache_raw")
    jpg_bytes, jpg_files = du(work / "cache_jpeg")
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")

    def ok(x, target):
        return "met" if x >= target else "**not met**"

    lines = [
        "## Cached dataset",
        "",
        f"Command: `python scripts/bench_cache.py{' --write-doc' if a.write_doc else ''}` "
        f"(defaults: {a.images} images, {V} variants at {size}x{size}, medians of {R}+ runs).  ",
        f"Machine: {machine()}; shared with other jobs: load average {load_before[0]:.1f} at the start, "
        f"{load_after[0]:.1f} at the end (the 2-process builder suffers most from that).  ",
        f"Date: {when}.",
        "",
        f"Sources: {a.images} generated {W}x{H} JPEGs (q92, scikit-image photos upscaled + film grain), "
        f"{src_bytes / a.images / 1e6:.2f} MB each, {src_bytes / 1e6:.0f} MB in {src_files} files.",
        "",
        "| build | median source images/s | runs | median CPU-ms per image |",
        "|---|---:|---|---:|",
        f"| `build_cache` raw, {cores} processes, one draft decode per image | {b_raw:.1f} | "
        f"{', '.join(f'{x:.1f}' for x in raw_rates)} | {c_raw:.0f} |",
        f"| `build_cache` jpeg q90, {cores} processes | {b_jpg:.1f} | {', '.join(f'{x:.1f}' for x in jpg_rates)} | "
        f"{c_jpg:.0f} |",
        f"| naive: 1 process, full decode per variant, 1 file per sample ({a.naive_images} images/run) | "
        f"{b_naive:.2f} | {', '.join(f'{x:.2f}' for x in naive_rates)} | {c_naive:.0f} |",
        "",
        f"Build speed-up vs naive (wall clock): **{b_raw / b_naive:.1f}x** raw, {b_jpg / b_naive:.1f}x jpeg "
        f"(target >= 5x: {ok(b_raw / b_naive, 5)}). CPU work per image is {c_naive / c_raw:.1f}x smaller "
        f"(measured, insensitive to the background load); with {cores} idle cores the wall-clock ratio could "
        f"reach about {cores} x that (not measured here).",
        "",
        f"| loader, one process, page cache, batch {bs} ({size}x{size}) | median samples/s | runs |",
        "|---|---:|---|",
        f"| `iterate_batches` raw, default threads | {med['raw_threads']:,.0f} | "
        f"{', '.join(f'{x:,.0f}' for x in rates['raw_threads'])} |",
        f"| `iterate_batches` raw, num_workers=0 (no threads) | {med['raw_sync']:,.0f} | "
        f"{', '.join(f'{x:,.0f}' for x in rates['raw_sync'])} |",
        f"| `iterate_batches` jpeg q90, default threads | {med['jpeg_threads']:,.0f} | "
        f"{', '.join(f'{x:,.0f}' for x in rates['jpeg_threads'])} |",
        f"| one `.pt` file per sample, uint8 CHW, DataLoader | {med['pt_uint8']:,.0f} | "
        f"{', '.join(f'{x:,.0f}' for x in rates['pt_uint8'])} |",
        f"| one `.pt` file per sample, normalised float32 (old CachedDataset) | {med['pt_float32']:,.0f} | "
        f"{', '.join(f'{x:,.0f}' for x in rates['pt_float32'])} |",
        f"| on-the-fly ImageFolder + PIL decode/RandomResizedCrop/flip, 1 process | {med['otf_1proc']:,.1f} | "
        f"{', '.join(f'{x:,.1f}' for x in rates['otf_1proc'])} |",
        f"| same with DataLoader num_workers={cores} | {med['otf_workers']:,.1f} | "
        f"{', '.join(f'{x:,.1f}' for x in rates['otf_workers'])} |",
        "",
        f"Loader targets: raw >= 20,000/s: {med['raw_threads']:,.0f} ({ok(med['raw_threads'], 20000)}); "
        f">= 100x on-the-fly: **{med['raw_threads'] / med['otf_1proc']:,.0f}x** "
        f"({ok(med['raw_threads'] / med['otf_1proc'], 100)}); >= 10x one-`.pt`-per-sample: "
        f"**{med['raw_threads'] / med['pt_uint8']:.1f}x** vs uint8 ({ok(med['raw_threads'] / med['pt_uint8'], 10)}), "
        f"{med['raw_threads'] / med['pt_float32']:.1f}x vs float32.",
        "",
        f"| on disk ({a.images} images x {V} variants = {a.images * V} samples) | bytes | files |",
        "|---|---:|---:|",
        f"| source JPEGs | {src_bytes / 1e6:,.0f} MB | {src_files} |",
        f"| cache raw | {raw_bytes / 1e6:,.1f} MB | {raw_files} |",
        f"| cache jpeg q90 | {jpg_bytes / 1e6:,.1f} MB | {jpg_files} |",
        f"| naive one `.npy` per sample (extrapolated from {a.naive_images} images) | "
        f"{naive_per_image * a.images / 1e6:,.1f} MB | {naive_files // a.naive_images * a.images} |",
        f"| one `.pt` per sample, float32 (extrapolated from {a.pt_samples}) | "
        f"{res['pt_float32_bytes'] / a.pt_samples * a.images * V / 1e6:,.1f} MB | {a.images * V} |",
        "",
        f"Raw/JPEG size ratio {raw_bytes / jpg_bytes:.1f}x; JPEG q90 PSNR vs raw: median "
        f"{statistics.median(psnrs):.1f} dB, min {min(psnrs):.1f} dB over {len(psnrs)} samples. "
        "Cache file count is shards + 2 (at least 16 shards so every core has work), independent of the "
        "sample count; at 256 MiB per shard a 560,000-image single-variant raw cache at 224x224 would be "
        f"{-(-560_000 * size * size * 3 // (256 * 2**20)) + 2} files.",
        "",
    ]
    text = "\n".join(lines)
    print(text)
    if a.write_doc:
        doc = ROOT / "docs" / "BENCHMARKS.md"
        old = doc.read_text() if doc.exists() else "# Benchmarks\n"
        pat = re.compile(r"^## Cached dataset\n.*?(?=^## |\Z)", re.S | re.M)
        new = pat.sub(lambda _: text + "\n", old) if pat.search(old) else old.rstrip("\n") + "\n\n" + text + "\n"
        doc.write_text(new)
        print(f"updated {doc}")


if __name__ == "__main__":
    main()
