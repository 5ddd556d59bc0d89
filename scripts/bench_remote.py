"""Read throughput of a cache in a bucket (a GCS emulator on 127.0.0.1) against the same cache on disk.

    python scripts/bench_remote.py [--images 1000] [--size 224]

Starts ``gcp-storage-emulator`` (in memory), builds one raw cache into a local folder and the
same into ``gs://``, then times ``iterate_batches`` over each: the bucket's first epoch
(downloads into an empty local copy) and second epoch (from the local copy), and the local
folder. Prints a markdown table for docs/BENCHMARKS.md.
"""
from __future__ import annotations

import argparse
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


class Noise:
    def __init__(self, n: int, size: int):
        self.n, self.size = n, size

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return np.random.default_rng(i).integers(0, 256, (self.size, self.size, 3), dtype=np.uint8), i % 10


def _epoch(ds, epoch: int) -> float:
    from xla_utils.data import iterate_batches

    t0, n = time.perf_counter(), 0
    for x, _, _ in iterate_batches(ds, 128, epoch=epoch, seed=0):
        n += x.shape[0]
    return n / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--images", type=int, default=1000)
    ap.add_argument("--size", type=int, default=224)
    a = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ["STORAGE_EMULATOR_HOST"] = f"http://127.0.0.1:{port}"
    os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] = "false"
    emu = subprocess.Popen([sys.executable, "-m", "gcp_storage_emulator", "start", "--host", "127.0.0.1", "--port",
                            str(port), "--in-memory", "--default-bucket", "bench"], start_new_session=True,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(3)
        from xla_utils.cache import build_cache
        from xla_utils.data import CachedImageDataset

        with tempfile.TemporaryDirectory() as tmp:
            kw = dict(size=a.size, shard_size="16MiB", verbose=False)
            t0 = time.perf_counter()
            build_cache(Noise(a.images, a.size), Path(tmp, "local"), **kw)
            t_local = time.perf_counter() - t0
            t0 = time.perf_counter()
            r = build_cache(Noise(a.images, a.size), "gs://bench/c", **kw)
            t_gs = time.perf_counter() - t0
            local = CachedImageDataset(Path(tmp, "local"))
            remote = CachedImageDataset("gs://bench/c", local_cache=Path(tmp, "copy"))
            first, second = _epoch(remote, 0), _epoch(remote, 1)
            disk = [_epoch(local, e) for e in range(3)]
        mb = r.bytes / 1e6
        print(f"{a.images} images {a.size}x{a.size} raw, {r.num_shards} shards, {mb:.0f} MB; "
              f"{platform.python_version()}, load {os.getloadavg()[0]:.1f}")
        print("| read, batch 128, default threads | images/s |\n|---|---:|")
        print(f"| gs:// emulator, first epoch (downloads, 4 at once) | {first:,.0f} |")
        print(f"| gs:// emulator, second epoch (local copy) | {second:,.0f} |")
        print(f"| local folder (median of 3 epochs) | {float(np.median(disk)):,.0f} |")
        print(f"build: local folder {a.images / t_local:,.0f} images/s, into gs:// {a.images / t_gs:,.0f} images/s")
    finally:
        os.killpg(emu.pid, signal.SIGTERM)
        emu.wait()


if __name__ == "__main__":
    main()
