"""Transfer benchmark: ``fine_tune`` vs ``fit`` from the same pretrained weights vs ``fit``
from scratch, at the same budget (epochs x steps), medians over seeds.

A small BatchNorm CNN is pretrained on scikit-learn's digits 0-4 (all of them), then
trained on a small set of digits 5-9 (``--shots`` images per class) and scored on the
other images of 5-9. Every run is ``OneCycleTrainer`` on XLA:CPU (``--simulate`` cores)
or, with ``--simulate 0``, plain torch.

    PJRT_DEVICE=CPU python scripts/bench_finetune.py --seeds 5 --simulate 1
    PJRT_DEVICE=CPU python scripts/bench_finetune.py --seeds 1 --epochs 2 --pre-epochs 1  # smoke

Prints one line per seed and the medians; ``--json PATH`` also writes them.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from xla_utils import OneCycleTrainer  # noqa: E402


class SmallNet(nn.Module):
    """A BatchNorm CNN for 1x8x8 digits; ``fc`` is the head (torchvision's name)."""

    def __init__(self, classes: int = 5):
        super().__init__()
        def block(i, o):
            return nn.Sequential(nn.Conv2d(i, o, 3, padding=1, bias=False), nn.BatchNorm2d(o), nn.ReLU())
        self.body = nn.Sequential(block(1, 16), block(16, 32), nn.MaxPool2d(2), block(32, 64),
                                  nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.fc = nn.Linear(64, classes)

    def forward(self, x):
        return self.fc(self.body(x))


def transfer_data(shots: int, seed: int):
    """(source train set: digits 0-4; target train: ``shots`` per class of 5-9; target val:
    the rest of 5-9), as TensorDatasets of float32[1, 8, 8] and int64 labels 0..4."""
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.tensor(d.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(d.target, dtype=torch.int64)
    src = y < 5
    rng = np.random.default_rng(seed)
    tgt_idx = np.flatnonzero(~src.numpy())
    pick = np.concatenate([rng.permutation(tgt_idx[d.target[tgt_idx] == c])[:shots] for c in range(5, 10)])
    rest = np.setdiff1d(tgt_idx, pick)
    ds = torch.utils.data.TensorDataset
    return (ds(x[src], y[src]), ds(x[pick], y[pick] - 5), ds(x[rest], y[rest] - 5))


def pretrain(source, epochs: int, simulate: int | None, seed: int = 0) -> dict:
    """The backbone's weights after training on the source set, without its head (the
    target task gets a new one, as when a pretrained ImageNet model is fine-tuned)."""
    t = OneCycleTrainer(SmallNet, nn.CrossEntropyLoss(), source, batch_size=32, epochs=epochs,
                        max_lr=1e-2, seed=seed)
    t.fit(simulate=simulate)
    return {k: v.clone() for k, v in t.model.state_dict().items() if not k.startswith("fc.")}


def run_all(pre: dict, target, val, *, epochs: int, lr: float, seed: int, simulate: int | None,
            batch_size: int = 5, lr_mult: float = 100.0) -> dict[str, float]:
    """Accuracy on ``val`` of fine_tune / fit-from-pretrained / fit-from-scratch, each
    trained for ``epochs`` epochs on ``target`` with peak LR ``lr``."""
    def trainer(weights):
        t = OneCycleTrainer(SmallNet, nn.CrossEntropyLoss(), target, val, batch_size=batch_size,
                            epochs=epochs, max_lr=lr, seed=seed, flip=False)
        if weights is not None:
            from xla_utils.finetune import load_pretrained
            load_pretrained(t.model, weights)
        return t

    out = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out["fine_tune"] = trainer(pre).fine_tune(epochs - 1, freeze_epochs=1, base_lr=lr, lr_mult=lr_mult,
                                                  simulate=simulate)[-1]["accuracy"]
        out["fit_pretrained"] = trainer(pre).fit(simulate=simulate)[-1]["accuracy"]
        out["fit_scratch"] = trainer(None).fit(simulate=simulate)[-1]["accuracy"]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--epochs", type=int, default=6, help="budget of every target run")
    p.add_argument("--pre-epochs", type=int, default=4)
    p.add_argument("--shots", type=int, default=10, help="target images per class")
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--lr-mult", type=float, default=100.0, help="fine_tune's lr_mult")
    p.add_argument("--simulate", type=int, default=1, help="simulated XLA:CPU cores; 0 = plain torch")
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args(argv)
    sim = a.simulate or None
    t0 = time.perf_counter()
    rows = []
    for seed in range(a.seeds):
        source, target, val = transfer_data(a.shots, seed)
        pre = pretrain(source, a.pre_epochs, sim, seed)
        r = run_all(pre, target, val, epochs=a.epochs, lr=a.lr, seed=seed, simulate=sim,
                    lr_mult=a.lr_mult)
        rows.append(r)
        print(f"seed {seed}: " + "  ".join(f"{k} {v:.4f}" for k, v in r.items()), flush=True)
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    print(f"median over {a.seeds} seed(s), {a.shots} shots/class, {a.epochs} epochs, lr {a.lr}: "
          + "  ".join(f"{k} {v:.4f}" for k, v in med.items())
          + f"  ({time.perf_counter() - t0:.0f} s)")
    if a.json:
        a.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(a).items()},
                                      "seeds": rows, "median": med}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
