"""Trainer overhead: OneCycleTrainer vs a minimal hand-written torch_xla loop.

Both train the same CNN on the same in-memory data with the same per-core batch
on one XLA:CPU device; each repetition runs every variant in a fresh process,
alternating, and the steady-state speed is taken from epochs 2.. (epoch 1
compiles). Reports median steps/s, the overhead ratio, graph executions and
device->host transfers per step.

    PJRT_DEVICE=CPU python scripts/bench_trainer.py [--reps 5] [--epochs 4] [--json out.json]

The hand-written loop is what a careful user writes from the torch_xla docs:
``MpDeviceLoader`` + ``xm.optimizer_step`` and no host reads inside the loop.
It is the only code in this repository outside ``xla_utils/runtime/`` that
calls torch_xla, because it is the baseline.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

N_SAMPLES = 2048
IMAGE = 32
CLASSES = 10


def make_model():
    import torch.nn as nn

    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(32 * 8 * 8, 64), nn.ReLU(), nn.Linear(64, CLASSES),
    )


def make_data():
    import torch

    g = torch.Generator().manual_seed(0)
    x = torch.randn(N_SAMPLES, 3, IMAGE, IMAGE, generator=g)
    y = torch.randint(0, CLASSES, (N_SAMPLES,), generator=g)
    return torch.utils.data.TensorDataset(x, y)


def run_hand(batch: int, epochs: int) -> dict:
    import torch
    import torch.nn.functional as F
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.debug.metrics as met
    import torch_xla.distributed.parallel_loader as pl

    torch.manual_seed(0)
    dev = torch_xla.device()
    model = make_model().to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loader = torch.utils.data.DataLoader(make_data(), batch_size=batch, shuffle=True, drop_last=True)
    device_loader = pl.MpDeviceLoader(loader, dev)
    steps = len(loader)
    times, execs, to_host = [], [], []
    for _ in range(epochs):
        e0 = met.metric_data("ExecuteTime")[0] if met.metric_data("ExecuteTime") else 0
        h0 = met.metric_data("TransferFromDeviceTime")
        h0 = h0[0] if h0 else 0
        t0 = time.perf_counter()
        for x, y in device_loader:
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            xm.optimizer_step(opt)
        xm.wait_device_ops()
        times.append(time.perf_counter() - t0)
        execs.append((met.metric_data("ExecuteTime")[0] - e0) / steps)
        h1 = met.metric_data("TransferFromDeviceTime")
        to_host.append(((h1[0] if h1 else 0) - h0) / steps)
    return {"steps": steps, "epoch_s": times, "exec_per_step": execs, "to_host_per_step": to_host}


def run_trainer(batch: int, epochs: int) -> dict:
    import torch

    from xla_utils import OneCycleTrainer

    torch.manual_seed(0)
    t = OneCycleTrainer(make_model(), torch.nn.CrossEntropyLoss(), make_data(), batch_size=batch,
                        epochs=epochs, optimizer="sgd", max_lr=0.01, seed=0)
    h = t.fit(simulate=1)
    steps = N_SAMPLES // batch
    return {"steps": steps, "epoch_s": [e["seconds"] for e in h.epochs],
            "to_host_per_step": [e["host_reads_per_step"] for e in h.epochs]}


def _child(variant: str, batch: int, epochs: int) -> dict:
    env = dict(os.environ, PJRT_DEVICE="CPU")
    p = subprocess.run([sys.executable, __file__, "--child", variant, "--batch", str(batch),
                        "--epochs", str(epochs)], capture_output=True, text=True, env=env)
    if p.returncode != 0:
        raise RuntimeError(f"{variant} failed:\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--json", help="also write the raw results here")
    ap.add_argument("--child", choices=["hand", "trainer"], help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        fn = run_hand if args.child == "hand" else run_trainer
        print(json.dumps(fn(args.batch, args.epochs)))
        return 0

    rates: dict[str, list[float]] = {"hand": [], "trainer": []}
    raw: dict[str, list[dict]] = {"hand": [], "trainer": []}
    for rep in range(args.reps):
        for variant in (("hand", "trainer") if rep % 2 == 0 else ("trainer", "hand")):
            r = _child(variant, args.batch, args.epochs)
            steady = r["epoch_s"][1:]
            rate = r["steps"] * len(steady) / sum(steady)
            rates[variant].append(rate)
            raw[variant].append(r)
            print(f"rep {rep} {variant:8s} {rate:7.2f} steps/s (epochs 2..{args.epochs})", flush=True)
    med = {k: statistics.median(v) for k, v in rates.items()}
    overhead = med["hand"] / med["trainer"] - 1
    # each rep's two runs are adjacent in time, so their ratio cancels most background load
    paired = statistics.median(h / t - 1 for h, t in zip(rates["hand"], rates["trainer"]))
    hand_exec = statistics.median(x for r in raw["hand"] for x in r["exec_per_step"][1:])
    hand_host = statistics.median(x for r in raw["hand"] for x in r["to_host_per_step"][1:])
    tr_host = statistics.median(x for r in raw["trainer"] for x in r["to_host_per_step"][1:])
    print(f"\nmedian steps/s: hand-written {med['hand']:.2f}, OneCycleTrainer {med['trainer']:.2f}; "
          f"trainer overhead {overhead:+.1%} (ratio of medians), {paired:+.1%} (median of "
          f"per-rep ratios); batch {args.batch}, {args.reps} reps")
    print(f"device->host transfers per step: hand-written {hand_host:.3f}, trainer {tr_host:.3f}; "
          f"hand-written graph executions per step {hand_exec:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rates": rates, "median": med, "overhead": overhead,
                       "paired_overhead": paired, "raw": raw}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
