"""The trainer's configuration: :class:`TrainerConfig`, every keyword of
:class:`~xla_utils.train.trainer.OneCycleTrainer`, and the values its options take.

A low module of its own, so that every module that is passed the configuration can
name its type. Its checks (``__post_init__``) ask the modules that own each option
(optimizer names: :mod:`xla_utils.step.optim`; EMA, mixup, cutmix, smoothing:
:mod:`xla_utils.train.mixup`; ``monitor``: :mod:`xla_utils.train.history`; ``strategy``:
:mod:`xla_utils.step.strategy`; ``compile_cache``: :mod:`xla_utils.runtime`), so those modules
import :class:`TrainerConfig` for their annotations only (``if TYPE_CHECKING:``).
``from xla_utils.train.trainer import TrainerConfig`` keeps working.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from ..step import device_plan
from .. import runtime
from ..step import strategy as _strategy
from .checkpoint import check_options as check_checkpoint_options
from ..data import IMAGENET_MEAN, IMAGENET_STD
from .history import check_monitor
from .mixup import check_step_options
from ..step.optim import resolve_optimizer
from ..utils.suggest import choice

__all__ = ["TrainerConfig", "LR_SCALING", "ON_NAN"]

LR_SCALING = ("linear", "sqrt", "none")
ON_NAN = ("stop", "continue")


@dataclass
class TrainerConfig:
    """Hyper-parameters of :class:`~xla_utils.train.trainer.OneCycleTrainer` (all keyword arguments of it).

    Every string option is read after ``.strip().lower()`` and stored so (``"AdamW "`` is
    ``"adamw"``, ``max_lr="Find"`` is ``"find"``); a near miss is refused with a suggestion.

    Attributes:
        batch_size: Samples per core per step (global batch = batch_size x cores); default 32.
        eval_batch_size: Samples per core per batch of ``fit``'s per-epoch validation
            (one padded, masked shape). Default None: :meth:`val_batch_size`'s choice.
        epochs: Passes over the training data. Default 1.
        max_lr: Peak LR for ONE core at ``batch_size`` (scaled by ``lr_scaling``),
            or ``"find"`` to run the LR finder first. Default 1e-3.
        optimizer: ``"sgd"`` (momentum), ``"adam"``, ``"adamw"`` or a callable ``f(params, lr=..., weight_decay=...)``.
            Default ``"adamw"``. An unknown name raises ``ValueError`` here.
        weight_decay: Default 0.0 (AdamW: decoupled).
        pct_start, div_factor, final_div_factor, moms: One-cycle shape (torch
            ``OneCycleLR`` defaults 0.3, 25, 1e4; momentum/beta1 0.95 -> 0.85 -> 0.95).
        lr_scaling: How ``max_lr`` grows with the number of cores k: ``"linear"``
            (x k, Goyal et al. 2017), ``"sqrt"`` (x sqrt k) or ``"none"``. Default
            None = linear for SGD, sqrt for Adam/AdamW and callables.
        bf16: ``precision="bf16"`` (kept for older notebooks; both given must agree). Default False.
        precision: ``"auto"`` (default): bf16 autocast on GPUs with bf16 matrix units (compute
            capability >= 8.0: A100, L4, H100), fp16 autocast with a ``torch.amp.GradScaler`` on
            older GPUs (T4, V100, P100), float32 on TPUs (unless ``"bf16"``) and the CPU;
            ``"bf16"``, ``"fp16"`` or ``"fp32"`` force one. fp16 on a TPU and bf16 on a GPU without
            it are refused before any device time. Steps the scaler skips (inf/NaN gradients)
            are counted per epoch (history ``skipped_steps``) and still advance the one-cycle
            schedule; the scaler's state is in the checkpoints. See :mod:`xla_utils.step.device_plan`.
        channels_last: ``"auto"`` (default): on CUDA, a model with ``Conv2d`` layers and image
            inputs run in channels_last memory format (the images normalised straight into it);
            True forces it on the torch backend, False keeps NCHW. XLA picks its own layouts.
        metrics: Validation metrics (``"accuracy"``, ``"top5"``/``"top<k>"``,
            ``"f1"``); None = accuracy (+top5 above 10 classes), F1 for
            multi-label data.
        checkpoint_dir: Write ``epoch_<nnn>-<run id>.pt`` after every epoch whose
            loss is finite and ``final.pt`` (weights only) at the end of a run that
            was not stopped: the weights ``predict`` uses (with ``ema`` the EMA
            weights, with ``monitor`` the best epoch's), and with ``ema`` also
            ``final_raw.pt`` (the trained, non-averaged weights of the last epoch;
            resuming uses the epoch files, which hold both). None (default) = no files.
        keep_checkpoints: This run's newest epoch files kept (default 2, >= 1).
        keep_runs: Runs whose epoch files stay in ``checkpoint_dir``, this one included:
            older runs' files are deleted once this run has written its first epoch
            file (never this run's, nor ``final.pt``/``best.pt``). Default None: every
            run's are kept, and ``fit`` says what earlier runs hold (count, size).
        seed: Seeds data order and device RNG (flips, dropout). Default 0.
        flip: Random horizontal flip of uint8 image batches on the device.
            Default True.
        mean, std: Per-channel normalisation of uint8 images, in 0..1 units
            (default ImageNet's).
        log_every: Steps between loss reads for the progress bar (default 20;
            each read waits for the device).
        num_workers: Host threads/processes assembling batches (None = automatic).
        on_nan: What to do when training diverges: the training loss read (every
            ``log_every`` steps and at each epoch end) is NaN or infinite, or an epoch's
            training or validation loss ends above ``loop.VAL_LOSS_EXPLODES`` (10) times the
            untrained model's loss at the first step (judged at epoch ends, so never inside
            the first epoch). ``"stop"`` (default) stops there; the model keeps the weights
            of the last good epoch (a host copy made at each epoch end), no checkpoint is
            written for the bad one, and ``History.stop_reason`` and one warning say why.
            ``"continue"`` says so once and trains on (no checkpoint for a non-finite epoch).
        compile_cache: torch_xla's persistent compilation cache for ``fit``,
            ``predict``, ``evaluate``, ``find_lr`` and ``check``: ``"auto"``
            (default) on TPUs only, under a folder that survives a notebook restart
            (``/kaggle/working/xla_compile_cache``, ``/content/xla_compile_cache``,
            else ``~/.cache/xla_utils/compile_cache``); a folder; ``True`` (on, also
            on XLA:CPU, which writes entries but cannot load them); ``None`` off.
            See :mod:`xla_utils.runtime.compile_cache`.
        accum_steps: Micro-batches per optimizer step (default 1); global batch = batch_size
            x cores x accum_steps, which scales the LR; the one-cycle counts optimizer steps.
        ema: Decay of a device weight EMA (timm ``ModelEmaV3`` warm-up, :mod:`xla_utils.train.ema`)
            that validation, ``evaluate`` and ``predict`` use; default None (off).
        mixup, cutmix, label_smoothing: timm-style, on the device (:mod:`xla_utils.train.mixup`):
            Beta alphas (usual 0.2, 1.0) and smoothing in [0, 1); default 0 (off).
        monitor: Keep the best epoch by this record value: ``"val_loss"``,
            ``"train_loss"`` or a validation metric (``"accuracy"``, ``"top<k>"``,
            ``"f1"``; higher is better except for losses). The run returns (and
            ``self.model`` gets) that epoch's weights, also written to
            ``checkpoint_dir/best.pt``. Default None (the last epoch's weights).
        patience: With ``monitor``: stop after this many epochs without
            improvement (``History.stop_reason`` says so). Default None.
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
    """

    batch_size: int = 32
    eval_batch_size: int | None = None
    epochs: int = 1
    max_lr: float | str = 1e-3
    optimizer: str | Callable[..., torch.optim.Optimizer] = "adamw"
    weight_decay: float = 0.0
    pct_start: float = 0.3
    div_factor: float = 25.0
    final_div_factor: float = 1e4
    moms: tuple[float, float, float] | None = (0.95, 0.85, 0.95)
    lr_scaling: str | None = None
    bf16: bool = False
    precision: str = "auto"
    channels_last: bool | str = "auto"
    metrics: Sequence[str] | None = None
    checkpoint_dir: str | os.PathLike | None = None
    keep_checkpoints: int = 2
    keep_runs: int | None = None
    seed: int = 0
    flip: bool = True
    mean: tuple[float, float, float] = IMAGENET_MEAN
    std: tuple[float, float, float] = IMAGENET_STD
    log_every: int = 20
    num_workers: int | None = None
    on_nan: str = "stop"
    compile_cache: str | os.PathLike | bool | None = "auto"
    accum_steps: int = 1
    ema: float | None = None
    mixup: float = 0.0
    cutmix: float = 0.0
    label_smoothing: float = 0.0
    monitor: str | None = None
    patience: int | None = None
    strategy: str = "spawn"
    fsdp_wrap: Sequence[type | str] | type | str | int | None = None
    activation_checkpointing: bool = False
    lr_find_on_mesh: bool | None = None

    def __post_init__(self) -> None:
        self.optimizer = resolve_optimizer(self.optimizer)
        self._normalise_strings()
        if not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise ValueError(f"batch_size must be a positive int (per core), got {self.batch_size!r}")
        ebs = self.eval_batch_size
        if ebs is not None and (isinstance(ebs, bool) or not isinstance(ebs, int) or ebs < 1):
            raise ValueError(f"eval_batch_size must be a positive int (per core) or None "
                             f"(max(batch_size, 64)), got {ebs!r}")
        if not isinstance(self.epochs, int) or self.epochs < 1:
            raise ValueError(f"epochs must be a positive int, got {self.epochs!r}")
        if self.max_lr != "find" and not (isinstance(self.max_lr, (int, float)) and self.max_lr > 0):
            raise ValueError(f"max_lr must be a positive number or 'find', got {self.max_lr!r}")
        if self.lr_scaling is not None and self.lr_scaling not in LR_SCALING:
            raise ValueError(f"lr_scaling must be one of {LR_SCALING} or None, got {self.lr_scaling!r}")
        if self.log_every < 1:
            raise ValueError("log_every must be >= 1")
        check_checkpoint_options(self)
        if self.on_nan not in ON_NAN:
            raise ValueError(f"on_nan must be one of {ON_NAN}, got {self.on_nan!r}")
        runtime.check_compile_cache_option(self.compile_cache)
        device_plan.check_config(self)
        check_step_options(self)
        check_monitor(self.monitor, self.patience)
        _strategy.check_config(self)

    def _normalise_strings(self) -> None:
        """Every string option as :func:`~xla_utils.utils.suggest.choice` reads it (after
        ``.strip().lower()``; a near miss refused with its suggestion), as ``optimizer``."""
        self.max_lr = choice(self.max_lr, ("find",), "max_lr", "a positive number")
        self.lr_scaling = choice(self.lr_scaling, LR_SCALING, "lr_scaling", "None")
        self.precision = choice(self.precision, device_plan.PRECISIONS, "precision")
        self.channels_last = choice(self.channels_last, ("auto",), "channels_last", "True/False")
        self.on_nan = choice(self.on_nan, ON_NAN, "on_nan")
        self.strategy = choice(self.strategy, _strategy.STRATEGIES, "strategy")
        if isinstance(self.monitor, str):
            self.monitor = self.monitor.strip().lower()
        if self.metrics is not None and not isinstance(self.metrics, str):
            self.metrics = [m.strip().lower() if isinstance(m, str) else m for m in self.metrics]

    def val_batch_size(self, samples: int, replicas: int) -> int:
        """The per-epoch validation's batch per core for ``samples`` items over ``replicas``:
        ``eval_batch_size``, else ``max(batch_size, min(64, ceil(samples / replicas)))`` (no
        gradients, so larger than a tiny training batch; pass ``eval_batch_size=batch_size``
        if validation runs out of memory)."""
        if self.eval_batch_size:
            return self.eval_batch_size
        return max(self.batch_size, min(64, -(-samples // replicas)))

    @property
    def scaling_rule(self) -> str:
        if self.lr_scaling is not None:
            return self.lr_scaling
        return "linear" if self.optimizer == "sgd" else "sqrt"
