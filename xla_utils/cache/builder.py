"""The build coordinator: :func:`build_cache`, resume, locking, the process pool and the manifest.

A build resolves its source, checks what the output folder already holds (nothing, a
compatible partial build to resume, the identical complete cache, or something else),
takes a lock, runs :func:`~xla_utils.cache.worker.build_shard` for each missing shard on
a process pool and rewrites ``manifest.json`` after every finished shard. Shard ``k``
holds source items ``[k * P, (k + 1) * P)`` where ``P`` (``images_per_shard``) follows
from the config and the source length alone, so a rerun knows which shards exist,
rebuilds only the missing ones and produces byte-identical files.

Crash safety: workers write each shard to a temporary file, fsync and rename it; only
the coordinator writes ``manifest.json`` (temp file, fsync, rename). A finished shard
is never touched again, so a failure can only lose work in progress. Byte-identical
rebuilds assume the same Pillow / numpy versions (recorded in the manifest under
``software``).
"""
from __future__ import annotations

import contextlib
import dataclasses
import errno
import fnmatch
import inspect
import io
import math
import os
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from ..utils.suggest import choice, unknown_keywords
from ..utils.units import format_bytes
from .config import CacheConfig
from .errors import BuildError
from .format import FORMAT, FORMAT_VERSION, LABELS, MANIFEST, manifest_text
from .sources import Source, resolve_source
from .space import check_space, disk_full, estimate_bytes, is_disk_full
from .storage import LockedError, Store, load_manifest
from .runners import ENGINES, mp_context, run_shards
from ..runtime.hosts import slice_host
from .worker import init_worker, pilot_item

__all__ = ["BuildReport", "DryRunEstimate", "build_cache", "missing_rows_warning"]


@dataclass
class BuildReport:
    """Outcome of :func:`build_cache`. Sizes in bytes, times in seconds.

    Attributes:
        path: the cache folder.
        num_sources: items in the source; ``num_images``: images cached (skipped ones excluded).
        num_shards: shard files; ``shards_built`` by this run, ``shards_reused`` from an
            earlier one.
        sources_built: source items processed by this run.
        bytes: size of the cache on disk; ``files``: its file count.
        seconds: duration of this run.
        skipped: one record per skipped image (``source_index``, ``path``, ``reason``).
        upscaled: one record per image smaller than ``size`` (``source_index``, ``path``, ``size``).
        unlabeled: the cache has no labels (a test set); see ``CachedImageDataset.unlabeled``.
    """

    path: str
    num_sources: int
    num_images: int
    num_shards: int
    shards_built: int
    shards_reused: int
    sources_built: int
    bytes: int
    files: int
    seconds: float
    skipped: list[dict[str, Any]]
    upscaled: list[dict[str, Any]]
    unlabeled: bool = False

    @property
    def images_per_s(self) -> float:
        """Source images processed per second by this run (reused shards excluded)."""
        return self.sources_built / self.seconds if self.seconds > 0 else 0.0

    def __repr__(self) -> str:
        # Short on purpose: a notebook cell ending in build_cache(...) prints this, and
        # the skipped/upscaled lists can hold thousands of entries (see .skipped).
        lines = [
            f"BuildReport({self.path!r}: {self.num_images:,} of {self.num_sources:,} images, "
            f"{self.num_shards} shards ({self.shards_built} built, {self.shards_reused} reused), "
            f"{self.files} files, {format_bytes(self.bytes)}, {self.seconds:.1f} s"
            + (", UNLABELLED" if self.unlabeled else ""),
            f"  skipped {len(self.skipped):,}, upscaled {len(self.upscaled):,} (full lists: .skipped, .upscaled)",
        ]
        lines += [f"  e.g. {e['path']}: {e['reason']}"[:160] for e in self.skipped[:3]]
        return "\n".join(lines) + ")"


@dataclass
class DryRunEstimate:
    """What a build would produce, extrapolated from a pilot of ``pilot_images`` sources.

    Attributes:
        num_sources, num_shards, images_per_shard: as the build would have them.
        estimated_bytes: size of the cache; ``estimated_seconds``: build time with ``workers``.
        estimated_skipped: images the build would skip.
        pilot_images: sources processed by the pilot; ``pilot_seconds_per_image`` on one core.
        workers: the worker count of the estimate.
        existing: what the output folder holds now, in words.
    """

    num_sources: int
    num_shards: int
    images_per_shard: int
    estimated_bytes: int
    estimated_seconds: float
    estimated_skipped: int
    pilot_images: int
    pilot_seconds_per_image: float
    workers: int
    existing: str


def _default_workers() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:
        return max(1, os.cpu_count() or 1)


def build_cache(source: Any, out: str | os.PathLike, config: CacheConfig | None = None, *,
                labels: str | os.PathLike | None = None, classes: Sequence[str] | None = None,
                workers: int | None = None, strict: bool = False, overwrite: bool = False,
                dry_run: bool = False, verbose: bool = True, unlabeled: bool = False, engine: str = "local",
                ray_address: str | None = None, task: str | None = None,
                **config_fields: Any) -> BuildReport | DryRunEstimate:
    """Build (or resume) a sharded uint8 image cache in ``out``.

    Args:
        source: an image folder or a URL prefix such as ``gs://bucket/images`` (one
            sub-folder per class; a flat folder is cached
            unlabelled), a CSV of ``path,label`` rows (multi-label: space-separated
            labels; paths relative to the CSV's folder), or any map-style dataset
            returning ``(PIL image | HWC uint8 array | file path, label)`` where label
            is an int or a multi-hot vector.
        out: output directory (created), or a URL prefix such as ``gs://bucket/cache``
            (needs ``pip install 'xla_utils[gcs]'``; see :mod:`xla_utils.cache.storage`).
            Rerunning the same build resumes it (finished
            shards are kept); a different config or source (relative paths, file sizes,
            labels) raises :class:`BuildError` unless ``overwrite``.
        config: a :class:`CacheConfig`; keyword arguments (``size=224, variants=4``...)
            override its fields.
        labels: a CSV of ``path,label`` rows whose paths are relative to ``source``.
        classes: fix the class list (e.g. a validation set reusing the training
            cache's ``classes``); items with other labels are skipped.
        workers: processes (default: all cores). Each holds about one shard in memory.
            Local engine only.
        strict: stop at the first bad image with :class:`BadImageError` naming it
            (finished shards are kept); default skips and lists bad images.
        overwrite: replace an existing cache in ``out`` (only cache files are removed).
            Without it, a complete cache of the same config and source is recognised
            before anything is written, so a rerun also works on a read-only copy
            (``/kaggle/input/...``); building into a read-only folder raises
            :class:`BuildError` naming the folder.
        dry_run: write nothing; estimate size, time and shard count from a pilot.
        verbose: show a progress bar (images/s, ETA) and a summary.
        unlabeled: cache a test set on purpose: every image of a folder (sub-folders
            included) or the file names in a CSV's first column (e.g. the competition's
            ``sample_submission.csv``; other columns are ignored), with no labels. A
            flat folder without ``labels=`` is also cached unlabelled, but the summary
            then warns and says how to add labels; training refuses unlabelled caches.
            Images that cannot be read are skipped as in any build, and the summary warns
            that they will be missing from a submission (:func:`missing_rows_warning`);
            the cache remembers their ids (``CachedImageDataset.skipped``).
        engine: ``"local"`` (a process pool, default) or ``"ray"``: one task per shard on a
            Ray cluster (``pip install 'xla_utils[ray]'``); the same bytes as a local build.
            Every node must reach ``source`` and ``out`` (use ``gs://`` for ``out`` on a
            real cluster); see :mod:`xla_utils.cache.runners`.
        ray_address: the cluster's ``HOST:PORT`` for ``engine="ray"``. Default: Ray's own
            ``RAY_ADDRESS``, else a local Ray (or the one this process already joined).
        task: ``"regression"``, ``"classification"`` or None (numbers not all integers: regression).

    Every cache records each image's id (``CachedImageDataset.ids``): its path
    relative to ``source`` (folders), the CSV's first-column value as written, or
    the index as a string (datasets); skipped images' ids too.

    Raises:
        TypeError: an unknown keyword (``varients=2``): the message suggests the
            nearest option (``variants``) and lists them all.
    """
    cfg = _config_of(config, config_fields)
    engine = choice(engine, ENGINES, "engine")
    workers = _checked_workers(engine, workers)
    out = Store(out)  # a URL whose protocol is not installed: ImportError naming the package
    src = resolve_source(source, labels, cfg, classes, unlabeled, task)
    if src.num_items == 0:
        raise BuildError(f"no images found in {src.description}")
    out.check()  # a missing bucket or credentials: named now, before any work
    if dry_run:
        return _dry_run(src, cfg, out, workers, verbose)
    if not overwrite:
        # A finished identical build needs no lock and no write (read-only mounts).
        t0 = time.perf_counter()
        state, old = _existing_state(out, src, cfg)
        if state == "complete":
            return _labels_note(_complete_report(out, old, t0, verbose), src, unlabeled, verbose)
    _make_folder(out, src, cfg)
    report = _build_once(out, src, cfg, overwrite, verbose, lambda: _build(
        src, cfg, out, workers, strict, overwrite, verbose, engine, ray_address))
    return _labels_note(report, src, unlabeled, verbose)


def _build_once(out: Store, src: Source, cfg: CacheConfig, overwrite: bool, verbose: bool,
                build: Any) -> Any:
    """``build()`` under the cache's lock; on a pod slice whose other host holds a bucket's
    lock (every host runs the same script), wait for that build and reuse it instead."""
    waited = None
    while True:
        try:
            with _locked(out, src, cfg):
                t0 = time.perf_counter()
                state, old = _existing_state(out, src, cfg) if out.is_url else ("", None)
                if state == "complete" and not overwrite:  # another build finished meanwhile
                    return _complete_report(out, old, waited or t0, verbose)
                return build()
        except _SliceBuilding as busy:
            waited = waited or _say_waiting(out, busy.where)
            time.sleep(1.0)
            state, old = _existing_state(out, src, cfg)
            if state == "complete" and not overwrite:
                return _complete_report(out, old, waited, verbose)


class _SliceBuilding(Exception):
    """The lock of a bucket's cache is held, and this process is one host of a pod slice
    (or torchrun node) where every host runs the same build: one builds, the others wait."""

    def __init__(self, where: tuple[int, int]) -> None:
        super().__init__(where)
        self.where = where


def _say_waiting(out: Store, where: tuple[int, int]) -> float:
    print(f"build_cache on host {where[0]} of {where[1]}: another host is building {out} (every "
          "host runs this script; one builds, the others wait for its manifest and reuse it)",
          flush=True)
    return time.perf_counter()


def _config_of(config: CacheConfig | None, config_fields: dict[str, Any]) -> CacheConfig:
    """``config`` with ``build_cache``'s keyword fields applied; an unknown keyword is a
    ``TypeError`` naming the nearest option."""
    fields = [f.name for f in dataclasses.fields(CacheConfig)]
    if set(config_fields) - set(fields):
        own = [k for k, p in inspect.signature(build_cache).parameters.items() if p.kind is p.KEYWORD_ONLY]
        raise unknown_keywords("build_cache()", [k for k in config_fields if k not in fields], fields + own)
    return dataclasses.replace(config, **config_fields) if config else CacheConfig(**config_fields)


def _checked_workers(engine: str, workers: int | None) -> int:
    """The worker count (default: all cores), checked with the engine's name."""
    if engine not in ENGINES:
        raise ValueError(f"engine={engine!r} must be one of {ENGINES}")
    workers = workers or _default_workers()
    if workers < 1:
        raise ValueError(f"workers={workers} must be >= 1")
    return workers


def _make_folder(out: Store, src: Source, cfg: CacheConfig) -> None:
    """Create ``out``; a folder that cannot be written is a :class:`BuildError` naming it."""
    try:
        out.mkdir()
    except OSError as e:
        err = _write_error(out, e, src, cfg)
        if err is None:
            raise
        raise err from e


def _labels_note(report: BuildReport, src: Source, intended: bool, verbose: bool) -> BuildReport:
    """Mark an unlabelled cache on its report and, when verbose, say so and how to add labels,
    and that its skipped images will be missing from a submission."""
    report.unlabeled = src.unlabeled
    if verbose and src.note and not src.unlabeled:
        print(src.note, flush=True)
    if verbose and src.unlabeled:
        print(_unlabeled_note(src, intended))
        if missing_rows_warning(report):
            print(missing_rows_warning(report), flush=True)
    return report


def missing_rows_warning(report: BuildReport) -> str | None:
    """The warning of an unlabelled (test) build that skipped images: they will be missing
    from a submission, and what to do. None for other builds."""
    if not (report.unlabeled and report.skipped):
        return None
    n = len(report.skipped)
    names = ", ".join(e["path"] for e in report.skipped[:5]) + (f" and {n - 5} more" if n > 5 else "")
    return (f"WARNING: {n} test image(s) were skipped ({names}) and will be MISSING from a "
            "submission: trainer.predict gives them no row, and write_submission refuses to write "
            "fewer rows than the test set has. Fix or replace those files and rebuild with "
            "overwrite=True (--overwrite), or write their rows with a fallback: "
            "write_submission(..., train=trainer, missing='fill') (the training set's most "
            "frequent class, or fill='<class name>').")


def _unlabeled_note(src: Source, intended: bool) -> str:
    if intended:
        return ("unlabelled cache (unlabeled=True): image ids recorded for predict() and "
                "write_submission(); it cannot be used as training data")
    return (f"WARNING: this cache is UNLABELLED: {src.description} is a flat folder and no labels "
            "were given, so it cannot be used as training data (OneCycleTrainer refuses it). "
            "To train on it, rebuild with labels=\"train.csv\" (tpu_cache_ds build ... --labels "
            "train.csv; rows of file,label) and overwrite=True (--overwrite), or put the images in one "
            "sub-folder per class. For a test set pass unlabeled=True (--unlabeled) to say so.")


_READ_ONLY_ERRNOS = (errno.EACCES, errno.EPERM, errno.EROFS)


def _write_error(out: Store, e: OSError, src: Source, cfg: CacheConfig) -> BuildError | None:
    """A clear :class:`BuildError` for an output folder we may not write to (None for other errors)."""
    if e.errno not in _READ_ONLY_ERRNOS or out.is_url:
        return None
    there = ""
    with contextlib.suppress(OSError):  # the folder may not even be listable
        state, old = _existing_state(out, src, cfg)
        if state == "compatible":
            there = " It holds an unfinished (or damaged) build of this cache, which cannot be finished here."
        elif state == "different" and old is not None:
            there = f" It holds a cache built with another config or source ({_difference(old, src, cfg)})."
        elif state == "broken":
            there = f" Its {MANIFEST} is unreadable."
    return BuildError(
        f"cannot write to {out} ({e.strerror or e}): the folder is read-only (Kaggle mounts /kaggle/input "
        f"read-only).{there} Build into a writable folder instead, e.g. /kaggle/working/{out.name} on "
        f"Kaggle or /content/{out.name} on Colab (a complete cache can be read from anywhere). "
        "Nothing was written.")


@contextlib.contextmanager
def _locked(out: Store, src: Source, cfg: CacheConfig):
    if out.is_url:
        try:
            with out.lock():
                yield
        except LockedError as e:
            where = slice_host()
            if where is not None:
                raise _SliceBuilding(where) from None
            raise BuildError(str(e)) from None
        return
    lock_path = out.local(".lock")
    try:
        fd = os.open(lock_path, os.O_CREAT | os.O_RDWR, 0o644)
    except OSError as e:
        err = _write_error(out, e, src, cfg)
        if err is None:
            raise
        raise err from e
    try:
        try:
            import fcntl
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except ImportError:  # non-POSIX: no inter-process lock
            pass
        except OSError:
            raise BuildError(f"another build is writing {out} (lock {lock_path} is held)") from None
        try:
            yield
        finally:
            with contextlib.suppress(OSError):
                os.unlink(lock_path)
    finally:
        os.close(fd)


def _new_manifest(src: Source, cfg: CacheConfig, per_shard: int) -> dict[str, Any]:
    from ..utils.version import __version__
    import PIL

    return {
        "format": FORMAT,
        # version 2 only where an older reader would misread the cache (regression targets)
        "format_version": FORMAT_VERSION if src.task == "regression" else 1,
        "complete": False,
        "num_images": None,
        "image_size": list(cfg.size),
        "num_variants": cfg.variants,
        "codec": cfg.codec,
        "multilabel": src.multilabel,
        "unlabeled": src.unlabeled,
        "classes": src.classes,
        **({"task": src.task, "targets": src.target_names} if src.task == "regression" else {}),
        "images_per_shard": per_shard,
        "num_shards": math.ceil(src.num_items / per_shard),
        "labels_file": LABELS,
        "config": cfg.to_dict(),
        "config_fingerprint": cfg.fingerprint(),
        "source": src.to_dict(),
        "software": {"xla_utils": __version__, "pillow": PIL.__version__, "numpy": np.__version__},
        "skipped": [],
        "upscaled": [],
        "shards": [],
    }


def _cache_files(names: Sequence[str]) -> list[str]:
    pats = ("shard-*.npy", "shard-*.jpgs", "shard-*.tmp-*", MANIFEST, MANIFEST + ".tmp*", LABELS, LABELS + ".tmp-*")
    return sorted({n for pat in pats for n in fnmatch.filter(names, pat)})


def _existing_state(out: Store, src: Source, cfg: CacheConfig) -> tuple[str, dict[str, Any] | None]:
    """('empty'|'compatible'|'complete'|'foreign'|'broken'|'different', manifest or None).

    'complete' also needs every shard and the labels file present at their recorded
    sizes; a complete manifest with a lost file is 'compatible' (a rerun rebuilds it).
    Reads only.
    """
    sizes = out.sizes()
    if MANIFEST not in sizes:
        others = [n for n in sizes if not n.startswith(".")]
        return ("foreign" if others else "empty"), None
    try:
        m = load_manifest(out)
    except (ValueError, OSError):
        return "broken", None
    if m["config_fingerprint"] != cfg.fingerprint() or m["source"]["fingerprint"] != src.fingerprint:
        return "different", m
    if not m["complete"]:
        return "compatible", m
    intact = sizes.get(LABELS, -1) >= 0 and all(sizes.get(s["file"]) == s["bytes"] for s in m["shards"])
    return ("complete" if intact else "compatible"), m


def _difference(m: dict[str, Any], src: Source, cfg: CacheConfig) -> str:
    old = m.get("config", {})
    new = cfg.to_dict()
    diffs = [f"{k}: {old.get(k)!r} -> {v!r}" for k, v in new.items() if old.get(k) != v]
    if m["source"]["fingerprint"] != src.fingerprint:
        diffs.append(f"source: {m['source'].get('path')} ({m['source'].get('num_items')} items) -> "
                     f"{src.description} ({src.num_items} items) or its files/labels changed")
    return "; ".join(diffs) or "format details differ"


def _build(src: Source, cfg: CacheConfig, out: Store, workers: int, strict: bool, overwrite: bool,
           verbose: bool, engine: str = "local", ray_address: str | None = None) -> BuildReport:
    t0 = time.perf_counter()
    state, old = _existing_state(out, src, cfg)
    if state in ("foreign", "broken", "different") and not overwrite:
        if state == "foreign":
            raise BuildError(f"{out} is not empty and holds no cache manifest: choose an empty "
                             "directory or pass overwrite=True (--overwrite)")
        if state == "broken":
            raise BuildError(f"{out.path(MANIFEST)} is unreadable (damaged or cut short): pass overwrite=True "
                             "(--overwrite) to rebuild the cache from scratch")
        raise BuildError(f"{out} holds a cache built with a different config or source "
                         f"({_difference(old, src, cfg)}); pass overwrite=True (--overwrite) to "
                         "replace it or choose another output directory")
    entries = out.entries()
    if overwrite:
        for name in _cache_files(list(entries)):
            out.remove(name)
        old = None
    elif state == "complete":  # finished by another process since build_cache looked
        return _complete_report(out, old, t0, verbose)
    for name in fnmatch.filter(entries, "*.tmp-*"):  # leftovers of a killed run (we hold the lock)
        out.remove(name)

    per_shard = cfg.images_per_shard(src.num_items)
    manifest = _new_manifest(src, cfg, per_shard)
    num_shards = manifest["num_shards"]
    done: dict[int, dict[str, Any]] = {}
    if old is not None:
        for s in old["shards"]:
            if _intact(entries.get(s["file"]), s):
                done[s["index"]] = s
        keep = lambda e: any(  # noqa: E731
            s["first_source"] <= e["source_index"] < s["first_source"] + s["num_sources"]
            for s in done.values())
        manifest["skipped"] = [e for e in old["skipped"] if keep(e)]
        manifest["upscaled"] = [e for e in old["upscaled"] if keep(e)]
    reused = len(done)
    todo = [k for k in range(num_shards) if k not in done]
    sources_built = sum(min(src.num_items, (k + 1) * per_shard) - k * per_shard for k in todo)

    def record(res: dict[str, Any]) -> None:
        manifest["skipped"].extend(res.pop("skipped"))
        manifest["upscaled"].extend(res.pop("upscaled"))
        done[res["index"]] = res

    def save() -> None:
        manifest["shards"] = [done[k] for k in sorted(done)]
        manifest["skipped"].sort(key=lambda e: e["source_index"])
        manifest["upscaled"].sort(key=lambda e: e["source_index"])
        _write_manifest(out, manifest)

    if not out.is_url:  # refuse before writing what cannot fit (one line naming both numbers)
        check_space(str(out), out.free_bytes(), cfg, sources_built, len(todo))
    try:
        if todo:
            save()
            run_shards(engine, src, cfg, out, todo, per_shard, sources_built, min(workers, len(todo)), strict,
                       verbose, record, save, ray_address)
        _finish(out, manifest, done, src)
        save()
    except Exception as e:
        if not (is_disk_full(e) or is_disk_full(e.__cause__)):
            raise
        _remove_temporaries(out)
        left = [k for k in range(num_shards) if k not in done]
        items = sum(min(src.num_items, (k + 1) * per_shard) - k * per_shard for k in left)
        raise disk_full(str(out), len(done), num_shards, estimate_bytes(cfg, items, len(left))) from None
    report = _report(out, manifest, reused, sources_built, time.perf_counter() - t0)
    if verbose:
        print(_summary(report, manifest))
    return report


def _remove_temporaries(out: Store) -> None:
    """Delete the ``*.tmp-*`` files of this build (we hold the lock)."""
    for name in fnmatch.filter(out.listdir(), "*.tmp-*"):
        with contextlib.suppress(OSError):
            out.remove(name)


def _intact(entry: dict[str, Any] | None, shard: dict[str, Any]) -> bool:
    """Whether a listed file matches its manifest entry: size, and the store's crc32c where recorded."""
    if entry is None or entry["size"] != shard["bytes"]:
        return False
    return shard.get("crc32c") is None or entry.get("crc32c") == shard["crc32c"]


def _complete_report(out: Store, manifest: dict[str, Any], t0: float, verbose: bool) -> BuildReport:
    """Report of a rerun that found the identical cache complete (writes nothing)."""
    report = _report(out, manifest, manifest["num_shards"], 0, time.perf_counter() - t0)
    if verbose:
        print(_summary(report, manifest))
    return report


def _finish(out: Store, manifest: dict[str, Any], done: dict[int, dict[str, Any]], src: Source) -> None:
    """Labels file, class list, counts; then the manifest can say complete."""
    labels = [lab for k in sorted(done) for lab in done[k]["labels"]]
    n = len(labels)
    classes = manifest["classes"]
    if manifest.get("task") == "regression":
        arr = np.asarray(labels, dtype=np.float32).reshape(n, len(manifest["targets"]))
    elif manifest["multilabel"]:
        arr = np.zeros((n, len(classes)), np.uint8)
        for r, lab in enumerate(labels):
            arr[r, lab] = 1
    else:
        arr = np.asarray(labels, dtype=np.int64).reshape(n)
        if classes is None:
            classes = [str(i) for i in range(int(arr.max(initial=-1)) + 1)]
        elif n and arr.max() >= len(classes):
            raise BuildError(f"label {int(arr.max())} is out of range for {len(classes)} classes")
    if n == 0:
        raise BuildError(f"every one of the {src.num_items} source images was skipped; first reasons: "
                         + "; ".join(f"{e['path']}: {e['reason']}" for e in manifest["skipped"][:3]))
    buf = io.BytesIO()
    np.save(buf, arr)
    out.write(LABELS, [buf.getvalue()])
    manifest.update(classes=classes, num_images=n, complete=True)


def _write_manifest(out: Store, manifest: dict[str, Any]) -> None:
    out.write(MANIFEST, [manifest_text(manifest).encode()])
    if out.is_url:
        return
    with contextlib.suppress(OSError, AttributeError):  # persist the renames
        fd = os.open(out.local(), os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _report(out: Store, manifest: dict[str, Any], reused: int, sources_built: int,
            seconds: float) -> BuildReport:
    files = [MANIFEST, LABELS] + [s["file"] for s in manifest["shards"]]
    sizes = out.sizes()
    return BuildReport(
        path=str(out), num_sources=manifest["source"]["num_items"], num_images=manifest["num_images"],
        num_shards=manifest["num_shards"], shards_built=manifest["num_shards"] - reused,
        shards_reused=reused, sources_built=sources_built, bytes=sum(max(0, sizes.get(f, 0)) for f in files),
        files=len(files), seconds=seconds, skipped=manifest["skipped"], upscaled=manifest["upscaled"])


def _summary(r: BuildReport, m: dict[str, Any]) -> str:
    h, w = m["image_size"]
    lines = [
        f"cached {r.num_images:,} of {r.num_sources:,} images x {m['num_variants']} variant(s) at {w}x{h} "
        f"({m['codec']}) in {r.path}: {r.num_shards} shards, {r.files} files, {format_bytes(r.bytes)}; "
        f"{r.seconds:.1f} s ({r.shards_built} shards built, {r.shards_reused} reused"
        + (f", {r.images_per_s:,.1f} images/s)" if r.shards_built else ")")]
    if r.skipped:
        lines.append(f"skipped {len(r.skipped)} image(s) (manifest.json 'skipped'):")
        lines += [f"  {e['path']}: {e['reason']}" for e in r.skipped[:10]]
        if len(r.skipped) > 10:
            lines.append(f"  ... and {len(r.skipped) - 10} more")
    if r.upscaled:
        lines.append(f"upscaled {len(r.upscaled)} image(s) smaller than {w}x{h} (manifest.json 'upscaled')")
    ignored = m["source"].get("ignored_files")
    if ignored:
        lines.append(f"ignored {ignored} non-image file(s) in the source folder, e.g. "
                     + ", ".join(m["source"]["ignored_examples"][:3]))
    return "\n".join(lines)


def _dry_run(src: Source, cfg: CacheConfig, out: Store, workers: int, verbose: bool) -> DryRunEstimate:
    n_pilot = min(src.num_items, 32)
    idx = sorted({int(round(x)) for x in np.linspace(0, src.num_items - 1, n_pilot)})
    ctx = mp_context()
    with ProcessPoolExecutor(min(workers, len(idx)), mp_context=ctx, initializer=init_worker,
                             initargs=(src, cfg, out, False, ctx.Value("q", 0),
                                       ctx.Value("q", src.num_items))) as ex:
        results = list(ex.map(pilot_item, idx))
    ok = [sizes for _, sizes in results if not isinstance(sizes, str)]
    sec = float(np.mean([t for t, _ in results]))
    good_frac = len(ok) / len(results)
    per_image = float(np.mean([sum(s) for s in ok])) if ok else 0.0
    per_shard = cfg.images_per_shard(src.num_items)
    num_shards = math.ceil(src.num_items / per_shard)
    state = _existing_state(out, src, cfg)[0]
    est = DryRunEstimate(
        num_sources=src.num_items, num_shards=num_shards, images_per_shard=per_shard,
        estimated_bytes=int(per_image * good_frac * src.num_items + num_shards * 128),
        estimated_seconds=sec * src.num_items / workers,
        estimated_skipped=round((1 - good_frac) * src.num_items), pilot_images=len(idx),
        pilot_seconds_per_image=sec, workers=workers,
        existing={"empty": "empty (a fresh build)", "compatible": "a compatible partial build (would resume)",
                  "complete": "a complete identical build (nothing to do)",
                  "different": "a cache with another config (needs --overwrite)",
                  "broken": "a cache with an unreadable manifest.json (needs --overwrite)",
                  "foreign": "other files (needs --overwrite)"}[state])
    if verbose:
        h, w = cfg.size
        print(f"dry run (pilot of {est.pilot_images} images, {sec * 1000:.0f} ms each on one core): "
              f"{src.num_items:,} images x {cfg.variants} variant(s) at {w}x{h} ({cfg.codec}) -> "
              f"~{format_bytes(est.estimated_bytes)} in {num_shards} shards of {per_shard} images, "
              f"~{est.estimated_seconds / 60:.1f} min with {workers} workers, "
              f"~{est.estimated_skipped} skipped; output directory: {est.existing}")
    return est
