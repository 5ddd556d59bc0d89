"""Fine-tuning a pretrained backbone, fastai style: :func:`fine_tune`, :func:`freeze`,
:func:`unfreeze`, the head and layer groups, pretrained weights.

``trainer.fine_tune(epochs, freeze_epochs=1)`` is two one-cycle runs of
:meth:`~xla_utils.train.trainer.OneCycleTrainer.fit` (as fastai's ``Learner.fine_tune``):

1. **frozen**: the body's weights are frozen (``requires_grad=False``) except its
   BatchNorm layers, which stay trainable and in training mode (fastai's
   ``train_bn=True``: frozen statistics from another image set hurt more than they
   help); the head trains at ``base_lr`` (body BatchNorm at ``base_lr / 10``) for
   ``freeze_epochs`` with ``pct_start=0.99``;
2. **unfrozen**: every parameter trains for ``epochs`` with discriminative LRs: the
   parameters are split into ``n_groups`` layer groups (the head last) whose LRs are
   spaced geometrically from ``base_lr / 2 / lr_mult`` (first group) to
   ``base_lr / 2`` (head), ``pct_start=0.3``, ``div_factor=5``.

The two phases are one run on disk: their epoch files are named ``<run id>+frozen`` and
``<run id>+unfrozen`` (:func:`xla_utils.train.checkpoint.phase_run_id`), so the folder's
listing counts them as one run and ``keep_runs`` never deletes the frozen phase's files
while the unfrozen phase runs.

Each phase is one training graph: freezing changes which gradients exist, so the
frozen phase compiles its own step once and the unfrozen phase once; nothing
recompiles inside a phase. The LR multiplier of a group rides in its param group
(``lr_mult``, applied by :func:`xla_utils.step.optim.set_hparams`), so scheduled LRs stay
device data.

The head is found automatically: timm models' ``get_classifier()`` (or
``pretrained_cfg`` / ``default_cfg['classifier']``), torchvision's ``fc`` (ResNet,
RegNet, ...), ``classifier`` (EfficientNet, MobileNet, DenseNet, VGG, ConvNeXt),
``heads`` (ViT) or ``head`` (Swin), the last child with parameters of an
``nn.Sequential``; or named with ``head="fc"`` (a submodule name or a list of them).
"""
from __future__ import annotations

import dataclasses
import functools
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence, Union

import torch

from .checkpoint import new_run_id, phase_run_id, resolve_resume, run_of

if TYPE_CHECKING:
    from .history import History
    from .trainer import OneCycleTrainer

__all__ = ["find_head", "freeze", "unfreeze", "layer_groups", "layer_group_lrs", "load_pretrained",
           "fine_tune"]

HEAD_NAMES = ("fc", "classifier", "heads", "head")
BN_TYPES = (torch.nn.modules.batchnorm._BatchNorm, torch.nn.GroupNorm, torch.nn.LayerNorm)
HeadSpec = Union[str, Sequence[str], None]


def find_head(model: torch.nn.Module, head: HeadSpec = None) -> list[str]:
    """Names of the submodules that form ``model``'s classifier head.

    Args:
        model: A timm or torchvision classifier, an ``nn.Sequential``, or any module
            when ``head`` is given.
        head: A submodule name (``"fc"``, ``"head.fc"``) or a list of them; default
            None = found automatically (see the module docstring).

    Raises:
        ValueError: ``head`` names no submodule, or no head could be found (the
            message lists the top-level children to choose from).
    """
    names = {id(m): n for n, m in model.named_modules()}
    if head is not None:
        heads = [head] if isinstance(head, str) else list(head)
        for h in heads:
            try:
                model.get_submodule(h)
            except AttributeError:
                raise ValueError(f"head={h!r} is not a submodule of {type(model).__name__}; its "
                                 f"children are {[n for n, _ in model.named_children()]}") from None
        return heads
    if callable(getattr(model, "get_classifier", None)):  # timm
        clf = model.get_classifier()
        if isinstance(clf, torch.nn.Module) and names.get(id(clf)) and _has_params(clf):
            return [names[id(clf)]]
        cfg = getattr(model, "pretrained_cfg", None) or getattr(model, "default_cfg", None) or {}
        spec = cfg.get("classifier") if isinstance(cfg, dict) else None
        if spec:
            return find_head(model, spec)
    for n in HEAD_NAMES:
        m = getattr(model, n, None)
        if isinstance(m, torch.nn.Module) and _has_params(m):
            return [n]
    if isinstance(model, torch.nn.Sequential):
        with_params = [n for n, m in model.named_children() if _has_params(m)]
        if with_params:
            return [with_params[-1]]
    raise ValueError(f"cannot find the classifier head of {type(model).__name__}: name it with "
                     f"head=<submodule name> (its children are "
                     f"{[n for n, _ in model.named_children()]})")


def _has_params(m: torch.nn.Module) -> bool:
    return any(True for _ in m.parameters())


def _in_head(name: str, heads: list[str]) -> bool:
    return any(name == h or name.startswith(h + ".") for h in heads)


def layer_groups(model: torch.nn.Module, head: HeadSpec = None, n_groups: int = 3) -> list[list[str]]:
    """Parameter names in ``n_groups`` layer groups, input side first, the head last.

    The body's parameters (in ``named_parameters`` order) are cut into
    ``n_groups - 1`` contiguous groups of about equal tensor counts.

    Raises:
        ValueError: ``n_groups < 2``, or the model has no body parameters.
    """
    if not isinstance(n_groups, int) or n_groups < 2:
        raise ValueError(f"n_groups must be an int >= 2 (body groups + the head), got {n_groups!r}")
    heads = find_head(model, head)
    names = [n for n, _ in model.named_parameters()]
    body = [n for n in names if not _in_head(n, heads)]
    head_names = [n for n in names if _in_head(n, heads)]
    if not body or not head_names:
        raise ValueError(f"head {heads} leaves {'no body' if not body else 'no head'} parameters: "
                         "name another head with head=...")
    k = min(n_groups - 1, len(body))
    cuts = [round(i * len(body) / k) for i in range(k + 1)]
    return [body[cuts[i]:cuts[i + 1]] for i in range(k)] + [head_names]


def even_mults(lr_mult: float, n: int) -> list[float]:
    """``n`` multipliers spaced geometrically from ``1 / lr_mult`` to 1 (fastai's
    ``even_mults`` divided by the top LR)."""
    if n == 1:
        return [1.0]
    return [float(lr_mult) ** -((n - 1 - i) / (n - 1)) for i in range(n)]


def _param_groups(model: torch.nn.Module, groups: list[list[str]],
                  mults: list[float]) -> list[dict[str, Any]]:
    """Param-group dicts of ``model`` (the replica's copy): trainable parameters
    only, each group with its ``lr_mult``."""
    params = dict(model.named_parameters())
    out = []
    for names, mult in zip(groups, mults):
        ps = [params[n] for n in names if params[n].requires_grad]
        if ps:
            out.append({"params": ps, "lr_mult": mult})
    return out


def freeze(model: torch.nn.Module, head: HeadSpec = None, train_bn: bool = True) -> list[str]:
    """Freeze everything but the head (and, with ``train_bn``, the normalisation
    layers: BatchNorm, GroupNorm, LayerNorm, as fastai). Returns the head's names."""
    heads = find_head(model, head)
    norm = {n for n, m in model.named_modules() if isinstance(m, BN_TYPES)} if train_bn else set()
    for n, p in model.named_parameters():
        owner = n.rpartition(".")[0]
        p.requires_grad_(_in_head(n, heads) or owner in norm)
    return heads


def unfreeze(model: torch.nn.Module) -> None:
    """Make every parameter of ``model`` trainable again."""
    for p in model.parameters():
        p.requires_grad_(True)


def layer_group_lrs(groups: list[list[str]], mults: list[float]
                    ) -> Callable[[torch.nn.Module], list[dict[str, Any]]]:
    """``fit(lr_groups=...)`` for the layer groups ``groups`` (parameter names, e.g. of
    :func:`layer_groups`): ``model -> param-group dicts``, each group's trainable parameters
    with its LR multiplier ``mults[i]`` (``lr_mult``: the group trains at the scheduled LR
    times it). Picklable, for the replicas."""
    return functools.partial(_param_groups, groups=groups, mults=mults)


def load_pretrained(model: torch.nn.Module, source: str | os.PathLike | Callable[[], torch.nn.Module]
                    | dict, head: HeadSpec = None) -> list[str]:
    """Load pretrained weights into ``model``, except a head of another shape.

    Args:
        model: The model to fine-tune (its head sized for the new task).
        source: A local file (a state dict, ``final.pt`` / ``best.pt`` of :meth:`fit`,
            an ``epoch_*.pt`` checkpoint, or a ``{"state_dict": ...}`` / ``{"model":
            ...}`` dict), a state dict, or a zero-argument factory returning a
            pretrained ``nn.Module``. Nothing is downloaded here.
        head: As in :func:`find_head`: head parameters missing from ``source`` or of
            another shape are skipped (left as initialised).

    Returns:
        The names of the parameters/buffers left as they were (the head's).

    Raises:
        FileNotFoundError: ``source`` is a path that does not exist.
        ValueError: a body parameter is missing from ``source`` or has another shape.
    """
    if callable(source) and not isinstance(source, torch.nn.Module):
        source = source()
    if isinstance(source, torch.nn.Module):
        state = source.state_dict()
    elif isinstance(source, dict):
        state = source
    else:
        path = Path(source).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"pretrained weights {path} do not exist (pass a local file, "
                                    "a state dict or a model factory)")
        state = torch.load(path, map_location="cpu", weights_only=False)
    for key in ("model", "state_dict"):
        if isinstance(state.get(key), dict):
            state = state[key]
    heads = find_head(model, head)
    own = model.state_dict()
    skipped, bad = [], []
    for n, t in own.items():
        ok = n in state and tuple(state[n].shape) == tuple(t.shape)
        if not ok:
            (skipped if _in_head(n, heads) else bad).append(n)
    if bad:
        raise ValueError(f"pretrained weights do not fit the body of {type(model).__name__}: "
                         f"{len(bad)} tensor(s) missing or of another shape, e.g. {bad[:3]}")
    model.load_state_dict({n: state[n] for n in own if n not in skipped}, strict=False)
    return skipped


def fine_tune(trainer: "OneCycleTrainer", epochs: int, freeze_epochs: int = 1,
              base_lr: float | str | None = None, lr_mult: float = 100.0, pct_start: float = 0.3,
              div: float = 5.0, head: HeadSpec = None, n_groups: int = 3, train_bn: bool = True,
              weights: Any = None, resume: str | os.PathLike | None = None,
              **fit_kwargs: Any) -> "History":
    """fastai's ``fine_tune``: the head alone, then everything with discriminative LRs.

    Args:
        trainer: The :class:`~xla_utils.train.trainer.OneCycleTrainer` whose model is the
            pretrained network (a factory passed to it may load timm/torchvision weights).
        epochs: Epochs of the unfrozen phase (>= 1).
        freeze_epochs: Epochs of the frozen phase (>= 0; 0 skips it). Default 1.
        base_lr: Peak LR of the frozen phase for one core (scaled by the number of
            cores as in :meth:`fit`); the unfrozen phase uses ``base_lr / 2`` for
            the head. Default None = the trainer's ``max_lr`` (``"find"``: the
            frozen phase runs the LR finder).
        lr_mult: Ratio of the head's LR to the first layer group's. Default 100.
        pct_start, div: The unfrozen phase's one-cycle warm-up fraction and
            ``div_factor``. Defaults 0.3 and 5 (fastai).
        head, n_groups: The head (see :func:`find_head`) and the number of layer
            groups (head included, >= 2). Defaults None and 3.
        train_bn: Keep normalisation layers trainable while frozen. Default True.
        weights: Pretrained weights loaded first (see :func:`load_pretrained`);
            default None = the model as it is. Not loaded when resuming.
        resume: An epoch checkpoint of an earlier ``fine_tune`` (a file, a folder
            or ``"last"``, as in :meth:`fit`): every checkpoint records its phase, so
            a run stopped in the frozen phase continues it, and one stopped in the
            unfrozen phase continues there (the frozen phase is not rerun; its
            epochs come back from the checkpoint). Default None (a new run).
        **fit_kwargs: ``cores``, ``simulate``, ``timeout``, ``check``, ``time_limit`` of
            :meth:`fit` (one limit for both phases).

    Returns:
        One :class:`~xla_utils.train.history.History`: the frozen phase's epochs then the
        unfrozen phase's (numbered on, each with ``phase`` ``"frozen"`` /
        ``"unfrozen"``); the other fields are the unfrozen phase's.

    Raises:
        ValueError: bad ``epochs`` / ``freeze_epochs`` / ``lr_mult`` / ``n_groups``,
            a head that cannot be found, or a ``resume`` checkpoint that ``fit``
            wrote outside ``fine_tune``, before any device time.
    """
    _check_fine_tune_args(epochs, freeze_epochs, lr_mult, fit_kwargs)
    model, cfg = trainer.model, trainer.config
    _Budget.install(fit_kwargs)
    groups = layer_groups(model, head, n_groups)
    path, resumed = _resume_phase(resume, cfg.checkpoint_dir)
    run = resumed.get("run") or new_run_id()  # the phases' files are one run's
    if weights is not None and path is None:
        load_pretrained(model, weights, head)
    base = cfg.max_lr if base_lr is None else base_lr
    phases: list[tuple[str, "History"]] = []
    frozen = dict(epochs=freeze_epochs, pct_start=0.99)  # fit's per-run schedule of each phase
    unfrozen = dict(epochs=epochs, pct_start=pct_start, div_factor=div)
    try:
        if freeze_epochs and resumed.get("phase") != "unfrozen":
            freeze(model, head, train_bn)
            mults = [0.1] * (len(groups) - 1) + [1.0]
            h1 = _phase(trainer, groups, mults, frozen, base, fit_kwargs, "frozen", [], path, [],
                        run)
            phases.append(("frozen", h1))
            base, path = h1.base_lr, None
            if h1.stop_reason and not h1.stop_reason.startswith("early stop"):
                return _merge(phases)
        unfreeze(model)
        if path is not None:  # the unfrozen phase resumes: its max_lr is the checkpoint's
            phase2_lr: float | str = resumed["base_lr"]
        else:
            phase2_lr = "find" if base == "find" else float(base) / 2
        done = list(phases[0][1].epochs) if phases else []
        h2 = _phase(trainer, groups, even_mults(lr_mult, len(groups)), unfrozen, phase2_lr,
                    fit_kwargs, "unfrozen", done, path, resumed.get("before", []), run)
        if not phases and h2.epochs and h2.epochs[0].get("phase") == "frozen":
            return h2  # resumed: the frozen epochs came back from the checkpoint
        phases.append(("unfrozen", h2))
    finally:
        trainer.unfreeze()
    return _merge(phases)


def _check_fine_tune_args(epochs: Any, freeze_epochs: Any, lr_mult: Any,
                          fit_kwargs: dict[str, Any]) -> None:
    """Refuse bad ``fine_tune`` arguments before any device time."""
    if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1:
        raise ValueError(f"fine_tune: epochs must be an int >= 1 (unfrozen epochs), got {epochs!r}")
    if isinstance(freeze_epochs, bool) or not isinstance(freeze_epochs, int) or freeze_epochs < 0:
        raise ValueError(f"fine_tune: freeze_epochs must be an int >= 0, got {freeze_epochs!r}")
    if not (isinstance(lr_mult, (int, float)) and lr_mult >= 1):
        raise ValueError(f"fine_tune: lr_mult must be a number >= 1 (head LR / first group LR), "
                         f"got {lr_mult!r}")
    unknown = set(fit_kwargs) - {"cores", "simulate", "timeout", "check", "time_limit"}
    if unknown:
        raise TypeError(f"fine_tune: unexpected argument(s) {sorted(unknown)}; fit options "
                        "passed on are cores, simulate, timeout, check, time_limit")


def _resume_phase(resume: Any, checkpoint_dir: Any) -> tuple[Path | None, dict[str, Any]]:
    """``(checkpoint file, its fine_tune record)`` of ``fine_tune(resume=...)``: the
    record holds ``"phase"`` (``"frozen"`` | ``"unfrozen"``), ``"before"`` (the earlier
    phase's epochs), ``"base_lr"`` (the run's max_lr for one core) and ``"run"`` (the run
    whose phase wrote it); ``(None, {})`` for a new run."""
    if resume is None:
        return None, {}
    path, ckpt = resolve_resume(resume, checkpoint_dir)
    info = ckpt.get("fine_tune")
    if not isinstance(info, dict) or info.get("phase") not in ("frozen", "unfrozen"):
        raise ValueError(f"fine_tune(resume={str(resume)!r}): {path} was written by fit(), not "
                         "by fine_tune (it records no phase); continue it with "
                         "trainer.fit(resume=...) or start fine_tune without resume")
    run = ckpt.get("run_id")
    return path, {**info, "base_lr": float(ckpt["base_lr"]), "run": run and run_of(run)}


def _phase(trainer: OneCycleTrainer, groups: list[list[str]], mults: list[float],
           schedule: dict[str, Any], max_lr: float | str, fit_kwargs: dict[str, Any], name: str,
           before: list[dict[str, Any]], resume: Path | None,
           resumed_before: list[dict[str, Any]], run: str) -> History:
    """One phase: ``fit`` with the phase's ``schedule`` (``epochs``, ``pct_start``, ...: fit's
    per-run overrides) and layer-group LRs, a planned continuation of the trained weights
    (no warning about them); its checkpoints record ``name`` and the earlier phase's epochs
    (``before``) and are named as phase ``name`` of ``run`` (a resumed phase keeps its
    checkpoint's run id). A resumed unfrozen phase returns the merged history
    (``resumed_before``: the frozen epochs its checkpoint recorded)."""
    kwargs = dict(fit_kwargs)
    if isinstance(kwargs.get("time_limit"), _Budget):
        kwargs["time_limit"] = kwargs["time_limit"].left()
    h = trainer.fit(max_lr=max_lr, resume=resume, lr_groups=layer_group_lrs(groups, mults),
                    checkpoint_extra={"fine_tune": {"phase": name, "before": before}},
                    warn_if_trained=False, **schedule, **kwargs,
                    run_id=None if resume is not None else phase_run_id(run, name))
    if resume is not None and name == "unfrozen" and resumed_before:
        return _merge([("frozen", dataclasses.replace(h, epochs=list(resumed_before), steps=[])),
                       ("unfrozen", h)])
    return h


class _Budget:
    """``fine_tune(time_limit=...)``: the seconds left of one limit over both phases."""

    def __init__(self, seconds: float):
        self.deadline = time.time() + seconds

    @classmethod
    def install(cls, fit_kwargs: dict[str, Any]) -> None:
        """``fit_kwargs["time_limit"]`` (a duration or ``"auto"``) as one budget for both
        phases: the unfrozen phase gets what the frozen one left."""
        if fit_kwargs.get("time_limit") is None:
            return
        from ..env.detection import platform_name
        from .session import resolve_time_limit

        fit_kwargs["time_limit"] = cls(resolve_time_limit(fit_kwargs["time_limit"],
                                                          platform_name())[0])

    def left(self) -> float:
        return max(self.deadline - time.time(), 1e-3)


def _merge(phases: list[tuple[str, "History"]]) -> "History":
    """The phases' histories as one (epochs and steps numbered on, tagged with their phase)."""
    records, steps, offset, step0 = [], [], 0, 0
    for name, h in phases:
        for r in h.epochs:
            records.append({**r, "epoch": r["epoch"] + offset, "phase": name})
        steps += [{**r, "epoch": r["epoch"] + offset, "step": r["step"] + step0}
                  for r in h.steps]
        offset += len(h.epochs)
        step0 = steps[-1]["step"] if steps else step0
    last = phases[-1][1]
    best = None if last.best_epoch is None else last.best_epoch + offset - len(last.epochs)
    return dataclasses.replace(last, epochs=records, steps=steps, best_epoch=best,
                               stop_reason=next((h.stop_reason for _, h in phases
                                                 if h.stop_reason), None))
