"""Splits of one cache: :func:`split` (training / validation) and k-fold :func:`cross_validate`.

``train, val = split(data, val_fraction=0.2)`` is a stratified, seeded hold-out split:
two :class:`CacheSubset` views of the same cache, no image copied.

``cross_validate(make_trainer, data, folds=5, test=test)`` splits ``data`` into
(stratified) folds, and for each fold builds a trainer on the other folds with the
fold as validation data, trains it, predicts the fold (out-of-fold, OOF) and the test
set. The folds are views of the same cache (:class:`CacheSubset`: index arrays over
the same memory maps, no image is copied). With ``folder=`` every finished fold is
written there (``fold_<k>.npz``, atomically) and a rerun after a crash starts at
the first unfinished fold.
"""
from __future__ import annotations

import hashlib
import inspect
import json
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from ..utils.atomic import atomic_write, atomic_writer
from ..data import CachedImageDataset
from .metrics import host_metric, metric_keys, resolve_metrics, target_kind

if TYPE_CHECKING:
    from .history import History
    from .trainer import OneCycleTrainer

__all__ = ["CacheSubset", "CVResult", "cross_validate", "fold_assignment", "split", "subset"]


class CacheSubset(CachedImageDataset):
    """Images ``indices`` of a :class:`~xla_utils.data.CachedImageDataset`, in that
    order: the same memory maps, remapped index arrays (no image copied). It is a
    ``CachedImageDataset`` for the trainer (ring-buffer loading, variants, TTA)."""

    def __init__(self, parent: CachedImageDataset, indices: Any):  # noqa: D107 (no super().__init__)
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        if isinstance(parent, CacheSubset):
            parent, idx = parent._parent, parent._indices[idx]
        if idx.size and (idx.min() < 0 or idx.max() >= len(parent)):
            raise IndexError(f"subset indices out of range for {len(parent)} images")
        self.__dict__.update(parent.__dict__)
        self._parent, self._indices = parent, idx
        self._shard_of, self._local = parent._shard_of[idx], parent._local[idx]
        self.labels = parent.labels[idx]
        self.source_indices = parent.source_indices[idx]
        self._n = int(idx.size)
        self._ids = None
        self._rings, self._rings_lock = {}, threading.Lock()

    @property
    def indices(self) -> np.ndarray:
        """``int64[n]``: each image's index in the parent dataset."""
        return self._indices.copy()

    @property
    def ids(self) -> list[str]:
        """The parent's ids of these images (see :attr:`CachedImageDataset.ids`)."""
        if self._ids is None:
            ids = self._parent.ids
            self._ids = [ids[i] for i in self._indices.tolist()]
        return list(self._ids)

    @property
    def skipped(self) -> list[dict[str, Any]]:
        """None: a subset holds the images it was given (its parent's ``skipped`` are the build's)."""
        return []

    @property
    def requested_ids(self) -> list[str]:
        """The subset's :attr:`ids` (it holds every image it was asked for)."""
        return self.ids

    def __repr__(self) -> str:
        return f"CacheSubset({len(self)} of {self._parent!r})"

    def __getstate__(self) -> dict[str, Any]:
        return {"parent": self._parent, "indices": self._indices, "epoch": self.epoch}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["parent"], state["indices"])
        self.epoch = state["epoch"]


def subset(data: Any, indices: Any) -> Any:
    """``data[indices]`` as a dataset: a :class:`CacheSubset` of a cache, else a
    ``torch.utils.data.Subset``."""
    if isinstance(data, CachedImageDataset):
        return CacheSubset(data, indices)
    import torch.utils.data

    return torch.utils.data.Subset(data, np.asarray(indices, dtype=np.int64).tolist())


def _labels(data: Any) -> np.ndarray:
    """The labels of ``data`` in order: ``data.labels``, a ``TensorDataset``'s
    second tensor, else read sample by sample."""
    if isinstance(getattr(data, "labels", None), np.ndarray):
        return np.asarray(data.labels)
    tensors = getattr(data, "tensors", None)
    if tensors is not None and len(tensors) >= 2:
        return tensors[1].numpy()
    return np.asarray([np.asarray(data[i][1]) for i in range(len(data))])


def fold_assignment(labels: np.ndarray, folds: int, stratify: bool = True, seed: int = 0) -> np.ndarray:
    """``int64[N]``: the fold of each item. Stratified (single-label ``int`` labels):
    each class's items are shuffled and dealt round-robin from a running offset, so
    every fold gets each class's share (+-1) and fold sizes differ by at most one.
    One regression target (float ``[N]`` or ``[N, 1]``): sorted by value and dealt in
    blocks of ``folds`` (ties and blocks shuffled), so every fold spans the whole range.
    Otherwise (``stratify=False``, multi-label or several targets): a shuffled split."""
    n = len(labels)
    rng = np.random.default_rng(seed)
    out = np.empty(n, dtype=np.int64)
    if stratify and labels.dtype.kind == "f" and labels.reshape(n, -1).shape[1] == 1:
        order = np.lexsort((rng.random(n), labels.reshape(n)))  # by value, ties at random
        for start in range(0, n, folds):
            block = order[start:start + folds]
            out[block] = rng.permutation(folds)[:len(block)]
        return out
    if stratify and labels.ndim == 1 and np.issubdtype(labels.dtype, np.integer):
        start = 0
        for c in np.unique(labels):
            members = rng.permutation(np.flatnonzero(labels == c))
            out[members] = (start + np.arange(len(members))) % folds
            start = (start + len(members)) % folds
        return out
    out[rng.permutation(n)] = np.arange(n) % folds
    return out


def split(data: Any, val_fraction: float = 0.2, seed: int = 0,
          stratify: bool = True) -> tuple[Any, Any]:
    """A training / validation split of one labelled dataset, in one call.

    ``train, val = xla_utils.split(CachedImageDataset("cache/train"), 0.2)`` for the usual
    Kaggle layout of one training folder. Both are views of ``data`` in its order
    (:class:`CacheSubset` for a cache: the same memory maps, no image copied; else a
    ``torch.utils.data.Subset``), so they go straight to ``OneCycleTrainer(model, loss,
    train, val)``. The same ``data``, ``val_fraction`` and ``seed`` give the same split.
    Validation images come from the same cache as training ones: with ``variants > 1``
    they are its stored random crops (epoch ``e`` shows variant ``e % variants``).

    Args:
        data: A labelled cache or any map-style ``(x, y)`` dataset.
        val_fraction: Share of the items held out for validation, in (0, 1); rounded to
            a whole number of items (at least one on each side). Default 0.2.
        seed: Seeds the choice. Default 0.
        stratify: Hold out each class's share (single-label ``int`` labels; largest
            remainders, and never a class's only image): class frequencies match in both
            parts. Ignored (a plain random choice) for multi-label or float targets.
            Default True.

    Returns:
        ``(train, val)``.

    Raises:
        ValueError: ``val_fraction`` outside (0, 1), fewer than 2 items, or unlabelled data.
    """
    if isinstance(val_fraction, bool) or not isinstance(val_fraction, (int, float)) \
            or not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction must be a number in (0, 1), the share held out for "
                         f"validation (e.g. 0.2), got {val_fraction!r}")
    if getattr(data, "unlabeled", False):
        raise ValueError("split needs labelled data: this cache was built with unlabeled=True "
                         "(a test set)")
    if data is None or len(data) < 2:
        raise ValueError(f"split needs at least 2 items, got {0 if data is None else len(data)}")
    labels = _labels(data)
    n = len(labels)
    n_val = min(n - 1, max(1, round(val_fraction * n)))
    rng = np.random.default_rng(seed)
    quota = None
    if stratify and labels.ndim == 1 and np.issubdtype(labels.dtype, np.integer):
        classes, counts = np.unique(labels, return_counts=True)
        quota = _class_quotas(counts, n_val, rng)
    if quota is not None and quota.sum():
        val_idx = np.concatenate([rng.permutation(np.flatnonzero(labels == c))[:q]
                                  for c, q in zip(classes, quota)])
    else:  # not stratified, or only classes of one image each
        val_idx = rng.permutation(n)[:n_val]
    held = np.zeros(n, dtype=bool)
    held[val_idx] = True
    return subset(data, np.flatnonzero(~held)), subset(data, np.flatnonzero(held))


def _class_quotas(counts: np.ndarray, n_val: int, rng: np.random.Generator) -> np.ndarray:
    """Validation items per class: ``n_val`` shared in proportion to ``counts`` by largest
    remainders (ties at random), never a class's last training item."""
    exact = counts * n_val / counts.sum()
    cap = counts - 1
    quota = np.minimum(np.floor(exact).astype(np.int64), cap)
    order = rng.permutation(len(counts))
    order = order[np.argsort(-(exact - quota)[order], kind="stable")]
    while quota.sum() < n_val and (quota < cap).any():
        for c in order:
            if quota.sum() < n_val and quota[c] < cap[c]:
                quota[c] += 1
    return quota


@dataclass
class CVResult:
    """What :func:`cross_validate` returns.

    Attributes:
        folds: Per fold: ``fold``, ``n_train``, ``n_val``, the validation record of
            the epoch whose weights predicted (the best epoch with ``monitor=``, else
            the last: ``val_loss``, ``accuracy``, ...), ``score`` (the fold's OOF score)
            and ``stop_reason``.
        oof: ``float32[N, C]`` out-of-fold predictions in dataset order (each row from
            the one model that did not train on it; activation as ``predict``'s).
        fold_of: ``int64[N]``: each item's fold.
        oof_score: The score of ``oof`` against the labels: ``metric``'s (RMSE for regression
            targets by default, where lower is better).
        test: ``float32[M, C]``: the mean of the folds' test predictions (ready for
            :func:`xla_utils.write_submission`), or None without ``test``.
        test_folds: ``float32[k, M, C]``: each fold's own test predictions, or None.
        histories: Each fold's History (None for folds loaded from ``folder``).
        folder: Where the folds were persisted, or None.
        metric: What ``score`` and ``oof_score`` are: the trainer's ``monitor`` when it is a
            validation metric, else its first metric (the task's defaults when none are
            configured: accuracy, F1 multi-label, AUC... see
            :func:`xla_utils.train.metrics.resolve_metrics`), or ``"score"`` for a
            ``score=`` function.
        oof_metrics: Every validation metric of the trainer on ``oof`` (computed by the
            functions the trainer's validation uses; empty with ``score=``).
    """

    folds: list[dict[str, Any]]
    oof: np.ndarray
    fold_of: np.ndarray
    oof_score: float
    test: np.ndarray | None = None
    test_folds: np.ndarray | None = None
    histories: list[Any] = field(default_factory=list, repr=False)
    folder: Path | None = None
    metric: str = "score"
    oof_metrics: dict[str, float] = field(default_factory=dict)

    def __str__(self) -> str:
        rows = [f"fold {f['fold']}: {f['n_train']} train / {f['n_val']} val, {self.metric} "
                f"{f['score']:.4f}" for f in self.folds]
        mean = np.mean([f["score"] for f in self.folds])
        others = ", ".join(f"{k} {v:.4f}" for k, v in self.oof_metrics.items() if k != self.metric)
        return "\n".join(rows + [f"OOF {self.metric} {self.oof_score:.4f} (mean of folds "
                                  f"{mean:.4f})" + (f"; {others}" if others else "")])


class _TrainerScore:
    """The OOF score by the trainer's own validation metrics: its ``monitor`` when that is a
    metric, else its first (:func:`xla_utils.train.metrics.resolve_metrics`), on predictions
    as ``predict`` gives them and the labels as the dataset holds them."""

    def __init__(self, trainer: "OneCycleTrainer", labels: np.ndarray, preds: np.ndarray):
        cfg = trainer.config
        self.kind = target_kind(preds, labels, trainer.loss)
        self.metrics = resolve_metrics(cfg.metrics, self.kind, preds.shape[1])
        names = [str(m) for m in self.metrics]
        monitor = cfg.monitor
        self.name = monitor if monitor in names else (names[0] if names else "score")

    def __call__(self, labels: np.ndarray, preds: np.ndarray) -> float:
        return self.all(labels, preds)[self.name]

    def all(self, labels: np.ndarray, preds: np.ndarray) -> dict[str, float]:
        """Every metric of ``preds`` (rows without a prediction, NaN, are left out)."""
        ok = ~np.isnan(preds).any(axis=1)
        return {str(m): host_metric(m, preds[ok], labels[ok], self.kind) for m in self.metrics}


def cross_validate(make_trainer: Callable[..., "OneCycleTrainer"], data: Any, folds: int = 5,
                   test: Any = None, stratify: bool = True, seed: int = 0, *,
                   folder: str | os.PathLike | None = None, tta: int = 1,
                   train: Callable[["OneCycleTrainer"], "History"] | None = None,
                   cores: int | str = "all", simulate: int | None = None,
                   score: Callable[[np.ndarray, np.ndarray], float] | None = None) -> CVResult:
    """K-fold cross-validation: one cache, ``folds`` fits, OOF and fold-averaged test predictions.

    Args:
        make_trainer: ``make_trainer(train_data, val_data)`` (or ``(train_data, val_data,
            fold)``) -> a fresh :class:`~xla_utils.train.trainer.OneCycleTrainer` (a new
            model each call, e.g. from a factory or pretrained weights).
        data: The labelled training set: a cache (folds are :class:`CacheSubset` views)
            or any map-style ``(x, y)`` dataset (``torch.utils.data.Subset``).
        folds: Number of folds k (>= 2). Default 5.
        test: An unlabelled test set to predict with every fold's model; default None.
        stratify: Keep each class's share (``int`` labels) or one regression target's
            spread (see :func:`fold_assignment`) in every fold. Default True.
        seed: Seeds the fold assignment. Default 0.
        folder: Persist each finished fold there (``cv.json`` + ``fold_<k>.npz``); a
            rerun with the same split skips finished folds (resume after a crash).
            Default None: nothing written, no resume.
        tta: Views per image for the OOF and test predictions (``predict``'s). Default 1.
        train: ``train(trainer) -> History``; default ``trainer.fit(cores=cores,
            simulate=simulate)``. Pass e.g. ``lambda t: t.fine_tune(3, simulate=8)``.
        cores, simulate: For the default ``train`` and for ``predict``.
        score: ``score(labels, preds) -> float``; default the trainer's validation metric
            as fit computes it: its ``monitor`` when that is a metric, else its first (the
            task's default: accuracy, micro F1 multi-label, ...); see ``CVResult.metric``.

    Returns:
        The :class:`CVResult`.

    Raises:
        ValueError: ``folds`` < 2 or more than the items, unlabelled data, or a
            ``folder`` holding another split (the message says which and the fix).
    """
    _check_folds(data, folds)
    labels = _labels(data)
    fold_of = fold_assignment(labels, folds, stratify, seed)
    store = _FoldStore(folder, fold_of, folds, seed, stratify) if folder is not None else None
    run = train or (lambda t: t.fit(cores=cores, simulate=simulate))
    scoring = _Scoring(score)
    n_args = _positional_count(make_trainer)
    oof, test_folds, records, histories = None, [], [], []
    for k in range(folds):
        done = store.load(k) if store is not None else None
        if done is None:
            val_idx, train_idx = np.flatnonzero(fold_of == k), np.flatnonzero(fold_of != k)
            args = (subset(data, train_idx), subset(data, val_idx)) + ((k,) if n_args >= 3 else ())
            trainer, history, pred, tpred = _train_fold(
                make_trainer(*args), run, args[1], test, dict(tta=tta, cores=cores, simulate=simulate),
                finished=lambda h: _refuse_paused(k, h, store))
            done = (val_idx, pred, tpred, _fold_record(k, train_idx, val_idx, history,
                                                       scoring.fold(trainer, labels[val_idx], pred)))
            if store is not None:
                store.save(k, *done)
            histories.append(history)
        else:
            histories.append(None)
        val_idx, pred, tpred, rec = done
        if oof is None:
            oof = np.full((len(data), pred.shape[1]), np.nan, dtype=np.float32)
        oof[val_idx] = pred
        records.append(rec)
        if tpred is not None:
            test_folds.append(tpred.astype(np.float32))
    tf = np.stack(test_folds) if test_folds else None
    oof_score, name, every = scoring.oof(labels, oof, lambda: _scorer_of_fold0(
        make_trainer, n_args, data, labels, fold_of, oof))
    return CVResult(folds=records, oof=oof, fold_of=fold_of, oof_score=oof_score,
                    test=None if tf is None else tf.mean(0), test_folds=tf, histories=histories,
                    folder=None if store is None else store.folder, metric=name,
                    oof_metrics=every)


def _check_folds(data: Any, folds: Any) -> None:
    """Refuse a fold count that is no int >= 2 or above the items, and unlabelled data."""
    if isinstance(folds, bool) or not isinstance(folds, int) or folds < 2:
        raise ValueError(f"folds must be an int >= 2, got {folds!r}")
    if data is None or len(data) < folds:
        raise ValueError(f"cross_validate needs at least folds={folds} items, got "
                         f"{0 if data is None else len(data)}")
    if getattr(data, "unlabeled", False):
        raise ValueError("cross_validate needs labelled data; this cache was built with "
                         "unlabeled=True (pass it as test= instead)")


def _train_fold(trainer: "OneCycleTrainer", run: Callable, val: Any, test: Any,
                predict: dict[str, Any], finished: Callable[[Any], None]
                ) -> tuple[Any, Any, np.ndarray, np.ndarray | None]:
    """``(trainer, history, validation predictions, test predictions or None)`` of one fold
    (``finished(history)`` refuses a fold whose fit did not finish, before any prediction)."""
    history = run(trainer)
    finished(history)
    pred = np.asarray(trainer.predict(val, **predict))
    return trainer, history, pred, None if test is None else np.asarray(trainer.predict(test, **predict))


class _Scoring:
    """The folds' and the OOF score: ``score=`` when given, else the trainer's metrics
    (:class:`_TrainerScore`, read from the first trainer)."""

    def __init__(self, score: Callable[[np.ndarray, np.ndarray], float] | None):
        self.score, self.metrics = score, None

    def fold(self, trainer: "OneCycleTrainer", labels: np.ndarray, pred: np.ndarray) -> float:
        if self.score is not None:
            return float(self.score(labels, pred))
        if self.metrics is None:
            self.metrics = _TrainerScore(trainer, labels, pred)
        return self.metrics(labels, pred)

    def oof(self, labels: np.ndarray, oof: np.ndarray, first: Callable[[], _TrainerScore]
            ) -> tuple[float, str, dict[str, float]]:
        """``(score, its name, every metric)`` of the OOF rows (``first()``: the metrics when
        no fold was trained in this call)."""
        if self.score is not None:
            return float(self.score(labels, oof)), "score", {}
        self.metrics = self.metrics or first()
        every = self.metrics.all(labels, oof)
        return float(every[self.metrics.name]), self.metrics.name, every


def _scorer_of_fold0(make_trainer: Callable, n_args: int, data: Any, labels: np.ndarray,
                     fold_of: np.ndarray, oof: np.ndarray) -> _TrainerScore:
    """The OOF score of a run whose folds all came from ``folder=``: fold 0's trainer (built,
    not trained) says which metric."""
    k0 = np.flatnonzero(fold_of == 0)
    args = (subset(data, np.flatnonzero(fold_of != 0)), subset(data, k0))
    trainer = make_trainer(*args, *((0,) if n_args >= 3 else ()))
    return _TrainerScore(trainer, labels[k0], oof[k0])


def _positional_count(fn: Callable) -> int:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return 2
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        return 3
    return sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params)


def _refuse_paused(k: int, history: Any, store: Any) -> None:
    """A fold whose fit paused (``fit(time_limit=...)``: its checkpoint holds the rest) is not
    finished: cross-validation stops there, saying how to go on.

    Raises:
        RuntimeError: the fold's fit stopped with a checkpoint to resume from.
    """
    reason = getattr(history, "stop_reason", None) or ""
    if not reason.endswith('fit(resume="last") continues'):
        return
    kept = (f"the finished folds are kept in {store.folder}" if store is not None else
            "pass folder=... to keep finished folds across runs")
    raise RuntimeError(f"cross_validate: fold {k}'s fit {reason.split(';')[0]}, so the fold is "
                       f"not finished; {kept}. To go on: run cross_validate again with the same "
                       "folder and a train= that resumes the fold, e.g. train=lambda t: "
                       "t.fit(resume='last', time_limit='auto') with a checkpoint_dir per fold")


def _fold_record(k: int, train_idx: np.ndarray, val_idx: np.ndarray, history: Any,
                 fold_score: float) -> dict[str, Any]:
    """The per-fold summary: sizes, the predicting epoch's validation values, score."""
    rec: dict[str, Any] = {"fold": k, "n_train": int(train_idx.size), "n_val": int(val_idx.size)}
    epochs = getattr(history, "epochs", None) or []
    if epochs:
        best = getattr(history, "best_epoch", None)
        e = next((r for r in epochs if r.get("epoch") == best), epochs[-1])
        rec["epoch"] = e.get("epoch")
        rec.update({key: e[key] for key in ["val_loss"] * ("val_loss" in e) + metric_keys(e)})
    rec["score"] = float(fold_score)
    rec["stop_reason"] = getattr(history, "stop_reason", None)
    return rec


class _FoldStore:
    """``folder/cv.json`` (the split's fingerprint) and ``fold_<k>.npz`` per finished fold."""

    def __init__(self, folder: str | os.PathLike, fold_of: np.ndarray, folds: int, seed: int,
                 stratify: bool):
        self.folder = Path(folder).expanduser()
        self.folder.mkdir(parents=True, exist_ok=True)
        meta = {"folds": folds, "items": int(len(fold_of)), "seed": seed, "stratify": stratify,
                "split_sha1": hashlib.sha1(fold_of.tobytes()).hexdigest()}
        path = self.folder / "cv.json"
        if path.exists():
            old = json.loads(path.read_text())
            if old != meta:
                diff = {k: (old.get(k), v) for k, v in meta.items() if old.get(k) != v}
                raise ValueError(f"{path} belongs to another split (was, now: {diff}): use another "
                                 "folder=, or delete that folder to start over")
        else:
            atomic_write(path, json.dumps(meta, indent=1))

    def load(self, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, dict] | None:
        path = self.folder / f"fold_{k}.npz"
        if not path.exists():
            return None
        with np.load(path, allow_pickle=False) as z:
            tpred = z["test"] if "test" in z.files else None
            return z["val_idx"], z["oof"], tpred, json.loads(str(z["record"]))

    def save(self, k: int, val_idx: np.ndarray, pred: np.ndarray, tpred: np.ndarray | None,
             rec: dict[str, Any]) -> None:
        arrays = {"val_idx": val_idx, "oof": pred.astype(np.float32),
                  "record": np.asarray(json.dumps(rec))}
        if tpred is not None:
            arrays["test"] = tpred.astype(np.float32)
        with atomic_writer(self.folder / f"fold_{k}.npz") as f:
            np.savez(f, **arrays)

