"""The problems of the LR-rule benchmark (scripts/bench_lr_rules.py).

Each :class:`Problem` is a small, fully offline training task: data from
scikit-learn's bundled or generated datasets or 12x12 images rendered here, a
model, an optimizer (``xla_utils.step.optim.make_optimizer``), a batch size and a
number of epochs. :func:`train_one_cycle` trains it on plain CPU torch with
:class:`xla_utils.train.schedule.OneCycleSchedule` (torch ``OneCycleLR`` defaults)
and returns the final validation loss, which is what a grid of ``max_lr``
values is ranked by.

Imported by scripts/bench_lr_rules.py and tests/train/test_lr_finder.py.
"""
from __future__ import annotations

import functools
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout
from xla_utils.step.optim import make_optimizer  # noqa: E402
from xla_utils.train.schedule import OneCycleSchedule  # noqa: E402


@dataclass
class Split:
    """Train tensors and a fixed validation set. ``multilabel``: float 0/1
    targets of shape [N, L] and BCE-with-logits loss; else int64 class labels
    and cross-entropy."""

    x_train: torch.Tensor
    y_train: torch.Tensor
    x_val: torch.Tensor
    y_val: torch.Tensor
    multilabel: bool = False

    @property
    def n_train(self) -> int:
        return len(self.y_train)

    @property
    def n_out(self) -> int:
        return self.y_train.shape[1] if self.multilabel else int(self.y_train.max()) + 1

    def loss(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.multilabel:
            return nn.functional.binary_cross_entropy_with_logits(out, y)
        return nn.functional.cross_entropy(out, y)

    def chance_loss(self) -> float:
        """Validation loss of predicting the training priors (no features)."""
        if self.multilabel:
            p = self.y_train.float().mean(0).clamp(1e-4, 1 - 1e-4)
            y = self.y_val
            return float(-(y * p.log() + (1 - y) * (1 - p).log()).mean())
        counts = torch.bincount(self.y_train, minlength=self.n_out).double() + 1
        logp = (counts / counts.sum()).log()
        return float(-logp[self.y_val].mean())


# ------------------------------------------------------------------ data
def _split(x: np.ndarray, y: np.ndarray, n_train: int, n_val: int, seed: int = 0,
           standardize: bool = True, multilabel: bool = False) -> Split:
    rng = np.random.default_rng(seed)
    idx = rng.permutation(len(y))
    tr, va = idx[:n_train], idx[n_train:n_train + n_val]
    if len(va) < n_val:
        raise ValueError(f"only {len(y)} samples for {n_train} + {n_val}")
    x = x.astype(np.float32)
    if standardize:
        flat = x.reshape(len(x), -1)
        mu, sd = flat[tr].mean(0), flat[tr].std(0)
        sd = np.where(sd < 1e-3, 1.0, sd)  # a feature constant in train (digits' border pixels)
        x = ((flat - mu) / sd).reshape(x.shape)
    ydt = torch.float32 if multilabel else torch.int64
    return Split(torch.from_numpy(x[tr]), torch.tensor(y[tr], dtype=ydt),
                 torch.from_numpy(x[va]), torch.tensor(y[va], dtype=ydt), multilabel)


@functools.lru_cache(maxsize=None)
def sk_dataset(name: str, n_train: int, n_val: int, image: bool = False) -> Split:
    """A bundled scikit-learn dataset (iris, wine, breast_cancer, digits),
    randomly split; ``image``: digits as [N, 1, 8, 8] in 0..1 (else standardized
    feature vectors)."""
    from sklearn import datasets

    d = getattr(datasets, f"load_{name}")()
    if image:
        return _split(d.images[:, None] / 16.0, d.target, n_train, n_val, standardize=False)
    return _split(d.data, d.target, n_train, n_val)


@functools.lru_cache(maxsize=None)
def generated(n_train: int, n_val: int, n_features: int = 20, n_classes: int = 5,
              flip_y: float = 0.05, multilabel: bool = False, seed: int = 0) -> Split:
    """``make_classification`` (5 informative-heavy features, ``flip_y`` label
    noise) or ``make_multilabel_classification`` (``n_classes`` labels)."""
    from sklearn import datasets

    n = n_train + n_val
    if multilabel:
        x, y = datasets.make_multilabel_classification(
            n, n_features=n_features, n_classes=n_classes, n_labels=2, random_state=seed)
    else:
        x, y = datasets.make_classification(
            n, n_features=n_features, n_informative=min(10, n_features), n_redundant=2,
            n_classes=n_classes, n_clusters_per_class=2, flip_y=flip_y, class_sep=1.0,
            random_state=seed)
    return _split(x, y, n_train, n_val, seed=seed, multilabel=multilabel)


def _shape_mask(kind: int, size: int, rng: np.random.Generator, res: int) -> np.ndarray:
    """Boolean [res, res] mask of one shape at a random position and size."""
    r = rng.uniform(size * 0.5, size)
    cy, cx = rng.uniform(r, res - r, size=2)
    yy, xx = np.mgrid[0:res, 0:res] + 0.5
    dy, dx = yy - cy, xx - cx
    if kind == 0:  # disc
        return dy ** 2 + dx ** 2 <= r ** 2
    if kind == 1:  # ring
        d = np.sqrt(dy ** 2 + dx ** 2)
        return (d <= r) & (d >= r * 0.55)
    if kind == 2:  # square
        return (abs(dy) <= r * 0.8) & (abs(dx) <= r * 0.8)
    if kind == 3:  # triangle (apex up)
        return (dy <= r * 0.7) & (dy >= -r) & (abs(dx) <= (dy + r) * 0.6)
    if kind == 4:  # plus
        w = max(r * 0.3, 0.8)
        return ((abs(dy) <= w) & (abs(dx) <= r)) | ((abs(dx) <= w) & (abs(dy) <= r))
    if kind == 5:  # x
        w = max(r * 0.3, 0.8)
        return ((abs(dy - dx) <= w * 1.4) | (abs(dy + dx) <= w * 1.4)) & (abs(dy) <= r) & (abs(dx) <= r)
    raise ValueError(kind)


@functools.lru_cache(maxsize=None)
def shapes(n_train: int, n_val: int, multilabel: bool = False, res: int = 12,
           seed: int = 0) -> Split:
    """Rendered [N, 1, res, res] grey images with background noise: one of 6
    shapes (class = shape), or (``multilabel``) each of 4 shapes present with
    probability 0.5, smaller, possibly overlapping (targets [N, 4])."""
    rng = np.random.default_rng(1234 + seed)
    n = n_train + n_val
    x = rng.normal(0.0, 0.25, size=(n, 1, res, res)).astype(np.float32)
    if multilabel:
        y = (rng.random((n, 4)) < 0.5).astype(np.float32)
        for i in range(n):
            for k in np.flatnonzero(y[i]):
                x[i, 0][_shape_mask(int(k), res * 0.28, rng, res)] += rng.uniform(0.7, 1.3)
    else:
        y = rng.integers(0, 6, size=n)
        for i in range(n):
            x[i, 0][_shape_mask(int(y[i]), res * 0.45, rng, res)] += rng.uniform(0.6, 1.4)
    return _split(x, y, n_train, n_val, seed=seed, standardize=False, multilabel=multilabel)


# ------------------------------------------------------------------ models
def mlp(d_in: int, n_out: int, hidden: tuple[int, ...] = (64, 64), bn: bool = False,
        dropout: float = 0.0) -> nn.Module:
    layers: list[nn.Module] = [nn.Flatten()]
    for h in hidden:
        layers.append(nn.Linear(d_in, h))
        if bn:
            layers.append(nn.BatchNorm1d(h))
        layers.append(nn.ReLU())
        if dropout:
            layers.append(nn.Dropout(dropout))
        d_in = h
    layers.append(nn.Linear(d_in, n_out))
    return nn.Sequential(*layers)


def cnn(res: int, n_out: int, ch: tuple[int, int] = (16, 32), bn: bool = True) -> nn.Module:
    """Two 3x3 conv(+BN)+ReLU blocks with 2x2 max-pool after each, linear head."""
    a, b = ch
    norm = (lambda c: nn.BatchNorm2d(c)) if bn else (lambda c: nn.Identity())
    return nn.Sequential(
        nn.Conv2d(1, a, 3, padding=1), norm(a), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(a, b, 3, padding=1), norm(b), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(b * (res // 4) ** 2, n_out))


class _Block(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int):
        super().__init__()
        self.c1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.b1 = nn.BatchNorm2d(c_out)
        self.c2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.b2 = nn.BatchNorm2d(c_out)
        self.short = (nn.Sequential() if stride == 1 and c_in == c_out else
                      nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False),
                                    nn.BatchNorm2d(c_out)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.b1(self.c1(x)))
        return torch.relu(self.b2(self.c2(h)) + self.short(x))


def resnet(n_out: int, width: int = 16) -> nn.Module:
    """ResNet-style: conv stem, two residual blocks (second strides 2), each
    with BatchNorm, global average pool, linear head."""
    return nn.Sequential(
        nn.Conv2d(1, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(),
        _Block(width, width, 1), _Block(width, 2 * width, 2),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(2 * width, n_out))


# ------------------------------------------------------------------ problems
@dataclass(frozen=True)
class Problem:
    """One benchmark problem: ``data()`` -> :class:`Split`, ``model(split)`` ->
    fresh module, the optimizer spec and weight decay, per-step batch size and
    epochs. ``steps`` (optimizer steps of the planned run) = epochs x
    (n_train // batch_size)."""

    name: str
    data: Callable[[], Split]
    model: Callable[[Split], nn.Module]
    optimizer: str
    batch_size: int
    epochs: int
    weight_decay: float = 0.0
    kind: str = "tabular"  # or "image"

    def steps(self, split: Split) -> int:
        return self.epochs * (split.n_train // self.batch_size)


def _tab(hidden=(64, 64), **kw):
    return lambda s: mlp(s.x_train[0].numel(), s.n_out, hidden, **kw)


def _img_cnn(**kw):
    return lambda s: cnn(s.x_train.shape[-1], s.n_out, **kw)


def _img_resnet(width=16):
    return lambda s: resnet(s.n_out, width)


P = Problem
sk = sk_dataset
PROBLEMS: tuple[Problem, ...] = (
    # ---- tabular, tiny (100-130 samples): the regime where the old default failed
    P("iris100_mlp_adam_b16_e4", lambda: sk("iris", 100, 50), _tab((32,)), "adam", 16, 4),
    P("iris100_mlp_sgd_b8_e10", lambda: sk("iris", 100, 50), _tab((32,)), "sgd", 8, 10),
    P("wine118_mlp_adam_b16_e4", lambda: sk("wine", 118, 60), _tab(), "adam", 16, 4),
    P("wine118_mlp_sgd_b8_e20", lambda: sk("wine", 118, 60), _tab(), "sgd", 8, 20),
    P("bc120_mlp_adam_b16_e5", lambda: sk("breast_cancer", 120, 300), _tab(), "adam", 16, 5),
    P("bc400_mlp_adamw_b32_e10", lambda: sk("breast_cancer", 400, 169), _tab(), "adamw", 32, 10,
      weight_decay=0.05),
    P("bc400_linear_sgd_b64_e20", lambda: sk("breast_cancer", 400, 169), _tab(()), "sgd", 64, 20),
    P("digits200_mlp_sgd_b16_e6", lambda: sk("digits", 200, 600), _tab(), "sgd", 16, 6),
    P("digits1297_mlp_adam_b64_e8", lambda: sk("digits", 1297, 500), _tab((128, 128)), "adam",
      64, 8),
    P("digits1297_mlp_adamw_b8_e12", lambda: sk("digits", 1297, 500), _tab((128, 128)), "adamw",
      8, 12, weight_decay=0.01),
    P("wine118_mlp_adamw_b8_e6", lambda: sk("wine", 118, 60), _tab(), "adamw", 8, 6,
      weight_decay=0.01),
    P("digits1297_mlp_sgd_b256_e10", lambda: sk("digits", 1297, 500), _tab((128, 128)), "sgd",
      256, 10),
    # ---- tabular, generated, medium to large
    P("mc20k_linear_adam_b256_e2", lambda: generated(20000, 2000), _tab(()), "adam", 256, 2),
    P("mc20k_mlp_sgd_b256_e5", lambda: generated(20000, 2000), _tab((128, 128)), "sgd", 256, 5),
    P("mc2000_mlp_adam_b32_e8", lambda: generated(2000, 1000, flip_y=0.1), _tab(), "adam", 32, 8),
    P("mc4000_mlp_sgd_b64_e16", lambda: generated(4000, 1000), _tab(), "sgd", 64, 16),
    P("mc5000_mlpbn_sgd_b64_e4", lambda: generated(5000, 1000), _tab((128, 128), bn=True), "sgd",
      64, 4),
    P("mc600_mlpdrop_adam_b16_e10", lambda: generated(600, 1000, n_classes=3),
      _tab((128,), dropout=0.2), "adam", 16, 10),
    P("ml2000_mlp_adam_b32_e10", lambda: generated(2000, 1000, multilabel=True), _tab(), "adam",
      32, 10),
    P("ml300_mlp_sgd_b16_e8", lambda: generated(300, 1000, multilabel=True), _tab(), "sgd", 16, 8),
    # ---- images
    P("digits1297_cnn_sgd_b64_e8", lambda: sk("digits", 1297, 500, image=True),
      lambda s: cnn(8, 10), "sgd", 64, 8, kind="image"),
    P("digits300_cnn_adam_b16_e5", lambda: sk("digits", 300, 600, image=True),
      lambda s: cnn(8, 10), "adam", 16, 5, kind="image"),
    P("shapes1500_cnn_adam_b64_e6", lambda: shapes(1500, 500), _img_cnn(), "adam", 64, 6,
      kind="image"),
    P("shapes1000_cnn_sgd_b32_e10", lambda: shapes(1000, 500), _img_cnn(bn=False), "sgd", 32, 10,
      kind="image"),
    P("shapes150_cnn_adam_b8_e3", lambda: shapes(150, 500), _img_cnn(), "adam", 8, 3,
      kind="image"),
    P("shapes1000_resnet_sgd_b32_e5", lambda: shapes(1000, 500), _img_resnet(8), "sgd", 32, 5,
      kind="image"),
    P("shapesml1000_cnn_adamw_b32_e6", lambda: shapes(1000, 500, multilabel=True), _img_cnn(),
      "adamw", 32, 6, weight_decay=0.01, kind="image"),
    # ---- short runs, 20-60 optimizer steps (issue 19): SGD at batch 8-32, then Adam/AdamW
    P("wine124_mlp_sgd_b16_e4", lambda: sk("wine", 124, 54), _tab(), "sgd", 16, 4),
    P("iris100_mlp_sgd_b16_e5", lambda: sk("iris", 100, 50), _tab((32,)), "sgd", 16, 5),
    P("bc200_mlp_sgd_b32_e8", lambda: sk("breast_cancer", 200, 300), _tab(), "sgd", 32, 8),
    P("digits300_mlp_sgd_b8_e1", lambda: sk("digits", 300, 600), _tab(), "sgd", 8, 1),
    P("mc400_mlp_sgd_b16_e2", lambda: generated(400, 1000), _tab(), "sgd", 16, 2),
    P("ml200_mlp_sgd_b32_e10", lambda: generated(200, 1000, multilabel=True), _tab(), "sgd",
      32, 10),
    P("digits400_cnn_sgd_b16_e2", lambda: sk("digits", 400, 600, image=True),
      lambda s: cnn(8, 10), "sgd", 16, 2, kind="image"),
    P("shapes300_cnn_sgd_b32_e4", lambda: shapes(300, 500), _img_cnn(), "sgd", 32, 4,
      kind="image"),
    P("digits200_mlp_adamw_b16_e3", lambda: sk("digits", 200, 600), _tab(), "adamw", 16, 3,
      weight_decay=0.01),
    P("bc150_mlp_adam_b8_e2", lambda: sk("breast_cancer", 150, 300), _tab(), "adam", 8, 2),
    P("shapes200_cnn_adam_b16_e4", lambda: shapes(200, 500), _img_cnn(), "adam", 16, 4,
      kind="image"),
)
SHORT = tuple(p.name for p in PROBLEMS[27:])  # the short runs added in issue 19
BY_NAME = {p.name: p for p in PROBLEMS}


def init_model(p: Problem, split: Split, seed: int) -> nn.Module:
    """The problem's model with the initial weights of ``seed``."""
    torch.manual_seed(seed)
    return p.model(split)


def train_one_cycle(p: Problem, split: Split, max_lr: float, seed: int) -> float:
    """Final validation loss of one one-cycle run (``seed``: initial weights and
    batch order; NaN if the run diverged)."""
    model = init_model(p, split, seed)
    opt = make_optimizer(p.optimizer, model.parameters(), lr=max_lr,
                         weight_decay=p.weight_decay)
    per_epoch = split.n_train // p.batch_size
    sched = OneCycleSchedule(p.epochs * per_epoch, max_lr)
    gen = torch.Generator().manual_seed(seed)
    step = 0
    model.train()
    for _ in range(p.epochs):
        perm = torch.randperm(split.n_train, generator=gen)
        for b in range(per_epoch):
            idx = perm[b * p.batch_size:(b + 1) * p.batch_size]
            sched.apply(opt, step)
            loss = split.loss(model(split.x_train[idx]), split.y_train[idx])
            if not torch.isfinite(loss):
                return math.nan
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1
    model.eval()
    with torch.no_grad():
        val = float(split.loss(model(split.x_val), split.y_val))
    return val if math.isfinite(val) else math.nan
