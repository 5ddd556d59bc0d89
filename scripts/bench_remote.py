"""Caches in a bucket against local ones, and build engines against each other, in one run.

    python scripts/bench_remote.py [--images 1000] [--size 224] [--reps 3] [--litdata /tmp/litdata_site]

Starts ``gcp-storage-emulator`` (in memory, 127.0.0.1) and prints markdown tables for
docs/BENCHMARKS.md, each figure the median over ``--reps`` with the 1-minute load average after it:

1. read images/s (``iterate_batches``, batch 128): the bucket's first epoch (downloads into an empty
   local copy) and second epoch (from the local copy), the local folder, and, with ``--litdata DIR``
   (a litdata install: ``pip install --target DIR --no-deps litdata lightning-utilities boto3 botocore
   s3transfer jmespath``), litdata streaming the same images from the same emulator
   (scripts/bench_litdata.py in a child process with ``PYTHONPATH=DIR``);
2. build throughput (source images/s) into a local folder: the process pool (1 and 2 workers) and
   Ray on 1 and on 2 local nodes of 1 CPU each (tests/local_servers.py starts them);
3. on paper from those figures: the time to cache 1M images on N Ray workers.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from local_servers import (free_port, ray_connect, start_emulator, start_ray_node, stop,  # noqa: E402
                           wait_port, wait_ray_nodes)

BUCKET = "bench"


class Noise:
    """``n`` uint8 ``size x size x 3`` images of noise, seeded by index (litdata's items are the same)."""

    def __init__(self, n: int, size: int):
        self.n, self.size = n, size

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return np.random.default_rng(i).integers(0, 256, (self.size, self.size, 3), dtype=np.uint8), i % 10


def _load() -> float:
    return os.getloadavg()[0]


def _epoch(ds, epoch: int) -> float:
    from xla_utils.data import iterate_batches

    t0, n = time.perf_counter(), 0
    for x, _, _ in iterate_batches(ds, min(128, len(ds)), epoch=epoch, seed=0):
        n += x.shape[0]
    return n / (time.perf_counter() - t0)


def _fig(values: list[float]) -> tuple[float, float]:
    """(median, load now)."""
    return float(np.median(values)), _load()


def _reads(a, tmp: Path) -> dict:
    from xla_utils.cache import build_cache
    from xla_utils.data import CachedImageDataset

    kw = dict(size=a.size, shard_size="16MiB", verbose=False)
    build_cache(Noise(a.images, a.size), tmp / "local", **kw)
    r = build_cache(Noise(a.images, a.size), f"gs://{BUCKET}/c", **kw)
    first, second = [], []
    for rep in range(a.reps):
        remote = CachedImageDataset(f"gs://{BUCKET}/c", local_cache=tmp / f"copy{rep}")
        first.append(_epoch(remote, 0))
        second.append(_epoch(remote, 1))
        shutil.rmtree(tmp / f"copy{rep}", ignore_errors=True)
    rows = {"ours, gs:// emulator, first epoch (downloads, 4 at once)": _fig(first),
            "ours, gs:// emulator, second epoch (local copy)": _fig(second)}
    local = CachedImageDataset(tmp / "local")
    rows["ours, local folder"] = _fig([_epoch(local, e) for e in range(a.reps)])
    return {"rows": rows, "mb": r.bytes / 1e6, "shards": r.num_shards}


def _litdata(a, tmp: Path) -> dict:
    """litdata rows (or one "not measured" row) from scripts/bench_litdata.py in a child process."""
    name = f"litdata (workers={a.litdata_workers}), gs:// emulator"
    if not a.litdata:
        return {f"{name}": "not measured: no --litdata DIR given"}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([a.litdata, str(ROOT)])}
    cmd = [sys.executable, str(ROOT / "scripts" / "bench_litdata.py"), "--url", f"gs://{BUCKET}/lit",
           "--images", str(a.images), "--size", str(a.size), "--reps", str(a.reps),
           "--workers", str(a.litdata_workers), "--tmp", str(tmp)]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if p.returncode != 0:
        tail = (p.stderr.strip().splitlines() or ["no output"])[-1]
        return {name: f"not measured: bench_litdata.py exited {p.returncode}: {tail}"}
    out = json.loads(p.stdout.strip().splitlines()[-1])
    return {f"{name}, first epoch (downloads)": _fig(out["first"]),
            f"{name}, second epoch (local chunks)": _fig(out["second"])}


def _build_rate(a, tmp: Path, **kw) -> float:
    from xla_utils.cache import build_cache

    rates = []
    for _ in range(a.reps):
        out = tmp / f"b-{secrets.token_hex(3)}"
        r = build_cache(Noise(a.images, a.size), out, size=a.size, shard_size="4MiB", verbose=False, **kw)
        rates.append(a.images / r.seconds)
        shutil.rmtree(out, ignore_errors=True)
    return float(np.median(rates))


def _builds(a, tmp: Path) -> dict:
    rows = {f"local process pool, {w} worker{'s' * (w > 1)}": (_build_rate(a, tmp, workers=w), _load())
            for w in (1, 2)}
    try:
        import ray
    except ImportError:
        return {**rows, "Ray": "not measured: ray is not installed (pip install 'xla_utils[ray]')"}
    port = free_port()
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0",
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "scripts"), os.environ.get("PYTHONPATH", "")])}
    temp = f"/tmp/xlr-{secrets.token_hex(3)}"
    procs = [start_ray_node(port, env, head_temp_dir=temp)]
    address = f"127.0.0.1:{port}"
    try:
        time.sleep(3)
        ray_connect(address)
        wait_ray_nodes(1)
        _build_rate(argparse.Namespace(images=min(a.images, 32), size=a.size, reps=1), tmp, engine="ray",
                    ray_address=address)  # warm-up: Ray starts its worker processes
        rows["Ray, 1 node (1 CPU)"] = (_build_rate(a, tmp, engine="ray", ray_address=address), _load())
        procs.append(start_ray_node(port, env))
        wait_ray_nodes(2)
        _build_rate(argparse.Namespace(images=min(a.images, 32), size=a.size, reps=1), tmp, engine="ray",
                    ray_address=address)
        rows["Ray, 2 nodes on this machine (1 CPU each)"] = (
            _build_rate(a, tmp, engine="ray", ray_address=address), _load())
    finally:
        if ray.is_initialized():
            ray.shutdown()
        for p in reversed(procs):
            stop(p)
        shutil.rmtree(temp, ignore_errors=True)
    return rows


def _table(title: str, rows: dict) -> None:
    print(f"| {title} | median | load |\n|---|---:|---:|")
    for name, v in rows.items():
        print(f"| {name} | {v} | |" if isinstance(v, str) else f"| {name} | {v[0]:,.0f} | {v[1]:.1f} |")


def _estimate(a, per_worker: float, mb_per_image: float) -> None:
    """Time to cache 1M images on N Ray workers: the slowest of CPU, source reads and uploads."""
    n_img = 1_000_000
    print(f"\nOn paper, 1M images on N Ray workers (1 CPU each) = max(CPU, source read, upload): "
          f"{per_worker:,.0f} images/s per worker (measured above, Ray 1 node, noise arrays so no JPEG "
          f"decode: with decoding and resizing from JPEG expect several times less per CPU); source "
          f"{a.src_kb:.0f} KB per image read at {a.src_mbps:,.0f} MB/s in all; cache {mb_per_image * 1e3:.0f} KB "
          f"per image uploaded at {a.up_mbps:,.0f} MB/s in all; Ray's start-up and the manifest not counted.\n")
    print("| Ray workers | CPU | source read | upload | total |\n|---:|---:|---:|---:|---:|")
    src_s = n_img * a.src_kb / 1e3 / a.src_mbps
    up_s = n_img * mb_per_image / a.up_mbps
    for n in (1, 8, 32, 128):
        cpu_s = n_img / (per_worker * n)
        print(f"| {n} | {cpu_s / 60:,.1f} min | {src_s / 60:,.1f} min | {up_s / 60:,.1f} min | "
              f"{max(cpu_s, src_s, up_s) / 60:,.1f} min |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--images", type=int, default=1000)
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument("--reps", type=int, default=3, help="each figure is the median of this many runs")
    ap.add_argument("--litdata", metavar="DIR", help="a litdata install (pip --target DIR) to compare with")
    ap.add_argument("--litdata-workers", type=int, default=2, help="StreamingDataLoader num_workers")
    ap.add_argument("--no-ray", action="store_true", help="skip the build table (Ray and the local pool)")
    ap.add_argument("--src-kb", type=float, default=110, help="estimate: source bytes per image (ImageNet JPEG)")
    ap.add_argument("--src-mbps", type=float, default=1000, help="estimate: aggregate source read MB/s")
    ap.add_argument("--up-mbps", type=float, default=1000, help="estimate: aggregate upload MB/s")
    a = ap.parse_args()
    port = free_port()
    os.environ["STORAGE_EMULATOR_HOST"] = f"http://127.0.0.1:{port}"
    os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] = "false"  # else gcsfs waits 60 s on a gRPC probe
    emu = start_emulator(port, BUCKET)
    try:
        wait_port(port, emu, 60)
        with tempfile.TemporaryDirectory() as tmp:
            reads = _reads(a, Path(tmp))
            reads["rows"].update(_litdata(a, Path(tmp)))
            builds = None if a.no_ray else _builds(a, Path(tmp))
    finally:
        stop(emu)
    print(f"{a.images} images {a.size}x{a.size} uint8, {reads['shards']} shards, {reads['mb']:.0f} MB; "
          f"median of {a.reps}; Python {platform.python_version()}, {os.cpu_count()} CPUs; load = 1-min "
          f"average right after the figure\n")
    _table(f"read, batch {min(128, a.images)}, images/s", reads["rows"])
    if builds:
        print()
        _table("build into a local folder, source images/s", builds)
        ray1 = builds.get("Ray, 1 node (1 CPU)")
        if isinstance(ray1, tuple):
            _estimate(a, ray1[0], reads["mb"] / a.images)


if __name__ == "__main__":
    main()
