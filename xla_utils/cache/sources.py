"""Sources of a cache build: an image folder, a CSV of file names and labels, or a dataset.

A folder may also be a URL prefix (``gs://bucket/images``, same layouts), and a CSV may
list URLs; their objects are read through :mod:`xla_utils.cache.storage`.

:func:`resolve_source` turns what the user passed into a :class:`Source`: the item
count, labels, class list and a fingerprint (a rerun resumes only the same source).
:func:`load_item` decodes one item (in a worker process).
"""
from __future__ import annotations

import csv
import hashlib
import io
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np
from PIL import Image

from .config import CacheConfig
from .errors import BuildError
from .images import decode_source
from .storage import filesystem, is_url, retry
from ..utils.suggest import choice, similar_path

__all__ = ["IMAGE_EXTENSIONS", "TASKS", "Source", "resolve_source", "load_item"]

# build_cache(task=...): None (read from the labels), or one of these.
TASKS = ("classification", "regression")

IMAGE_EXTENSIONS = frozenset(
    ".jpg .jpeg .jpe .jfif .png .bmp .gif .tif .tiff .webp .ppm .pgm .pbm .pnm".split()
)


@dataclass
class Source:
    """What a build reads: the items, their names and labels, and the source's fingerprint."""

    kind: str  # "folder" | "csv" | "dataset"
    description: str
    num_items: int
    paths: list[str] | None = None  # absolute file paths (folder / csv)
    names: list[str] | None = None  # relative names for reports
    labels: list[Any] | None = None  # int, list[int] (multi-label), -1, or list[float] (regression)
    errors: dict[int, str] = field(default_factory=dict)  # item -> reason it will be skipped
    classes: list[str] | None = None
    multilabel: bool = False
    fingerprint: str = ""
    ignored: list[str] = field(default_factory=list)
    dataset: Any = None
    unlabeled: bool = False  # no labels at all (a test set, or a flat folder without labels=)
    task: str = "classification"  # or "regression": labels are lists of float targets
    target_names: list[str] | None = None  # regression: each target's name (the CSV header's)
    note: str = ""  # how the labels were read, for the build's summary

    def name(self, i: int) -> str:
        """Item ``i``'s name in reports: its relative path or ``dataset[i]``."""
        return self.names[i] if self.names is not None else f"dataset[{i}]"

    def item_id(self, i: int) -> str:
        """The id recorded for item ``i``: its path relative to the source folder,
        the CSV's first-column value as written, or the dataset index."""
        return self.names[i] if self.names is not None else str(i)

    def to_dict(self) -> dict[str, Any]:
        """The manifest's ``source`` entry."""
        d = {"kind": self.kind, "path": self.description, "num_items": self.num_items,
             "fingerprint": self.fingerprint}
        if self.ignored:
            d["ignored_files"] = len(self.ignored)
            d["ignored_examples"] = self.ignored[:10]
        return d


def resolve_source(source: Any, labels_csv: str | os.PathLike | None, cfg: CacheConfig,
                   classes: Sequence[str] | None, unlabeled: bool = False,
                   task: str | None = None) -> Source:
    """The :class:`Source` of ``build_cache``'s arguments (see :func:`xla_utils.cache.build_cache`).

    ``task``: None reads a CSV's labels as regression targets when they are numbers and
    some are not integers (a dataset's when its first label is a float), else as classes;
    ``"classification"`` or ``"regression"`` decides.

    Raises:
        BuildError: the source does not exist or contradicts the other arguments.
        TypeError: ``source`` is neither a path nor a map-style dataset.
    """
    if unlabeled and labels_csv is not None:
        raise BuildError("unlabeled=True (--unlabeled) and labels= (--labels) contradict each other: "
                         "pass the test set's CSV of file names as the source instead")
    task = choice(task, TASKS, "task", "None (read from the labels)")
    if task is not None and task not in TASKS:
        raise BuildError(f"task={task!r} must be one of {TASKS} or None (read from the labels)")
    if task == "regression" and classes is not None:
        raise BuildError("task='regression' and classes= contradict each other: regression targets "
                         "are numbers, not classes")
    if is_url(source):
        if labels_csv is not None:
            raise BuildError(f"labels= (--labels) with a URL source ({source}): put the CSV's rows as full URLs "
                             "in a local CSV and pass that CSV as the source")
        return _url_folder_source(str(source).rstrip("/"), classes, unlabeled)
    if isinstance(source, (str, os.PathLike)):
        p = Path(source).expanduser().resolve()
        if labels_csv is not None:
            if not p.is_dir():
                raise BuildError(f"source {p} must be the image folder the CSV {labels_csv} refers to")
            return _csv_source(Path(labels_csv).expanduser().resolve(), p, cfg, classes, task=task)
        if p.is_file() and p.suffix.lower() in (".csv", ".tsv", ".txt"):
            return _csv_source(p, p.parent, cfg, classes, unlabeled, task)
        if p.is_dir():
            return _folder_source(p, classes, unlabeled)
        if not p.exists():
            guess, parent = similar_path(p)
            raise BuildError(f"source {p} does not exist"
                             + (f"; did you mean {guess}?" if guess is not None else "")
                             + f" (the nearest existing folder is {parent})")
        raise BuildError(f"source {p} is neither a folder nor a CSV file")
    if hasattr(source, "__getitem__") and hasattr(source, "__len__"):
        if labels_csv is not None:
            raise BuildError("labels=FILE.csv only applies to folder sources")
        return _dataset_source(source, classes, unlabeled, task)
    raise TypeError(f"source must be a folder, a CSV file or a map-style dataset, got {type(source).__name__}")


def _is_image_name(name: str) -> bool:
    return Path(name).suffix.lower() in IMAGE_EXTENSIONS


def _walk_files(root: Path) -> list[Path]:
    out = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=True):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        out.extend(Path(dirpath) / f for f in sorted(filenames) if not f.startswith("."))
    return out


def _folder_source(root: Path, classes: Sequence[str] | None, unlabeled: bool = False) -> Source:
    subdirs = sorted(d.name for d in root.iterdir() if d.is_dir() and not d.name.startswith("."))
    src = Source(kind="folder", description=str(root), num_items=0, paths=[], names=[], labels=[])
    top_files = sorted(f for f in root.iterdir() if f.is_file() and not f.name.startswith("."))
    if unlabeled:  # every image below root, sub-folders included; ids are relative paths
        src.classes, src.unlabeled = (list(classes) if classes is not None else []), True
        for f in _walk_files(root):
            rel = f.relative_to(root).as_posix()
            if _is_image_name(f.name):
                src.paths.append(str(f))
                src.names.append(rel)
                src.labels.append(-1)
            else:
                src.ignored.append(rel)
    elif subdirs:  # one sub-folder per class (torchvision ImageFolder layout)
        src.classes = list(classes) if classes is not None else subdirs
        index = {c: i for i, c in enumerate(src.classes)}
        src.ignored = [f.name for f in top_files]
        for d in subdirs:
            for f in _walk_files(root / d):
                rel = f.relative_to(root).as_posix()
                if not _is_image_name(f.name):
                    src.ignored.append(rel)
                    continue
                if d not in index:
                    src.errors[len(src.paths)] = f"class folder {d!r} is not in the given classes"
                src.paths.append(str(f))
                src.names.append(rel)
                src.labels.append(index.get(d, -1))
    else:  # flat folder without labels=: unlabelled images, said loudly in the build summary
        src.classes, src.unlabeled = (list(classes) if classes is not None else []), True
        for f in top_files:
            if _is_image_name(f.name):
                src.paths.append(str(f))
                src.names.append(f.name)
                src.labels.append(-1)
            else:
                src.ignored.append(f.name)
    return _finish_file_source(src)


def _walk_key(rel: str) -> list[tuple[int, str]]:
    """Sort key putting relative paths in :func:`_walk_files` order (a folder's files, then its sub-folders)."""
    parts = rel.split("/")
    return [(1, d) for d in parts[:-1]] + [(0, parts[-1])]


def _url_folder_source(url: str, classes: Sequence[str] | None, unlabeled: bool = False) -> Source:
    """A folder source whose folder is a URL prefix: the same layouts, ids and order as a local folder."""
    fs, key = filesystem(url)
    try:
        found = retry(lambda: fs.find(key, detail=True), f"listing {url}")
    except FileNotFoundError:
        found = {}
    files = {}
    for path, info in found.items():
        rel = path[len(key):].lstrip("/")
        if info.get("type") != "directory" and rel and not any(c.startswith(".") for c in rel.split("/")):
            files[rel] = int(info.get("size") or 0)
    if not files:
        raise BuildError(f"no objects under {url}: check the URL (`gcloud storage ls {url}`) and the credentials")
    rels = sorted(files, key=_walk_key)
    subdirs = sorted({r.split("/")[0] for r in rels if "/" in r})
    src = Source(kind="folder", description=url, num_items=0, paths=[], names=[], labels=[])
    if unlabeled or not subdirs:  # every image (unlabeled=True) or the top-level ones (a flat prefix)
        src.classes, src.unlabeled = (list(classes) if classes is not None else []), True
        chosen = [(r, -1, None) for r in rels if unlabeled or "/" not in r]
    else:  # one sub-folder per class
        src.classes = list(classes) if classes is not None else subdirs
        index = {c: i for i, c in enumerate(src.classes)}
        chosen = []
        for r in rels:
            if "/" not in r:
                continue
            d = r.split("/")[0]
            err = None if d in index else f"class folder {d!r} is not in the given classes"
            chosen.append((r, index.get(d, -1), err))
        src.ignored = [r for r in rels if "/" not in r]
    for r, label, error in chosen:
        if not _is_image_name(r):
            src.ignored.append(r)
            continue
        if error:
            src.errors[len(src.paths)] = error
        src.paths.append(f"{url}/{r}")
        src.names.append(r)
        src.labels.append(label)
    sizes = {f"{url}/{r}": n for r, n in files.items()}
    return _finish_file_source(src, sizes)


def _csv_source(csv_path: Path, root: Path, cfg: CacheConfig, classes: Sequence[str] | None,
                unlabeled: bool = False, task: str | None = None) -> Source:
    if not csv_path.is_file():
        guess, _ = similar_path(csv_path)
        raise BuildError(f"labels CSV {csv_path} does not exist"
                         + (f"; did you mean {guess}?" if guess is not None else ""))
    with open(csv_path, newline="", encoding="utf-8-sig") as f:
        sample = f.read(4096)
        f.seek(0)
        delimiter = "\t" if sample.count("\t") > sample.count(",") else ","
        rows = [r for r in csv.reader(f, delimiter=delimiter) if r and any(c.strip() for c in r)]
    first = rows[0][0].strip() if rows else ""
    header = None
    if rows and not _csv_path(root, first).exists() and (
            first.lower() in _HEADER_NAMES or (len(rows) > 1 and _csv_path(root, rows[1][0].strip()).exists())):
        header, rows = rows[0], rows[1:]  # a header such as "image,labels"
    if not rows:
        raise BuildError(f"labels CSV {csv_path} has no rows")
    cells = [(r[0].strip(), r[1].strip() if len(r) > 1 and not unlabeled else "") for r in rows]
    if unlabeled:  # a test set's CSV (e.g. sample_submission.csv): first column = file name / id
        src = Source(kind="csv", description=str(csv_path), num_items=0, paths=[], names=[], labels=[],
                      classes=list(classes) if classes is not None else [], unlabeled=True)
        for rel, _ in cells:
            src.paths.append(str(_csv_path(root, rel)))
            src.names.append(rel)
            src.labels.append(-1)
        return _finish_file_source(src)
    token_lists = [cell.split() for _, cell in cells]
    numeric = bool(token_lists) and all(ts and all(_is_number(t) for t in ts) for ts in token_lists)
    if task == "regression" or (task is None and classes is None and numeric
                                and not all(t.lstrip("+-").isdigit() for ts in token_lists for t in ts)):
        return _regression_csv(csv_path, root, cells, token_lists, header, task is None)
    multi = cfg.multilabel
    if multi is None:
        multi = any(len(t) > 1 for t in token_lists)
    elif not multi:
        for n, t in enumerate(token_lists):
            if len(t) > 1:
                raise BuildError(f"{csv_path} row {n + 1} has several labels {' '.join(t)!r} "
                                 "but multilabel=False")
    tokens = {t for ts in token_lists for t in ts}
    if classes is not None:
        class_list = list(classes)
    elif tokens and all(t.isdigit() for t in tokens):
        class_list = [str(i) for i in range(max(int(t) for t in tokens) + 1)]
    else:
        class_list = sorted(tokens)
    index = {c: i for i, c in enumerate(class_list)}
    src = Source(kind="csv", description=str(csv_path), num_items=0, paths=[], names=[], labels=[],
                  classes=class_list, multilabel=multi)
    if numeric and classes is None and task is None and not multi:
        src.note = (f"labels: integers read as {len(class_list)} classes (task='regression', "
                    "--task regression, reads them as numeric targets)")
    for n, ((rel, _), ts) in enumerate(zip(cells, token_lists)):
        p = _csv_path(root, rel)
        unknown = [t for t in ts if t not in index]
        if unknown:
            src.errors[n] = f"label {unknown[0]!r} is not in the given classes"
        if multi:
            src.labels.append(sorted({index[t] for t in ts if t in index}))
        else:
            src.labels.append(index[ts[0]] if ts and ts[0] in index else -1)
        src.paths.append(str(p))
        src.names.append(rel)
    return _finish_file_source(src)


def _is_number(t: str) -> bool:
    try:
        return np.isfinite(float(t))
    except ValueError:
        return False


def _regression_csv(csv_path: Path, root: Path, cells: list[tuple[str, str]],
                    token_lists: list[list[str]], header: list[str] | None, detected: bool) -> Source:
    """A CSV source of numeric targets (regression): each row's cell holds ``k`` numbers
    (space-separated when ``k > 1``); a row with another count or a non-number is skipped."""
    counts = [len(ts) for ts in token_lists if ts]
    k = max(set(counts), key=counts.count) if counts else 1
    name = header[1].strip() if header is not None and len(header) > 1 and header[1].strip() else "target"
    names = [name] if k == 1 else [f"{name}_{j}" for j in range(k)]
    src = Source(kind="csv", description=str(csv_path), num_items=0, paths=[], names=[], labels=[],
                 classes=[], task="regression", target_names=names)
    src.note = (f"labels: regression targets ({k} per image, float32"
                + (", read as numbers because some are not integers; task='classification' reads "
                   "them as class names" if detected else "") + ")")
    for n, ((rel, cell), ts) in enumerate(zip(cells, token_lists)):
        bad = [t for t in ts if not _is_number(t)]
        if bad or len(ts) != k:
            src.errors[n] = (f"target {bad[0]!r} is not a finite number" if bad else
                             f"{len(ts)} target value(s) {cell!r}, expected {k}")
            src.labels.append([float("nan")] * k)
        else:
            src.labels.append([float(t) for t in ts])
        src.paths.append(str(_csv_path(root, rel)))
        src.names.append(rel)
    return _finish_file_source(src)


_HEADER_NAMES = {"path", "paths", "file", "filename", "file_name", "filepath", "fname", "image", "images",
                 "image_id", "image_name", "img", "id", "name"}


class _Url(str):
    """A CSV cell that is a URL: taken as it is, not checked here (its read fails per item)."""

    def exists(self) -> bool:
        return True


def _csv_path(root: Path, rel: str) -> Path | _Url:
    if is_url(rel):
        return _Url(rel)
    p = root / rel
    if not p.exists() and not p.suffix:  # CSVs often list ids without the extension
        for ext in (".jpg", ".png", ".jpeg"):
            if p.with_name(p.name + ext).exists():
                return p.with_name(p.name + ext)
    return p


def _finish_file_source(src: Source, sizes: dict[str, int] | None = None) -> Source:
    src.num_items = len(src.paths)
    h = hashlib.sha256()
    for name, path, label in zip(src.names, src.paths, src.labels):
        try:
            size = sizes[path] if sizes is not None else -1 if is_url(path) else os.stat(path).st_size
        except (OSError, KeyError):
            size = -1
        h.update(f"{name}\0{size}\0{label}\n".encode())
    h.update(json.dumps([src.classes, src.multilabel, sorted(src.errors.items())]).encode())
    if src.task != "classification":  # (classification fingerprints as before: old caches resume)
        h.update(json.dumps([src.task, src.target_names]).encode())
    # (src.unlabeled is not hashed: a flat folder built without unlabeled=True and
    # rebuilt with it is the same cache, and the rerun finds it complete)
    src.fingerprint = h.hexdigest()[:16]
    return src


def _dataset_source(ds: Any, classes: Sequence[str] | None, unlabeled: bool = False,
                    task: str | None = None) -> Source:
    desc = f"{type(ds).__module__}.{type(ds).__qualname__}"
    if unlabeled:  # items are images, or tuples whose first element is the image
        n = len(ds)
        fp = hashlib.sha256(f"{desc}\0{n}\0unlabeled\0{list(classes or [])}".encode())
        return Source(kind="dataset", description=desc, num_items=n, dataset=ds, unlabeled=True,
                       classes=list(classes or []), fingerprint=fp.hexdigest()[:16])
    if classes is None:
        found = getattr(ds, "classes", None)
        if isinstance(found, (list, tuple)) and all(isinstance(c, str) for c in found):
            classes = found
    n = len(ds)
    multi = False
    first = np.asarray(0)
    if n:  # the first item's label says single- or multi-label (and the multi-hot width)
        try:
            first = np.asarray(_as_numpy(ds[0][1]))
        except Exception:
            pass
    if task == "regression" or (task is None and first.dtype.kind == "f" and first.ndim == 0):
        k = int(first.size) or 1
        names = ["target"] if k == 1 else [f"target_{j}" for j in range(k)]
        fp = hashlib.sha256(f"{desc}\0{n}\0regression\0{names}".encode())
        return Source(kind="dataset", description=desc, num_items=n, dataset=ds, classes=[],
                      task="regression", target_names=names, fingerprint=fp.hexdigest()[:16],
                      note=f"labels: regression targets ({k} per image, float32)")
    multi = first.ndim == 1
    if multi and classes is None:
        classes = [str(i) for i in range(first.shape[0])]
    fp = hashlib.sha256(f"{desc}\0{n}\0{multi}\0{list(classes) if classes is not None else None}".encode())
    return Source(kind="dataset", description=desc, num_items=n, dataset=ds, multilabel=multi,
                   classes=list(classes) if classes is not None else None, fingerprint=fp.hexdigest()[:16])


def _as_numpy(x: Any) -> Any:
    if hasattr(x, "detach"):  # a torch tensor from the user's dataset
        return x.detach().cpu().numpy()
    return x


def _dataset_label(label: Any, multilabel: bool, targets: int = 0) -> int | list[int] | list[float]:
    """int-like -> int; a 1-D multi-hot vector -> sorted indices of its positives;
    regression (``targets`` values per item) -> the list of float targets."""
    arr = np.asarray(-1 if label is None else _as_numpy(label))
    if targets:
        values = arr.astype(np.float64).reshape(-1)
        if values.size != targets or not np.isfinite(values).all():
            raise ValueError(f"target {arr.tolist()!r} is not {targets} finite number(s) like the first item's")
        return values.tolist()
    if arr.ndim == 0 and not multilabel:
        return int(arr)
    if arr.ndim == 1 and multilabel:
        return [int(i) for i in np.flatnonzero(arr > 0.5)]
    kind = "a multi-hot vector" if multilabel else "a class index"
    raise ValueError(f"label of shape {arr.shape} is not {kind} like the first item's")



def load_item(src: Source, cfg: CacheConfig, i: int) -> tuple[Image.Image, int | list[int], tuple[int, int]]:
    """Decode source item ``i``.

    Returns:
        ``(RGB image, label, (width, height))``: the label is a class index (-1 =
        unlabelled), a list of class indices (multi-label) or a list of float targets
        (regression); the size is the source's in pixels.

    Raises:
        Exception: any failure of the item (bad file, user dataset error, unknown label).
    """
    if i in src.errors:
        raise ValueError(src.errors[i])
    if src.dataset is not None:
        item = src.dataset[i]
        if src.unlabeled:
            img, wh = decode_source(item[0] if isinstance(item, (tuple, list)) and item else item, cfg)
            return img, -1, wh
        if not isinstance(item, (tuple, list)) or len(item) < 2:
            raise ValueError(f"dataset items must be (image, label) pairs, got {type(item).__name__}")
        img, wh = decode_source(item[0], cfg)
        k = len(src.target_names or []) if src.task == "regression" else 0
        return img, _dataset_label(item[1], src.multilabel, k), wh
    path = src.paths[i]
    if is_url(path):
        fs, key = filesystem(path)
        path = io.BytesIO(retry(lambda: fs.cat_file(key), f"reading {path}"))
    img, wh = decode_source(path, cfg)
    return img, src.labels[i], wh
