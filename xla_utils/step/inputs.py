"""Checks on datasets and targets, done in the calling process before any device time.

Used by :class:`~xla_utils.train.trainer.OneCycleTrainer` (``fit``, ``predict``,
``evaluate``, ``find_lr``, ``check``, ``debug``), :func:`xla_utils.lr_find` and
:func:`xla_utils.diagnostics.debug.debug_run`: a wrong label, an unlabelled cache, a too
small training set or a sample the trainer cannot feed fails here, with its
fix, instead of on the TPU.

:func:`inspect_inputs` decides once per dataset, from its first sample, how its
inputs are fed (:class:`InputSpec`): uint8 images channels-last ``[H, W, C]``
(the cache, numpy, PIL) or channels-first ``[C, H, W]`` (torchvision's
``read_image``, ``PILToTensor``, ``tv_tensors.Image``) are normalised (and flipped
when training) on the device; PIL images are turned into uint8 ``[H, W, C]``
arrays on the host (:class:`HostFeed`); anything else numeric goes to the model
unchanged. The layout never changes within a run, so nothing recompiles.
"""
from __future__ import annotations

import dataclasses
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import torch

from ..data import (IMAGE_CHANNELS, CachedImageDataset, apply_batch_transform, describe_value,
                    image_layout, images_to_float, type_name)

__all__ = ["check_batches", "check_targets", "require_labels", "shape_mismatch",
           "AsPairs", "InputSpec", "InputRefused", "inspect_inputs", "HostFeed", "pil_array",
           "INPUT_KEYS", "TARGET_KEYS", "targets_of", "output_width", "output_shape",
           "TargetPlan", "loss_kind", "plan_targets", "TASKS", "check_batch_transform"]

# Keys of dict samples (Hugging Face ``datasets`` style) taken as input and target, first found wins
# (``input_ids``/``labels``: token sequences of a language model, fed unchanged).
INPUT_KEYS = ("image", "img", "pixel_values", "input_ids", "tokens", "input", "inputs", "x")
TARGET_KEYS = ("label", "labels", "target", "targets", "y")


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


def targets_of(data) -> tuple[np.ndarray | None, np.ndarray | None]:
    """``(targets, sample index of each)`` without decoding inputs where possible:
    a label array for cached data, ``TensorDataset`` and torchvision datasets;
    otherwise a bounded, evenly spread scan (index array given)."""
    from ..data import CachedImageDataset

    if isinstance(data, CachedImageDataset):
        return np.asarray(data.labels), None
    if isinstance(data, torch.utils.data.Subset):
        inner, where = targets_of(data.dataset)
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


def output_shape(model: torch.nn.Module, data, prepare: Callable, eval_step: Callable
                 ) -> tuple[int, ...] | None:
    """One sample's output shape (``(C,)`` for ``[B, C]`` outputs, ``()`` for ``[B]``), from
    one CPU forward of two samples in eval mode (None when that is not possible: the
    forward is then left to fit)."""
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
    if isinstance(out, torch.Tensor) and out.dim() >= 1:
        return tuple(int(d) for d in out.shape[1:])
    return None


def output_width(model: torch.nn.Module, data, prepare: Callable, eval_step: Callable) -> int | None:
    """Width of the model's 2-D output for two samples (:func:`output_shape`'s ``C`` of
    ``[B, C]``; None for other outputs or when the forward is not possible)."""
    shape = output_shape(model, data, prepare, eval_step)
    return shape[0] if shape is not None and len(shape) == 1 else None


# The problems check_targets tells apart (TargetPlan.kind).
TASKS = ("multiclass", "multilabel", "binary", "regression")
_REGRESSION_LOSSES = ("MSELoss", "L1Loss", "HuberLoss", "SmoothL1Loss", "mse_loss", "l1_loss",
                      "huber_loss", "smooth_l1_loss")
_BINARY_LOSSES = ("BCEWithLogitsLoss", "BCELoss", "binary_cross_entropy_with_logits",
                  "binary_cross_entropy")
_INDEX_LOSSES = ("CrossEntropyLoss", "NLLLoss", "cross_entropy", "nll_loss")


def loss_kind(loss: Any) -> str | None:
    """What a loss is for, by its class or function name: ``"regression"`` (MSE, L1,
    Huber, SmoothL1), ``"binary"`` (the BCE family: one-logit binary or multi-label),
    ``"index"`` (cross-entropy, NLL: class indices) or None (unknown)."""
    name = getattr(loss, "__name__", None)
    if not isinstance(name, str):
        name = type(loss).__name__
    return ("regression" if name in _REGRESSION_LOSSES else "binary" if name in _BINARY_LOSSES
            else "index" if name in _INDEX_LOSSES else None)


@dataclass(frozen=True)
class TargetPlan:
    """What :func:`check_targets` found out about a run's targets, on the host.

    Attributes:
        kind: ``"multiclass"`` (class indices), ``"multilabel"`` (multi-hot rows),
            ``"binary"`` (2 classes, a one-output model and a BCE loss), ``"regression"``
            (float targets, a regression cache or an MSE/L1/Huber loss), or None (unknown).
        shape: one sample's target as the loader feeds it: float32 of this shape (the
            model output's, e.g. ``(1,)``; :attr:`InputSpec.targets`), or None: as the
            dataset gives it.
    """

    kind: str | None
    shape: tuple[int, ...] | None = None


def check_batch_transform(fn: Callable | None, data, prepare: Callable) -> None:
    """Run ``batch_transform=`` once on the host, on the first two samples of ``data``
    prepared as the step prepares them (``prepare``), to refuse one that changes the batch's
    shapes before any device time. A hook that fails on the CPU for another reason (it
    needs the device) is left to the first step.

    Raises:
        ValueError: ``fn`` returned other shapes (:func:`xla_utils.data.apply_batch_transform`).
    """
    if fn is None:
        return
    try:
        x, y = torch.utils.data.default_collate([data[i] for i in range(min(2, len(data)))])[:2]
        x = prepare(x)
    except Exception:
        return  # samples the collate cannot batch: the other checks name them
    try:
        with torch.no_grad():
            apply_batch_transform(fn, x, y)
    except ValueError as e:
        if str(e).startswith("batch_transform= must return"):
            raise
    except Exception:
        pass  # device-only code: the first step runs it


def check_targets(model: torch.nn.Module, loss: Callable, data, name: str,
                   prepare: Callable, eval_step: Callable) -> TargetPlan:
    """Check the targets of ``data`` against the model's outputs, the loss and the
    dataset's classes, before any training, and say what problem they make.

    Class indices must lie within the outputs and the classes; multi-hot rows must be as
    wide as the outputs; a one-output model with a BCE loss takes labels 0/1 (one-logit
    binary); regression (a regression cache, or an MSE/L1/Huber/SmoothL1 loss) finite
    targets, as many per sample as the model has outputs.

    Returns: the :class:`TargetPlan`: the problem's kind and the target shape to feed.

    Raises:
        ValueError: targets the model, the loss or the dataset cannot take (the first bad
            sample and the fix named).
    """
    targets, where = targets_of(data)
    lk = loss_kind(loss)
    regression = getattr(data, "task", None) == "regression" or lk == "regression"
    if targets is None or targets.size == 0:
        return TargetPlan("regression" if regression else None)
    int_labels = targets.dtype.kind in "iu" and targets.ndim == 1
    multi_hot = targets.dtype.kind == "f" and targets.ndim == 2 and not regression
    if not (int_labels or multi_hot or regression):
        return TargetPlan(None)  # something else: nothing to check
    classes = getattr(data, "num_classes", None)
    if classes is None and isinstance(getattr(data, "classes", None), (list, tuple)):
        classes = len(data.classes)
    out = output_shape(model, data, prepare, eval_step)
    width = out[0] if out is not None and len(out) == 1 else None
    scope = "" if where is None else f" (checked {len(where)} evenly spread samples)"
    if regression:
        return _regression_plan(targets, where, out, lk, loss, name, scope)
    if multi_hot:
        if width is not None and targets.shape[1] != width:
            raise ValueError(f"{name} has multi-label targets of width {targets.shape[1]} but the "
                             f"model outputs {width} values per sample: build the model with "
                             f"{targets.shape[1]} outputs (num_classes={targets.shape[1]})")
        return TargetPlan("multilabel")
    if lk == "binary" and out in ((1,), ()):
        return _binary_plan(targets, where, out, loss, name, classes, scope)
    limits = [v for v in (width, classes) if v is not None]
    if not limits:
        return TargetPlan("multiclass")
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
        elif width == 1 and int(targets.max()) <= 1:
            fix = ("a one-output model is a one-logit binary classifier: train it with "
                   "loss=nn.BCEWithLogitsLoss() (the labels 0/1 are fed as floats), or build the "
                   "model with 2 outputs for CrossEntropyLoss")
        elif width == 1:
            fix = ("a one-output model with these numeric labels is a regression: train it with "
                   "loss=nn.MSELoss() (or L1Loss, HuberLoss), and build the cache with "
                   "task='regression' for float targets; for classes build the model with "
                   f"{classes or int(targets.max()) + 1} outputs")
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
    return TargetPlan("multiclass")


def plan_targets(model: torch.nn.Module, loss: Callable, data, spec: "InputSpec", name: str,
                 prepare: Callable, eval_step: Callable) -> tuple["InputSpec", TargetPlan]:
    """:func:`check_targets` of ``data`` (fed as ``spec`` says), and ``spec`` feeding the
    targets as the :class:`TargetPlan` says (``spec.feed(data)`` then gives float32 targets
    of the output's shape to a regression or one-logit binary run: converted on the host,
    so the step's graph never changes)."""
    plan = check_targets(model, loss, spec.feed(data), name, prepare, eval_step)
    return spec.with_targets(plan), plan


def _loss_name(loss: Any) -> str:
    name = getattr(loss, "__name__", None)
    return name if isinstance(name, str) else type(loss).__name__


def _regression_plan(targets: np.ndarray, where: np.ndarray | None, out: tuple[int, ...] | None,
                     lk: str | None, loss: Any, name: str, scope: str) -> TargetPlan:
    """The :class:`TargetPlan` of regression targets, refusing what cannot train."""
    if lk in ("index", "binary"):
        raise ValueError(
            f"{name} holds regression targets (a cache built from numeric labels: "
            f"task='regression') but the loss is {_loss_name(loss)}, a classification loss. Fix: "
            "loss=nn.MSELoss() (or nn.L1Loss(), nn.HuberLoss()) and a model with one output per "
            "target, or rebuild the cache with task='classification' for class labels")
    values = targets.astype(np.float64, copy=False).reshape(len(targets), -1)
    finite = np.isfinite(values).all(axis=1)
    if not finite.all():
        j = int(np.argmin(finite))
        raise ValueError(f"{name}: the target of sample {int(j if where is None else where[j])} is "
                         f"not finite ({values[j].tolist()}; {int((~finite).sum())} such sample(s)"
                         f"{scope}). On XLA a NaN target turns every weight into NaN. Fix: drop "
                         "those samples or fill their targets")
    k = values.shape[1]
    if out is None:
        return TargetPlan("regression", (k,) if targets.ndim == 1 else None)
    m = int(np.prod(out)) if out else 1
    if m != k:
        raise ValueError(
            f"{name} has {k} regression target(s) per sample but the model outputs {m} value(s) "
            f"(shape {list(out)}): build the model with {k} output(s) (e.g. nn.Linear(..., {k}))"
            + (", not one per class: a regression cache has no classes" if m > k else ""))
    return TargetPlan("regression", out)


def _binary_plan(targets: np.ndarray, where: np.ndarray | None, out: tuple[int, ...],
                 loss: Any, name: str, classes: int | None, scope: str) -> TargetPlan:
    """The :class:`TargetPlan` of a one-output model with a BCE loss: labels 0 and 1."""
    bad = (targets != 0) & (targets != 1)
    if bad.any():
        j = int(np.argmax(bad))
        n = classes or int(targets.max()) + 1
        raise ValueError(
            f"{name}: label {int(targets[j])} at sample {int(j if where is None else where[j])} is "
            f"not 0 or 1 ({int(bad.sum())} such sample(s){scope}), but a one-output model with "
            f"{_loss_name(loss)} is a one-logit binary classifier (the output is the logit of "
            f"class 1). Fix: for {n} classes use loss=nn.CrossEntropyLoss() and a model with {n} "
            "outputs" + ("; -1 marks an unlabelled image: build the cache with labels="
                         if int(targets[j]) == -1 else ""))
    if classes is not None and classes != 2:
        raise ValueError(f"{name} has {classes} classes, but a one-output model with "
                         f"{_loss_name(loss)} is a one-logit binary classifier (2 classes). Fix: "
                         f"loss=nn.CrossEntropyLoss() and a model with {classes} outputs")
    return TargetPlan("binary", out)


def require_labels(data, name: str, action: str = "train") -> None:
    """Refuse an unlabelled cache (every label -1) where labels are needed."""
    if getattr(data, "unlabeled", False):
        raise ValueError(
            f"{name} {getattr(data, 'path', '')} is an unlabelled cache (built from a flat folder "
            f"without labels, or with unlabeled=True), so it cannot be used to {action}. Rebuild it "
            "with its labels: build_cache(SOURCE, OUT, labels=\"train.csv\", overwrite=True) "
            "(tpu_cache_ds build SOURCE OUT --labels train.csv --overwrite; rows of file,label), or "
            "one sub-folder per class. Unlabelled caches are for trainer.predict().")


def shape_mismatch(data, spec: "InputSpec", train_data, train_spec: "InputSpec") -> str | None:
    """Why ``data``'s inputs cannot go through the model trained on ``train_data``
    (images compared as ``(C, H, W)``, whatever their layout), or None when they can."""
    if spec.image_chw is None or train_spec.image_chw is None or \
            spec.image_chw == train_spec.image_chw:
        return None
    where = f" ({data.path})" if isinstance(data, CachedImageDataset) else ""
    train_where = f" ({train_data.path})" if isinstance(train_data, CachedImageDataset) else ""
    msg = (f"the inputs of data{where} have shape {spec.shape} but the training data{train_where} "
           f"has {train_spec.shape}: the model was trained at another size")
    if isinstance(data, CachedImageDataset) and train_spec.layout is not None:
        size = train_spec.image_chw[1:]
        msg += (f"; rebuild it at the training size: build_cache(SOURCE, {str(data.path)!r}, "
                f"size={tuple(size)}, unlabeled=True, overwrite=True)")
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


# --------------------------------------------------------------------------- input layout
# PIL modes fed as they are (channels); the rest is converted to RGB (palette, CMYK...) or
# RGBA (grey + alpha) first, as build_cache would.
_PIL_DIRECT = ("RGB", "L", "RGBA")
_PIL_CONVERT = {"1": "L", "LA": "RGBA", "PA": "RGBA", "La": "RGBA", "RGBa": "RGBA"}


class InputRefused(TypeError):
    """A dataset's sample the trainer cannot feed; the message names it and the fix."""


@dataclass(frozen=True)
class InputSpec:
    """How the trainer feeds one dataset's inputs, decided once from its first sample.

    Attributes:
        layout: ``"channels_last"`` (uint8 ``[H, W, C]``), ``"channels_first"`` (uint8
            ``[C, H, W]``): images normalised on the device; None: inputs go to the model
            unchanged.
        shape: one input's shape as the loader collates it (after host conversion);
            None for non-tensor inputs (numbers, nested structures).
        dtype: its dtype (``"uint8"``, ``"float32"``, ...).
        source: what the dataset yields, in words (``"torch.Tensor"``,
            ``"tv_tensors.Image"``, ``"numpy.ndarray"``, ``"PIL.Image (mode RGB)"``, ...).
        pil: PIL images are turned into uint8 ``[H, W, C]`` arrays on the host.
        keys: ``(input key, target key or None)`` of dict samples, else None.
        ambiguous: both ends of the image shape could be the channel axis; the
            layout followed the rule of :func:`xla_utils.data.image_layout`.
        targets: each target is fed as float32 of this shape (:attr:`TargetPlan.shape`:
            regression, one-logit binary), else None: as the dataset gives it.
    """

    layout: str | None
    shape: tuple[int, ...] | None
    dtype: str
    source: str
    pil: bool = False
    keys: tuple[str, str | None] | None = None
    ambiguous: bool = False
    targets: tuple[int, ...] | None = None

    @property
    def channels(self) -> int | None:
        """Channels of an image input, else None."""
        if self.layout is None or self.shape is None:
            return None
        return self.shape[0] if self.layout == "channels_first" else self.shape[2]

    @property
    def image_chw(self) -> tuple[int, ...] | None:
        """``(C, H, W)`` of an image input (what the model sees), else the raw shape."""
        if self.layout == "channels_last" and self.shape is not None:
            h, w, c = self.shape
            return (c, h, w)
        return self.shape

    def prepare(self, x: Any, mean: Sequence[float], std: Sequence[float], flip: bool,
                memory_format: torch.memory_format = torch.contiguous_format) -> Any:
        """Model input from a device batch: images normalised (and randomly mirrored
        when ``flip``) into ``memory_format``, anything else unchanged."""
        if self.layout is None:
            return x
        return images_to_float(x, mean, std, flip=flip, memory_format=memory_format,
                               channels_first=self.layout == "channels_first")

    def feed(self, data: Any) -> Any:
        """``data`` as the loader can collate it (a :class:`HostFeed` when samples need host
        work; a cache's float-target view with :attr:`targets`)."""
        if isinstance(data, CachedImageDataset):
            return data if self.targets is None else data.float_targets(self.targets)
        host = self.pil or self.keys is not None or self.targets is not None
        return HostFeed(data, self) if host else data

    def with_targets(self, plan: TargetPlan) -> "InputSpec":
        """This spec feeding targets as ``plan`` says (:attr:`targets`)."""
        return dataclasses.replace(self, targets=plan.shape)

    def describe(self, flip: bool) -> str:
        """One line: the inputs seen and what the trainer does with them."""
        dims = "" if self.shape is None else "[B," + ",".join(str(d) for d in self.shape) + "]"
        if self.layout is None:
            what = f"{self.dtype} {dims}".strip() if dims else self.dtype
            return f"inputs: {what} ({self.source}), passed to the model unchanged"
        side = self.layout.replace("_", "-")
        host = ""
        if self.pil:
            host = f"{self.source} converted on the host to "
        elif self.keys is not None:
            host = f"dict samples ({self.keys[0]!r}) as "
        tie = ""
        if self.ambiguous:
            tie = (f" (ambiguous shape: both ends could be channels; {side} because the samples "
                   f"are {'torch tensors' if self.layout == 'channels_first' else 'numpy arrays'})")
        done = "normalised and flipped" if flip else "normalised"
        src = "" if self.pil else f" ({self.source})"
        return f"inputs: {host}uint8 {dims} {side} images{src}{tie}, {done} on the device"


class HostFeed:
    """``data`` with each sample made collatable on the host: dict samples become
    ``(input, target)`` (by :data:`INPUT_KEYS` / :data:`TARGET_KEYS`), PIL images
    uint8 ``[H, W, C]`` arrays (``np.array``, the work of ``PILToTensor`` minus its
    transpose), targets float32 arrays of ``spec.targets``' shape when it is set. Other attributes (``targets``, ``classes``, ``set_epoch`` ...) are
    those of ``data``."""

    def __init__(self, data: Any, spec: InputSpec):
        self.data, self.spec = data, spec

    def __len__(self) -> int:
        return len(self.data)

    def __getattr__(self, name: str) -> Any:
        if name in ("data", "spec") or name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.data, name)

    def __getitem__(self, i: int) -> Any:
        item = self.data[i]
        keys = self.spec.keys
        if keys is not None:
            item = (item[keys[0]],) if keys[1] is None else (item[keys[0]], item[keys[1]])
        if self.spec.targets is not None and isinstance(item, (tuple, list)) and len(item) > 1:
            y = item[1].detach().cpu().numpy() if isinstance(item[1], torch.Tensor) else item[1]
            item = (item[0], np.asarray(y, dtype=np.float32).reshape(self.spec.targets), *item[2:])
        if not self.spec.pil:
            return item
        if isinstance(item, (tuple, list)):
            return (pil_array(item[0]), *item[1:])
        return pil_array(item)


def pil_array(img: Any) -> np.ndarray:
    """A PIL image as a uint8 ``[H, W, C]`` array (C = 1 for grey, 3, or 4 with alpha)."""
    from PIL import Image

    if not isinstance(img, Image.Image):
        raise InputRefused(f"a sample's input is a {type_name(img)}, but the dataset's first "
                           "sample was a PIL image: every sample must have the same type")
    mode = img.mode
    if mode not in _PIL_DIRECT:
        if mode.startswith("I") or mode == "F":
            raise InputRefused(
                f"PIL image of mode {mode} (16/32-bit): the trainer feeds 8-bit images. Fix: "
                "convert it in the dataset's transform (transforms.ToTensor() gives float "
                "input, passed to the model unchanged), or build_cache(...) which handles it")
        img = img.convert(_PIL_CONVERT.get(mode, "RGB"))
    a = np.array(img)  # a writable copy (np.asarray's view of PIL's bytes is read-only)
    return a[:, :, None] if a.ndim == 2 else a


def _split_sample(sample: Any, name: str, need_target: bool, verb: str
                  ) -> tuple[Any, Any, tuple[str, str | None] | None]:
    """``(input, target or None, dict keys or None)`` of a dataset's first sample."""
    keys = None
    if isinstance(sample, dict):
        k_in = next((k for k in INPUT_KEYS if k in sample), None)
        k_y = next((k for k in TARGET_KEYS if k in sample), None)
        if k_in is None:
            raise InputRefused(
                f"{name} item 0 is a dict with keys {sorted(map(str, sample))}, none of which the "
                f"trainer knows as the input ({', '.join(INPUT_KEYS)}). Fix: return (input, target) "
                "tuples from the dataset, or name the input key 'image' and the target 'label'")
        keys, x, y = (k_in, k_y), sample[k_in], sample.get(k_y) if k_y else None
    elif isinstance(sample, (tuple, list)):
        if not sample:
            raise InputRefused(f"{name} item 0 is an empty {type(sample).__name__}")
        x, y = sample[0], (sample[1] if len(sample) > 1 else None)
    else:
        x, y = sample, None
    if need_target and y is None:
        raise InputRefused(
            f"{name} item 0 is {describe_value(sample)}, not an (input, target) pair: {verb} needs "
            "targets. Fix: return (input, target) from the dataset's __getitem__"
            + (f" (a dict sample needs one of the keys {', '.join(TARGET_KEYS)})" if keys else ""))
    return x, y, keys


def _leaf_problem(v: Any, depth: int = 0) -> tuple[Any] | None:
    """``(part,)``: the first part of a (nested) input the loader cannot collate into
    numbers, else None."""
    if isinstance(v, torch.Tensor) or isinstance(v, (bool, int, float, np.number, np.bool_)):
        return None
    if isinstance(v, np.ndarray):
        return (v,) if v.dtype.kind in "OUSV" else None
    parts = list(v) if isinstance(v, (tuple, list)) else \
        list(v.values()) if isinstance(v, dict) else None
    if parts and depth < 4:
        return next((p for p in (_leaf_problem(e, depth + 1) for e in parts) if p is not None),
                    None)
    return (v,)


def _refuse_input(name: str, x: Any, why: str) -> InputRefused:
    return InputRefused(
        f"{name} item 0: the input is {describe_value(x)}, which the trainer cannot feed{why}. "
        "It feeds uint8 images [C, H, W] or [H, W, C] with C in 1, 3, 4 (torch tensors, "
        "tv_tensors.Image, numpy arrays; normalised on the device), PIL images (converted on the "
        "host), and numeric tensors/arrays of any other dtype (passed to the model unchanged). "
        "Fix: convert it in the dataset's transform (e.g. transform=transforms.PILToTensor() "
        "for images, or a float tensor), or build a cache with build_cache(...)")


def _input_spec(x: Any, name: str) -> InputSpec:
    """The :class:`InputSpec` of one input ``x`` (the first sample's)."""
    from PIL import Image

    if isinstance(x, Image.Image):
        a = pil_array(x)
        return InputSpec("channels_last", tuple(a.shape), "uint8", f"PIL.Image (mode {x.mode})",
                         pil=True)
    tv_image = type(x).__module__.startswith("torchvision.tv_tensors") and \
        type(x).__name__ == "Image"
    if isinstance(x, (torch.Tensor, np.ndarray)):
        src = type_name(x) if not isinstance(x, torch.Tensor) or tv_image else "torch.Tensor"
        dtype = str(x.dtype).replace("torch.", "")
        shape = tuple(int(d) for d in x.shape)
        if isinstance(x, np.ndarray) and x.dtype.kind in "OUSV":
            raise _refuse_input(name, x, " (not numbers)")
        if dtype != "uint8":
            return InputSpec(None, shape, dtype, src)
        torch_like = isinstance(x, torch.Tensor)
        layout = image_layout(shape, channels_first_on_tie=torch_like)
        if tv_image and len(shape) == 3:
            layout = "channels_first"
        if layout is None:
            raise _refuse_input(name, x, f" (uint8 of {len(shape)} dims with no channel axis of "
                                f"{', '.join(map(str, IMAGE_CHANNELS))} at either end)")
        ambiguous = not tv_image and shape[0] in IMAGE_CHANNELS and shape[2] in IMAGE_CHANNELS
        return InputSpec(layout, shape, dtype, src, ambiguous=ambiguous)
    bad = _leaf_problem(x)
    if bad is not None:
        part = "" if bad[0] is x else f" (the part {describe_value(bad[0])})"
        raise _refuse_input(name, x, part)
    what = "number" if not isinstance(x, (tuple, list, dict)) else \
        f"{type(x).__name__} of {len(x)} inputs"
    return InputSpec(None, None, what, type_name(x))


def inspect_inputs(data: Any, name: str, *, need_target: bool = True, verb: str = "training",
                   mean: Sequence[float] | None = None) -> InputSpec:
    """Decide how ``data``'s inputs are fed, from its first sample (host only, no device time).

    Args:
        data: a :class:`~xla_utils.data.CachedImageDataset` or a map-style dataset of
            ``(input, target)``, ``input`` or dicts with an input key of :data:`INPUT_KEYS`.
        name: the dataset's name in messages (``"train_data"``).
        need_target: refuse samples without a target.
        verb: what needs the targets, in messages.
        mean: the normalisation's per-channel mean: its length must match the images'
            channels (None: not checked).

    Returns:
        The dataset's :class:`InputSpec`.

    Raises:
        InputRefused: (a ``TypeError``) a sample type the trainer cannot feed; the message
            names its type, shape and dtype and the fix.
        ValueError: images whose channels do not match ``mean``.
    """
    if isinstance(data, CachedImageDataset):
        spec = InputSpec("channels_last", (*data.image_size, 3), "uint8", "CachedImageDataset")
    else:
        if len(data) == 0:
            raise ValueError(f"{name} is empty")
        x, y, keys = _split_sample(data[0], name, need_target, verb)
        spec = dataclasses.replace(_input_spec(x, name), keys=keys)
        if y is not None and _leaf_problem(y) is not None:
            raise InputRefused(
                f"{name} item 0: the target is {describe_value(y)}, which cannot be batched into "
                "a tensor. Fix: return class indices (int), or float/int tensors or arrays, e.g. "
                "dataset.classes.index(name) for class names")
    c = spec.channels
    if mean is not None and c is not None and c != len(mean):
        raise ValueError(
            f"{name} has {c}-channel images ({spec.source}, {spec.layout.replace('_', '-')}) but "
            f"the trainer's mean/std have {len(mean)} values. Fix: pass mean= and std= with {c} "
            f"value(s) to the trainer (e.g. mean={(0.5,) * c}, std={(0.5,) * c})"
            + (", or convert the images to RGB in the dataset" if c in (1, 4) else ""))
    return spec
