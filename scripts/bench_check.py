"""How long ``xla_utils.check`` takes, beside ``debug_run`` on the same model and steps.

``debug_run`` (the baseline) only reads XLA's counters over plain steps;
``check`` adds one CPU analysis pass (dispatch trace, FLOPs, saved tensors) and
the per-step IR text, and compiles with LLVM -O0. Both run 4 training steps in a
forked child on one XLA:CPU device. Models: the digits MLP (64-128-256-10, batch
16), a 128-channel CNN on 28x28 images (batch 16) and, with ``--resnet``,
torchvision's ResNet-18 at batch 8 and 224x224 (check only: debug_run compiles it
at -O2, several minutes here).

    PJRT_DEVICE=CPU python scripts/bench_check.py [--repeats 3] [--resnet]
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import time

import torch
from torch import nn

import xla_utils


def digits_mlp_case():
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.tensor(d.data[:16], dtype=torch.float32) / 16.0
    y = torch.tensor(d.target[:16], dtype=torch.int64)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 256), nn.ReLU(),
                          nn.Linear(256, 10))
    return "digits MLP 64-128-256-10, batch 16", model, (x, y)


def cnn128_case():
    from skimage import data as skdata

    photo = torch.from_numpy(skdata.astronaut()[::18, ::18][:28, :28].copy())  # uint8 28x28x3
    x = photo.expand(16, 28, 28, 3).contiguous()
    y = torch.arange(16) % 10
    model = nn.Sequential(nn.Conv2d(3, 128, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                          nn.Conv2d(128, 128, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                          nn.Flatten(), nn.Linear(128, 10))
    return "CNN 2x128 channels on 28x28, batch 16", model, (x, y)


def resnet18_case():
    import torchvision
    from skimage import data as skdata

    photos = [skdata.astronaut(), skdata.coffee(), skdata.chelsea(), skdata.rocket()]
    x = torch.stack([torch.from_numpy(p[:224, :224].copy()) for p in photos * 2])
    return "torchvision ResNet-18, batch 8, 224x224", torchvision.models.resnet18(num_classes=4), \
        (x, torch.arange(8) % 4)


def time_check(model, batch) -> float:
    t0 = time.perf_counter()
    xla_utils.check(model, batch, verbose=False)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--resnet", action="store_true")
    args = ap.parse_args()
    cases = [digits_mlp_case(), cnn128_case()]
    print(f"# {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, "
          f"{platform.node()}, {os.cpu_count()} vCPUs, load {os.getloadavg()[0]:.1f}, "
          f"torch {torch.__version__}")
    print("| model | check (median s) | debug_run (median s) | ratio |")
    print("|---|---|---|---|")
    for name, model, batch in cases:
        ds = torch.utils.data.TensorDataset(*(t.repeat(4, *[1] * (t.dim() - 1)) for t in batch))
        checks, debugs = [], []
        for _ in range(args.repeats):  # alternate, so that load changes hit both alike
            checks.append(time_check(model, batch))
            t0 = time.perf_counter()
            xla_utils.debug_run(model, nn.CrossEntropyLoss(), ds, batch_size=len(batch[0]),
                                steps=4, print_report=False)
            debugs.append(time.perf_counter() - t0)
        c, d = statistics.median(checks), statistics.median(debugs)
        print(f"| {name} | {c:.1f} | {d:.1f} | {c / d:.2f} |", flush=True)
    if args.resnet:
        name, model, batch = resnet18_case()
        print(f"| {name} | {time_check(model, batch):.0f} (1 run) | not run | |", flush=True)


if __name__ == "__main__":
    main()
