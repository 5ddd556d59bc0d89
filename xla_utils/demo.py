"""End-to-end demo on real data, no TPU needed: ``python -m xla_utils.demo``.

1. renders scikit-learn's bundled handwritten digits (1,797 real 8x8 scans) as
   PNG files in an image folder, one sub-folder per class;
2. builds a sharded uint8 cache from it on all CPU cores (4 augmented variants
   per training image, 1 plain variant for validation);
3. runs the LR finder on one (simulated) core;
4. trains a small CNN with the one-cycle policy on 8 simulated TPU cores
   (XLA:CPU), printing the LR/batch scaling, progress and history.

It finishes in a few minutes on a 2-core machine. ``--cores N`` changes the
number of simulated cores; on a real TPU machine pass ``--tpu`` to use every
TPU core instead. ``--tiny`` is the smallest end-to-end run (2 simulated cores,
1 epoch, a fixed LR instead of the finder; about 20 s), used to check an install.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

from . import env

IMAGE_SIZE = 32  # rendered PNG side, pixels
CACHE_SIZE = 28  # cached side, pixels


def render_digits(out: Path, val_fraction: float = 0.2, seed: int = 0) -> tuple[Path, Path]:
    """Write the digits as ``out/{train,val}/<digit>/<index>.png`` (32x32 RGB).

    Returns the train and validation folders. Existing files are reused.
    """
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise SystemExit("the demo needs scikit-learn for its bundled digits: "
                         "pip install scikit-learn (or xla_utils[demo])") from None
    from PIL import Image

    digits = load_digits()
    rng = np.random.default_rng(seed)
    is_val = rng.random(len(digits.target)) < val_fraction
    for split in ("train", "val"):
        for c in range(10):
            (out / split / str(c)).mkdir(parents=True, exist_ok=True)
    for i, (img, label) in enumerate(zip(digits.images, digits.target)):
        path = out / ("val" if is_val[i] else "train") / str(label) / f"{i:04d}.png"
        if path.exists():
            continue
        pixels = (img * (255.0 / 16.0)).clip(0, 255).astype(np.uint8)
        pil = Image.fromarray(pixels, "L").resize((IMAGE_SIZE, IMAGE_SIZE), Image.BICUBIC)
        pil.convert("RGB").save(path)
    return out / "train", out / "val"


def make_cnn():
    """A small CNN for 28x28 RGB inputs and 10 classes."""
    from torch import nn

    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(32 * 7 * 7, 64), nn.ReLU(), nn.Linear(64, 10),
    )


def run_demo(out: str | Path = "xla_utils_demo", cores: int = 8, tpu: bool = False,
             epochs: int = 6, batch_size: int = 16, max_lr: float | str = "find"):
    """Run the whole demo; returns the trainer's :class:`~xla_utils.train.trainer.History`.

    ``cores`` simulated XLA:CPU cores (default 8) unless ``tpu`` (every real TPU
    core); ``batch_size`` per core (default 16); ``max_lr`` for one core, or
    ``"find"`` (default) to run the LR finder first.
    """
    import torch

    from .cache import build_cache
    from .data import CachedImageDataset
    from .train.trainer import OneCycleTrainer

    t_start = time.perf_counter()
    info = env.detect()
    print(f"[1/4] environment: {info.platform}, {info.accelerator}, torch {info.torch}, "
          f"torch_xla {info.torch_xla}, {info.cpus} vCPUs", flush=True)
    out = Path(out)
    train_dir, val_dir = render_digits(out / "images")
    n_train = sum(1 for _ in train_dir.rglob("*.png"))
    n_val = sum(1 for _ in val_dir.rglob("*.png"))
    print(f"[2/4] rendered scikit-learn digits: {n_train} train / {n_val} val PNGs in {out / 'images'}",
          flush=True)
    build_cache(train_dir, out / "cache" / "train", size=CACHE_SIZE, variants=4,
                scale=(0.7, 1.0), rotate=10.0)
    train = CachedImageDataset(out / "cache" / "train")
    build_cache(val_dir, out / "cache" / "val", size=CACHE_SIZE, variants=1, classes=train.classes)
    val = CachedImageDataset(out / "cache" / "val")
    print(f"[3/4] caches: {len(train)} x {train.num_variants} variants, {len(val)} val, "
          f"classes {train.classes}", flush=True)

    trainer = OneCycleTrainer(make_cnn, torch.nn.CrossEntropyLoss(), train, val,
                              batch_size=batch_size, epochs=epochs, optimizer="adam",
                              flip=False, mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5), seed=0)
    where = "all TPU cores" if tpu else f"{cores} simulated cores (XLA:CPU)"
    print(f"[4/4] one-cycle training on {where}", flush=True)
    history = trainer.fit(simulate=None if tpu else cores, max_lr=max_lr)
    print(history, flush=True)
    print(f"final validation accuracy {history[-1]['accuracy']:.2%} on {history[-1]['samples']} "
          f"images; total {time.perf_counter() - t_start:.0f} s", flush=True)
    return history


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m xla_utils.demo", description=__doc__.split("\n")[0])
    p.add_argument("--out", default="xla_utils_demo", help="working folder (default ./xla_utils_demo)")
    p.add_argument("--cores", type=int, default=8, help="simulated XLA:CPU cores (default 8)")
    p.add_argument("--tpu", action="store_true", help="train on every real TPU core instead")
    p.add_argument("--epochs", type=int, default=6, help="training epochs (default 6)")
    p.add_argument("--batch-size", type=int, default=16, help="per-core batch size (default 16)")
    p.add_argument("--max-lr", default="find",
                   help="peak LR for one core, or 'find' to run the LR finder (default)")
    p.add_argument("--tiny", action="store_true",
                   help="smallest run, to check an install: 2 simulated cores (unless --tpu), "
                        "1 epoch, max_lr 0.003 (about 20 s)")
    args = p.parse_args(argv)
    if args.tiny:
        args.cores, args.epochs, args.max_lr = 2, 1, "0.003"
    max_lr = args.max_lr if args.max_lr == "find" else float(args.max_lr)
    run_demo(args.out, cores=args.cores, tpu=args.tpu, epochs=args.epochs,
             batch_size=args.batch_size, max_lr=max_lr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
