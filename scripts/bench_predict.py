"""Inference overhead: OneCycleTrainer.predict vs a hand-written MpDeviceLoader loop.

Both run the same CNN (random weights, fixed seed) over the same uint8 image
cache (scikit-learn's 1,797 digits rendered at 32x32) at the same batch on one
XLA:CPU device, normalise on the device, apply a softmax and bring every
prediction to the host as one numpy array. Each repetition runs both variants,
each in a fresh process, alternating the order; the timed span is everything
after the imports: device start, compilation, the pass and the gather
(``predict`` also forks its replica); importing torch_xla is not timed. Reports median images/s, the overhead
ratio and the largest difference between the two prediction arrays.

    PJRT_DEVICE=CPU python scripts/bench_predict.py [--reps 5] [--batch 64] [--repeat 3] [--json out.json]

The hand-written loop is what a careful user writes from the torch_xla docs:
a ``DataLoader`` over the cache, ``MpDeviceLoader``, outputs kept on the device
and read once at the end. It is, with scripts/bench_trainer.py, the only code
outside ``xla_utils/runtime/`` that calls torch_xla, because it is the baseline.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CLASSES = 10
MEAN, STD = (0.5,) * 3, (0.5,) * 3


def make_model():
    import torch
    import torch.nn as nn

    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(32 * 8 * 8, 64), nn.ReLU(), nn.Linear(64, CLASSES),
    )


def build(cache: Path, repeat: int) -> None:
    """The digits, ``repeat`` times over (a bigger pass), as a 32x32 uint8 cache."""
    import numpy as np
    from sklearn.datasets import load_digits

    from xla_utils import build_cache

    d = load_digits()
    imgs = [np.repeat((im * 15).astype(np.uint8)[..., None], 3, axis=2) for im in d.images] * repeat
    build_cache([(im, int(t)) for im, t in zip(imgs, list(d.target) * repeat)], cache, size=32,
                verbose=False)


def run_hand(cache: str, batch: int) -> dict:
    import torch
    import torch_xla
    import torch_xla.distributed.parallel_loader as pl

    from xla_utils import CachedImageDataset
    from xla_utils.data import images_to_float

    ds = CachedImageDataset(cache)
    t0 = time.perf_counter()
    dev = torch_xla.device()
    model = make_model().to(dev).eval()
    loader = torch.utils.data.DataLoader(ds, batch_size=batch, shuffle=False, drop_last=False)
    outs = []
    with torch.no_grad():
        for x, _ in pl.MpDeviceLoader(loader, dev):
            outs.append(torch.softmax(model(images_to_float(x, MEAN, STD)), 1))
    preds = torch.cat(outs).cpu().numpy()
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "images": len(ds), "preds": preds.tolist()}


def run_predict(cache: str, batch: int) -> dict:
    import torch

    from xla_utils import CachedImageDataset, OneCycleTrainer, runtime

    runtime.xla_available()  # imports torch_xla (untimed, as in run_hand); the runtime stays untouched
    ds = CachedImageDataset(cache)
    t = OneCycleTrainer(make_model(), torch.nn.CrossEntropyLoss(), ds, batch_size=batch, mean=MEAN, std=STD)
    t0 = time.perf_counter()
    preds = t.predict(ds, simulate=1)
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "images": len(ds), "preds": preds.tolist()}


def _child(variant: str, cache: Path, batch: int) -> dict:
    env = dict(os.environ, PJRT_DEVICE="CPU")
    p = subprocess.run([sys.executable, __file__, "--child", variant, "--cache", str(cache),
                        "--batch", str(batch)], capture_output=True, text=True, env=env)
    if p.returncode != 0:
        raise RuntimeError(f"{variant} failed:\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3, help="passes of the 1,797 digits in the cache")
    ap.add_argument("--json", help="also write the medians and per-run rates here")
    ap.add_argument("--child", choices=["hand", "predict"], help=argparse.SUPPRESS)
    ap.add_argument("--cache", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        fn = run_hand if args.child == "hand" else run_predict
        print("\n" + json.dumps(fn(args.cache, args.batch)))  # after any progress bar
        return 0

    import numpy as np

    with tempfile.TemporaryDirectory() as tmp:
        cache = Path(tmp) / "cache"
        build(cache, args.repeat)
        rates: dict[str, list[float]] = {"hand": [], "predict": []}
        diff = 0.0
        for rep in range(args.reps):
            preds = {}
            for variant in (("hand", "predict") if rep % 2 == 0 else ("predict", "hand")):
                r = _child(variant, cache, args.batch)
                rate = r["images"] / r["seconds"]
                rates[variant].append(rate)
                preds[variant] = np.asarray(r["preds"])
                print(f"rep {rep} {variant:8s} {rate:8.1f} images/s ({r['images']} images, "
                      f"{r['seconds']:.2f} s)", flush=True)
            diff = max(diff, float(np.abs(preds["hand"] - preds["predict"]).max()))
    med = {k: statistics.median(v) for k, v in rates.items()}
    overhead = med["hand"] / med["predict"] - 1
    paired = statistics.median(h / p - 1 for h, p in zip(rates["hand"], rates["predict"]))
    print(f"\nmedian images/s: hand-written MpDeviceLoader loop {med['hand']:.1f}, predict "
          f"{med['predict']:.1f}; predict overhead {overhead:+.1%} (ratio of medians), {paired:+.1%} "
          f"(median of per-rep ratios); batch {args.batch}, {args.reps} reps; max |difference| of "
          f"the predictions {diff:.2e}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rates": rates, "median": med, "overhead": overhead, "paired_overhead": paired,
                       "max_abs_diff": diff}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
