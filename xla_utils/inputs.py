"""Checks on datasets and targets, done in the calling process before any device time.

Used by :class:`~xla_utils.trainer.OneCycleTrainer` (``fit``, ``predict``,
``evaluate``) and :func:`xla_utils.debug.debug_run`: a wrong label, an
unlabelled cache or a too small training set fails here, with its fix, instead
of silently on the TPU.
"""
from __future__ import annotations

import time
import warnings
from typing import Callable

import numpy as np
import torch

from .data import CachedImageDataset

__all__ = ["check_batches", "check_targets", "require_labels", "input_shape", "shape_mismatch",
           "AsPairs"]


# Samples read to check the targets of a dataset that keeps no label array.
LABEL_SCAN_SAMPLES = 512


LABEL_SCAN_SECONDS = 5.0


def check_batches(data, batch_size: int, world: int) -> None:
    """Refuse a training set smaller than one global batch, naming the trainer's fix."""
    n = len(data)
    if n < batch_size * world:
        fit = n // world
        raise ValueError(
            f"train_data has {n} samples, fewer than one global batch ({batch_size} per core x "
            f"{world} core{'s' if world > 1 else ''} = {batch_size * world}); the trainer drops "
            "the ragged last batch so every core gets equal full batches (no recompiles). Fix: "
            + (f"batch_size={fit} or lower, or more training samples." if fit >= 1 else
               f"at least {world} training samples (one per core), or fit(cores=1)."))


def _targets_of(data) -> tuple[np.ndarray | None, np.ndarray | None]:
    """``(targets, sample index of each)`` without decoding inputs where possible:
    a label array for cached data, ``TensorDataset`` and torchvision datasets;
    otherwise a bounded, evenly spread scan (index array given)."""
    from .data import CachedImageDataset

    if isinstance(data, CachedImageDataset):
        return np.asarray(data.labels), None
    if isinstance(data, torch.utils.data.Subset):
        inner, where = _targets_of(data.dataset)
        if inner is not None and where is None:
            return inner[np.asarray(data.indices)], None
    if isinstance(data, torch.utils.data.TensorDataset) and len(data.tensors) >= 2:
        return data.tensors[1].detach().cpu().numpy(), None
    targets = getattr(data, "targets", None)
    if targets is not None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            t = np.asarray(targets.cpu() if isinstance(targets, torch.Tensor) else targets)
        if t.dtype != object and len(t) == len(data):
            return t, None
    n = len(data)
    where = np.unique(np.linspace(0, n - 1, min(n, LABEL_SCAN_SAMPLES)).astype(np.int64))
    found, idx = [], []
    t0 = time.perf_counter()
    for i in where:
        sample = data[int(i)]
        if not isinstance(sample, (tuple, list)) or len(sample) < 2:
            return None, None
        y = sample[1]
        y = y.detach().cpu().numpy() if isinstance(y, torch.Tensor) else np.asarray(y)
        if y.dtype == object:
            return None, None
        found.append(y)
        idx.append(int(i))
        if time.perf_counter() - t0 > LABEL_SCAN_SECONDS:
            break
    if not found or len({f.shape for f in found}) != 1:
        return None, None
    return np.stack(found), np.asarray(idx)


def _output_width(model: torch.nn.Module, data, prepare: Callable, eval_step: Callable) -> int | None:
    """Width of the model's 2-D output for two samples, from one CPU forward in
    eval mode (None when that is not possible: the forward is then left to fit)."""
    params = list(model.parameters())
    if params and params[0].device.type not in ("cpu", "cuda"):
        return None
    modes = [m.training for m in model.modules()]
    try:
        batch = torch.utils.data.default_collate([data[i] for i in range(min(2, len(data)))])
        x, y = batch[0], batch[1]
        if params:
            x = x.to(params[0].device) if isinstance(x, torch.Tensor) else x
        model.eval()
        with torch.no_grad():
            out = eval_step(model, (prepare(x), y))
    except Exception:
        return None
    finally:
        for m, mode in zip(model.modules(), modes):
            m.training = mode
    if isinstance(out, torch.Tensor) and out.dim() == 2:
        return int(out.shape[1])
    return None


def check_targets(model: torch.nn.Module, loss: Callable, data, name: str,
                   prepare: Callable, eval_step: Callable) -> None:
    """Check class-index targets (or multi-hot widths) of ``data`` against the
    model's output width and the dataset's classes, before any training."""
    targets, where = _targets_of(data)
    if targets is None or targets.size == 0:
        return
    int_labels = targets.dtype.kind in "iu" and targets.ndim == 1
    multi_hot = targets.dtype.kind == "f" and targets.ndim == 2
    if not (int_labels or multi_hot):
        return  # regression or something else: nothing to check
    classes = getattr(data, "num_classes", None)
    if classes is None and isinstance(getattr(data, "classes", None), (list, tuple)):
        classes = len(data.classes)
    width = _output_width(model, data, prepare, eval_step)
    scope = "" if where is None else f" (checked {len(where)} evenly spread samples)"
    if multi_hot:
        if width is not None and targets.shape[1] != width:
            raise ValueError(f"{name} has multi-label targets of width {targets.shape[1]} but the "
                             f"model outputs {width} values per sample: build the model with "
                             f"{targets.shape[1]} outputs (num_classes={targets.shape[1]})")
        return
    limits = [v for v in (width, classes) if v is not None]
    if not limits:
        return
    limit = min(limits)
    bad = (targets < 0) | (targets >= limit)
    ignore = getattr(loss, "ignore_index", None)
    if isinstance(ignore, int):
        bad &= targets != ignore
    if bad.any():
        j = int(np.argmax(bad))
        label, sample = int(targets[j]), int(j if where is None else where[j])
        what = (f"the model's {width} outputs (class indices 0..{width - 1})"
                if limit == width else f"the dataset's {classes} classes (0..{classes - 1})")
        if label == -1 and classes is not None:
            fix = ("-1 marks an unlabelled image: build the cache with labels= (a CSV "
                   "path,label or a dict), or one sub-folder per class")
        elif classes is not None and width is not None and label < classes:
            fix = f"build the model with {classes} outputs (num_classes={classes})"
        else:
            fix = ("fix the labels, or build the model with "
                   f"num_classes={int(targets.max()) + 1}")
        raise ValueError(
            f"{name}: label {label} at sample {sample} is outside {what}"
            + (f"; {name} has {classes} classes" if classes is not None else "")
            + f" ({int(bad.sum())} such sample(s){scope}). On XLA an out-of-range label "
            f"trains silently on garbage. Fix: {fix}.")
    if width is not None and classes is not None and width != classes:
        warnings.warn(f"the model outputs {width} classes but {name} has {classes}: build "
                      f"it with num_classes={classes}", UserWarning, stacklevel=3)


def require_labels(data, name: str, action: str = "train") -> None:
    """Refuse an unlabelled cache (every label -1) where labels are needed."""
    if getattr(data, "unlabeled", False):
        raise ValueError(
            f"{name} {getattr(data, 'path', '')} is an unlabelled cache (built from a flat folder "
            f"without labels, or with unlabeled=True), so it cannot be used to {action}. Rebuild it "
            "with its labels: build_cache(SOURCE, OUT, labels=\"train.csv\", overwrite=True) "
            "(tpu_cache_ds build SOURCE OUT --labels train.csv --overwrite; rows of file,label), or "
            "one sub-folder per class. Unlabelled caches are for trainer.predict().")


def input_shape(data, first) -> tuple[int, ...] | None:
    """Shape of one input (HWC for caches), or None when it has none."""
    if isinstance(data, CachedImageDataset):
        return (*data.image_size, 3)
    if first is None:
        try:
            first = data[0]
        except Exception:
            return None
    x = first[0] if isinstance(first, (tuple, list)) else first
    shape = getattr(x, "shape", None)
    return tuple(int(d) for d in shape) if shape is not None else None


def shape_mismatch(data, shape, train_data, train_shape) -> str:
    where = f" ({data.path})" if isinstance(data, CachedImageDataset) else ""
    train_where = f" ({train_data.path})" if isinstance(train_data, CachedImageDataset) else ""
    msg = (f"the inputs of data{where} have shape {shape} but the training data{train_where} has "
           f"{train_shape}: the model was trained at another size")
    if isinstance(data, CachedImageDataset):
        msg += (f"; rebuild it at the training size: build_cache(SOURCE, {str(data.path)!r}, "
                f"size={tuple(train_shape[:2])}, unlabeled=True, overwrite=True)")
    return msg


class AsPairs:
    """A map-style dataset of ``x`` or ``(x, y, ...)`` as ``(x, y)`` pairs (``y = 0`` when absent)."""

    def __init__(self, data):
        self.data = data

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int):
        item = self.data[i]
        if isinstance(item, (tuple, list)):
            return item[0], (item[1] if len(item) > 1 else 0)
        return item, 0
