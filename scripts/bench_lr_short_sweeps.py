"""How much a shorter LR sweep loses: the default rule on N-step sweeps against the full one.

``fit(max_lr="find")`` shortens the sweep when 100 steps would cost more than a quarter of
the planned run (``xla_utils.train.lr_finder.sweep_length``). This scores such sweeps the way
``scripts/bench_lr_rules.py`` scores the rules: for every cached problem of
``docs/lr_rules_results.json`` (its one-cycle grid of max_lr values, 3 seeds), new sweeps
of ``--steps`` steps from ``--start-lr`` (smoothing kept per decade of LR, as lr_find does
when it shortens) are run on this CPU, and the default rule's max_lr is scored as the
grid's loss there over the grid's best; the cached 100-step sweeps give the reference.

    nice -n 10 python scripts/bench_lr_short_sweeps.py --steps 50 --start-lr 1e-5

Deterministic (CPU torch, seeded); about 30 s for the 38 problems on one core.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "scripts"), str(ROOT)]

import bench_lr_rules as bench  # noqa: E402
import lr_problems as lp  # noqa: E402
from xla_utils.train.lr_finder import (BETA, DEFAULT_RULE, NUM_IT, lr_find,  # noqa: E402
                                       smooth_losses, suggest)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--start-lr", type=float, default=1e-5)
    ap.add_argument("--end-lr", type=float, default=10.0)
    ap.add_argument("--verbose", action="store_true", help="one line per problem")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    problems = json.loads(bench.CACHE.read_text())["problems"]
    full_decades = math.log10(args.end_lr / 1e-7)
    beta = BETA ** (NUM_IT / full_decades * math.log10(args.end_lr / args.start_lr) / args.steps)
    full, short = [], []
    for name, entry in problems.items():
        p = lp.BY_NAME[name]
        curve = bench.grid_curve(entry)
        best = min(curve.values())
        split = p.data()
        ref, new = [], []
        for s in bench.SEEDS:
            sw = entry["sweeps"][str(s)]
            raw = np.array([np.nan if v is None else v for v in sw["losses"]])
            ref.append(bench.loss_at(curve, suggest(sw["lrs"], smooth_losses(raw),
                                                    num_it=NUM_IT)[DEFAULT_RULE]) / best)
            res = lr_find(lp.init_model(p, split, s), split.loss,
                          torch.utils.data.TensorDataset(split.x_train, split.y_train),
                          p.batch_size, optimizer=p.optimizer, weight_decay=p.weight_decay,
                          seed=s, show_progress=False, num_it=args.steps,
                          start_lr=args.start_lr, end_lr=args.end_lr, beta=beta)
            new.append(bench.loss_at(curve, res.suggestion) / best)
        full.append(float(np.mean(ref)))
        short.append(float(np.mean(new)))
        if args.verbose:
            print(f"{name:36s} {entry['steps']:5d} steps  100 steps {full[-1]:.2f}x  "
                  f"{args.steps} steps {short[-1]:.2f}x", flush=True)
    print(f"{len(full)} problems, default rule ({DEFAULT_RULE}), loss at its max_lr / best grid loss: "
          f"100-step sweeps from 1e-7: median {np.median(full):.2f}x, worst {max(full):.2f}x; "
          f"{args.steps}-step sweeps from {args.start_lr:g} (beta {beta:.3f}): median "
          f"{np.median(short):.2f}x, worst {max(short):.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
