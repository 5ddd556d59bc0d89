"""Validation metrics: device sums reduced once per pass, and whole-set metrics computed on
the host from every validation row, gathered once.

Two kinds of metric, one accumulator (:class:`MetricAccumulator`):

* **Sums** (``accuracy``, ``top<k>``, ``f1``, ``rmse``, ``mae``): every batch adds to a
  handful of device tensors (no host sync); at the end of a pass one ``all_reduce`` and one
  read bring the totals to the host.
* **Whole-set metrics** (``auc``, ``logloss``, ``qwk``, ``macro_f1`` and any callable
  ``metric(preds, targets) -> float``): each batch's predictions and targets stay on the
  device; at the end of the pass they are gathered over the replicas in order, once (a
  zero-filled ``all_reduce``, :func:`gather_rows`), the padding removed, and the master
  computes each metric in NumPy and shares the value with every replica (all agree, so
  best-epoch choice and early stopping are the same everywhere). The values do not depend
  on the number of replicas.

Padded samples (``valid == False``, see :func:`xla_utils.data.iterate_batches`) are masked
out, so each sample counts exactly once across all replicas and no batch ever changes shape.

A metric sees ``preds`` as the probabilities ``predict`` gives (softmax for multi-class,
sigmoid for multi-label and one-logit binary, raw outputs for regression: see
:func:`target_kind`), ``float64[n, outputs]``, and ``targets`` as the dataset gives them
(class ints, 0/1 or floats), ``[n]`` or ``[n, m]``. Names are checked when the trainer's
configuration is built (:func:`normalize_metrics`, with a did-you-mean), and every metric
is tried on a small sample of the validation set's shape before any device time
(:func:`check_metrics`).
"""
from __future__ import annotations

import copy
import inspect
import math
import re
import traceback
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch

from .. import runtime
from ..utils.suggest import did_you_mean

__all__ = ["MetricAccumulator", "NamedMetric", "per_sample_loss", "resolve_metrics",
           "normalize_metrics", "metric_names", "target_kind", "lower_is_better",
           "host_metric", "check_metrics", "gather_rows", "activate_kind", "metric_keys",
           "METRICS", "KINDS", "RECORD_KEYS"]

# name -> description, for errors and docs
METRICS = {
    "accuracy": "top-1 accuracy (multi-class argmax; binary at 0.5)",
    "top5": "top-5 accuracy (multi-class; top<k> for any k)",
    "f1": "micro-averaged F1 at 0.5 (multi-label, binary)",
    "auc": "ROC AUC: binary; macro one-vs-rest (multi-class); macro over labels (multi-label)",
    "logloss": "log loss of the probabilities (multi-label: mean over the labels)",
    "rmse": "root mean squared error (regression; binary, multi-label: of the probabilities)",
    "mae": "mean absolute error (as rmse)",
    "qwk": "quadratic weighted kappa of the predicted grade (multi-class argmax, binary at 0.5, "
           "regression rounded)",
    "macro_f1": "F1 per class, averaged (multi-class argmax, binary at 0.5, multi-label per label)",
}
# What a task is, for metrics: decided from the first batch (target_kind).
KINDS = ("multiclass", "binary", "multilabel", "regression")
# Metrics kept as device sums; the others need every row (gathered once per pass).
_SUMS = ("accuracy", "f1", "rmse", "mae")
# Better lower: a monitored name ending so (losses, logloss, rmse, mae; a callable's name too).
LOWER_SUFFIXES = ("loss", "error", "mse", "mae", "msle")
# Keys of an epoch record that are not validation metrics (a callable may not take them).
RECORD_KEYS = ("epoch", "loss", "samples", "train_loss", "val_loss", "lr_max", "lr_last",
               "images_per_s", "seconds", "compiles", "host_reads_per_step", "skipped_steps",
               "compile_seconds", "grad_norm", "grad_norm_max", "clipped_steps",
               "grad_norm_clipped_max")
_TOPK = re.compile(r"top[1-9]\d*")
# Rows of the validation set a callable is tried on before any device time.
CHECK_ROWS = 64


class NamedMetric:
    """A callable metric ``fn(preds, targets) -> float`` under ``name`` (the history's
    column and what ``monitor=`` names). ``str()`` is the name."""

    def __init__(self, name: str, fn: Callable[[np.ndarray, np.ndarray], float]):
        self.name, self.fn = name, fn

    def __call__(self, preds: np.ndarray, targets: np.ndarray) -> float:
        return self.fn(preds, targets)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, NamedMetric) and (self.name, self.fn) == (other.name, other.fn)

    def __hash__(self) -> int:
        return hash(self.name)

    def __str__(self) -> str:
        return self.name

    def __repr__(self) -> str:
        return f"NamedMetric({self.name!r}, {getattr(self.fn, '__qualname__', self.fn)!r})"


def _builtin(name: str) -> bool:
    return name in METRICS or bool(_TOPK.fullmatch(name))


def _named(name: Any, fn: Any) -> NamedMetric:
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"metrics: a callable's name must be a non-empty str, got {name!r}")
    if not callable(fn):
        raise ValueError(f"metrics: {name!r} must map to a callable metric(preds, targets) -> "
                         f"float, got {type(fn).__name__}")
    key = name.strip().lower()
    if _builtin(key) or key in RECORD_KEYS:
        raise ValueError(f"metrics: the callable named {key!r} takes a name the trainer uses "
                         f"already (a built-in metric or a history column): name it otherwise, "
                         f"e.g. metrics={{'my_{key}': fn}}")
    return NamedMetric(key, fn)


def normalize_metrics(metrics: Any) -> list[str | NamedMetric] | None:
    """``metrics=`` as the configuration keeps it: built-in names lower-case, callables as
    :class:`NamedMetric` (checked here, when the trainer's configuration is built).

    Args:
        metrics: None (the defaults for the task), a name, a callable, a dict
            ``{name: callable}``, or a sequence of those. A callable is named by its
            ``__name__`` (a ``def``); a lambda or a ``functools.partial`` needs a dict entry
            (``{"qwk": lambda p, t: ...}``). Names are read lower-case.

    Raises:
        ValueError: an unknown name (with the nearest one), an unnamed callable, a callable
            named like a built-in metric or a history column, or a name given twice.
    """
    if metrics is None:
        return None
    items: list[Any]
    if isinstance(metrics, (str, NamedMetric)) or callable(metrics):
        items = [metrics]
    elif isinstance(metrics, Mapping):
        items = [dict([kv]) for kv in metrics.items()]
    else:
        try:
            items = list(metrics)
        except TypeError:
            raise ValueError(f"metrics must be None, a name, a callable, a dict {{name: callable}} "
                             f"or a list of those, got {type(metrics).__name__}") from None
    out: list[str | NamedMetric] = []
    for item in items:
        if isinstance(item, NamedMetric):
            out.append(item)
        elif isinstance(item, str):
            name = item.strip().lower()
            if not _builtin(name):
                raise ValueError(
                    f"unknown metric {item!r}{did_you_mean(name, METRICS)}: choose from "
                    f"{sorted(METRICS)} or top<k>, or pass a callable metric(preds, targets) -> "
                    "float (a def, or {'name': fn})")
            out.append(name)
        elif isinstance(item, Mapping):
            out += [_named(k, v) for k, v in item.items()]
        elif callable(item):
            name = getattr(item, "__name__", None)
            if not isinstance(name, str) or name == "<lambda>":
                raise ValueError(
                    f"metrics: the callable {item!r} has no name to show in the history and to "
                    "monitor: pass it in a dict, e.g. metrics={'qwk': lambda p, t: ...} (or "
                    "metrics=['accuracy', {'qwk': fn}]), or as a def")
            out.append(_named(name, item))
        else:
            raise ValueError(f"metrics: {item!r} is neither a metric name nor a callable "
                             f"metric(preds, targets) -> float")
    names = [str(m) for m in out]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"metrics names {twice} more than once: each metric is one history "
                         "column")
    return out


def metric_names(metrics: Sequence[str | NamedMetric] | None) -> list[str]:
    """The record keys of ``metrics`` (normalized), in order."""
    return [str(m) for m in metrics or ()]


def lower_is_better(name: str) -> bool:
    """Whether a smaller ``name`` (a record key) is better: losses, ``logloss``, ``rmse``,
    ``mae``, and a callable named ``..._loss``, ``..._error``, ``...mse``, ``...mae`` or
    ``...msle``; every other metric is better higher."""
    return name.endswith(LOWER_SUFFIXES)


def metric_keys(record: Mapping[str, Any]) -> list[str]:
    """The validation metrics of an epoch ``record`` (numbers not in :data:`RECORD_KEYS`)."""
    return [k for k, v in record.items() if k not in RECORD_KEYS
            and isinstance(v, (int, float)) and not isinstance(v, bool)]


# ------------------------------------------------------------------------ task kind
_BCE = ("BCEWithLogitsLoss", "binary_cross_entropy_with_logits")
_REGRESSION = ("MSELoss", "L1Loss", "SmoothL1Loss", "HuberLoss", "mse_loss", "l1_loss",
               "smooth_l1_loss", "huber_loss")


def _loss_name(loss_fn: Any) -> str:
    if isinstance(loss_fn, torch.nn.Module):
        return type(loss_fn).__name__
    return getattr(loss_fn, "__name__", "")


def _floating(t: Any) -> bool:
    if isinstance(t, torch.Tensor):
        return t.dtype.is_floating_point
    return np.asarray(t).dtype.kind == "f"


def target_kind(outputs: Any, targets: Any, loss_fn: Callable) -> str:
    """What the task is, for metrics and their defaults, from one batch's shapes and dtypes
    (tensors or arrays; nothing is read from a device).

    * ``"binary"``: class-int targets and one output per sample (one logit), or float
      targets of one column with ``BCEWithLogitsLoss``;
    * ``"multiclass"``: class-int targets and several outputs;
    * ``"multilabel"``: float targets of several columns, unless the loss is a regression
      loss;
    * ``"regression"``: other float targets (``MSELoss``, ``L1Loss``, ``SmoothL1Loss``,
      ``HuberLoss`` or their functions, or any loss with one-column targets).

    Returns:
        One of :data:`KINDS`.
    """
    width = 1 if len(outputs.shape) < 2 else int(np.prod(outputs.shape[1:]))
    name = _loss_name(loss_fn)
    if not _floating(targets):
        return "binary" if width == 1 else "multiclass"
    columns = 1 if len(targets.shape) < 2 else int(np.prod(targets.shape[1:]))
    if name in _REGRESSION:
        return "regression"
    if name in _BCE:
        return "binary" if columns == 1 else "multilabel"
    return "multilabel" if columns > 1 else "regression"


def resolve_metrics(metrics: Sequence[str | NamedMetric] | None, kind: str,
                    num_outputs: int | None) -> tuple[str | NamedMetric, ...]:
    """The run's metrics: ``metrics`` (normalized, :func:`normalize_metrics`), or the
    defaults for ``kind``: ``("accuracy",)`` for multi-class (plus ``"top5"`` above 10
    classes), ``("f1",)`` for multi-label, ``("accuracy", "auc")`` for one-logit binary and
    ``("rmse",)`` for regression."""
    if metrics is not None:
        return tuple(normalize_metrics(metrics) or ())
    if kind == "multilabel":
        return ("f1",)
    if kind == "binary":
        return ("accuracy", "auc")
    if kind == "regression":
        return ("rmse",)
    return ("accuracy", "top5") if (num_outputs or 0) > 10 else ("accuracy",)


def activate_kind(out: torch.Tensor, kind: str) -> torch.Tensor:
    """The probabilities a metric sees for ``kind`` (``[B, outputs]`` outputs): softmax
    (multi-class), sigmoid (binary, multi-label) or the outputs (regression)."""
    if kind == "multiclass":
        return torch.softmax(out, dim=1)
    if kind in ("binary", "multilabel"):
        return torch.sigmoid(out)
    return out


# ------------------------------------------------------------------- host metrics
def _kind_error(name: str, kind: str, needs: str) -> ValueError:
    return ValueError(f"metric {name!r} needs {needs}; this task is {kind} (see "
                      "xla_utils.train.metrics.target_kind)")


def _columns(preds: np.ndarray, targets: np.ndarray, name: str) -> np.ndarray:
    t = np.asarray(targets, dtype=np.float64)
    if t.size != preds.size:
        raise ValueError(f"metric {name!r}: targets of shape {t.shape} do not pair with "
                         f"predictions of shape {preds.shape}")
    return t.reshape(preds.shape)


def _binary_score(preds: np.ndarray, targets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(score of the positive class, 0/1 targets)`` of a binary task (one column, or the
    second of two)."""
    score = preds[:, -1] if preds.shape[1] <= 2 else preds[:, 0]
    return score, np.asarray(targets).reshape(-1) > 0.5


def _auc(score: np.ndarray, pos: np.ndarray) -> float:
    """ROC AUC of ``score`` for ``pos`` (Mann-Whitney, ties count half); NaN with one class."""
    n1 = int(pos.sum())
    n0 = pos.size - n1
    if n1 == 0 or n0 == 0:
        return math.nan
    order = np.argsort(score, kind="mergesort")
    s = score[order]
    start = np.r_[True, s[1:] != s[:-1]]
    first = np.flatnonzero(start)
    avg = first + (np.diff(np.r_[first, s.size]) + 1) / 2.0  # 1-based mean rank per tie group
    ranks = np.empty(s.size)
    ranks[order] = avg[np.cumsum(start) - 1]
    return float((ranks[pos].sum() - n1 * (n1 + 1) / 2.0) / (n1 * n0))


def _mean_defined(values: list[float]) -> float:
    ok = [v for v in values if not math.isnan(v)]
    return float(np.mean(ok)) if ok else math.nan


def _labels_pred(preds: np.ndarray, targets: np.ndarray, kind: str, name: str
                 ) -> tuple[np.ndarray, np.ndarray]:
    """``(true grades, predicted grades)`` as ints: argmax, 0.5 threshold, or rounding."""
    t = np.asarray(targets).reshape(-1)
    if kind == "multiclass":
        return t.astype(np.int64), preds.argmax(1)
    if kind == "binary":
        return (t > 0.5).astype(np.int64), (_binary_score(preds, t)[0] > 0.5).astype(np.int64)
    if kind == "regression":
        if preds.shape[1] != 1:
            raise ValueError(f"metric {name!r} needs one output per sample for regression, got "
                             f"{preds.shape[1]}")
        if not np.allclose(t, np.rint(t)):
            raise ValueError(f"metric {name!r} needs whole-number grades as regression targets")
        t = np.rint(t).astype(np.int64)
        p = np.clip(np.rint(preds[:, 0]), t.min(), t.max()).astype(np.int64)
        return t, p
    raise _kind_error(name, kind, "one grade per sample (multi-class, binary or regression)")


def _qwk(y: np.ndarray, p: np.ndarray) -> float:
    """Quadratic weighted kappa as scikit-learn's ``cohen_kappa_score(weights="quadratic")``
    (weights over the sorted labels that occur)."""
    labels, idx = np.unique(np.r_[y, p], return_inverse=True)
    k = labels.size
    if k < 2:
        return math.nan
    conf = np.zeros((k, k))
    np.add.at(conf, (idx[:y.size], idx[y.size:]), 1.0)
    expected = np.outer(conf.sum(1), conf.sum(0)) / conf.sum()
    w = (np.arange(k)[:, None] - np.arange(k)[None, :]) ** 2.0
    denom = (w * expected).sum()
    return float(1.0 - (w * conf).sum() / denom) if denom else math.nan


def _f1(pred: np.ndarray, true: np.ndarray) -> float:
    tp = float((pred & true).sum())
    denom = 2 * tp + float((pred & ~true).sum()) + float((~pred & true).sum())
    return 2 * tp / denom if denom else 0.0


def _auc_of(preds: np.ndarray, t: np.ndarray, kind: str) -> float:
    if kind == "binary" or (kind == "multiclass" and preds.shape[1] == 2):
        return _auc(*_binary_score(preds, t))
    if kind == "multiclass":
        y = t.reshape(-1).astype(np.int64)
        return _mean_defined([_auc(preds[:, c], y == c) for c in range(preds.shape[1])])
    if kind == "multilabel":
        tt = _columns(preds, t, "auc") > 0.5
        return _mean_defined([_auc(preds[:, j], tt[:, j]) for j in range(preds.shape[1])])
    raise _kind_error("auc", kind, "class or 0/1 targets")


def _logloss_of(preds: np.ndarray, t: np.ndarray, kind: str) -> float:
    eps = 1e-15
    if kind == "multiclass":
        p = np.clip(preds, eps, 1.0)
        p = p / p.sum(1, keepdims=True)
        y = t.reshape(-1).astype(np.int64)
        return float(-np.log(p[np.arange(y.size), y]).mean())
    if kind == "binary":
        p, tb = _binary_score(preds, t)
        tt = tb.astype(np.float64)
    elif kind == "multilabel":
        p, tt = preds, _columns(preds, t, "logloss")
    else:
        raise _kind_error("logloss", kind, "class or 0/1 targets")
    p = np.clip(p, eps, 1 - eps)
    return float(-(tt * np.log(p) + (1 - tt) * np.log1p(-p)).mean())


def _error_of(name: str, preds: np.ndarray, t: np.ndarray, kind: str) -> float:
    if kind == "multiclass":
        raise _kind_error(name, kind, "float (regression) or 0/1 targets paired with the outputs")
    d = preds - _columns(preds, t, name)
    return float(np.sqrt((d * d).mean()) if name == "rmse" else np.abs(d).mean())


def _macro_f1_of(preds: np.ndarray, t: np.ndarray, kind: str) -> float:
    if kind == "multilabel":
        tt = _columns(preds, t, "macro_f1") > 0.5
        pp = preds > 0.5
        return float(np.mean([_f1(pp[:, j], tt[:, j]) for j in range(preds.shape[1])]))
    if kind == "regression":
        raise _kind_error("macro_f1", kind, "class or 0/1 targets")
    y, p = _labels_pred(preds, t, kind, "macro_f1")
    return float(np.mean([_f1(p == c, y == c) for c in np.union1d(y, p)]))


def _micro_f1_of(preds: np.ndarray, t: np.ndarray, kind: str) -> float:
    if kind not in ("binary", "multilabel"):
        raise _kind_error("f1", kind, "multi-label or binary targets (macro_f1 or accuracy for "
                          "single-label classes)")
    return _f1(preds > 0.5, _columns(preds, t, "f1") > 0.5)


def _accuracy_of(name: str, preds: np.ndarray, t: np.ndarray, kind: str) -> float:
    k = 1 if name == "accuracy" else int(name[3:])
    if kind == "binary" and k == 1:
        y, p = _labels_pred(preds, t, kind, name)
        return float((y == p).mean())
    if kind != "multiclass":
        raise _kind_error(name, kind, "class targets (multi-class, or binary for accuracy)")
    y = t.reshape(-1).astype(np.int64)
    top = np.argsort(-preds, axis=1, kind="stable")[:, :min(k, preds.shape[1])]
    return float((top == y[:, None]).any(1).mean())


def host_metric(metric: str | NamedMetric | Callable, preds: np.ndarray, targets: np.ndarray,
                kind: str) -> float:
    """One metric of every validation row, on the host.

    Args:
        metric: A built-in name (:data:`METRICS`, ``top<k>``) or a callable
            ``metric(preds, targets) -> float``.
        preds: ``[n, outputs]`` probabilities (:func:`activate_kind`) or regression outputs.
        targets: ``[n]`` or ``[n, m]`` as the dataset gives them.
        kind: The task (:func:`target_kind`).

    Raises:
        ValueError: the metric does not apply to ``kind`` (e.g. ``auc`` of regression) or the
            shapes do not pair.
    """
    preds = np.asarray(preds, dtype=np.float64)
    if preds.ndim == 1:
        preds = preds[:, None]
    if not isinstance(metric, str):
        value = metric(preds, targets)
        if not _number(value):
            raise TypeError(f"it returned {type(value).__name__}, not a number (a metric "
                            "returns a float)")
        return float(value)
    t = np.asarray(targets)
    if metric == "auc":
        return _auc_of(preds, t, kind)
    if metric == "logloss":
        return _logloss_of(preds, t, kind)
    if metric in ("rmse", "mae"):
        return _error_of(metric, preds, t, kind)
    if metric == "qwk":
        return _qwk(*_labels_pred(preds, t, kind, metric))
    if metric == "macro_f1":
        return _macro_f1_of(preds, t, kind)
    if metric == "f1":
        return _micro_f1_of(preds, t, kind)
    if metric == "accuracy" or _TOPK.fullmatch(metric):
        return _accuracy_of(metric, preds, t, kind)
    raise ValueError(f"unknown metric {metric!r}{did_you_mean(metric, METRICS)}")


def _sample_rows(targets: np.ndarray, rows: int) -> np.ndarray:
    """Evenly spread rows of ``targets``, plus each class's first row (int targets) or each
    label's first positive and negative (multi-hot): a sample where the classes occur."""
    n = len(targets)
    idx = set(np.linspace(0, n - 1, min(n, rows)).astype(np.int64).tolist())
    t = np.asarray(targets)
    if t.ndim == 1 and t.dtype.kind in "iub":
        idx |= set(np.unique(t, return_index=True)[1].tolist())
    elif t.ndim == 2 and t.dtype.kind == "f":
        for col in (t > 0.5).T:
            for want in (True, False):
                hit = np.flatnonzero(col == want)
                if hit.size:
                    idx.add(int(hit[0]))
    return np.asarray(sorted(idx), dtype=np.int64)


def _sample_preds(kind: str, n: int, width: int, targets: np.ndarray) -> np.ndarray:
    rng = np.random.default_rng(0)
    z = rng.normal(size=(n, width))
    if kind == "multiclass":
        e = np.exp(z - z.max(1, keepdims=True))
        return e / e.sum(1, keepdims=True)
    if kind in ("binary", "multilabel"):
        return 1.0 / (1.0 + np.exp(-z))
    t = np.asarray(targets, dtype=np.float64)
    return t.reshape(n, width) + 0.1 * z if t.size == n * width else z


def check_metrics(metrics: Sequence[str | NamedMetric] | None, *, targets: np.ndarray | None,
                  width: int | None, loss_fn: Callable, where: str = "val_data"
                  ) -> tuple[str, ...] | None:
    """Try the run's metrics on a small sample of the validation set's shape, on the host,
    before any device time: the targets of up to :data:`CHECK_ROWS` validation samples
    (every class's first among them) and made-up predictions of the model's width.

    Args:
        metrics: ``TrainerConfig.metrics`` (normalized; None: the task's defaults).
        targets: The validation targets (``step.inputs.targets_of``), or None when they
            cannot be read cheaply (then only the names are resolved, for known kinds).
        width: The model's outputs per sample, or None (taken from the targets).
        loss_fn: The trainer's loss (decides the task kind with the targets).
        where: The dataset's name, for messages.

    Returns:
        The resolved metric names, or None when ``targets`` is None.

    Raises:
        ValueError: a metric that does not apply to the task, or a callable that raised or
            returned no number on the sample (named, with its traceback's last lines).
    """
    if targets is None or len(targets) == 0:
        return None
    t = np.asarray(targets)
    t = t[_sample_rows(t, CHECK_ROWS)]
    n = len(t)
    if width is None:
        width = (int(t.max()) + 1 if t.dtype.kind in "iub" and t.ndim == 1 else
                 1 if t.ndim == 1 else int(np.prod(t.shape[1:])))
    kind = target_kind(np.zeros((n, width)), t, loss_fn)
    resolved = resolve_metrics(metrics, kind, width)
    preds = _sample_preds(kind, n, width, t)
    for m in resolved:
        name = str(m)
        try:
            host_metric(m, preds.copy(), t.copy(), kind)
        except Exception as exc:
            if isinstance(m, str):
                raise ValueError(f"metrics: {exc} ({where}: targets {t.dtype}{list(t.shape[1:])}, "
                                 f"model with {width} output(s), {_loss_name(loss_fn) or 'loss'})"
                                 ) from None
            raise ValueError(
                f"metric {name!r} failed before training, on a sample shaped like {where}'s "
                f"validation (preds float64[{n}, {width}] as the trainer gives them for this "
                f"{kind} task, targets {t.dtype}{list(t.shape)}): {_summary(exc)}") from None
    return tuple(str(m) for m in resolved)


def _number(value: Any) -> bool:
    """Whether a metric's value is one number (a float, a NumPy or 0-d tensor scalar)."""
    if isinstance(value, (bool, str, bytes)) or np.ndim(value) != 0:
        return False
    try:
        float(value)
    except (TypeError, ValueError):
        return False
    return True


def _summary(exc: BaseException) -> str:
    """The exception and the frames of its traceback (last three), one line each."""
    frames = traceback.extract_tb(exc.__traceback__)[-3:]
    where = "; ".join(f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno} in {f.name}" for f in frames)
    return "".join(traceback.format_exception_only(type(exc), exc)).strip() + (
        f" (at {where})" if where else "")


# ----------------------------------------------------------------- device side
def per_sample_loss(loss_fn: Callable) -> Callable | None:
    """A version of ``loss_fn`` returning one value per sample, or None.

    Works for torch loss modules with a ``reduction`` attribute and for
    functions accepting a ``reduction`` keyword (``F.cross_entropy`` ...).
    """
    if isinstance(loss_fn, torch.nn.Module) and hasattr(loss_fn, "reduction"):
        m = copy.copy(loss_fn)
        m.reduction = "none"
        return m
    try:
        params = inspect.signature(loss_fn).parameters
    except (TypeError, ValueError):
        return None
    if "reduction" in params:
        return lambda out, y: loss_fn(out, y, reduction="none")
    return None


def gather_rows(local: torch.Tensor, *, world_size: int, rank: int, dev: torch.device
                ) -> np.ndarray | None:
    """Every rank's ``[batches, B, W]`` rows on the master, ``float32[batches * world * B, W]``
    in (batch, rank, slot) order: dataset order for the unshuffled loader (``None`` on the
    other ranks). One all_reduce of a zero-filled ``[batches, world, B, W]`` tensor, where each
    rank fills its own slots, gathers them exactly. Every rank calls it."""
    ws = world_size
    if ws > 1:
        mine = runtime.to_device(torch.arange(ws) == rank, dev).view(1, ws, 1, 1)
        local = runtime.all_reduce(torch.where(mine, local.unsqueeze(1), local.new_zeros(())))
    runtime.sync()
    if not runtime.is_master():
        return None
    return local.cpu().numpy().reshape(-1, local.shape[-1])


class MetricAccumulator:
    """Loss and the chosen metrics over one eval pass: device sums, and (whole-set metrics)
    each batch's predictions and targets kept on the device until :meth:`compute`.

    Args:
        names: Metric names and :class:`NamedMetric` s (:func:`resolve_metrics`).
        loss_fn: The trainer's loss (its per-sample form when it has one).
        device: The replica's device.
        kind: The task (:func:`target_kind`); None: decided from the first batch.
    """

    def __init__(self, names: Sequence[str | NamedMetric | Callable], loss_fn: Callable, device,
                 kind: str | None = None):
        self.metrics = tuple(normalize_metrics(list(names)) or ())
        self.names = tuple(str(m) for m in self.metrics)
        self.loss_fn = loss_fn
        self.sample_loss = per_sample_loss(loss_fn)
        self.device = device
        self.kind = kind
        # [loss_sum, n, then per summed metric: numerator (f1: tp, fp, fn; rmse/mae: error sum)]
        self._slots = ["loss", "n"]
        for m in self.names:
            if m == "f1":
                self._slots += ["tp", "fp", "fn"]
            elif m in _SUMS or _TOPK.fullmatch(m):
                self._slots.append(m)
        self._rows_for = tuple(m for m in self.metrics if str(m) not in self._slots
                               and str(m) != "f1")
        self.rows: list[torch.Tensor] = []
        self._layout: tuple[int, int, bool, bool] | None = None  # outputs, target cols, 1-D, int
        self._width = 1  # outputs per sample (rmse/mae average over every output)
        self.totals = runtime.to_device(torch.zeros(len(self._slots)), device)

    def update(self, outputs: torch.Tensor, targets: torch.Tensor, valid: torch.Tensor) -> None:
        """Add one batch. ``valid`` is bool[B]; invalid (padding) rows count for nothing."""
        w = valid.to(torch.float32)
        out = outputs.float()
        if self.kind is None:
            self.kind = target_kind(out, targets, self.loss_fn)
        if self.sample_loss is not None:
            per = self.sample_loss(out, targets).float()
            if per.dim() > 1:  # e.g. BCE with reduction='none' gives [B, C]
                per = per.flatten(1).mean(1)
            loss_sum = (per * w).sum()
        else:
            # Unknown loss: batch mean weighted by valid count (padding rows are
            # duplicates of real samples, so only the padded batch is approximate).
            loss_sum = self.loss_fn(out, targets).float() * w.sum()
        b = out.shape[0]
        o = out.reshape(b, -1)
        self._width = o.shape[1]
        p = activate_kind(o, self.kind)
        t = targets.reshape(b, -1).to(torch.float32)
        wm = w.unsqueeze(1)
        parts = [loss_sum, w.sum()]
        for m in self.names:
            if m == "f1":
                pred = (o > 0).to(torch.float32)  # sigmoid(x) > 0.5
                tt = (t > 0.5).to(torch.float32)
                parts += [(pred * tt * wm).sum(), (pred * (1 - tt) * wm).sum(),
                          ((1 - pred) * tt * wm).sum()]
            elif m in ("rmse", "mae"):
                d = p - t if t.shape == p.shape else p - t.reshape(p.shape)
                parts.append(((d * d if m == "rmse" else d.abs()) * wm).sum())
            elif m == "accuracy" and self.kind == "binary":
                hit = ((o[:, -1] > 0) == (t[:, 0] > 0.5)).to(torch.float32)
                parts.append((hit * w).sum())
            elif m == "accuracy" or _TOPK.fullmatch(m):
                k = 1 if m == "accuracy" else int(m[3:])
                k = min(k, o.shape[1])
                topk = o.topk(k, dim=1).indices
                hit = (topk == targets.view(-1, 1)).any(dim=1).to(torch.float32)
                parts.append((hit * w).sum())
        self.totals = self.totals + torch.stack(parts)
        if self._rows_for:
            if self._layout is None:
                self._layout = (p.shape[1], t.shape[1], targets.dim() == 1,
                                not targets.dtype.is_floating_point)
            self.rows.append(torch.cat([p, t, wm], dim=1))

    def compute(self) -> dict[str, float]:
        """All-reduce over replicas and read once: ``{"loss": .., "samples": .., metric: ..}``
        (whole-set metrics: gathered, computed on the master, the same on every replica)."""
        totals = runtime.all_reduce(self.totals)
        rows = None
        if self.rows:
            rows = gather_rows(torch.stack(self.rows), world_size=runtime.world_size(),
                               rank=runtime.rank(), dev=self.device)
        else:
            runtime.sync()
        vals = dict(zip(self._slots, totals.cpu().tolist()))
        n = max(vals["n"], 1.0)
        res = {"loss": vals["loss"] / n, "samples": int(round(vals["n"]))}
        host = self._host_values(rows) if self._rows_for else {}
        for m in self.names:
            if m == "f1":
                tp, fp, fn = vals["tp"], vals["fp"], vals["fn"]
                res["f1"] = 2 * tp / max(2 * tp + fp + fn, 1e-12)
            elif m == "rmse":
                res[m] = math.sqrt(vals[m] / (n * self._width))
            elif m == "mae":
                res[m] = vals[m] / (n * self._width)
            elif m in self._slots:
                res[m] = vals[m] / n
            else:
                res[m] = host[m]
        return res

    def _host_values(self, rows: np.ndarray | None) -> dict[str, float]:
        """The whole-set metrics of the gathered ``rows`` (master), shared with every rank."""
        values: dict[str, float] = {}
        error = ""
        if rows is not None:
            k, m, flat, integer = self._layout
            rows = rows[rows[:, -1] > 0.5]
            preds = rows[:, :k].astype(np.float64)
            targets = rows[:, k:k + m]
            targets = targets[:, 0] if flat else targets
            if integer:
                targets = np.rint(targets).astype(np.int64)
            for metric in self._rows_for:
                try:
                    values[str(metric)] = float(host_metric(metric, preds, targets, self.kind))
                except Exception as exc:  # every rank raises below, not the master alone
                    error = (f"metric {str(metric)!r} failed on the validation predictions "
                             f"({len(preds)} rows, preds {list(preds.shape)}, targets "
                             f"{targets.dtype}{list(targets.shape)}): {_summary(exc)}")
                    break
        if runtime.world_size() > 1:
            if runtime.all_reduce(1.0 if error else 0.0):
                raise RuntimeError(error or "a validation metric failed on the master replica")
            values = {str(m): runtime.all_reduce(values.get(str(m), 0.0) if rows is not None
                                                 else 0.0) for m in self._rows_for}
        elif error:
            raise RuntimeError(error)
        return values
