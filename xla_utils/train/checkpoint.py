"""Epoch checkpoints of :class:`~xla_utils.train.trainer.OneCycleTrainer`: write, find, read, resume.

An epoch checkpoint (``epoch_<nnn>-<run id>.pt``) holds the model and optimizer
state, the history and everything the one-cycle schedule needs to continue the
run exactly; an in-epoch one (``epoch_<nnn>_step<ssssss>-<run id>.pt``: epoch ``nnn`` in
progress, ``ssssss`` of its optimizer steps done; ``checkpoint_every``, a time limit, a
signal) holds the same and the position inside the epoch (``"in_epoch"``), and rotates with
the epoch files; ``final.pt`` holds weights only. Reading never touches a device.

Disk: every run writes its own epoch files (a run rotates only its own, see
``keep_checkpoints``), so reruns into one ``checkpoint_dir`` add up.
:func:`earlier_runs_note` says what a folder holds from earlier runs and
:func:`prune_runs` deletes all but the newest runs' files (``keep_runs=``). A run of
several phases (``fine_tune``: frozen, then unfrozen) names each phase's files
``<run id>+<phase>`` (:func:`phase_run_id`): the phases are one run there.
"""
from __future__ import annotations

import copy
import math
import os
import re
import secrets
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from .. import runtime
from .config import callable_name
from ..step.optim import optimizer_label
from ..utils.units import format_bytes

if TYPE_CHECKING:
    from .config import TrainerConfig

__all__ = ["CheckpointError", "ResumeError", "save_checkpoint", "checkpoint_name",
           "resolve_resume", "resume_on_every_host", "check_resume",
           "model_with_weights", "sharded_meta", "run_files", "prune_runs",
           "earlier_runs_note", "checkpoint_listing", "check_extra", "RESERVED_KEYS",
           "new_run_id", "phase_run_id", "run_of", "check_run_id"]


class CheckpointError(ValueError):
    """A checkpoint file is corrupt, truncated or not an epoch checkpoint."""


class ResumeError(ValueError):
    """A checkpoint cannot be continued exactly with this trainer's configuration."""


_CKPT_KEYS = {"model", "optimizer", "epoch", "history", "base_lr", "world_size", "steps_per_epoch"}


# What an epoch checkpoint (or a .dcp twin's meta) holds itself: extra fields may not reuse them.
RESERVED_KEYS = ("model", "optimizer", "epoch", "history", "base_lr", "lr_world", "world_size",
                 "steps_per_epoch", "run_id", "initial_loss", "optimizer_name", "config", "ema",
                 "optimizer_devices", "sharded_strategy", "sharded", "device_type", "scaler",
                 "steps", "in_epoch")


# Config fields the optimizer state and the one-cycle schedule depend on: a
# resumed run with any of them changed would not continue the same run.
_RESUME_FIXED = ("batch_size", "epochs", "weight_decay", "pct_start", "div_factor",
                 "final_div_factor", "moms", "lr_scaling", "mean", "std", "accum_steps", "ema",
                 "grad_clip")


# An epoch file of a run: ``epoch_<nnn>-<run id>.pt`` or its sharded twin ``.dcp`` (a folder),
# or an in-epoch one, ``epoch_<nnn>_step<ssssss>-<run id>.pt``.
_RUN_FILE = re.compile(r"^epoch_(\d+)(?:_step\d+)?-(.+)\.(pt|dcp)$")
# A run id: what a file name can hold on every system; ``+`` joins a run and its phase.
_RUN_ID = re.compile(r"^[A-Za-z0-9_.-]+(\+[A-Za-z0-9_.-]+)?$")


def new_run_id() -> str:
    """A new run's id: the local time and 4 random hex digits (``20261202-031500-ab12``)."""
    return time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(2)


def phase_run_id(run: str, phase: str) -> str:
    """The id of phase ``phase`` of run ``run`` (``<run>+<phase>``): its files are the run's
    in :func:`run_files`, :func:`prune_runs` and :func:`earlier_runs_note`."""
    return f"{run_of(run)}+{phase}"


def run_of(run_id: str) -> str:
    """The run a run id belongs to: itself, or for a phase's id (:func:`phase_run_id`) its run."""
    return run_id.split("+", 1)[0]


def check_run_id(run_id: object) -> None:
    """Refuse a ``run_id`` that cannot name checkpoint files.

    Raises:
        ValueError: not a str of letters, digits, ``_``, ``.``, ``-`` (and one ``+<phase>``).
    """
    if not (isinstance(run_id, str) and _RUN_ID.match(run_id)):
        raise ValueError(f"run_id must be a str of letters, digits, '_', '.' and '-' (optionally "
                         f"'+<phase>': a phase of that run), e.g. {new_run_id()!r}; got {run_id!r}")


def _size(path: Path) -> int:
    if path.is_dir():
        return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    return path.stat().st_size


def run_files(directory: str | os.PathLike) -> dict[str, list[Path]]:
    """The epoch files of every run in ``directory``: ``{run id: [paths]}``, the oldest
    run first (by its newest file's modification time); the files of a run's phases
    (``<run id>+<phase>``) are its own. ``.pt`` files and sharded ``.dcp`` folders count;
    ``final.pt``, ``best.pt`` and ``history.csv`` belong to no run (each run overwrites
    them). A missing folder holds nothing."""
    folder = Path(directory)
    runs: dict[str, list[Path]] = {}
    if not folder.is_dir():
        return runs
    for p in folder.iterdir():
        m = _RUN_FILE.match(p.name)
        if m:
            runs.setdefault(run_of(m.group(2)), []).append(p)
    newest = {rid: max(p.stat().st_mtime for p in ps) for rid, ps in runs.items()}
    return {rid: sorted(runs[rid]) for rid in sorted(runs, key=lambda r: (newest[r], r))}


def prune_runs(directory: str | os.PathLike, keep: int, current: str | None = None) -> list[Path]:
    """Delete the epoch files of all but the newest ``keep`` runs in ``directory``.

    Args:
        directory: a ``checkpoint_dir``.
        keep: runs whose files stay (``current`` counts as one); 0 deletes every run's
            epoch files except ``current``'s.
        current: a run id whose run's files are never deleted (the running fit's; a
            phase's id keeps its whole run: ``fine_tune``'s frozen phase too).

    Returns:
        The paths deleted. ``final.pt``, ``best.pt``, ``final_raw.pt`` and ``history.csv``
        are never touched.
    """
    runs = run_files(directory)
    current = None if current is None else run_of(current)
    others = [rid for rid in runs if rid != current]
    stay = max(0, keep - (current is not None and current in runs))
    doomed = others[:max(0, len(others) - stay)]
    gone = []
    for rid in doomed:
        for p in runs[rid]:
            if p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)
            gone.append(p)
    return gone


def earlier_runs_note(directory: str | os.PathLike | None, keep_runs: int | None,
                      show: bool = False, current: str | None = None) -> str | None:
    """One line on what ``directory`` holds from earlier runs (files, runs, size) and how
    to remove them, or None when it holds none. ``fit`` prints it (``show``) before a run;
    ``current`` is the run's id: its files (a resumed run's, or the earlier phases' of a
    run in phases, ``fine_tune``'s) are named as such and not counted as an earlier run."""
    runs = run_files(directory) if directory is not None else {}
    if not runs:
        return None
    note = _runs_note(directory, runs, keep_runs, current)
    if show:
        print(note, flush=True)
    return note


def _runs_note(directory: Any, runs: dict[str, list[Path]], keep_runs: int | None,
               current: str | None = None) -> str:
    own = runs.pop(run_of(current), []) if current is not None else []
    head = f"checkpoint_dir {directory} holds "
    if own:
        size = format_bytes(sum(_size(p) for p in own))
        ids = sorted({_RUN_FILE.match(p.name).group(2) for p in own})
        if current in ids:
            head += f"{len(own)} epoch checkpoint(s) of run {current}, resumed here ({size})"
        else:  # only its earlier phases' (fine_tune's frozen phase, in the unfrozen one)
            words = ", ".join(r.partition("+")[2] or r for r in ids)
            head += (f"{len(own)} epoch checkpoint(s) of this run's earlier phase(s) ({words}; "
                     f"run {run_of(current)}, {size})")
        if not runs:
            return head
        head += " and "
    files = [p for ps in runs.values() for p in ps]
    total = sum(_size(p) for p in files)
    note = head + (f"{len(files)} epoch checkpoint(s) of {len(runs)} "
                   f"earlier run(s), {format_bytes(total)} (newest run {list(runs)[-1]})")
    if keep_runs is None:
        return note + (f"; they are kept (keep_runs=None). keep_runs=N keeps only the newest N "
                       f"runs' files (this one included); to delete them now: "
                       f"xla_utils.train.checkpoint.prune_runs({str(directory)!r}, keep=0)")
    doomed = list(runs)[:max(0, len(runs) - (keep_runs - 1))]
    if not doomed:
        return note + f"; keep_runs={keep_runs} keeps them all"
    size = sum(_size(p) for rid in doomed for p in runs[rid])
    return note + (f"; keep_runs={keep_runs}: the files of the {len(doomed)} oldest run(s) "
                   f"({format_bytes(size)}) are deleted once this run has written its first "
                   "epoch checkpoint")


def checkpoint_listing(folder: Path) -> str:
    """What a checkpoint folder holds, for a path that was not found: its checkpoints,
    newest first, and ``resume="last"``."""
    if not folder.is_dir():
        return f"the folder {folder} does not exist either"
    found = [p for p in folder.iterdir() if p.suffix in (".pt", ".dcp")]
    if not found:
        return f"{folder} holds no checkpoint (*.pt)"
    found.sort(key=lambda p: p.stat().st_mtime, reverse=True)
    names = ", ".join(p.name for p in found[:8]) + (f" and {len(found) - 8} more" if len(found) > 8 else "")
    return (f"{folder} holds (newest first): {names}. fit(resume=\"last\") resumes the newest "
            "good epoch checkpoint of checkpoint_dir; epoch files are named "
            "epoch_<nnn>-<run id>.pt")


def _epoch_of(path: Path) -> int | None:
    """Epoch number in an ``epoch_<nnn>[_step<s>][-<run id>].pt`` file name."""
    head = path.name[len("epoch_"):].split("-", 1)[0].split(".", 1)[0].split("_step", 1)[0]
    return int(head) if head.isdigit() else None


def _position(path: Path) -> tuple[int, int] | None:
    """``(epochs done, optimizer steps of the next epoch done)`` of a run's checkpoint file
    by its name: ``epoch_003`` is (3, 0), ``epoch_004_step000412`` is (3, 412)."""
    m = re.match(r"^epoch_(\d+)(?:_step(\d+))?[-.]", path.name)
    if m is None:
        return None
    return (int(m.group(1)), 0) if m.group(2) is None else (int(m.group(1)) - 1, int(m.group(2)))


def checkpoint_name(epoch: int, run_id: str, step: int | None = None) -> str:
    """The file name of this run's checkpoint after ``epoch`` epochs (and, inside the next
    one, ``step`` optimizer steps)."""
    if step is None:
        return f"epoch_{epoch:03d}-{run_id}.pt"
    return f"epoch_{epoch + 1:03d}_step{step:06d}-{run_id}.pt"


def _optimizer_name(spec: Any) -> str:
    return spec if isinstance(spec, str) else callable_name(spec)


def _read_checkpoint(path: Path, mmap: bool = False) -> dict:
    ckpt = torch.load(path, map_location="cpu", weights_only=False, mmap=mmap)
    if not isinstance(ckpt, dict):
        raise CheckpointError(f"{path} holds a {type(ckpt).__name__}, not an xla_utils epoch "
                              "checkpoint")
    return ckpt


def _newest_good_checkpoint(directory: Path, exclude: Path | None = None) -> tuple[Path, dict] | None:
    """The most recently written epoch checkpoint in ``directory`` that loads
    (memory-mapped, so tensors are not read), with its contents."""
    files = [p for p in directory.glob("epoch_*.pt") if p.is_file()
             and (exclude is None or p.resolve() != exclude.resolve())]
    files.sort(key=lambda p: (p.stat().st_mtime, _position(p) or (0, 0), p.name), reverse=True)
    for p in files:
        try:
            ckpt = _read_checkpoint(p, mmap=True)
        except Exception:
            try:  # e.g. the legacy non-zip format cannot be memory-mapped
                ckpt = _read_checkpoint(p)
            except Exception:
                continue
        if not _CKPT_KEYS - set(ckpt):
            return p, ckpt
    return None


def _load_checkpoint(path: str | os.PathLike) -> dict:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {path} does not exist; {checkpoint_listing(path.parent)}")
    try:
        ckpt = _read_checkpoint(path)
    except CheckpointError:
        raise
    except Exception as exc:
        size = path.stat().st_size
        good = _newest_good_checkpoint(path.parent, exclude=path)
        beside = (f"The newest good checkpoint beside it is {good[0]} (epoch {good[1]['epoch']}): "
                  f"fit(resume={str(good[0])!r})" if good is not None else
                  f"No good epoch checkpoint is beside it in {path.parent}.")
        raise CheckpointError(
            f"checkpoint {path} is corrupt or truncated ({size} bytes; {type(exc).__name__}: "
            f"{str(exc).splitlines()[0][:160] if str(exc) else 'no detail'}), e.g. a copy or "
            f"upload that did not finish. {beside}") from None
    missing = _CKPT_KEYS - set(ckpt)
    if missing:
        raise CheckpointError(f"{path} is not an xla_utils epoch checkpoint (missing "
                              f"{sorted(missing)}); final.pt holds weights only: load it with "
                              "model.load_state_dict(torch.load(path))")
    return ckpt


def _run_epoch_file(path: Path, doing: str) -> Path:
    """``epoch_003.pt`` named the pre-run-id way: the newest run's epoch 3 file beside it."""
    if path.exists() or _epoch_of(path) is None or "-" in path.name:
        return path
    runs = sorted(path.parent.glob(f"{path.stem}-*.pt"), key=lambda p: p.stat().st_mtime)
    if not runs:
        return path
    print(f"{path.name} does not exist; {doing} {runs[-1].name}, the newest "
          f"epoch {_epoch_of(path)} checkpoint in {path.parent}", flush=True)
    return runs[-1]


def resolve_resume(resume: str | os.PathLike, checkpoint_dir) -> tuple[Path, dict]:
    """``resume`` is a file, a sharded ``epoch_<nnn>-<run id>.dcp`` folder
    (``strategy="spmd"``/``"fsdp"``), a folder, or ``"last"`` (the configured
    ``checkpoint_dir``); a folder means its newest good epoch checkpoint."""
    if isinstance(resume, str) and resume == "last":
        if checkpoint_dir is None:
            raise ValueError("resume='last' needs checkpoint_dir=...; or pass a checkpoint file")
        resume = checkpoint_dir
    path = _run_epoch_file(Path(resume), "resuming from")
    if path.is_dir() and path.suffix == ".dcp":
        return path, _load_sharded_meta(path)
    if path.is_dir():
        good = _newest_good_checkpoint(path)
        if good is None:
            raise FileNotFoundError(f"no readable epoch checkpoint (epoch_*.pt) in {path}; "
                                    + checkpoint_listing(path))
        path = good[0]
        print(f"resuming from {path}, the newest good checkpoint in {path.parent}", flush=True)
    return path, _load_checkpoint(path)


def _ckpt_optimizer(ckpt: dict) -> str | None:
    """The optimizer name a checkpoint was written with (inferred for old ones)."""
    if "optimizer_name" in ckpt:
        return ckpt["optimizer_name"]
    groups = ckpt["optimizer"].get("param_groups") or [{}]
    if "decoupled" in groups[0]:
        return "adamw" if groups[0]["decoupled"] else "adam"
    if "momentum" in groups[0] and "betas" not in groups[0]:
        return "sgd"
    return None


def check_resume(path: Path, ckpt: dict, cfg: TrainerConfig, model: torch.nn.Module,
                  max_lr: float | str | None, world: int | None, steps_per_epoch: int) -> str:
    """Compare a checkpoint with the new run before anything is loaded; refuse
    (one error listing every difference) what would not continue exactly.

    Returns:
        The line ``fit`` prints: what was kept and what changed, or, when the checkpoint
        holds the run's last epoch, that the run is already complete.
    """
    old = dict(ckpt.get("config", {}))
    new = cfg.stored_options()
    fixed: list[str] = []

    def differs(a: Any, b: Any) -> bool:
        norm = (lambda v: tuple(v) if isinstance(v, (list, tuple)) else v)
        return norm(a) != norm(b)

    for k in _RESUME_FIXED:
        if k in old and differs(old[k], new[k]):
            fixed.append(f"{k}: {old[k]!r} in the checkpoint, {new[k]!r} now")
    was_opt, now_opt = _ckpt_optimizer(ckpt), _optimizer_name(cfg.optimizer)
    if was_opt is not None and was_opt != now_opt:
        fixed.append(f"optimizer: {was_opt!r} in the checkpoint, {now_opt!r} now")
    now_strategy = getattr(cfg, "strategy", "spawn")
    if "sharded" in ckpt and now_strategy == "spawn":
        fixed.append(f"strategy: a sharded checkpoint (.dcp) of strategy "
                     f"{ckpt['sharded_strategy']!r}, strategy 'spawn' now: it loads only on a mesh "
                     f"(strategy='spmd' or 'fsdp'); under 'spawn' resume from its consolidated "
                     f"twin {path.with_suffix('.pt').name}")
    if world is None:
        pass  # checked in the replica, where the world size is known
    elif ckpt["world_size"] != world:
        was, now = old.get("strategy", "spawn"), getattr(cfg, "strategy", "spawn")
        fixed.append(f"cores: {ckpt['world_size']} in the checkpoint, {world} now (strategy "
                     f"{was!r} then, {now!r} now; a checkpoint resumes under any strategy with "
                     "the same number of devices)")
    elif ckpt["steps_per_epoch"] != steps_per_epoch:
        fixed.append(f"steps per epoch: {ckpt['steps_per_epoch']} in the checkpoint, "
                     f"{steps_per_epoch} now (the training set has changed size)")
    # Only an LR given to this fit() is compared: the trainer's configured max_lr is
    # for new runs, and the checkpoint's (given to or found for that run) is kept.
    if max_lr not in (None, "find") and not math.isclose(float(max_lr), ckpt["base_lr"],
                                                         rel_tol=1e-9):
        fixed.append(f"max_lr: {ckpt['base_lr']:.6g} in the checkpoint, {max_lr!r} now "
                     "(given to fit(); leave max_lr out to keep the checkpoint's)")
    mine = model.state_dict()
    theirs = ckpt["model"]
    missing = [k for k in mine if k not in theirs]
    extra = [k for k in theirs if k not in mine]
    shapes = [f"{k} {tuple(theirs[k].shape)} vs {tuple(mine[k].shape)}" for k in mine
              if k in theirs and hasattr(theirs[k], "shape") and theirs[k].shape != mine[k].shape]
    if missing or extra or shapes:
        fixed.append("model: the checkpoint's weights do not fit this model ("
                     + "; ".join(filter(None, [
                         f"missing {missing[:5]}" if missing else "",
                         f"unexpected {extra[:5]}" if extra else "",
                         f"shapes {shapes[:5]}" if shapes else ""])) + ")")
    if fixed:
        raise ResumeError(
            f"cannot resume from {path} (epoch {ckpt['epoch']}): the optimizer state and the "
            "one-cycle schedule would not continue exactly, because\n  " + "\n  ".join(fixed)
            + "\nEither change these back to continue that run, or start a new schedule from "
            "its weights: trainer.model.load_state_dict(torch.load(path)['model']), then "
            "fit() without resume.")
    changed = [f"{k} {old[k]!r} -> {new[k]!r}" for k in new
               if k in old and k not in _RESUME_FIXED and k != "max_lr" and differs(old[k], new[k])]
    total, run = old.get("epochs", cfg.epochs), ckpt.get("run_id", "(unnamed)")
    kept = _kept_words(ckpt, cfg, max_lr)
    if ckpt.get("in_epoch"):
        return _in_epoch_resume(path, ckpt, cfg, kept + ", RNG position and history"
                                + (f"; changed: {', '.join(changed)}" if changed else ""))
    if ckpt["epoch"] >= total:
        return (f"run {run} is already complete: {path.name} holds epoch {ckpt['epoch']} of "
                f"{total}. Nothing was trained and no file written; fit() returns its history "
                "and trainer.model takes its last epoch's weights. To train more, start a new "
                "schedule from them: fit() without resume.")
    return (f"resuming run {run} from {path.name} after epoch "
            f"{ckpt['epoch']} of {total}: {kept} and history"
            + (f"; changed: {', '.join(changed)}" if changed else "") + ".")


def _kept_words(ckpt: dict, cfg: TrainerConfig, max_lr: float | str | None) -> str:
    """What a resumed run keeps of its checkpoint, in words (the LR, optimizer, batch...)."""
    return (f"kept max_lr {ckpt['base_lr']:.3g}" + _kept_lr_note(ckpt["base_lr"], cfg.max_lr, max_lr)
            + f", optimizer {optimizer_label(cfg.optimizer)}, batch {cfg.batch_size} x "
            f"{runtime.replicas_word(ckpt['world_size'], ckpt.get('device_type', 'xla'))}, "
            "its schedule, optimizer state")


def _in_epoch_resume(path: Path, ckpt: dict, cfg: TrainerConfig, kept: str) -> str:
    """The line of a resume from an in-epoch checkpoint (``"resumed at epoch 7, step 412 of
    1,250: ..."``); refused when ``log_every`` changed (the RNGs are seeded again at every
    loss read, so the rest of the epoch would draw otherwise)."""
    done, spe = ckpt["in_epoch"]["step"], ckpt["steps_per_epoch"]
    was, now = ckpt["in_epoch"].get("log_every"), cfg.log_every
    if was is not None and was != now:
        raise ResumeError(
            f"cannot resume from {path}: it was written inside an epoch with log_every={was} "
            f"(the RNGs are seeded again at every loss read), log_every={now} now would not "
            f"continue exactly. Fix: log_every={was}")
    return (f"resumed at epoch {ckpt['epoch'] + 1}, step {done:,} of {spe:,}: run "
            f"{ckpt.get('run_id', '(unnamed)')} from {path.name}, {kept}.")


def check_extra(extra: Any) -> None:
    """Refuse extra checkpoint fields (``fit(checkpoint_extra=...)``) that are not a dict
    with str keys, or that reuse a key the checkpoint holds itself (:data:`RESERVED_KEYS`),
    before any device time.

    Raises:
        TypeError: not a dict, or a key that is not a str.
        ValueError: a reserved key, named with the fix.
    """
    if extra is None:
        return
    if not isinstance(extra, dict) or not all(isinstance(k, str) for k in extra):
        raise TypeError(f"checkpoint_extra must be a dict with str keys (stored beside the run's "
                        f"state in every epoch checkpoint), got {extra!r}")
    taken = sorted(k for k in extra if k in RESERVED_KEYS)
    if taken:
        raise ValueError(f"checkpoint_extra uses {taken}, which every epoch checkpoint holds "
                         f"itself ({', '.join(RESERVED_KEYS)}). Fix: choose other keys, e.g. "
                         f"{{'my_{taken[0]}': ...}}")


def _kept_lr_note(kept: float, configured: float | str, given: float | str | None) -> str:
    """Why a resumed run's max_lr is not the trainer's configured one, in words ("" when
    they agree)."""
    if given == "find":
        return " (the checkpoint's; a resumed run does not sweep again)"
    if configured == "find" or not math.isclose(float(configured), kept, rel_tol=1e-9):
        return (f" from the checkpoint (this trainer's max_lr={configured!r} applies to new "
                "runs only)")
    return ""


def model_with_weights(model: torch.nn.Module, path: str | os.PathLike) -> torch.nn.Module:
    """A copy of ``model`` with the weights of ``final.pt`` or an epoch checkpoint (its EMA
    weights when it has them: a run with ``ema`` set)."""
    path = _run_epoch_file(Path(path), "using")
    if not path.is_file():
        raise FileNotFoundError(f"weights={str(path)!r} does not exist; "
                                f"{checkpoint_listing(path.parent)}")
    try:
        obj = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as exc:
        raise ValueError(f"weights={str(path)!r} cannot be read ({type(exc).__name__}: {exc}); "
                         "the file is corrupt or truncated, or not a torch checkpoint") from None
    key = "ema" if isinstance(obj, dict) and isinstance(obj.get("ema"), dict) else "model"
    state = obj[key] if isinstance(obj, dict) and isinstance(obj.get(key), dict) else obj
    if not isinstance(state, dict):
        raise ValueError(f"weights={str(path)!r} holds a {type(state).__name__}, not a state dict "
                         "or an xla_utils checkpoint")
    net = copy.deepcopy(model)
    try:
        net.load_state_dict(state)
    except RuntimeError as exc:
        raise ValueError(f"weights={str(path)!r} do not fit this trainer's model: {exc}") from None
    return net


def save_checkpoint(model: torch.nn.Module, opt: torch.optim.Optimizer, cfg: TrainerConfig, *,
                    epoch: int,
                    history: list[dict[str, Any]], base_lr: float, lr_world: int, world_size: int,
                    steps_per_epoch: int, run_id: str, host_state: dict | None,
                    initial_loss: float | None, ema: dict | None = None,
                    scaler: dict | None = None, extra: dict | None = None,
                    steps: list[dict[str, Any]] | None = None,
                    in_epoch: dict[str, Any] | None = None) -> dict:
    """Write this run's epoch checkpoint from every replica; keep its newest files.

    Call it on every rank. Writes ``epoch_<nnn>-<run_id>.pt`` in
    ``cfg.checkpoint_dir`` (through :func:`xla_utils.runtime.save`), then the
    master deletes this run's older epoch files beyond ``cfg.keep_checkpoints`` and,
    with ``cfg.keep_runs``, the files of runs older than the newest ``keep_runs``
    (:func:`prune_runs`; never this run's).

    Args:
        model, opt: The replica's model and optimizer.
        cfg: The run's :class:`~xla_utils.train.config.TrainerConfig`.
        epoch: Epochs completed (1-based number of the epoch just ended).
        history: The per-epoch records so far.
        base_lr: ``max_lr`` for ``lr_world`` cores, as given or found.
        lr_world: The world size ``base_lr`` is meant for.
        world_size: This run's world size.
        steps_per_epoch: Optimizer steps per epoch.
        run_id: Names this run's files.
        host_state: A host copy of the weights to save instead of the model's.
        initial_loss: The untrained model's loss at the run's first step.
        ema: The EMA weights (``cfg.ema`` set), saved under ``"ema"``.
        scaler: The fp16 gradient scaler's state (``GradScaler.state_dict()``), saved
            under ``"scaler"`` and resumed by :func:`xla_utils.train.loop.set_up`.
        extra: More keys to store (``fine_tune`` stores which phase wrote the file).
        steps: The per-step records so far (``History.steps``), saved under ``"steps"``.
        in_epoch: Written inside epoch ``epoch + 1``: its position (``step``: optimizer steps
            done in it; ``train_loss``: its running loss; ``log_every``), saved under
            ``"in_epoch"`` in ``epoch_<epoch + 1>_step<step>-<run_id>.pt``.

    Returns:
        What was written (the state dict).
    """
    directory = Path(cfg.checkpoint_dir)
    state = {
        "model": host_state if host_state is not None else model.state_dict(),
        "optimizer": opt.state_dict(), "epoch": epoch,
        "history": history, "base_lr": base_lr, "lr_world": lr_world, "world_size": world_size,
        "steps_per_epoch": steps_per_epoch, "run_id": run_id, "initial_loss": initial_loss,
        "optimizer_name": _optimizer_name(cfg.optimizer), "device_type": runtime.device().type,
        "config": cfg.stored_options(),
    }
    if ema is not None:
        state["ema"] = ema
    if scaler is not None:
        state["scaler"] = scaler
    if steps is not None:
        state["steps"] = steps
    if in_epoch is not None:
        state["in_epoch"] = in_epoch
    state.update(extra or {})
    runtime.save(state, directory / checkpoint_name(
        epoch, run_id, None if in_epoch is None else in_epoch["step"]))
    if runtime.is_master():
        # Only this run's files, ranked by position: a rerun into the same
        # folder never deletes another run's checkpoints, nor its own newest.
        mine = sorted((_position(p), p) for p in directory.glob(f"epoch_*-{run_id}.pt")
                      if _position(p) is not None)
        for _, p in mine[:-cfg.keep_checkpoints]:
            p.unlink(missing_ok=True)
        if cfg.keep_runs is not None:
            gone = prune_runs(directory, cfg.keep_runs, current=run_id)
            if gone:
                print(f"keep_runs={cfg.keep_runs}: deleted {len(gone)} epoch checkpoint(s) of "
                      f"earlier runs in {directory}", flush=True)
    return state


def sharded_meta(state: dict, strategy: str) -> dict:
    """What a ``.dcp`` sharded checkpoint keeps beside its tensors: the epoch checkpoint
    ``state`` with every tensor as a ``meta`` tensor (shape and dtype, no data), the
    optimizer state's devices, and the strategy that wrote it."""
    def skel(t: Any) -> Any:
        return torch.empty(t.shape, dtype=t.dtype, device="meta") if isinstance(t, torch.Tensor) else t

    meta = {k: v for k, v in state.items() if k not in ("model", "optimizer", "ema")}
    meta["model"] = {k: skel(v) for k, v in state["model"].items()}
    opt = state["optimizer"]
    meta["optimizer"] = {"param_groups": opt["param_groups"],
                         "state": {i: {k: skel(v) for k, v in e.items()}
                                   for i, e in opt["state"].items()}}
    meta["optimizer_devices"] = {i: {k: v.device.type for k, v in e.items()
                                     if isinstance(v, torch.Tensor)}
                                 for i, e in opt["state"].items()}
    meta["sharded_strategy"] = strategy
    return meta


def _load_sharded_meta(path: Path) -> dict:
    """The resume state of a ``.dcp`` folder (its tensors stay in the folder)."""
    from ..runtime.spmd import SHARDED_META

    f = path / SHARDED_META
    if not f.is_file():
        raise CheckpointError(f"{path} is not an xla_utils sharded checkpoint (no {SHARDED_META}: "
                              "written before sharded resume existed, or not by xla_utils). Fix: "
                              "resume from its consolidated twin " f"{path.with_suffix('.pt').name}")
    meta = torch.load(f, map_location="cpu", weights_only=False)
    meta["sharded"] = str(path)
    return meta

def resume_on_every_host(resume: str | os.PathLike, checkpoint_dir: Any,
                          placement: runtime.Placement) -> tuple[Any, dict]:
    """``resolve_resume``'s checkpoint, the same on every host of a run spanning several
    (each host reads its own disk: a local ``checkpoint_dir`` holds the files only on the host
    that wrote them). Raises ``ResumeError`` naming the fix when a host lacks it or differs."""
    where = runtime.slice_host()
    fix = ("each host of the run reads its own disk, and only global rank 0's host wrote the "
           "checkpoints: put them in a bucket (checkpoint_dir='gs://bucket/run'), which every "
           "host pulls before the run")
    try:
        path, ckpt = resolve_resume(resume, checkpoint_dir)
    except (FileNotFoundError, ResumeError, CheckpointError) as exc:
        if where is None:
            raise
        raise ResumeError(f"{exc}\nThis is host {where[0]} of {where[1]}: {fix}") from None
    if where is not None:
        mine = (os.path.basename(str(path)), ckpt["epoch"], (ckpt.get("in_epoch") or {}).get("step"))
        theirs = runtime.same_everywhere(mine, placement)
        if tuple(theirs) != mine:
            raise ResumeError(f"resume={resume!r} is {mine[0]} (epoch {mine[1]}) on host {where[0]} "
                              f"of {where[1]} but {theirs[0]} (epoch {theirs[1]}) on global rank "
                              f"0's host: {fix}")
    return path, ckpt

