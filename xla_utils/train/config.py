"""The trainer's configuration: :class:`TrainerConfig`, the settings of
:class:`~xla_utils.train.trainer.OneCycleTrainer` in seven groups, and the values its
options take.

Each group is a small dataclass that checks its own fields when built
(:class:`DataSettings`, :class:`ScheduleSettings`, :class:`OptimSettings`,
:class:`AugmentSettings`, :class:`CheckpointSettings`, :class:`DeviceSettings`,
:class:`DiagnosticsSettings`); :class:`TrainerConfig` holds one of each and checks the
few rules that span two groups. Users pass the options flat
(``OneCycleTrainer(..., batch_size=64, max_lr=1e-3)``, ``TrainerConfig(epochs=5)``): each
keyword goes to its group (:data:`OPTION_GROUPS`), and an unknown one is refused with the
nearest name and its group. A low module of its own: the parts of the trainer import the
group they read from here, and it imports none of them back.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch

from .. import runtime
from ..data import IMAGENET_MEAN, IMAGENET_STD
from ..runtime.shardinfo import STRATEGIES
from ..utils.suggest import choice, closest, deprecated, did_you_mean
from ..step.clip import check_grad_clip
from ..step.device_plan import PRECISIONS
from .ema import check_ema
from .metrics import METRICS, metric_names, normalize_metrics
from ..step.optim import resolve_optimizer
from .schedule import OneCycleSchedule
from .session import check_checkpoint_every
from .torch_compile import check_compile_option

__all__ = ["TrainerConfig", "DataSettings", "ScheduleSettings", "OptimSettings",
           "AugmentSettings", "CheckpointSettings", "DeviceSettings", "DiagnosticsSettings",
           "GROUPS", "OPTION_GROUPS", "LR_SCALING", "ON_NAN", "LOSS_MONITORS",
           "METRIC_MONITORS", "check_option_names", "callable_name", "TENSORBOARD_MISSING"]

LR_SCALING = ("linear", "sqrt", "none")
ON_NAN = ("stop", "continue")
# Values of a history record that ``monitor`` may name (besides ``top<k>`` and the names of
# callable metrics); which way is better: ``metrics.lower_is_better``.
LOSS_MONITORS = ("val_loss", "train_loss")
METRIC_MONITORS = tuple(METRICS)
# Other libraries' names for an option (Lightning, Hugging Face, timm), suggested as it.
_THEIR_NAMES = {"gradient_clip_val": "grad_clip", "max_grad_norm": "grad_clip",
                "clip_grad": "grad_clip", "clip_grad_norm": "grad_clip"}
TENSORBOARD_MISSING = ("tensorboard= writes TensorBoard event files, which needs the tensorboard "
                       "package: pip install tensorboard (or tensorboard=None)")


def callable_name(fn: Any) -> str:
    """A callable option as a checkpoint names it: ``"callable module.qualname"``."""
    return f"callable {getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def _positive_int(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, int) and value >= 1


def _check_hook(name: str, fn: Any, what: str) -> None:
    """Refuse a hook option that is neither None nor callable."""
    if fn is not None and not callable(fn):
        raise TypeError(f"{name} must be a callable ({what}) or None, got {fn!r}")


@dataclass
class DataSettings:
    """What the loader feeds (``config.data``).

    Attributes:
        batch_size: Samples per core per step (global batch = batch_size x cores); default 32.
        eval_batch_size: Samples per core per batch of ``fit``'s per-epoch validation
            (one padded, masked shape). Default None: :meth:`val_batch_size`'s choice.
        num_workers: Host threads/processes assembling batches (None = automatic).
        flip: Random horizontal flip of uint8 image batches on the device. Default True.
        mean, std: Per-channel normalisation of uint8 images, in 0..1 units
            (default ImageNet's).
        seed: Seeds data order and device RNG (flips, dropout). Default 0.
        transform: Per-sample host augmentation of the training batches: a callable given
            each image as a uint8 ``[C, H, W]`` tensor after the cache's variant is read
            (torchvision v2 transforms take it), returning a uint8 tensor of the same shape,
            run in the loader threads (:func:`xla_utils.data.iterate_batches`). Needs a
            cache, or a dataset around one on the loader threads; checked on sample 0 before
            any device time. Not applied to validation, ``predict``/``evaluate`` or the LR
            finder. Default None.
    """

    batch_size: int = 32
    eval_batch_size: int | None = None
    num_workers: int | None = None
    flip: bool = True
    mean: tuple[float, float, float] = IMAGENET_MEAN
    std: tuple[float, float, float] = IMAGENET_STD
    seed: int = 0
    transform: Callable[[torch.Tensor], torch.Tensor] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise ValueError(f"batch_size must be a positive int (per core), got {self.batch_size!r}")
        ebs = self.eval_batch_size
        if ebs is not None and not _positive_int(ebs):
            raise ValueError(f"eval_batch_size must be a positive int (per core) or None "
                             f"(max(batch_size, 64)), got {ebs!r}")
        _check_hook("transform", self.transform, "a uint8 [C, H, W] tensor -> the same shape, e.g. "
                    "torchvision.transforms.v2.Compose([...])")

    def val_batch_size(self, samples: int, replicas: int) -> int:
        """The per-epoch validation's batch per core for ``samples`` items over ``replicas``:
        ``eval_batch_size``, else ``max(batch_size, min(64, ceil(samples / replicas)))`` (no
        gradients, so larger than a tiny training batch; pass ``eval_batch_size=batch_size``
        if validation runs out of memory)."""
        if self.eval_batch_size:
            return self.eval_batch_size
        return max(self.batch_size, min(64, -(-samples // replicas)))


@dataclass
class ScheduleSettings:
    """The one-cycle run (``config.schedule``); ``fit()`` overrides any of them for one run.

    Attributes:
        epochs: Passes over the training data. Default 1.
        max_lr: Peak LR for ONE core at ``batch_size`` (scaled by ``lr_scaling``),
            or ``"find"`` to run the LR finder first. Default 1e-3.
        lr_scaling: How ``max_lr`` grows with the number of cores k: ``"linear"``
            (x k, Goyal et al. 2017), ``"sqrt"`` (x sqrt k) or ``"none"``. Default
            None = linear for SGD, sqrt for Adam/AdamW and callables.
        pct_start, div_factor, final_div_factor, moms: One-cycle shape (torch
            ``OneCycleLR`` defaults 0.3, 25, 1e4; momentum/beta1 0.95 -> 0.85 -> 0.95).
    """

    epochs: int = 1
    max_lr: float | str = 1e-3
    lr_scaling: str | None = None
    pct_start: float = 0.3
    div_factor: float = 25.0
    final_div_factor: float = 1e4
    moms: tuple[float, float, float] | None = (0.95, 0.85, 0.95)

    def __post_init__(self) -> None:
        self.max_lr = choice(self.max_lr, ("find",), "max_lr", "a positive number")
        self.lr_scaling = choice(self.lr_scaling, LR_SCALING, "lr_scaling", "None")
        if not isinstance(self.epochs, int) or self.epochs < 1:
            raise ValueError(f"epochs must be a positive int, got {self.epochs!r}")
        if self.max_lr != "find" and not (isinstance(self.max_lr, (int, float)) and self.max_lr > 0):
            raise ValueError(f"max_lr must be a positive number or 'find', got {self.max_lr!r}")
        if self.lr_scaling is not None and self.lr_scaling not in LR_SCALING:
            raise ValueError(f"lr_scaling must be one of {LR_SCALING} or None, got {self.lr_scaling!r}")
        OneCycleSchedule(total_steps=1, max_lr=1.0, pct_start=self.pct_start,
                         div_factor=self.div_factor, final_div_factor=self.final_div_factor,
                         moms=self.moms)  # the shape's own checks


@dataclass
class OptimSettings:
    """The optimizer and the step's arithmetic (``config.optim``).

    Attributes:
        optimizer: ``"sgd"`` (momentum), ``"adam"``, ``"adamw"`` or a callable
            ``f(params, lr=..., weight_decay=...)``. Default ``"adamw"``. An unknown name
            raises ``ValueError`` here.
        weight_decay: Default 0.0 (AdamW: decoupled).
        accum_steps: Micro-batches per optimizer step (default 1); global batch = batch_size
            x cores x accum_steps, which scales the LR; the one-cycle counts optimizer steps.
        precision: ``"auto"`` (default): bf16 autocast on GPUs with bf16 matrix units (compute
            capability >= 8.0: A100, L4, H100), fp16 autocast with a ``torch.amp.GradScaler`` on
            older GPUs (T4, V100, P100), float32 on TPUs (unless ``"bf16"``) and the CPU;
            ``"bf16"``, ``"fp16"`` or ``"fp32"`` force one. fp16 on a TPU and bf16 on a GPU without
            it are refused before any device time. Steps the scaler skips (inf/NaN gradients)
            are counted per epoch (history ``skipped_steps``) and still advance the one-cycle
            schedule; the scaler's state is in the checkpoints. See
            :mod:`xla_utils.step.device_plan`. The keyword ``bf16=True`` of older notebooks is
            ``precision="bf16"`` (deprecated: it warns).
        channels_last: ``"auto"`` (default): on CUDA, a model with ``Conv2d`` layers and image
            inputs run in channels_last memory format (the images normalised straight into it);
            True forces it on the torch backend, False keeps NCHW. XLA picks its own layouts.
        grad_clip: Clip each optimizer step's gradients to this total L2 norm (after they are
            averaged over the replicas and, with fp16, unscaled), on every backend and
            strategy, inside the step's graph; default None (off). The history records the
            norms per epoch (``grad_norm``, ``grad_norm_max``, ``clipped_steps``,
            ``grad_norm_clipped_max``). See :mod:`xla_utils.step.clip`.
    """

    optimizer: str | Callable[..., torch.optim.Optimizer] = "adamw"
    weight_decay: float = 0.0
    accum_steps: int = 1
    precision: str = "auto"
    channels_last: bool | str = "auto"
    grad_clip: float | None = None

    def __post_init__(self) -> None:
        self.optimizer = resolve_optimizer(self.optimizer)
        self.grad_clip = check_grad_clip(self.grad_clip)
        self.precision = choice(self.precision, PRECISIONS, "precision")
        self.channels_last = choice(self.channels_last, ("auto",), "channels_last", "True/False")
        if not _positive_int(self.accum_steps):
            raise ValueError(f"accum_steps must be an int >= 1 (micro-batches per optimizer step; "
                             f"1 = no accumulation), got {self.accum_steps!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {self.precision!r}")
        if not (self.channels_last == "auto" or isinstance(self.channels_last, bool)):
            raise ValueError(f"channels_last must be 'auto', True or False, got {self.channels_last!r}")


@dataclass
class AugmentSettings:
    """On-device augmentation and the weight EMA (``config.augment``).

    Attributes:
        mixup, cutmix, label_smoothing: timm-style, on the device (:mod:`xla_utils.train.mixup`):
            Beta alphas (usual 0.2, 1.0) and smoothing in [0, 1); default 0 (off). Mixing
            needs an even ``batch_size`` (checked by :class:`TrainerConfig`).
        ema: Decay of a device weight EMA (timm ``ModelEmaV3`` warm-up,
            :mod:`xla_utils.train.ema`) that validation, ``evaluate`` and ``predict`` use;
            default None (off).
        batch_transform: Batch-level augmentation on the device, inside the training step's
            graph: ``fn(x, y) -> (x, y)`` with ``x`` the normalised float ``[B, C, H, W]``
            batch (after the flip, before mixup/cutmix) and ``y`` its targets; shapes must
            not change, and random draws must be device ops (``torch.rand(...,
            device=x.device)``) so that nothing recompiles. Training steps only. Default None.
    """

    mixup: float = 0.0
    cutmix: float = 0.0
    label_smoothing: float = 0.0
    ema: float | None = None
    batch_transform: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None

    def __post_init__(self) -> None:
        check_ema(self.ema)
        _check_hook("batch_transform", self.batch_transform, "(x, y) -> (x, y) on the device")
        for name, v in (("mixup", self.mixup), ("cutmix", self.cutmix)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0 \
                    or not math.isfinite(v):
                raise ValueError(f"{name} must be a Beta alpha >= 0 (0 = off; timm's usual values: "
                                 f"mixup=0.2 or 0.8, cutmix=1.0), got {v!r}")
        ls = self.label_smoothing
        if isinstance(ls, bool) or not isinstance(ls, (int, float)) or not 0 <= ls < 1:
            raise ValueError(f"label_smoothing must be in [0, 1) (0 = off, usual 0.1), got {ls!r}")

    @property
    def mixes(self) -> bool:
        """Whether batches are mixed (mixup or cutmix on)."""
        return self.mixup > 0 or self.cutmix > 0


@dataclass
class CheckpointSettings:
    """Epoch files and the best epoch (``config.checkpoints``).

    Attributes:
        checkpoint_dir: Write ``epoch_<nnn>-<run id>.pt`` after every epoch whose
            loss is finite and ``final.pt`` (weights only) at the end of a run that
            was not stopped: the weights ``predict`` uses (with ``ema`` the EMA
            weights, with ``monitor`` the best epoch's), and with ``ema`` also
            ``final_raw.pt`` (the trained, non-averaged weights of the last epoch;
            resuming uses the epoch files, which hold both). A URL (``"gs://bucket/run"``)
            keeps them in the bucket: written through a local folder and uploaded after every
            checkpoint (:mod:`xla_utils.train.mirror`). None (default) = no files.
        keep_checkpoints: This run's newest epoch files kept (default 2, >= 1).
        keep_runs: Runs whose epoch files stay in ``checkpoint_dir``, this one included:
            older runs' files are deleted once this run has written its first epoch
            file (never this run's, nor ``final.pt``/``best.pt``). Default None: every
            run's are kept, and ``fit`` says what earlier runs hold (count, size).
        monitor: Keep the best epoch by this record value: ``"val_loss"``,
            ``"train_loss"`` or a validation metric (a built-in one: ``"accuracy"``,
            ``"top<k>"``, ``"f1"``, ``"auc"``, ``"logloss"``, ``"rmse"``, ``"mae"``,
            ``"qwk"``, ``"macro_f1"``; or a callable's name in ``metrics``). Lower is better
            for losses, ``logloss``, ``rmse``, ``mae`` and names ending in ``loss``,
            ``error``, ``mse``, ``mae`` or ``msle``; higher for the others
            (:func:`xla_utils.train.metrics.lower_is_better`). The run returns (and
            ``self.model`` gets) that epoch's weights, also written to
            ``checkpoint_dir/best.pt``. Default None (the last epoch's weights). Names are
            checked against ``metrics`` by :class:`TrainerConfig`.
        patience: With ``monitor``: stop after this many epochs without
            improvement (``History.stop_reason`` says so). Default None.
        checkpoint_every: In-epoch checkpoints (``epoch_<nnn>_step<s>-<run id>.pt``, rotated
            with the epoch files; ``fit(resume="last")`` continues at their step): an int
            of optimizer steps, a duration (``"30min"``, ``"2h"``), None (epoch files only)
            or ``"auto"`` (default: every 30 minutes on Kaggle and Colab, whose sessions
            end, else off). Written at the first loss read (``log_every``) past the interval.
    """

    checkpoint_dir: str | os.PathLike | None = None
    keep_checkpoints: int = 2
    keep_runs: int | None = None
    monitor: str | None = None
    patience: int | None = None
    checkpoint_every: int | str | None = "auto"

    def __post_init__(self) -> None:
        self.checkpoint_every = check_checkpoint_every(self.checkpoint_every)
        if isinstance(self.monitor, str):
            self.monitor = self.monitor.strip().lower()
        kc, kr = self.keep_checkpoints, self.keep_runs
        if not _positive_int(kc):
            raise ValueError(f"keep_checkpoints must be an int >= 1 (this run's newest epoch files "
                             f"kept), got {kc!r}")
        if kr is not None and not _positive_int(kr):
            raise ValueError(f"keep_runs must be None (keep every run's files) or an int >= 1 (the "
                             f"newest runs whose epoch files stay in checkpoint_dir, this run "
                             f"included), got {kr!r}")
        self._check_monitor()

    def _check_monitor(self) -> None:
        monitor, patience = self.monitor, self.patience
        if monitor is not None and not (isinstance(monitor, str) and monitor):
            raise ValueError(f"monitor must be None or the name of a value fit records "
                             f"('val_loss', 'train_loss' or a validation metric), got {monitor!r}")
        if patience is not None:
            if not _positive_int(patience):
                raise ValueError(f"patience must be an int >= 1 (epochs without improvement before "
                                 f"stopping) or None, got {patience!r}")
            if monitor is None:
                raise ValueError("patience= needs monitor= (the value that must improve), e.g. "
                                 "monitor='val_loss' or monitor='accuracy'")


@dataclass
class DeviceSettings:
    """How the model is spread over the devices, and compiled graphs kept (``config.devices``).

    Attributes:
        strategy: ``"spawn"`` (default: one process per core, whole model on each),
            ``"spmd"`` (one process feeds every device, batch split over a 1-D mesh) or
            ``"fsdp"`` (FSDPv2: parameters, gradients, optimizer state and batch sharded
            over the mesh's ``fsdp`` axis). See :mod:`xla_utils.step.strategy`.
        fsdp_wrap: ``"fsdp"`` units: module classes or class names (e.g. the
            transformer block), a minimum parameter count per unit, or None (default:
            the whole model as one unit).
        activation_checkpointing: Recompute each FSDP unit's activations in the
            backward pass (``"fsdp"`` only). Default False.
        lr_find_on_mesh: Where ``find_lr`` / ``fit(max_lr="find")`` sweep under
            ``"spmd"``/``"fsdp"``: None (default) on the mesh only when one core cannot
            hold the model, True always on the mesh, False on one core.
        compile_cache: torch_xla's persistent compilation cache for ``fit``,
            ``predict``, ``evaluate``, ``find_lr`` and ``check``: ``"auto"``
            (default) on TPUs only, under a folder that survives a notebook restart
            (``/kaggle/working/xla_compile_cache``, ``/content/xla_compile_cache``,
            else ``~/.cache/xla_utils/compile_cache``); a folder; ``True`` (on, also
            on XLA:CPU, which writes entries but cannot load them); ``None`` off.
            See :mod:`xla_utils.runtime.compile_cache`.
        compile: The model's forward through ``torch.compile`` on the torch backend (CUDA
            GPUs, the CPU): False (default, eager), True (mode ``"default"``) or a mode
            (``"reduce-overhead"``, ``"max-autotune"``, ``"max-autotune-no-cudagraphs"``).
            Inductor's caches are kept under ``compile_cache`` (a folder), else beside the
            checkpoints, so a fresh session compiles from them; refused on XLA (the step is
            one XLA graph there already). See :mod:`xla_utils.train.torch_compile`.
    """

    strategy: str = "spawn"
    fsdp_wrap: Sequence[type | str] | type | str | int | None = None
    activation_checkpointing: bool = False
    lr_find_on_mesh: bool | None = None
    compile_cache: str | os.PathLike | bool | None = "auto"
    compile: bool | str = False

    def __post_init__(self) -> None:
        self.strategy = choice(self.strategy, STRATEGIES, "strategy")
        runtime.check_compile_cache_option(self.compile_cache)
        self.compile = check_compile_option(self.compile)
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {self.strategy!r}")
        wrap = self.fsdp_wrap
        ok = wrap is None or _positive_int(wrap) or isinstance(wrap, (str, type)) or (
            isinstance(wrap, (list, tuple, set, frozenset)) and len(wrap) > 0
            and all(isinstance(w, (str, type)) for w in wrap))
        if not ok:
            raise ValueError("fsdp_wrap must be None (the whole model as one FSDP unit), module "
                             "classes or class names (e.g. [nn.TransformerEncoderLayer] or "
                             f"['Block']), or a minimum parameter count per unit (int >= 1); got {wrap!r}")
        if not isinstance(self.activation_checkpointing, bool):
            raise ValueError(f"activation_checkpointing must be True or False, got "
                             f"{self.activation_checkpointing!r}")
        if self.lr_find_on_mesh not in (None, True, False):
            raise ValueError(f"lr_find_on_mesh must be None (automatic), True or False, got "
                             f"{self.lr_find_on_mesh!r}")
        if self.lr_find_on_mesh and self.strategy == "spawn":
            raise ValueError("lr_find_on_mesh=True sweeps as a mesh run, but strategy='spawn' has "
                             "no mesh. Fix: strategy='spmd' or 'fsdp', or drop lr_find_on_mesh")
        if self.strategy != "fsdp" and (wrap is not None or self.activation_checkpointing):
            name = "fsdp_wrap" if wrap is not None else "activation_checkpointing"
            raise ValueError(f"{name} applies to FSDP units, but strategy={self.strategy!r}. Fix: "
                             f"strategy='fsdp', or drop {name}")


@dataclass
class DiagnosticsSettings:
    """What a run measures and reports, and what it does when it diverges
    (``config.diagnostics``).

    Attributes:
        metrics: Validation metrics, each a history column: built-in names
            (``"accuracy"``, ``"top<k>"``, ``"f1"``, ``"auc"``, ``"logloss"``, ``"rmse"``,
            ``"mae"``, ``"qwk"``, ``"macro_f1"``: :data:`xla_utils.train.metrics.METRICS`)
            and callables ``metric(preds, targets) -> float`` (a ``def``, named by its
            ``__name__``, or ``{"name": fn}`` for a lambda), in a list or a dict. A metric
            sees every validation row once (``preds`` the probabilities ``predict`` gives,
            ``targets`` as the dataset gives them). None = the task's defaults: accuracy
            (+top5 above 10 classes), F1 for multi-label data, accuracy and AUC for a
            one-logit binary task, RMSE for regression. Unknown names are refused here
            (did-you-mean); each metric is tried on a sample of the validation set before
            any device time (docs/TRAINER.md, "Validation metrics").
        log_every: Steps between loss reads for the progress bar (default 20;
            each read waits for the device).
        on_nan: What to do when training diverges: the training loss read (every
            ``log_every`` steps and at each epoch end) is NaN or infinite, or an epoch's
            training or validation loss ends above ``loop.VAL_LOSS_EXPLODES`` (10) times the
            untrained model's loss at the first step (judged at epoch ends, so never inside
            the first epoch). ``"stop"`` (default) stops there; the model keeps the weights
            of the last good epoch (a host copy made at each epoch end), no checkpoint is
            written for the bad one, and ``History.stop_reason`` and one warning say why.
            ``"continue"`` says so once and trains on (no checkpoint for a non-finite epoch).
        tensorboard: Write TensorBoard event files (the master replica, each epoch's record as
            it ends; :mod:`xla_utils.train.board`): a folder (each run in ``<folder>/<run
            id>``), True (``checkpoint_dir/tensorboard``) or None (default, off). Needs the
            ``tensorboard`` package (``pip install tensorboard``), checked here.
    """

    metrics: Sequence[str | Callable] | Mapping[str, Callable] | None = None
    log_every: int = 20
    on_nan: str = "stop"
    tensorboard: bool | str | os.PathLike | None = None

    def __post_init__(self) -> None:
        self.on_nan = choice(self.on_nan, ON_NAN, "on_nan")
        self.metrics = normalize_metrics(self.metrics)
        if self.log_every < 1:
            raise ValueError("log_every must be >= 1")
        if self.on_nan not in ON_NAN:
            raise ValueError(f"on_nan must be one of {ON_NAN}, got {self.on_nan!r}")
        board = self.tensorboard
        if not (board is None or isinstance(board, (bool, str, os.PathLike))) or board == "":
            raise ValueError(f"tensorboard must be a folder, True (checkpoint_dir/tensorboard) or "
                             f"None (off), got {board!r}")
        if board not in (None, False) and importlib.util.find_spec("tensorboard") is None:
            raise ImportError(TENSORBOARD_MISSING)


# The groups, by their attribute of TrainerConfig (docs/TRAINER.md's table, in its order).
GROUPS: dict[str, type] = {
    "data": DataSettings, "schedule": ScheduleSettings, "optim": OptimSettings,
    "augment": AugmentSettings, "checkpoints": CheckpointSettings, "devices": DeviceSettings,
    "diagnostics": DiagnosticsSettings}
# Every option (a keyword of OneCycleTrainer and TrainerConfig) -> the attribute of its group.
OPTION_GROUPS: dict[str, str] = {f.name: attr for attr, cls in GROUPS.items()
                                 for f in dataclasses.fields(cls)}


def check_option_names(where: str, options: Mapping[str, Any]) -> None:
    """Refuse keywords that are no option (nor a group, nor the deprecated ``bf16``).

    Args:
        where: The callable the user called, for the message (``"OneCycleTrainer()"``).
        options: The keywords given.

    Raises:
        TypeError: each unknown keyword with the nearest option and the group it is in
            (``'batchsize' (did you mean 'batch_size'?) in the data group
            (config.data.batch_size)``), then every option by group.
    """
    known = [*OPTION_GROUPS, *GROUPS, "bf16"]
    unknown = [k for k in options if k not in known]
    if not unknown:
        return
    parts = []
    for k in unknown:
        near = [_THEIR_NAMES[k]] if k in _THEIR_NAMES else closest(k, OPTION_GROUPS, n=1)
        attr = OPTION_GROUPS[near[0]] if near else ""
        where_near = f" in the {attr} group (config.{attr}.{near[0]})" if near else ""
        mean = (f" (did you mean {near[0]!r}?)" if k in _THEIR_NAMES
                else did_you_mean(k, OPTION_GROUPS))
        parts.append(f"{k!r}{mean}{where_near}")
    by_group = "; ".join(f"{attr}: {', '.join(f.name for f in dataclasses.fields(cls))}"
                         for attr, cls in GROUPS.items())
    s = "s" if len(parts) > 1 else ""
    raise TypeError(f"{where} got unexpected keyword argument{s} {', '.join(parts)}; "
                    f"its options, by group: {by_group}")


def _bf16_alias(options: dict[str, Any]) -> None:
    """``bf16=`` (older notebooks) as ``precision``, with the deprecation warning."""
    bf16 = options.pop("bf16")
    if not isinstance(bf16, bool):
        raise ValueError(f"bf16 must be True or False, got {bf16!r}")
    deprecated(f"bf16={bf16}", "precision='bf16'" if bf16 else "precision (default 'auto')")
    if not bf16:
        return
    precision = options.get("precision", "auto")
    if isinstance(precision, str) and precision.strip().lower() not in ("auto", "bf16"):
        raise ValueError(f"bf16=True and precision={precision!r} disagree: bf16=True is "
                         "precision='bf16'. Fix: drop bf16=True (or pass precision='bf16')")
    options["precision"] = "bf16"


@dataclass(init=False)
class TrainerConfig:
    """Every setting of :class:`~xla_utils.train.trainer.OneCycleTrainer`, in groups.

    ``TrainerConfig(batch_size=64, epochs=5)`` takes the options flat, as the trainer does,
    and puts each in its group; ``TrainerConfig(data=DataSettings(...), ...)`` takes whole
    groups (options given beside a group override its fields). Each group checks its own
    fields when built; this class checks the rules that span groups. Every string option is
    read after ``.strip().lower()`` and stored so (``"AdamW "`` is ``"adamw"``,
    ``max_lr="Find"`` is ``"find"``); a near miss is refused with a suggestion.

    Read a setting through its group (``config.schedule.max_lr``); the flat name
    (``config.max_lr``) is the same attribute, for reading and writing. A written value is
    not checked again: :meth:`replace` makes a checked copy.

    Attributes:
        data: :class:`DataSettings`: ``batch_size``, ``eval_batch_size``, ``num_workers``,
            ``flip``, ``mean``, ``std``, ``seed``, ``transform``.
        schedule: :class:`ScheduleSettings`: ``epochs``, ``max_lr``, ``lr_scaling``,
            ``pct_start``, ``div_factor``, ``final_div_factor``, ``moms``.
        optim: :class:`OptimSettings`: ``optimizer``, ``weight_decay``, ``accum_steps``,
            ``precision``, ``channels_last``, ``grad_clip``.
        augment: :class:`AugmentSettings`: ``mixup``, ``cutmix``, ``label_smoothing``, ``ema``,
            ``batch_transform``.
        checkpoints: :class:`CheckpointSettings`: ``checkpoint_dir``, ``keep_checkpoints``,
            ``keep_runs``, ``monitor``, ``patience``, ``checkpoint_every``.
        devices: :class:`DeviceSettings`: ``strategy``, ``fsdp_wrap``,
            ``activation_checkpointing``, ``lr_find_on_mesh``, ``compile_cache``, ``compile``.
        diagnostics: :class:`DiagnosticsSettings`: ``metrics``, ``log_every``, ``on_nan``,
            ``tensorboard``.
    """

    data: DataSettings = field(default_factory=DataSettings)
    schedule: ScheduleSettings = field(default_factory=ScheduleSettings)
    optim: OptimSettings = field(default_factory=OptimSettings)
    augment: AugmentSettings = field(default_factory=AugmentSettings)
    checkpoints: CheckpointSettings = field(default_factory=CheckpointSettings)
    devices: DeviceSettings = field(default_factory=DeviceSettings)
    diagnostics: DiagnosticsSettings = field(default_factory=DiagnosticsSettings)

    def __init__(self, **options: Any) -> None:
        check_option_names("TrainerConfig()", options)
        if "bf16" in options:
            _bf16_alias(options)
        groups = {attr: options.pop(attr, None) for attr in GROUPS}
        for attr, cls in GROUPS.items():
            group = groups[attr]
            if group is not None and not isinstance(group, cls):
                raise TypeError(f"{attr} must be a {cls.__name__}, got {type(group).__name__}")
            mine = {k: options[k] for k in options if OPTION_GROUPS[k] == attr}
            if group is None:
                group = cls(**mine)
            elif mine:
                group = dataclasses.replace(group, **mine)
            setattr(self, attr, group)
        self._check_across_groups()

    def _check_across_groups(self) -> None:
        """The rules that span two groups: the monitor is a value the run records, mixing
        needs an even batch, ``tensorboard=True`` needs a ``checkpoint_dir``."""
        self._check_monitor_name()
        if self.diagnostics.tensorboard is True and self.checkpoints.checkpoint_dir is None:
            raise ValueError("tensorboard=True writes beside the checkpoints, but checkpoint_dir "
                             "is None. Fix: tensorboard='<folder>', or checkpoint_dir=...")
        bs = self.data.batch_size
        if self.augment.mixes and bs % 2:
            raise ValueError(f"mixup/cutmix pair each sample with the batch's reverse and need an even "
                             f"batch_size (per core), got {bs}: use batch_size="
                             f"{bs + 1} or {max(bs - 1, 2)}")

    def _check_monitor_name(self) -> None:
        """``monitor`` names a loss, a built-in metric or a callable of ``metrics`` (and one
        of ``metrics`` when they are given)."""
        monitor, metrics = self.checkpoints.monitor, self.diagnostics.metrics
        if monitor is None or monitor in LOSS_MONITORS:
            return
        names = metric_names(metrics)
        if monitor in METRIC_MONITORS or re.fullmatch(r"top[1-9]\d*", monitor) or monitor in names:
            if metrics is not None and monitor not in names:
                raise ValueError(f"monitor={monitor!r} is not among this run's validation metrics "
                                 f"{names}: add it to metrics=[...] or monitor one of "
                                 f"{[*LOSS_MONITORS, *names]}")
            return
        options = [*LOSS_MONITORS, *METRIC_MONITORS, *names]
        raise ValueError(f"monitor={monitor!r}{did_you_mean(monitor, options)} is not a value fit "
                         f"records: use 'val_loss', 'train_loss', a validation metric "
                         f"({', '.join(repr(m) for m in METRIC_MONITORS)}, 'top<k>') or the name "
                         "of a callable in metrics=, or None")

    def replace(self, **options: Any) -> "TrainerConfig":
        """A copy with ``options`` (flat names, as the constructor takes) changed, checked
        by their groups."""
        return TrainerConfig(**{attr: getattr(self, attr) for attr in GROUPS}, **options)

    def options(self) -> dict[str, Any]:
        """Every option by its flat name (the layout checkpoints store, where callable
        metrics are stored by name: :meth:`stored_options`)."""
        return {name: getattr(getattr(self, attr), name) for name, attr in OPTION_GROUPS.items()}

    def stored_options(self) -> dict[str, Any]:
        """:meth:`options` as a checkpoint records them (and a resume compares them): without
        the optimizer (it has its own state), ``metrics`` by name, a callable option
        (``transform``, ``batch_transform``) as :func:`callable_name`'s words: functions can
        neither be pickled reliably nor compared across sessions."""
        out = {k: callable_name(v) if callable(v) and not isinstance(v, type) else v
               for k, v in self.options().items() if k != "optimizer"}
        if out.get("metrics") is not None:
            out["metrics"] = metric_names(out["metrics"])
        return out

    @property
    def scaling_rule(self) -> str:
        """``lr_scaling``, or its default for the optimizer: linear for SGD, else sqrt."""
        if self.schedule.lr_scaling is not None:
            return self.schedule.lr_scaling
        return "linear" if self.optim.optimizer == "sgd" else "sqrt"


def _flat(name: str, attr: str) -> property:
    def get(self: TrainerConfig) -> Any:
        return getattr(getattr(self, attr), name)

    def put(self: TrainerConfig, value: Any) -> None:
        setattr(getattr(self, attr), name, value)

    return property(get, put, doc=f"``config.{attr}.{name}``")


for _name, _attr in OPTION_GROUPS.items():
    setattr(TrainerConfig, _name, _flat(_name, _attr))
