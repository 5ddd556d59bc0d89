"""Data sets and small models that the test modules share, and their parameter lists marked
with the XLA:CPU optimisation level (:func:`opt_level_params`) (import them as
``from helpers import ...``: tests/ is on ``sys.path`` in the test process, and every
simulated job and replica process gets the caller's ``sys.path``).

A model builder passed to a trainer as its ``make_model`` (``OneCycleTrainer(tiny_mlp, ...)``,
or ``functools.partial(tiny_mlp, hidden=64)``) is pickled by reference and imported again in
each replica, from this module: keep the builders module-level functions here.

The data all come from scikit-learn's 1,797 handwritten digits (8x8 pixels, values 0-16,
labels 0-9), always in the same order unless a builder says it shuffles: every call gives the
same tensors.
"""
from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from torch import nn

__all__ = ["digit_gray_images", "digit_images", "digit_score_csv", "digits_dataset", "digits_rgb_uint8",
           "digits_split", "digits_tensors", "opt_level_params", "pooled_cnn", "tiny_cnn", "tiny_mlp"]


@functools.lru_cache(maxsize=1)
def _digits():
    from sklearn.datasets import load_digits

    return load_digits()


# ------------------------------------------------------------------------- data

def digits_tensors(n: int | None = None, *, shuffle: bool = False,
                   shape: tuple[int, ...] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``n`` digits (all when ``None``): float32 ``[n, 64]`` in 0..1 and int64 labels.

    ``shuffle``: in the order of ``torch.randperm`` seeded with 0 (the same every call) before
    taking ``n``. ``shape``: each sample viewed as that shape, e.g. ``(1, 8, 8)`` for images."""
    d = _digits()
    x = torch.tensor(d.data, dtype=torch.float32) / 16.0
    y = torch.tensor(d.target, dtype=torch.int64)
    if shuffle:
        perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
        x, y = x[perm], y[perm]
    x, y = x[:n], y[:n]
    if shape is not None:
        x = x.view(-1, *shape)
    return x, y


def digits_dataset(n: int | None = None, *, shape: tuple[int, ...] | None = None
                   ) -> torch.utils.data.TensorDataset:
    """:func:`digits_tensors` (the first ``n``, in order) as a ``TensorDataset`` of ``(x, y)``."""
    return torch.utils.data.TensorDataset(*digits_tensors(n, shape=shape))


def digits_split(n_val: int = 360, n_train: int | None = None, *, shuffle: bool = True,
                 val_first: bool = True
                 ) -> tuple[torch.utils.data.TensorDataset, torch.utils.data.TensorDataset]:
    """``(train, val)`` ``TensorDataset`` s of :func:`digits_tensors` (shuffled with seed 0
    unless ``shuffle=False``): ``val`` the first ``n_val`` samples and ``train`` the ``n_train``
    after them (all the rest when ``None``); with ``val_first=False``, ``train`` the first
    ``n_train`` and ``val`` the ``n_val`` after them."""
    x, y = digits_tensors(shuffle=shuffle)
    if val_first:
        val = slice(0, n_val)
        train = slice(n_val, None if n_train is None else n_val + n_train)
    else:
        if n_train is None:
            raise ValueError("val_first=False needs n_train")
        train, val = slice(0, n_train), slice(n_train, n_train + n_val)
    ds = torch.utils.data.TensorDataset
    return ds(x[train], y[train]), ds(x[val], y[val])


def digit_images(n: int, *, seed: int = 0, classes: int = 5) -> list[tuple[np.ndarray, int]]:
    """``n`` distinct digits, drawn in a seeded random order, as ``(uint8 8x8x3 image, label)``
    pairs for ``build_cache``: the channels are the digit, the digit shifted one pixel right and
    its negative (asymmetric, so a horizontal flip changes the image); labels modulo
    ``classes``."""
    d = _digits()
    idx = np.random.default_rng(seed).permutation(len(d.images))[:n]
    out = []
    for i in idx:
        g = (d.images[i] * 15).astype(np.uint8)
        out.append((np.stack([g, np.roll(g, 1, axis=1), 255 - g], axis=-1), int(d.target[i]) % classes))
    return out


def digit_score_csv(root, n: int, *, seed: int = 0, name: str = "train.csv"):
    """A regression task on disk: the first ``n`` :func:`digit_images` (seed ``seed``, 10
    classes) as ``root/img/<k>.png`` and ``root/<name>`` with rows ``img/<k>.png,<score>`` under
    the header ``image_id,score``, the score the digit's value plus Gaussian noise (sd 0.3,
    written with 3 decimals). Returns the CSV's path and the scores (``float32[n]``)."""
    from pathlib import Path

    from PIL import Image

    root = Path(root)
    (root / "img").mkdir(parents=True, exist_ok=True)
    items = digit_images(n, seed=seed, classes=10)
    noise = np.random.default_rng(seed).normal(0.0, 0.3, n)
    scores = np.round(np.array([y for _, y in items]) + noise, 3).astype(np.float32)
    rows = ["image_id,score"]
    for k, ((img, _), s) in enumerate(zip(items, scores)):
        Image.fromarray(img).save(root / "img" / f"{k}.png")
        rows.append(f"img/{k}.png,{s:.3f}")
    (root / name).write_text("\n".join(rows) + "\n")
    return root / name, scores


def digit_gray_images(n: int, *, classes: int | None = None) -> list[tuple[np.ndarray, int]]:
    """The first ``n`` digits as ``(uint8 8x8x3 grey image, label)`` pairs for ``build_cache``
    (the digit in all three channels); labels modulo ``classes`` when given."""
    d = _digits()
    return [(np.repeat((im * 15).astype(np.uint8)[..., None], 3, axis=2),
             int(t) if classes is None else int(t) % classes)
            for im, t in zip(d.images[:n], d.target[:n])]


def digits_rgb_uint8(n: int, *, upscale: int = 4) -> torch.utils.data.TensorDataset:
    """The first ``n`` digits as uint8 NHWC images ``[n, 8 * upscale, 8 * upscale, 3]`` (each
    pixel repeated ``upscale`` times both ways, grey in all three channels, 0..255) with their
    labels, as a ``TensorDataset``."""
    d = _digits()
    img = np.kron(d.images[:n], np.ones((upscale, upscale))) * 255 / 16
    x = torch.tensor(np.repeat(img[..., None], 3, axis=3).astype(np.uint8))
    return torch.utils.data.TensorDataset(x, torch.tensor(d.target[:n]))


# ----------------------------------------------------------------------- models

def tiny_mlp(classes: int = 10, *, hidden: int | tuple[int, ...] = 32, inputs: int = 64,
             seed: int | None = None) -> nn.Sequential:
    """An MLP for the flat digits: ``Linear(inputs, h), ReLU`` for each width ``h`` of
    ``hidden``, then ``Linear(last, classes)``. ``seed``: ``torch.manual_seed(seed)`` first, so
    that every call (in this process or a replica) starts from the same weights."""
    if seed is not None:
        torch.manual_seed(seed)
    widths = (hidden,) if isinstance(hidden, int) else tuple(hidden)
    layers: list[nn.Module] = []
    for a, b in zip((inputs, *widths), widths):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(widths[-1] if widths else inputs, classes))


def tiny_cnn(classes: int = 5, *, size: int = 12, seed: int | None = None) -> nn.Sequential:
    """One 3x3 convolution (3 -> 4 channels, no padding), ReLU and a linear head, for
    ``size`` x ``size`` RGB images (``[N, 3, size, size]``). ``seed`` as in :func:`tiny_mlp`."""
    if seed is not None:
        torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(),
                         nn.Linear(4 * (size - 2) * (size - 2), classes))


def pooled_cnn(classes: int = 2, *, seed: int | None = None) -> nn.Sequential:
    """One padded 3x3 convolution (3 -> 4 channels), ReLU, global average pooling and a linear
    head: takes RGB images of any size. ``seed`` as in :func:`tiny_mlp`."""
    if seed is not None:
        torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                         nn.Flatten(), nn.Linear(4, classes))


def opt_level_params(values: list, ids: list[str], level_1: set[str]) -> list:
    """``values`` as pytest parameters named ``ids`` (a tuple is the values of several argument
    names); those whose id is in ``level_1`` are marked ``xla_opt_level(1)`` (tests/conftest.py:
    the processes they start compile XLA:CPU at LLVM level 1, for programs that run many steps
    of few graphs)."""
    unknown = level_1 - set(ids)
    assert not unknown, f"opt_level_params: no parameter named {sorted(unknown)}"
    level = [pytest.mark.xla_opt_level(1)]
    return [pytest.param(*(v if isinstance(v, tuple) else (v,)), id=i,
                         marks=level if i in level_1 else ()) for v, i in zip(values, ids)]
