"""Transfer benchmark: ``fine_tune`` vs ``fit`` from the same pretrained weights vs ``fit``
from scratch, at the same budget (optimizer steps), medians over seeds.

A small BatchNorm CNN (``SmallNet``, head ``fc``) is pretrained on one half of
scikit-learn's digits (every other image, all 10 classes, upright); the target task
is the other half turned upside down (rotated 180 degrees: a 6 looks like a 9, strokes
run the other way), ``--shots`` labelled images per class, scored on the rest of that
half. All three contenders train ``--epochs`` epochs on the target set at the same peak
LR; ``fine_tune`` spends ``--freeze-epochs`` of them with the body frozen. Every run is
``OneCycleTrainer`` on XLA:CPU (``--simulate`` cores) or, with ``--simulate 0``, plain torch.

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
    """A BatchNorm CNN for 1x8x8 digits (``width``/2x/4x channels); ``fc`` is the head
    (torchvision's name)."""

    def __init__(self, classes: int = 10, width: int = 32):
        super().__init__()
        def block(i, o):
            return nn.Sequential(nn.Conv2d(i, o, 3, padding=1, bias=False), nn.BatchNorm2d(o), nn.ReLU())
        w = width
        self.body = nn.Sequential(block(1, w), block(w, 2 * w), nn.MaxPool2d(2), block(2 * w, 4 * w),
                                  nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.fc = nn.Linear(4 * w, classes)

    def forward(self, x):
        return self.fc(self.body(x))


def transfer_data(shots: int, seed: int, n_val: int | None = None):
    """(source: the even-indexed digits, upright, all 10 classes; target train: ``shots``
    per class of the odd-indexed digits rotated 180 degrees; target val: ``n_val`` (default
    all) of the other odd-indexed ones, rotated), as TensorDatasets of float32[1, 8, 8] and
    int64 labels 0..9. ``seed`` picks the target images."""
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.tensor(d.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(d.target, dtype=torch.int64)
    idx = np.arange(len(y))
    src, tgt = idx[idx % 2 == 0], idx[idx % 2 == 1]
    rng = np.random.default_rng(seed)
    pick = np.concatenate([rng.permutation(tgt[d.target[tgt] == c])[:shots] for c in range(10)])
    rest = rng.permutation(np.setdiff1d(tgt, pick))[:n_val]
    turned = torch.rot90(x, 2, (2, 3)).contiguous()
    ds = torch.utils.data.TensorDataset
    return ds(x[src], y[src]), ds(turned[pick], y[pick]), ds(turned[rest], y[rest])


def pretrain(source, epochs: int, simulate: int | None, seed: int = 0) -> dict:
    """The backbone's weights after training on the source set, without its head (the
    target task gets a new one, as when a pretrained ImageNet model is fine-tuned)."""
    t = OneCycleTrainer(SmallNet, nn.CrossEntropyLoss(), source, batch_size=32, epochs=epochs,
                        max_lr=1e-2, seed=seed, flip=False)
    t.fit(simulate=simulate)
    return {k: v.clone() for k, v in t.model.state_dict().items() if not k.startswith("fc.")}


def run_all(pre: dict, target, val, *, epochs: int, lr: float, seed: int, simulate: int | None,
            batch_size: int = 5, lr_mult: float = 100.0, freeze_epochs: int = 1) -> dict[str, float]:
    """Accuracy on ``val`` of fine_tune / fit-from-pretrained / fit-from-scratch, each
    trained for ``epochs`` epochs on ``target`` with peak LR ``lr`` (``fine_tune``:
    ``freeze_epochs`` frozen, then ``epochs - freeze_epochs`` unfrozen)."""
    def trainer(weights):
        torch.manual_seed(seed)  # the same new head for all three
        # No per-epoch validation (at batch 5 it would cost 10x the training steps):
        # the score is one evaluate() at the end.
        t = OneCycleTrainer(SmallNet(), nn.CrossEntropyLoss(), target, batch_size=batch_size,
                            epochs=epochs, max_lr=lr, seed=seed, flip=False)
        if weights is not None:
            from xla_utils.train.finetune import load_pretrained
            load_pretrained(t.model, weights)
        return t

    def score(t):
        return t.evaluate(val, simulate=simulate, batch_size=100)["accuracy"]

    out = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t = trainer(pre)
        t.fine_tune(epochs - freeze_epochs, freeze_epochs=freeze_epochs, base_lr=lr,
                    lr_mult=lr_mult, simulate=simulate)
        out["fine_tune"] = score(t)
        t = trainer(pre)
        t.fit(simulate=simulate)
        out["fit_pretrained"] = score(t)
        t = trainer(None)
        t.fit(simulate=simulate)
        out["fit_scratch"] = score(t)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--epochs", type=int, default=10, help="budget of every target run")
    p.add_argument("--freeze-epochs", type=int, default=1, help="fine_tune's frozen epochs")
    p.add_argument("--pre-epochs", type=int, default=8)
    p.add_argument("--shots", type=int, default=3, help="target images per class")
    p.add_argument("--batch-size", type=int, default=5)
    p.add_argument("--lr", type=float, default=5e-2)
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
                    lr_mult=a.lr_mult, freeze_epochs=a.freeze_epochs, batch_size=a.batch_size)
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
