"""Which LR-finder rule picks a good one-cycle max_lr on problems it was not tuned on?

For every problem of scripts/lr_problems.py (38 problems: tabular and image,
100-20,000 training samples, batch 8-256, 24-1,944 optimizer steps, MLPs, CNNs,
a ResNet-style model with BatchNorm, SGD+momentum, Adam, AdamW+weight decay,
classification and multi-label):

1. a grid of max_lr values (9 half-decade points, 1e-3..10 for SGD, 1e-4..1
   for Adam/AdamW, extended by half decades while the best is at an edge),
   each trained with one-cycle (:class:`xla_utils.OneCycleSchedule`, torch
   ``OneCycleLR`` defaults) for every seed; the mean final validation loss over
   the seeds is the LR's loss (a diverged run counts as 3x the loss of
   predicting the training priors);
2. per seed, :func:`xla_utils.lr_find` (library defaults, in-process on plain
   torch) from that seed's initial weights, at the problem's batch size and
   optimizer; the raw loss curve is stored;
3. every rule turns each stored sweep into a max_lr; its score on the problem
   is the loss interpolated (linearly in log-loss over log-LR) between the grid
   points around the suggestion, divided by the grid's best loss, averaged over
   the seeds' sweeps.

All runs are cached in ``docs/lr_rules_results.json`` (resumable; rules are
re-evaluated from it without training):

    nice -n 10 python scripts/bench_lr_rules.py run          # fill the cache (~35 min, 1 core)
    python scripts/bench_lr_rules.py report                  # tables from the cache

Also imported by tests/train/test_lr_finder.py (a CI-sized slice).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import lr_problems as lp  # noqa: E402
from xla_utils.train.lr_finder import lr_find  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CACHE = ROOT / "docs" / "lr_rules_results.json"
SEEDS = (0, 1, 2)


def base_grid(p: lp.Problem) -> list[float]:
    """9 half-decade points: 1e-3..10 for SGD, 1e-4..1 for Adam/AdamW."""
    lo = -3.0 if p.optimizer == "sgd" else -4.0
    return [round(lo + 0.5 * i, 2) for i in range(9)]  # log10 values


def _key(log10_lr: float) -> str:
    return f"{log10_lr:+.2f}"


def load_cache(path: Path = CACHE) -> dict[str, Any]:
    if path.exists():
        with open(path) as f:
            return json.load(f)
    return {"problems": {}}


def save_cache(cache: dict[str, Any], path: Path = CACHE) -> None:
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w") as f:
        json.dump(cache, f, indent=0, sort_keys=True)
    os.replace(tmp, path)  # a crash never leaves a half-written cache


def measure(p: lp.Problem, seeds=SEEDS, grid: list[float] | None = None,
            entry: dict[str, Any] | None = None, save=None, max_extend: int = 2,
            verbose: bool = True) -> dict[str, Any]:
    """Grid runs and finder sweeps of one problem into ``entry`` (what is there
    already is kept); ``save()`` is called after every new measurement."""
    split = p.data()
    entry = entry if entry is not None else {}
    entry.setdefault("grid", {})
    entry.setdefault("sweeps", {})
    entry.update(n_train=split.n_train, batch_size=p.batch_size, epochs=p.epochs,
                 steps=p.steps(split), optimizer=p.optimizer, weight_decay=p.weight_decay,
                 kind=p.kind, multilabel=split.multilabel, chance_loss=split.chance_loss())
    save = save or (lambda: None)

    def run_lr(lg: float) -> None:
        cell = entry["grid"].setdefault(_key(lg), {})
        for s in seeds:
            if str(s) not in cell:
                t0 = time.perf_counter()
                v = lp.train_one_cycle(p, split, 10.0 ** lg, s)
                cell[str(s)] = None if math.isnan(v) else v
                entry["train_s"] = entry.get("train_s", 0.0) + time.perf_counter() - t0
                save()

    for s in seeds:
        if str(s) not in entry["sweeps"]:
            t0 = time.perf_counter()
            res = lr_find(lp.init_model(p, split, s), split.loss,
                          torch.utils.data.TensorDataset(split.x_train, split.y_train),
                          p.batch_size, optimizer=p.optimizer, weight_decay=p.weight_decay,
                          seed=s, show_progress=False)
            entry["sweeps"][str(s)] = {"lrs": res.lrs.tolist(),
                                       "losses": [x if math.isfinite(x) else None
                                                  for x in res.losses.tolist()],
                                       "stop_reason": res.stop_reason,
                                       "seconds": time.perf_counter() - t0}
            save()
    lgs = list(grid if grid is not None else base_grid(p))
    for lg in lgs:
        run_lr(lg)
    for _ in range(max_extend):  # extend while the best is at an edge
        curve = grid_curve(entry, seeds)
        best = min(curve, key=curve.get)
        lo, hi = min(curve), max(curve)
        if best == lo:
            run_lr(round(lo - 0.5, 2))
        elif best == hi:
            run_lr(round(hi + 0.5, 2))
        else:
            break
    if verbose:
        curve = grid_curve(entry, seeds)
        best = min(curve, key=curve.get)
        print(f"{p.name}: {entry['steps']} steps, best max_lr 1e{best:+.1f} "
              f"(val {curve[best]:.4f}); {entry.get('train_s', 0):.0f} s training", flush=True)
    return entry


def grid_curve(entry: dict[str, Any], seeds=SEEDS) -> dict[float, float]:
    """{log10 max_lr: mean val loss over ``seeds``} for the grid points that have
    every seed; a diverged run counts as 3x the chance loss."""
    out = {}
    bad = 3.0 * entry["chance_loss"]
    for k, cell in entry["grid"].items():
        vals = [cell.get(str(s), "missing") for s in seeds]
        if "missing" in vals:
            continue
        out[float(k)] = float(np.mean([bad if v is None else min(v, bad) for v in vals]))
    return dict(sorted(out.items()))


def loss_at(curve: dict[float, float], lr: float) -> float:
    """Mean val loss at ``lr``: linear in log-loss over log10-LR between the grid
    points around it; beyond the grid, the edge point's loss (NaN lr -> the worst
    grid loss)."""
    xs = np.array(list(curve))
    ys = np.log(np.array(list(curve.values())))
    if not (lr > 0 and math.isfinite(lr)):
        return float(np.exp(ys.max()))
    return float(np.exp(np.interp(math.log10(lr), xs, ys)))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("cmd", choices=["run", "report"])
    ap.add_argument("--problems", nargs="*", help="names (default: all)")
    ap.add_argument("--cache", type=Path, default=CACHE)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    probs = [lp.BY_NAME[n] for n in args.problems] if args.problems else list(lp.PROBLEMS)
    cache = load_cache(args.cache)
    if args.cmd == "run":
        cache.setdefault("env", {}).update(
            torch=torch.__version__, python=platform.python_version(),
            cpu=platform.processor() or platform.machine(), threads=args.threads)
        t0 = time.perf_counter()
        for p in probs:
            entry = cache["problems"].setdefault(p.name, {})
            measure(p, entry=entry, save=lambda: save_cache(cache, args.cache))
        cache["env"]["last_run_s"] = time.perf_counter() - t0
        save_cache(cache, args.cache)
        return 0
    import lr_rules_report

    print(lr_rules_report.report(cache, [p.name for p in probs]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
