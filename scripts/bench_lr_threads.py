"""How long an LR sweep in the notebook process takes, and what it said it would take.

The issue-46 notebook: a torchvision ResNet-18 on a cache of 303 images at 64x64 (the
default 2 loader threads), ``lr_find`` in this process on the CPU with 2 micro-batches per
step (the sweep ``fit(max_lr="find")`` runs for 2 replicas). Prints the sweep's seconds, the
estimate it printed after warm-up (when it prints one) and torch's threads before and after.

    python scripts/bench_lr_threads.py /tmp/cache --steps 30 [--threads 1] [--load 1]

``--threads N`` sets ``torch.set_num_threads(N)`` in this process first (the report's
workaround); ``--load N`` runs N busy Python processes beside it (a loaded host). Timings
depend on what else the host runs: give ``uptime`` with every figure.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import multiprocessing as mp
import os
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _busy() -> None:
    while True:
        pass


class _Pictures:
    def __len__(self) -> int:
        return 303

    def __getitem__(self, i: int):
        import numpy as np
        from PIL import Image

        rng = np.random.default_rng(i)
        return Image.fromarray(rng.integers(0, 255, (80, 80, 3), dtype=np.uint8)), i % 3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("cache", help="the cache folder (built on the first run)")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads first")
    p.add_argument("--load", type=int, default=0, help="busy processes beside the sweep")
    args = p.parse_args()
    import torch
    import torchvision
    from torch import nn

    from xla_utils import CachedImageDataset, build_cache, lr_find

    if not (Path(args.cache) / "manifest.json").exists():
        build_cache(_Pictures(), args.cache, size=64, verbose=False)
    data = CachedImageDataset(args.cache)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    before = torch.get_num_threads()
    burners = [mp.get_context("fork").Process(target=_busy, daemon=True) for _ in range(args.load)]
    for b in burners:
        b.start()
    out = io.StringIO()
    try:
        model = torchvision.models.resnet18(num_classes=3)
        t0 = time.perf_counter()
        with contextlib.redirect_stdout(out):
            res = lr_find(model, nn.CrossEntropyLoss(), data, batch_size=16, num_it=args.steps,
                          optimizer="adamw", accum_steps=2)
        took = time.perf_counter() - t0
    finally:
        for b in burners:
            b.kill()
    said = re.search(r"about (\d+) s for all", out.getvalue())
    print(f"sweep {took:.1f} s for {len(res.lrs)} steps; estimate "
          f"{said.group(1) + ' s' if said else 'none printed'}; threads {before} before, "
          f"{torch.get_num_threads()} after; load {args.load}; loadavg {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
