"""Kaggle submission files: :func:`write_submission`.

``write_submission(preds, test, "submission.csv", classes=train.classes)`` writes
one row per test image, in the test set's order, with the ids the cache recorded
(``CachedImageDataset.ids``). Needs neither torch nor torch_xla.
"""
from __future__ import annotations

import csv
import io
import os
from pathlib import Path
from typing import Any, Sequence

import numpy as np

__all__ = ["write_submission"]

KINDS = ("label", "probabilities")


def write_submission(preds: Any, data: Any, path: str | os.PathLike, id_column: str = "image_id",
                     label_column: str = "label", classes: Sequence[str] | None = None,
                     kind: str = "label", threshold: float = 0.5, overwrite: bool = False,
                     multilabel: bool | None = None, verbose: bool = True) -> Path:
    """Write a Kaggle submission CSV: one row per image of ``data``, in its order.

    Args:
        preds: ``[N, C]`` predictions, e.g. ``trainer.predict(test, tta=2)`` (numpy
            array, torch tensor or nested list).
        data: the test set: a dataset with ``ids`` (a :class:`CachedImageDataset`),
            or the list of ids itself. Ids must be unique and ``N`` long.
        path: the CSV to write (parent folders are created; written to a temporary
            file and renamed, so an interrupted write never leaves half a file).
        id_column: header of the id column. Default ``"image_id"``.
        label_column: header of the label column for ``kind="label"``. Default ``"label"``.
        classes: class names, ``C`` of them, in the model's output order, e.g.
            ``train.classes`` (the training cache's). Default: ``data.classes`` when
            ``data`` is a cache that has classes (a test cache built with
            ``classes=train.classes``); otherwise ``classes=`` is required.
        kind: ``"label"`` (default): the argmax class name (single-label) or the
            space-separated names of every class above ``threshold`` (multi-label);
            ``"probabilities"``: one column per class holding ``preds`` (the
            plant-pathology format ``image_id,healthy,multiple_diseases,rust,scab``).
        threshold: multi-label decision threshold on probabilities. Default 0.5.
        overwrite: replace an existing ``path`` that is not a submission of the same
            layout (same header). Default False: such a file is refused.
        multilabel: for ``kind="label"``: None (default) infers it: rows that sum to 1
            (softmax) are single-label, anything else (sigmoid) multi-label.
        verbose: print what was written (rows, columns, the first row).

    Returns:
        The path written.

    Raises:
        ValueError: ids not unique or not matching ``preds`` in number, ``classes``
            not matching the number of outputs, non-finite predictions.
        FileExistsError: ``path`` exists and is not a submission with this header.
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    p = np.asarray(preds.detach().cpu().numpy() if hasattr(preds, "detach") else preds, dtype=np.float64)
    if p.ndim == 1:
        p = p[:, None]
    if p.ndim != 2:
        raise ValueError(f"preds must be [N, C] (one row per image), got shape {p.shape}")
    if not np.isfinite(p).all():
        bad = int(np.flatnonzero(~np.isfinite(p).all(axis=1))[0])
        raise ValueError(f"preds has non-finite values (first in row {bad}): the model diverged?")
    ids = _ids(data)
    if len(ids) != len(p):
        raise ValueError(f"{len(p)} predictions for {len(ids)} ids: preds must come from the same "
                         "test set, in its order (trainer.predict(test) returns that)")
    seen: dict[str, int] = {}
    for i, x in enumerate(ids):
        if x in seen:
            raise ValueError(f"id {x!r} appears twice (rows {seen[x]} and {i}): ids must be unique")
        seen[x] = i
    if classes is None:
        found = getattr(data, "classes", None)
        if found:
            classes = list(found)
        else:
            raise ValueError("no class names: pass classes=train.classes (the training cache's), "
                             "or build the test cache with classes=train.classes")
    classes = [str(c) for c in classes]
    if len(classes) != p.shape[1]:
        raise ValueError(f"{len(classes)} classes {classes[:5]}{'...' if len(classes) > 5 else ''} but "
                         f"the predictions have {p.shape[1]} columns (model outputs): pass the "
                         "training cache's classes (classes=train.classes)")
    if len(set(classes)) != len(classes):
        raise ValueError(f"class names must be unique, got {classes}")
    if kind == "probabilities":
        header = [id_column] + classes
        rows = [[x] + [f"{v:.6g}" for v in row] for x, row in zip(ids, p)]
        empty = 0
    else:
        if not 0.0 < threshold < 1.0:
            raise ValueError(f"threshold must be in (0, 1), got {threshold!r}")
        if multilabel is None:
            multilabel = p.shape[1] == 1 or not np.allclose(p.sum(axis=1), 1.0, atol=1e-3)
        header = [id_column, label_column]
        if multilabel:
            names = [" ".join(classes[j] for j in np.flatnonzero(row > threshold)) for row in p]
        else:
            names = [classes[j] for j in p.argmax(axis=1)]
        rows = [[x, n] for x, n in zip(ids, names)]
        empty = sum(1 for n in names if not n)
    path = Path(path).expanduser()
    if path.exists() and not overwrite:
        first = _first_line(path)
        if first != _csv_line(header):
            raise FileExistsError(
                f"{path} exists and is not a submission with the header {_csv_line(header)!r} "
                f"(its first line is {first[:80]!r}): pass overwrite=True to replace it, or choose "
                "another path")
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(header)
    w.writerows(rows)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(buf.getvalue(), encoding="utf-8")
    os.replace(tmp, path)
    if verbose:
        msg = (f"wrote {path}: {len(rows):,} rows x {len(header)} columns ({', '.join(header[:6])}"
               f"{', ...' if len(header) > 6 else ''}); first row: {_csv_line(rows[0])}")
        if empty:
            msg += (f"\nwarning: {empty} row(s) have no class above threshold {threshold} "
                    "(an empty label); lower threshold= if the competition needs one")
        print(msg, flush=True)
    return path


def _ids(data: Any) -> list[str]:
    if isinstance(data, (list, tuple, np.ndarray)):
        return [str(x) for x in data]
    ids = getattr(data, "ids", None)
    if ids is None:
        raise TypeError(f"data must be a dataset with .ids (a CachedImageDataset) or a list of ids, "
                        f"got {type(data).__name__}")
    return [str(x) for x in ids]


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
