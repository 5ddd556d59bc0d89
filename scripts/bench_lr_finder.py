"""Which LR-finder rule picks a good one-cycle max_lr? Measured on scikit-learn digits.

For each config (MLP or small CNN) x (SGD+momentum or Adam) x seed:

1. for every max_lr of a log-spaced grid, train one-cycle runs
   (:class:`xla_utils.OneCycleSchedule`) and record the final validation loss,
   averaged over ``Budget.train_seeds`` training seeds;
2. run :func:`xla_utils.lr_find` (defaults: 1e-7 -> 10, 100 steps, same batch
   size, same optimizer) from the seed's initial weights;
3. evaluate every rule's suggestion the same way as a grid point.

A rule passes a (config, seed) when its validation loss is at most 2x the
grid's best and lower than the losses at 10x and 1/10 of the grid's best LR.

    python scripts/bench_lr_finder.py                  # 4 configs x seeds 0 1 2
    python scripts/bench_lr_finder.py --seeds 0 --json out.json

Runs on plain torch CPU, one thread by default: about 4 minutes per seed on one
core of a 2-core x86 VM. Also imported by tests/test_lr_finder.py.
"""
from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout
from xla_utils.lr_finder import DEFAULT_RULE, RULES, lr_find
from xla_utils.optim import make_optimizer
from xla_utils.schedule import OneCycleSchedule

CONFIGS = (("mlp", "sgd"), ("mlp", "adam"), ("cnn", "sgd"), ("cnn", "adam"))


@dataclass(frozen=True)
class Budget:
    """Training budget of every one-cycle run (same for grid and rules)."""

    epochs: int = 8
    batch_size: int = 64
    # max_lr grid: 10**-3 .. 10**1 in half decades (9 points)
    grid: tuple[float, ...] = tuple(float(v) for v in np.logspace(-3, 1, 9))
    num_it: int = 100  # LR finder steps
    # Each LR's validation loss is the mean over this many training seeds
    # (single runs on 500 validation images are too noisy to rank LRs).
    train_seeds: int = 5


@dataclass
class Digits:
    train: torch.utils.data.TensorDataset
    x_val: torch.Tensor
    y_val: torch.Tensor


def load_digits_split(val_size: int = 500, split_seed: int = 0) -> Digits:
    """sklearn digits (1797 8x8 images, 10 classes), pixels scaled to [0, 1],
    shape [N, 1, 8, 8]; a stratified split fixed by ``split_seed``."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    d = load_digits()
    x = torch.tensor(d.images / 16.0, dtype=torch.float32).unsqueeze(1)
    y = torch.tensor(d.target, dtype=torch.int64)
    idx_tr, idx_va = train_test_split(np.arange(len(y)), test_size=val_size,
                                      random_state=split_seed, stratify=d.target)
    return Digits(torch.utils.data.TensorDataset(x[idx_tr], y[idx_tr]), x[idx_va], y[idx_va])


def make_model(kind: str) -> nn.Module:
    """``"mlp"``: 64-128-128-10 ReLU MLP. ``"cnn"``: two 3x3 conv+BN+ReLU blocks
    (16, 32 channels), 2x2 max-pool, linear classifier."""
    if kind == "mlp":
        return nn.Sequential(nn.Flatten(), nn.Linear(64, 128), nn.ReLU(),
                             nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10))
    if kind == "cnn":
        return nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
            nn.MaxPool2d(2), nn.Flatten(), nn.Linear(32 * 4 * 4, 10))
    raise ValueError(f"unknown model kind {kind!r}")


def init_model(kind: str, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return make_model(kind)


def mean_val_loss(kind: str, opt_name: str, max_lr: float, seed: int, data: Digits,
                  budget: Budget) -> float:
    """Mean final validation loss of ``budget.train_seeds`` one-cycle runs
    (training seeds ``1000*seed + j``; inf if any diverged)."""
    return float(np.mean([train_one_cycle(kind, opt_name, max_lr, 1000 * seed + j, data, budget)
                          for j in range(budget.train_seeds)]))


def train_one_cycle(kind: str, opt_name: str, max_lr: float, seed: int, data: Digits,
                    budget: Budget) -> float:
    """Final validation cross-entropy of a one-cycle run (inf if it diverged);
    ``seed`` sets the initial weights and the batch order."""
    model = init_model(kind, seed)
    opt = make_optimizer(opt_name, model.parameters(), lr=max_lr)
    x_tr, y_tr = data.train.tensors
    steps_per_epoch = len(y_tr) // budget.batch_size
    sched = OneCycleSchedule(budget.epochs * steps_per_epoch, max_lr)
    gen = torch.Generator().manual_seed(seed)
    step = 0
    model.train()
    for _ in range(budget.epochs):
        perm = torch.randperm(len(y_tr), generator=gen)
        for b in range(steps_per_epoch):
            idx = perm[b * budget.batch_size:(b + 1) * budget.batch_size]
            sched.apply(opt, step)
            loss = nn.functional.cross_entropy(model(x_tr[idx]), y_tr[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1
    model.eval()
    with torch.no_grad():
        val = float(nn.functional.cross_entropy(model(data.x_val), data.y_val))
    return val if math.isfinite(val) else math.inf


@dataclass
class ConfigResult:
    kind: str
    optimizer: str
    seed: int
    grid: dict[str, float]  # "lr" -> val loss
    best_lr: float
    best_loss: float
    loss_10x: float  # val loss at 10 x best_lr
    loss_01x: float  # val loss at best_lr / 10
    finder_s: float
    suggestions: dict[str, float] = field(default_factory=dict)
    rule_loss: dict[str, float] = field(default_factory=dict)

    def passes(self, rule: str) -> bool:
        v = self.rule_loss[rule]
        return v <= 2 * self.best_loss and v < self.loss_10x and v < self.loss_01x

    def ratio(self, rule: str) -> float:
        return self.rule_loss[rule] / self.best_loss


def evaluate_config(kind: str, opt_name: str, seed: int, data: Digits, budget: Budget = Budget(),
                    rules: tuple[str, ...] = RULES) -> ConfigResult:
    """Grid, finder and rule runs for one (model, optimizer, seed)."""
    cache: dict[float, float] = {}

    def run(lr: float) -> float:
        key = round(math.log10(lr), 6)
        if key not in cache:
            cache[key] = mean_val_loss(kind, opt_name, lr, seed, data, budget)
        return cache[key]

    grid = {f"{lr:.3g}": run(lr) for lr in budget.grid}
    best_lr = min(budget.grid, key=run)
    t0 = time.perf_counter()
    res = lr_find(init_model(kind, seed), nn.functional.cross_entropy, data.train,
                  budget.batch_size, optimizer=opt_name, num_it=budget.num_it, seed=seed,
                  show_progress=False)
    finder_s = time.perf_counter() - t0
    out = ConfigResult(kind, opt_name, seed, grid, best_lr, run(best_lr), run(best_lr * 10),
                       run(best_lr / 10), finder_s, dict(res.suggestions))
    for r in rules:
        lr = res.suggestions[r]
        out.rule_loss[r] = run(lr) if math.isfinite(lr) and lr > 0 else math.inf
    return out


def summarize(results: list[ConfigResult], rules: tuple[str, ...] = RULES) -> str:
    """Markdown: per-rule pass count, median and worst loss ratio, median
    distance of the suggestion from the grid's best LR in decades."""
    lines = ["| rule | passes | median loss / best | worst loss / best | median log10(lr / best lr) |",
             "|---|---|---|---|---|"]
    for r in rules:
        ratios = [c.ratio(r) for c in results]
        dist = [math.log10(c.suggestions[r] / c.best_lr) for c in results
                if math.isfinite(c.suggestions[r])]
        lines.append(f"| {r}{' (default)' if r == DEFAULT_RULE else ''} | "
                     f"{sum(c.passes(r) for c in results)}/{len(results)} | "
                     f"{np.median(ratios):.2f} | {max(ratios):.2f} | "
                     f"{np.median(dist):+.2f} |")
    lines += ["", "| config | seed | grid best lr | best val loss | "
              + " | ".join(f"{r} lr (loss)" for r in rules) + " |",
              "|---|---|---|---|" + "---|" * len(rules)]
    for c in results:
        cells = " | ".join(
            f"{c.suggestions[r]:.2g} ({c.rule_loss[r]:.3f}){'' if c.passes(r) else ' ✗'}"
            for r in rules)
        lines.append(f"| {c.kind}+{c.optimizer} | {c.seed} | {c.best_lr:.3g} | "
                     f"{c.best_loss:.3f} | {cells} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--epochs", type=int, default=Budget.epochs)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    ap.add_argument("--json", help="also write every measurement here")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    budget = Budget(epochs=args.epochs)
    data = load_digits_split()
    t0 = time.perf_counter()
    results = []
    for seed in args.seeds:
        for kind, opt_name in CONFIGS:
            c = evaluate_config(kind, opt_name, seed, data, budget)
            results.append(c)
            print(f"{kind}+{opt_name} seed {seed}: best lr {c.best_lr:.3g} "
                  f"(val {c.best_loss:.3f}); "
                  + ", ".join(f"{r} {c.suggestions[r]:.2g}->{c.rule_loss[r]:.3f}" for r in RULES),
                  flush=True)
    print(f"\n{len(results)} (config, seed) pairs, {time.perf_counter() - t0:.0f} s, "
          f"torch {torch.__version__}, {platform.processor() or platform.machine()}, "
          f"{args.threads} thread(s); budget {budget.epochs} epochs x batch {budget.batch_size}, "
          f"mean of {budget.train_seeds} training seeds per LR, grid {len(budget.grid)} points "
          f"{budget.grid[0]:.3g}..{budget.grid[-1]:.3g}\n")
    print(summarize(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"budget": asdict(budget), "results": [asdict(c) for c in results]}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
