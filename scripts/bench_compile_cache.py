"""What the persistent compilation cache does on this machine: three fits of the demo CNN.

    PJRT_DEVICE=CPU python scripts/bench_compile_cache.py [--cores 2] [--epochs 1]

Runs ``fit`` on the demo's digits cache three times: with ``compile_cache=None``,
then twice with a fresh cache folder (the first run writes it, the second looks
its graphs up). Prints per run: wall seconds, graphs compiled, seconds compiling
(master replica), the run's compile-cache line, and the cache folder's entries and
size. On XLA:CPU the second run finds every entry but cannot load it
(``PersistentCacheDeserializeFailure``) and compiles again; on a TPU those are hits.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch


def _one_fit(train, val, cores: int, epochs: int, cache) -> tuple[float, object]:
    from xla_utils.demo import make_cnn
    from xla_utils.train.trainer import OneCycleTrainer

    t = OneCycleTrainer(make_cnn, torch.nn.CrossEntropyLoss(), train, val, batch_size=16,
                        epochs=epochs, optimizer="adam", max_lr=3e-3, flip=False,
                        mean=(0.5,) * 3, std=(0.5,) * 3, seed=0, compile_cache=cache)
    t0 = time.perf_counter()
    h = t.fit(simulate=cores)
    return time.perf_counter() - t0, h


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cores", type=int, default=2)
    p.add_argument("--epochs", type=int, default=1)
    args = p.parse_args(argv)
    from xla_utils.cache import build_cache
    from xla_utils.data import CachedImageDataset
    from xla_utils.demo import CACHE_SIZE, render_digits

    with tempfile.TemporaryDirectory(prefix="bench_cc_") as tmp:
        tmp = Path(tmp)
        train_dir, val_dir = render_digits(tmp / "images")
        build_cache(train_dir, tmp / "train", size=CACHE_SIZE, variants=1)
        train = CachedImageDataset(tmp / "train")
        build_cache(val_dir, tmp / "val", size=CACHE_SIZE, classes=train.classes)
        val = CachedImageDataset(tmp / "val")
        folder = tmp / "compile_cache"
        rows = []
        for name, cache in (("off", None), ("cache, 1st run", folder), ("cache, 2nd run", folder)):
            wall, h = _one_fit(train, val, args.cores, args.epochs, cache)
            files = [f for f in folder.rglob("*") if f.is_file()] if folder.exists() else []
            rows.append((name, wall, h[-1]["compiles"], len(files),
                         sum(f.stat().st_size for f in files) / 2**20, h.compile_cache))
        print(f"{'run':16} {'wall_s':>7} {'compiles':>8} {'entries':>7} {'MiB':>6}  compile cache line")
        for name, wall, compiles, n, mib, line in rows:
            print(f"{name:16} {wall:7.1f} {compiles:8d} {n:7d} {mib:6.2f}  {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
