"""The litdata half of scripts/bench_remote.py, run by it in a child process whose PYTHONPATH holds a
litdata install (``--litdata DIR``), so that litdata never enters the stack's own site-packages.

    PYTHONPATH=DIR STORAGE_EMULATOR_HOST=http://127.0.0.1:PORT python scripts/bench_litdata.py \
        --url gs://bench/lit --images 1000 --size 224 --reps 3 --workers 2 --tmp /tmp/x

``litdata.optimize`` writes the same uint8 ``size x size x 3`` noise images (and labels) as the
benchmark into 16 MB chunks under ``--url`` on the emulator; then, per rep, a fresh ``StreamingDataset``
(empty cache folder) + ``StreamingDataLoader`` (batch 128, or all images if fewer) reads a first epoch
(downloads) and a second (local chunks). Prints one JSON object: build seconds and the images/s lists.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np

SIZE = 224


def _item(i: int) -> dict:
    """Sample ``i``: the same bytes as bench_remote.Noise[i]."""
    img = np.random.default_rng(i).integers(0, 256, (SIZE, SIZE, 3), dtype=np.uint8)
    return {"image": img, "label": i % 10}


def _epoch(loader) -> float:
    t0, n = time.perf_counter(), 0
    for batch in loader:
        n += batch["image"].shape[0]
    return n / (time.perf_counter() - t0)


def main() -> None:
    global SIZE
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", required=True)
    ap.add_argument("--images", type=int, required=True)
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--tmp", required=True)
    a = ap.parse_args()
    SIZE = a.size
    if "STORAGE_EMULATOR_HOST" not in os.environ:
        raise SystemExit("bench_litdata.py: set STORAGE_EMULATOR_HOST=http://127.0.0.1:PORT (the GCS emulator)")
    from litdata import StreamingDataLoader, StreamingDataset, optimize

    opts = {"project": "bench"}  # google.cloud.storage.Client(project=...): the emulator needs no credentials
    t0 = time.perf_counter()
    optimize(fn=_item, inputs=list(range(a.images)), output_dir=a.url, chunk_bytes="16MB", num_workers=1,
             storage_options=opts, verbose=False, start_method="fork")
    build = time.perf_counter() - t0
    first, second = [], []
    for r in range(a.reps):
        ds = StreamingDataset(a.url, cache_dir=str(Path(a.tmp, f"lit-cache-{r}")), storage_options=opts)
        assert len(ds) == a.images, f"litdata sees {len(ds)} items, wrote {a.images}"
        loader = StreamingDataLoader(ds, batch_size=min(128, a.images), num_workers=a.workers)
        first.append(_epoch(loader))
        second.append(_epoch(loader))
    print(json.dumps({"build_s": build, "first": first, "second": second}))


if __name__ == "__main__":
    main()
