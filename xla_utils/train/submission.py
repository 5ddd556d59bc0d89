"""Kaggle submission files: :func:`write_submission`.

``write_submission(preds, test, "submission.csv", train=trainer)`` writes one row
per id of the competition's ``sample_submission.csv`` when one lies next to the test
folder the cache was built from (Kaggle's layout), in its order under its headers; else
one row per id of the test set, in its order, with the ids the cache recorded
(``CachedImageDataset.ids``). It never loses or invents a row: an image the cache
build skipped (a truncated file) has no prediction, and the write is refused,
naming it, unless ``missing="fill"`` says what to write for it. Single- or
multi-label comes from the training data (``train=``) or ``multilabel=``, never
from the predictions' scale. A regression model's outputs and a one-logit binary
model's probabilities are written as values under the sample's target column(s).
Needs neither torch nor torch_xla.
"""
from __future__ import annotations

import csv
import io
import os
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from ..utils.atomic import atomic_write
from ..cache.sources import IMAGE_EXTENSIONS

__all__ = ["write_submission", "competition_sample", "training_multilabel", "training_task",
           "missing_note"]

KINDS = ("label", "probabilities", "values")
SAMPLE_NAME = "sample_submission.csv"  # Kaggle's name, next to the test folder
MISSING = ("error", "fill")
SHOWN = 5  # ids named in a message


def write_submission(preds: Any, data: Any, path: str | os.PathLike, id_column: str | None = None,
                     label_column: str | None = None, classes: Sequence[str] | None = None,
                     kind: str | None = None, threshold: float = 0.5, overwrite: bool = False,
                     multilabel: bool | None = None, verbose: bool = True, *, train: Any = None,
                     sample: str | os.PathLike | None = "auto", missing: str = "error",
                     fill: str = "prior") -> Path:
    """Write a Kaggle submission CSV: one row per id of the test set, in its order.

    Args:
        preds: ``[N, C]`` predictions, e.g. ``trainer.predict(test, tta=2)`` (numpy
            array, torch tensor or nested list), one row per image of ``data`` (``[N]``:
            one column).
        data: the test set: a dataset with ``ids`` (a :class:`CachedImageDataset`),
            or the list of ids itself. Ids must be unique and ``N`` long. A cache
            also knows the ids its build skipped (``data.requested_ids``): their
            rows are missing (see ``missing``).
        path: the CSV to write (folders created; written atomically, so an interrupted
            or refused write never touches the existing file).
        id_column, label_column: headers of the id and label (or one value) columns.
            Default: the ``sample``'s first two, else ``"image_id"`` and ``"label"``
            (values: the regression cache's target name, else ``"target"``).
        classes: class names, ``C`` of them, in the model's output order. Default: the
            training data's (``train``), else ``data.classes`` when the test cache was
            built with ``classes=train.classes``.
        kind: ``"label"``: the argmax class name (single-label), the names of every class
            above ``threshold`` (multi-label; a one-logit binary model: its positive class
            or else the negative); ``"probabilities"``: one column per class (the format
            ``image_id,healthy,multiple_diseases,rust,scab``); ``"values"``: ``preds``'
            columns as numbers under the sample's target columns (``id,target``: regression,
            or a one-logit model's probabilities). Default None: ``"values"`` for
            regression (:func:`training_task`) and one column, else ``"label"``.
        threshold: multi-label decision threshold on probabilities. Default 0.5.
        overwrite: replace an existing ``path`` that is not a submission with the same
            header (default False: refused).
        multilabel: single- (False) or multi-label (True). Default None: from ``train``
            (its training data's ``multilabel``, or a trainer's ``BCEWithLogitsLoss``);
            without ``train``, rows that are probability distributions (softmax, summing
            to 1) are single-label and anything else is refused as ambiguous. Single-label
            rows get their argmax whatever their scale (raw outputs too); multi-label
            rows must be probabilities in [0, 1] (raw outputs are refused with the fix).
        verbose: print what was written (rows, columns, the first row) and the sample used.
        train: the :class:`~xla_utils.train.trainer.OneCycleTrainer` that made ``preds``, or its
            training dataset (e.g. the training cache): gives ``multilabel``, ``classes``
            and the class prior for ``fill="prior"``. Default None.
        sample: a CSV whose first column lists the ids to write, in order, under a header
            row (the competition's ``sample_submission.csv``): the file written has exactly
            its ids in its order and its headers. Ids match ``data``'s exactly or without an
            image extension; ids that differ are refused, the first differences shown.
            Default ``"auto"``: the ``sample_submission.csv`` next to the test cache's source
            folder (Kaggle's layout); ``None`` (or none there): the test set's own ids.
        missing: what to do with ids that have no prediction (images the cache build
            skipped, or ``sample`` ids absent from ``data``): ``"error"`` (default) refuses
            the write and names them; ``"fill"`` writes them with ``fill`` and says so.
        fill: the row of a missing id with ``missing="fill"``: ``"prior"`` (default) the
            training set's class prior (``kind="label"``: its most frequent class, or for
            multi-label the classes more frequent than ``threshold``; ``"probabilities"``:
            the class frequencies; ``"values"``: the targets' mean or positive rate), which
            needs ``train``; or class name(s), space separated for multi-label (a one-hot
            row of probabilities); or for ``"values"`` a number.

    Returns the path written.

    Raises:
        ValueError: ids missing (``missing="error"``), not unique or not matching ``preds``
            in number or (with ``sample``) in name; ``classes`` not matching the number of
            outputs; non-finite predictions; single/multi-label undecidable; multi-label or
            ``kind="probabilities"`` values outside [0, 1]. Nothing is written then.
        FileExistsError: ``path`` exists and is not a submission with this header.
    """
    _check_options(kind, missing, threshold)
    p, ids, seen = _checked_predictions(preds, data)
    task = training_task(train) if train is not None else None
    kind = _resolved_kind(kind, task, p)
    sample = _sample_path(sample, data, verbose)
    if kind == "values":
        return _write_values(p, task, data, ids, seen, sample, path, train, id_column,
                             label_column, overwrite, missing, fill, verbose)
    return _write_classes(p, task, data, ids, seen, sample, path, train, id_column, label_column,
                          classes, kind, threshold, overwrite, multilabel, missing, fill, verbose)


def _write_classes(p: np.ndarray, task: str | None, data: Any, ids: list[str],
                   seen: dict[str, int], sample: Any, path: str | os.PathLike, train: Any,
                   id_column: str | None, label_column: str | None,
                   classes: Sequence[str] | None, kind: str, threshold: float, overwrite: bool,
                   multilabel: bool | None, missing: str, fill: str, verbose: bool) -> Path:
    """``kind="label"`` or ``"probabilities"``: class names, or one column per class."""
    p, binary = _one_logit_columns(p, task, kind, train, data, classes)
    classes, multilabel, prior = _checked_classes(p, train, data, classes, multilabel)
    multilabel = False if binary else _check_values(p, kind, multilabel)
    wanted, order, head = _wanted_rows(data, ids, seen, sample)
    header = _header(kind, classes, head, id_column, label_column)
    gaps = [x for x, r in zip(wanted, order) if r is None]
    if gaps and missing == "error":
        raise ValueError(_missing_error(gaps, data, len(wanted), sample))
    filler = _fill_row(fill, classes, prior, multilabel, threshold, kind, gaps) if gaps else None
    rows = _rows(p, wanted, order, header, classes, kind, multilabel, threshold, filler, binary)
    path = _checked_path(path, header, overwrite)
    _write_atomic(path, header, rows)
    _say_written(path, header, rows, gaps, filler, kind, fill, threshold, verbose)
    return path


def training_task(train: Any) -> str | None:
    """The problem ``train`` (a trainer, or a training dataset) makes: a trainer's
    :attr:`~xla_utils.train.trainer.OneCycleTrainer.task` (``"regression"``, ``"binary"``:
    a one-logit model, ``"multiclass"``, ``"multilabel"``), a dataset's ``"regression"``
    (a regression cache) or ``"multilabel"``; None when it does not say."""
    task = getattr(train, "task", None)
    if isinstance(task, str) and task != "classification":
        return task
    if getattr(train, "multilabel", False):
        return "multilabel"
    return None


def _resolved_kind(kind: str | None, task: str | None, p: np.ndarray) -> str:
    """``kind``, or the default: values for regression and one column, else labels;
    class names for a regression model refused with the fix."""
    if kind is None:
        return "values" if task == "regression" or p.shape[1] == 1 else "label"
    if task == "regression" and kind != "values":
        raise ValueError(f"kind={kind!r}: these are a regression model's predictions (numbers, "
                         "not classes): write them with kind='values' (the default), under the "
                         "sample's target column(s)")
    return kind


def _one_logit_columns(p: np.ndarray, task: str | None, kind: str, train: Any, data: Any,
                       classes: Sequence[str] | None) -> tuple[np.ndarray, bool]:
    """A one-logit binary model's ``[N, 1]`` probabilities as the two classes' ``[N, 2]``
    (``kind="label"`` or ``"probabilities"`` with two class names), and whether they are."""
    if p.shape[1] != 1:
        return p, False
    tdata = getattr(train, "train_data", train) if train is not None else None
    names = classes if classes is not None else (getattr(tdata, "classes", None)
                                                 or getattr(data, "classes", None))
    if not names or len(names) != 2:
        return p, False
    lo, hi = float(p.min()), float(p.max())
    if lo < 0.0 or hi > 1.0:
        raise ValueError(f"a one-logit binary model's predictions must be probabilities in [0, 1]; "
                         f"these range {lo:.3g}..{hi:.3g} (raw outputs? predict with "
                         "activation='auto', the default, which applies the sigmoid)")
    return np.concatenate([1.0 - p, p], axis=1), True


def _write_values(p: np.ndarray, task: str | None, data: Any, ids: list[str], seen: dict[str, int],
                  sample: Any, path: str | os.PathLike, train: Any, id_column: str | None,
                  label_column: str | None, overwrite: bool, missing: str, fill: Any,
                  verbose: bool) -> Path:
    """``kind="values"``: ``p``'s columns as numbers under the sample's target columns."""
    if task == "binary":
        lo, hi = float(p.min()), float(p.max())
        if lo < 0.0 or hi > 1.0:
            raise ValueError(f"a one-logit binary model's predictions must be probabilities in [0, "
                             f"1]; these range {lo:.3g}..{hi:.3g} (raw outputs? predict with "
                             "activation='auto', the default, which applies the sigmoid)")
    wanted, order, head = _wanted_rows(data, ids, seen, sample)
    k = p.shape[1]
    if head is not None:
        if len(head) - 1 != k:
            raise ValueError(
                f"the sample's header {head[:6]} has {len(head) - 1} column(s) after the id but the "
                f"predictions have {k} column(s)"
                + (": a sample of id + one column per class wants kind='probabilities' (or "
                   "kind='label' for class names)" if k == 1 else
                   ": for a 2-class softmax model in a sample of id,target (e.g. an AUC "
                   "competition) write the positive class's column: write_submission(preds[:, 1:], "
                   "...)" if k == 2 and len(head) == 2 else ""))
        names = head[1:]
    else:
        tdata = getattr(train, "train_data", train) if train is not None else None
        found = getattr(tdata, "targets", None) if task == "regression" else None
        if k == 1:
            names = [label_column or (found[0] if isinstance(found, list) and found else "target")]
        else:
            names = list(found) if isinstance(found, list) and len(found) == k else \
                [f"target_{j}" for j in range(k)]
    header = [id_column or (head[0] if head else "image_id"), *names]
    gaps = [x for x, r in zip(wanted, order) if r is None]
    if gaps and missing == "error":
        raise ValueError(_missing_error(gaps, data, len(wanted), sample))
    filler = _fill_values(fill, train, k, gaps) if gaps else None
    rows = [[x] + [f"{v:.6g}" for v in (p[r] if r is not None else filler)]
            for x, r in zip(wanted, order)]
    path = _checked_path(path, header, overwrite)
    _write_atomic(path, header, rows)
    _say_written(path, header, rows, gaps, filler, "values", fill, 0.5, verbose)
    return path


def _fill_values(fill: Any, train: Any, k: int, gaps: list[str]) -> np.ndarray:
    """The values written for a missing id: the training targets' mean (``"prior"``) or ``fill``."""
    if fill == "prior":
        tdata = getattr(train, "train_data", train) if train is not None else None
        labels = getattr(tdata, "labels", None)
        if not isinstance(labels, np.ndarray) or not len(labels):
            raise ValueError(f"missing='fill' with fill='prior' needs the training targets for the "
                             f"{len(gaps)} missing row(s): pass train=trainer (or the training "
                             "cache), or fill=<number>. Nothing was written.")
        values = labels.astype(np.float64).reshape(len(labels), -1)
        if values.shape[1] != k:  # class indices of a one-logit binary model: its positive rate
            values = (labels.reshape(-1, 1) == 1).astype(np.float64)
        return values.mean(axis=0)
    try:
        return np.full(k, float(fill))
    except (TypeError, ValueError):
        raise ValueError(f"fill={fill!r}: values need a number (or 'prior'). Nothing was "
                         "written.") from None


def competition_sample(data: Any) -> Path | None:
    """The competition's ``sample_submission.csv`` beside the folder (or CSV) the test cache
    ``data`` was built from (its manifest's source), or None (none there, a source in a
    bucket or a Python dataset, or ``data`` is not a cache)."""
    source = (getattr(data, "manifest", None) or {}).get("source") or {}
    where = source.get("path")
    if source.get("kind") not in ("folder", "csv") or not where or "://" in str(where):
        return None
    found = Path(where).parent / SAMPLE_NAME
    return found if found.is_file() else None


def _sample_path(sample: Any, data: Any, verbose: bool) -> str | os.PathLike | None:
    """The sample to follow: ``sample`` itself, or for ``"auto"`` the competition's
    (:func:`competition_sample`), said when found; None: the test set's own ids."""
    if sample is None or sample is False:
        return None
    if isinstance(sample, str) and sample == "auto":
        found = competition_sample(data)
        if found is not None and verbose:
            print(f"write_submission: ids, order and header from {found} (the competition's sample "
                  "next to the test folder; sample=None writes the test set's own ids)", flush=True)
        return found
    return sample


def _header(kind: str, classes: list[str], head: list[str] | None, id_column: str | None,
            label_column: str | None) -> list[str]:
    """The CSV's header: the id column, then the label column or one column per class
    (in the sample's order when it has one)."""
    class_columns = _class_columns(kind, classes, head)
    id_column = id_column or (head[0] if head else "image_id")
    if kind == "probabilities":
        return [id_column] + class_columns
    return [id_column, label_column or (head[1] if head and len(head) > 1 else "label")]


def _check_options(kind: str | None, missing: str, threshold: float) -> None:
    if kind is not None and kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS} or None (decided from the task), got {kind!r}")
    if missing not in MISSING:
        raise ValueError(f"missing must be one of {MISSING}, got {missing!r}")
    if kind in ("label", None) and not 0.0 < threshold < 1.0:
        raise ValueError(f"threshold must be in (0, 1), got {threshold!r}")


def _checked_predictions(preds: Any, data: Any) -> tuple[np.ndarray, list[str], dict[str, int]]:
    """``(predictions [N, C], the test set's ids, id -> row)``; refuses a count mismatch
    and repeated ids."""
    p = _matrix(preds)
    ids = _ids(data)
    if len(ids) != len(p):
        raise ValueError(f"{len(p)} predictions for {len(ids)} ids: preds must come from the same "
                         "test set, in its order (trainer.predict(test) returns that)")
    seen: dict[str, int] = {}
    for i, x in enumerate(ids):
        if x in seen:
            raise ValueError(f"id {x!r} appears twice (rows {seen[x]} and {i}): ids must be unique")
        seen[x] = i
    return p, ids, seen


def _checked_classes(p: np.ndarray, train: Any, data: Any, classes: Sequence[str] | None,
                     multilabel: bool | None) -> tuple[list[str], bool | None, Any]:
    """:func:`_training_info`, with the class names checked against the outputs."""
    classes, multilabel, prior = _training_info(train, data, classes, multilabel)
    if len(classes) != p.shape[1]:
        raise ValueError(f"{len(classes)} classes {classes[:5]}{'...' if len(classes) > 5 else ''} but "
                         f"the predictions have {p.shape[1]} columns (model outputs): pass the "
                         "training cache's classes (classes=train.classes, or train=trainer)")
    if len(set(classes)) != len(classes):
        raise ValueError(f"class names must be unique, got {classes}")
    return classes, multilabel, prior


def _wanted_rows(data: Any, ids: list[str], seen: dict[str, int], sample: Any
                 ) -> tuple[list[str], list[int | None], list[str] | None]:
    """``(ids to write in order, the prediction row of each or None, the sample's header)``."""
    if sample is not None:
        wanted, head = _sample_ids(sample)
        return wanted, _match(wanted, seen, sample), head
    wanted = _requested(data, ids)
    return wanted, [seen.get(x) for x in wanted], None


def _rows(p: np.ndarray, wanted: list[str], order: list[int | None], header: list[str],
          classes: list[str], kind: str, multilabel: bool, threshold: float,
          filler: Any, binary: bool = False) -> list[list[str]]:
    """The CSV's rows under ``header``; a missing id's row is ``filler``."""
    if kind == "probabilities":
        cols = [classes.index(c) for c in header[1:]]
        return [[x] + [f"{v:.6g}" for v in (p[r] if r is not None else filler)[cols]]
                for x, r in zip(wanted, order)]
    if binary:  # a one-logit model: the positive class above threshold
        names = [classes[int(row[1] > threshold)] for row in p]
    elif multilabel:
        names = [" ".join(classes[j] for j in np.flatnonzero(row > threshold)) for row in p]
    else:
        names = [classes[j] for j in p.argmax(axis=1)]
    return [[x, names[r] if r is not None else filler] for x, r in zip(wanted, order)]


def _checked_path(path: str | os.PathLike, header: list[str], overwrite: bool) -> Path:
    """``path``, refused when it exists and is not a submission with ``header``."""
    path = Path(path).expanduser()
    if path.exists() and not overwrite:
        first = _first_line(path)
        if first != _csv_line(header):
            raise FileExistsError(
                f"{path} exists and is not a submission with the header {_csv_line(header)!r} "
                f"(its first line is {first[:80]!r}): pass overwrite=True to replace it, or choose "
                "another path")
    return path


def _say_written(path: Path, header: list[str], rows: list[list[str]], gaps: list[str],
                 filler: Any, kind: str, fill: str, threshold: float, verbose: bool) -> None:
    if gaps:
        what = filler if kind == "label" else "the row " + ", ".join(f"{v:.3g}" for v in filler)
        print(f"write_submission: filled {len(gaps)} missing row(s) with {what!r} (fill={fill!r}): "
              f"{_shown(gaps)}", flush=True)
    if verbose:
        empty = sum(1 for r in rows if not r[1]) if kind == "label" else 0
        msg = (f"wrote {path}: {len(rows):,} rows x {len(header)} columns ({', '.join(header[:6])}"
               f"{', ...' if len(header) > 6 else ''}); first row: {_csv_line(rows[0])}")
        if empty:
            msg += (f"\nwarning: {empty} row(s) have no class above threshold {threshold} "
                    "(an empty label); lower threshold= if the competition needs one")
        print(msg, flush=True)


def training_multilabel(train: Any) -> bool | None:
    """Whether ``train`` is multi-label: a trainer (its ``train_data.multilabel``, else its
    loss: ``BCEWithLogitsLoss`` or ``binary_cross_entropy_with_logits``) or a training
    dataset (its ``multilabel``). None when a dataset does not say."""
    data = getattr(train, "train_data", train)
    flag = getattr(data, "multilabel", None)
    if flag is not None:
        return bool(flag)
    if data is train:  # a dataset that does not say
        return None
    import torch  # a trainer: torch is loaded already

    loss = getattr(train, "loss", None)
    return isinstance(loss, torch.nn.BCEWithLogitsLoss) or \
        loss is torch.nn.functional.binary_cross_entropy_with_logits


def missing_note(data: Any, show: bool = False) -> str | None:
    """What ``trainer.predict(data)`` says (``show``: prints) about images of a cache that
    its build skipped: they get no prediction, and how to still write a full submission.
    None when every requested image is there (or ``data`` is not a cache)."""
    skipped = getattr(data, "skipped", None)
    if not skipped:
        return None
    total = len(data) + len(skipped)
    note = (f"predict: {len(skipped)} of the {total} images of {getattr(data, 'path', 'this cache')} "
            f"were skipped when the cache was built, so they get no prediction: "
            + "; ".join(f"{e['id']} ({e['reason']})" for e in skipped[:SHOWN])
            + (f"; ... and {len(skipped) - SHOWN} more" if len(skipped) > SHOWN else "")
            + ". write_submission refuses a submission without their rows: fix or replace those "
            "files and rebuild the cache (overwrite=True), or write them with a fallback: "
            "write_submission(..., train=trainer, missing='fill')")
    if show:
        print(note, flush=True)
    return note


def _matrix(preds: Any) -> np.ndarray:
    p = np.asarray(preds.detach().cpu().numpy() if hasattr(preds, "detach") else preds, dtype=np.float64)
    if p.ndim == 1:
        p = p[:, None]
    if p.ndim != 2:
        raise ValueError(f"preds must be [N, C] (one row per image), got shape {p.shape}")
    if not np.isfinite(p).all():
        bad = int(np.flatnonzero(~np.isfinite(p).all(axis=1))[0])
        raise ValueError(f"preds has non-finite values (first in row {bad}): the model diverged?")
    return p


def _training_info(train: Any, data: Any, classes: Sequence[str] | None,
                   multilabel: bool | None) -> tuple[list[str], bool | None, np.ndarray | None]:
    """``(classes, multilabel, class prior or None)`` from the arguments and the training data."""
    tdata = getattr(train, "train_data", train) if train is not None else None
    if classes is None:
        found = getattr(tdata, "classes", None) or getattr(data, "classes", None)
        if not found:
            raise ValueError("no class names: pass train=trainer (or the training cache), "
                             "classes=train.classes, or build the test cache with "
                             "classes=train.classes")
        classes = list(found)
    if multilabel is None and train is not None:
        multilabel = training_multilabel(train)
    prior = None
    labels = getattr(tdata, "labels", None)
    if isinstance(labels, np.ndarray) and len(labels):
        if labels.ndim == 2:
            prior = labels.astype(np.float64).mean(axis=0)
        elif (labels >= 0).any():
            prior = np.bincount(labels[labels >= 0], minlength=len(classes)) / (labels >= 0).sum()
    return [str(c) for c in classes], multilabel, prior


def _check_values(p: np.ndarray, kind: str, multilabel: bool | None) -> bool:
    """The single/multi-label decision, refusing values that cannot be what is written."""
    lo, hi = float(p.min()), float(p.max())
    probs = lo >= 0.0 and hi <= 1.0
    sums_to_one = bool(np.allclose(p.sum(axis=1), 1.0, atol=1e-3))
    fix = ("raw model outputs? predict with activation='auto' (the default), or apply "
           "a sigmoid/softmax yourself")
    if p.shape[1] == 1:
        multilabel = True  # one output: a binary decision at threshold
    if multilabel is None and probs and (sums_to_one or kind == "probabilities"):
        multilabel = not sums_to_one  # probabilities are written as they are
    if multilabel is None:
        raise ValueError(
            f"cannot tell whether these predictions are single- or multi-label (rows range "
            f"{lo:.3g}..{hi:.3g} and do not all sum to 1): pass train=trainer (or the training "
            "cache), or multilabel=False (argmax per row) / multilabel=True (probabilities "
            "above threshold)")
    if (multilabel or kind == "probabilities") and not probs:
        need = "multi-label predictions" if multilabel else "kind='probabilities'"
        raise ValueError(f"{need} must be probabilities in [0, 1]; these range {lo:.3g}..{hi:.3g} "
                         f"({fix})")
    if kind == "probabilities" and not multilabel and not sums_to_one:
        raise ValueError("kind='probabilities' of a single-label model: each row must sum to 1 "
                         f"(softmax); these do not ({fix})")
    return bool(multilabel)


def _ids(data: Any) -> list[str]:
    if isinstance(data, (list, tuple, np.ndarray)):
        return [str(x) for x in data]
    ids = getattr(data, "ids", None)
    if ids is None:
        raise TypeError(f"data must be a dataset with .ids (a CachedImageDataset) or a list of ids, "
                        f"got {type(data).__name__}")
    return [str(x) for x in ids]


def _requested(data: Any, ids: list[str]) -> list[str]:
    """Every id of the test set in its order: a cache's ``requested_ids`` (skipped ones
    included), else ``ids``."""
    wanted = getattr(data, "requested_ids", None)
    return ids if wanted is None else [str(x) for x in wanted]


def _sample_ids(sample: str | os.PathLike) -> tuple[list[str], list[str]]:
    """``(ids, header)`` of a sample submission: its first column below the header row."""
    path = Path(sample).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"sample={str(sample)!r} does not exist (the competition's "
                                "sample_submission.csv, a CSV whose first column lists the ids)")
    with open(path, newline="", encoding="utf-8-sig") as f:
        rows = [r for r in csv.reader(f) if r and any(c.strip() for c in r)]
    if len(rows) < 2:
        raise ValueError(f"{path} has no ids below its header row")
    ids = [r[0].strip() for r in rows[1:]]
    seen: set[str] = set()
    for x in ids:
        if x in seen:
            raise ValueError(f"{path} lists id {x!r} twice")
        seen.add(x)
    return ids, [c.strip() for c in rows[0]]


def _stem(x: str) -> str:
    head, dot, ext = x.rpartition(".")
    return head if dot and "." + ext.lower() in IMAGE_EXTENSIONS else x


def _match(wanted: list[str], seen: dict[str, int], sample: Any) -> list[int | None]:
    """The prediction row of each ``sample`` id (None: no prediction); refuses predictions
    whose ids the sample does not list."""
    stems: dict[str, int | None] = {}
    for x, r in seen.items():
        stems[_stem(x)] = None if _stem(x) in stems else r  # None: ambiguous
    order = [seen[x] if x in seen else stems.get(_stem(x)) for x in wanted]
    extra = set(seen.values()) - {r for r in order if r is not None}
    if extra:
        names = [x for x, r in seen.items() if r in extra]
        unmatched = [x for x, r in zip(wanted, order) if r is None]
        raise ValueError(
            f"the test set's ids do not match {sample}: {len(names)} prediction(s) have ids it "
            f"does not list ({_shown(names)})"
            + (f" and {len(unmatched)} of its ids have no prediction ({_shown(unmatched)})"
               if unmatched else "") + ". Nothing was written. Fix: predict the test set the "
            f"sample lists (build the test cache from the sample itself: build_cache("
            f"{str(sample)!r}, ..., unlabeled=True)), pass the right file as sample=, or "
            "sample=None to write the test set's own ids")
    return order


def _missing_error(gaps: list[str], data: Any, total: int, sample: Any) -> str:
    skipped = getattr(data, "skipped", None) or []
    reasons = {k: e["reason"] for e in skipped for k in (_stem(e["id"]), e["id"])}
    named = "; ".join(f"{x} ({'skipped at build: ' + reasons[x] if x in reasons else 'no prediction'})"
                      for x in gaps[:SHOWN]) + (f"; ... and {len(gaps) - SHOWN} more"
                                                if len(gaps) > SHOWN else "")
    where = str(sample) if sample is not None else "the test set"
    return (f"{len(gaps)} of the {total} ids of {where} have no prediction, so the submission "
            f"would have {total - len(gaps)} rows instead of {total} (Kaggle rejects it): {named}. "
            "Fix or replace those images and rebuild the test cache (build_cache(..., "
            "overwrite=True)), or write their rows with a fallback: missing='fill' (the training "
            "set's most frequent class, with train=trainer; or fill='<class name>'). Nothing "
            "was written.")


def _fill_row(fill: str, classes: list[str], prior: np.ndarray | None, multilabel: bool,
              threshold: float, kind: str, gaps: list[str]) -> Any:
    """The label (``kind="label"``) or probability row written for a missing id."""
    if fill == "prior":
        if prior is None:
            raise ValueError(f"missing='fill' with fill='prior' needs the training labels for "
                             f"the {len(gaps)} missing row(s): pass train=trainer (or the training "
                             "cache), or fill='<class name>'. Nothing was written.")
        row = prior
    else:
        names = str(fill).split() if multilabel else [str(fill)]
        unknown = [n for n in names if n not in classes]
        if unknown or not names:
            raise ValueError(f"fill={fill!r}: {unknown or names} not among the classes {classes[:10]}"
                             f"{'...' if len(classes) > 10 else ''}; use 'prior' or a class name")
        row = np.zeros(len(classes))
        row[[classes.index(n) for n in names]] = 1.0
    if kind == "probabilities":
        return np.asarray(row, dtype=np.float64)
    if multilabel:
        return " ".join(classes[j] for j in np.flatnonzero(row > threshold))
    return classes[int(np.argmax(row))]


def _class_columns(kind: str, classes: list[str], header: list[str] | None) -> list[str]:
    """``kind="probabilities"``: the class columns, in the sample's order when it has one.
    Refuses a sample whose layout is not ``kind``'s (id + label, or id + one column per class)."""
    if header is not None and len(header) > 2 and kind == "label":
        raise ValueError(f"the sample has {len(header)} columns ({', '.join(header[:4])}...): one "
                         "per class, so write kind='probabilities'")
    if kind == "label":
        return []
    if header is None:
        return list(classes)
    if sorted(header[1:]) != sorted(classes):
        advice = "pass the training cache's classes (train=trainer)"
        if len(header) == 2 and len(classes) == 2:
            advice = (f"a sample of one column {header[1]!r}: for the positive class's probability "
                      "(e.g. an AUC competition) write kind='values' with preds[:, 1:] (a 2-output "
                      "softmax model) or a one-output model's predictions; kind='label' writes "
                      "class names")
        elif len(header) == 2:
            advice = "a sample of id,label rows: write kind='label'"
        raise ValueError(f"the sample's columns after the id {header[1:6]} are not the classes "
                         f"{classes[:5]}: " + advice)
    return header[1:]


def _shown(ids: list[str]) -> str:
    return ", ".join(ids[:SHOWN]) + (f" and {len(ids) - SHOWN} more" if len(ids) > SHOWN else "")


def _write_atomic(path: Path, header: list[str], rows: list[list[str]]) -> None:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(header)
    w.writerows(rows)
    atomic_write(path, buf.getvalue())


def _csv_line(cells: Sequence[str]) -> str:
    buf = io.StringIO()
    csv.writer(buf, lineterminator="").writerow(cells)
    return buf.getvalue()


def _first_line(path: Path) -> str:
    try:
        with open(path, encoding="utf-8", newline="") as f:
            return f.readline().rstrip("\r\n")
    except (OSError, UnicodeDecodeError):
        return "<unreadable>"
