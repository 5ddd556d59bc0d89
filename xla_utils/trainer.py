"""One-cycle training on every TPU core: :class:`OneCycleTrainer` and its configuration.

``OneCycleTrainer(model, loss, train_data, val_data, batch_size=32, ...).fit()``
launches one replica per core through :func:`xla_utils.runtime.launch` (fork,
so models and functions defined in a notebook work), scales the LR by the world
size, drives LR and momentum with :class:`~xla_utils.schedule.OneCycleSchedule`
every optimizer step, and returns a :class:`History` to the notebook.

This module holds the API and the host-side planning (checks, LR, resume); each
replica's work is the plain functions of :mod:`xla_utils.loop` (set-up, one
training epoch, evaluation, inference), checkpoints are :mod:`xla_utils.checkpoint`,
the input checks :mod:`xla_utils.inputs` and the single-core debug loop
(:meth:`OneCycleTrainer.debug`) :mod:`xla_utils.debug`.
"""
from __future__ import annotations

import dataclasses
import math
import os
import secrets
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np
import torch

from . import device_plan, loop, runtime
from . import mesh_tasks as _mesh_tasks
from . import strategy as _strategy
from .checkpoint import (CheckpointError, ResumeError, check_resume, model_with_weights,
                         resolve_resume, save_checkpoint, sharded_meta)
from .data import IMAGENET_MEAN, IMAGENET_STD, CachedImageDataset, iterate_batches
from .debug import DebugReport, debug_run
from .ema import with_weights
from .history import BestTracker, History, check_monitor, check_monitor_data, epoch_files
from .inputs import (AsPairs, InputSpec, check_batches, check_targets, inspect_inputs,
                     require_labels, shape_mismatch)
from .loop import scale_lr
from .mixup import MixConfig, check_step_options, mix_config_for
from .optim import resolve_optimizer
from .simulate import resident as _resident
from .simulate.live import live_or_launch

if TYPE_CHECKING:
    from .readiness import ReadinessReport

__all__ = ["TrainerConfig", "OneCycleTrainer", "History", "DebugReport", "debug_run",
           "scale_lr", "CheckpointError", "ResumeError"]

LR_SCALING = ("linear", "sqrt", "none")
ON_NAN = ("stop", "continue")


@dataclass
class TrainerConfig:
    """Hyper-parameters of :class:`OneCycleTrainer` (all keyword arguments of it).

    Attributes:
        batch_size: Samples per core per step (global batch = batch_size x cores); default 32.
        eval_batch_size: Samples per core per batch of ``fit``'s per-epoch validation
            (one padded, masked shape). Default None: :meth:`val_batch_size`'s choice.
        epochs: Passes over the training data. Default 1.
        max_lr: Peak LR for ONE core at ``batch_size`` (scaled by ``lr_scaling``),
            or ``"find"`` to run the LR finder first. Default 1e-3.
        optimizer: ``"sgd"`` (momentum), ``"adam"``, ``"adamw"`` (any case; stored
            lower-case) or a callable ``f(params, lr=..., weight_decay=...)``.
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
            schedule; the scaler's state is in the checkpoints. See :mod:`xla_utils.device_plan`.
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
        keep_checkpoints: This run's newest epoch files kept (default 2, >= 1);
            files of other runs in the same folder are never deleted.
        seed: Seeds data order and device RNG (flips, dropout). Default 0.
        flip: Random horizontal flip of uint8 image batches on the device.
            Default True.
        mean, std: Per-channel normalisation of uint8 images, in 0..1 units
            (default ImageNet's).
        log_every: Steps between loss reads for the progress bar (default 20;
            each read waits for the device).
        num_workers: Host threads/processes assembling batches (None = automatic).
        on_nan: What to do when the training loss read (every ``log_every``
            steps and at each epoch end) is NaN or infinite: ``"stop"``
            (default) stops there; the model keeps the weights of the last epoch
            that ended finite (a host copy made at each epoch end) and
            ``History.stop_reason`` says why. ``"continue"`` warns and trains on
            (no checkpoint is written for a non-finite epoch).
        compile_cache: torch_xla's persistent compilation cache for ``fit``,
            ``predict``, ``evaluate``, ``find_lr`` and ``check``: ``"auto"``
            (default) on TPUs only, under a folder that survives a notebook restart
            (``/kaggle/working/xla_compile_cache``, ``/content/xla_compile_cache``,
            else ``~/.cache/xla_utils/compile_cache``); a folder; ``True`` (on, also
            on XLA:CPU, which writes entries but cannot load them); ``None`` off.
            See :mod:`xla_utils.runtime.compile_cache`.
        accum_steps: Micro-batches per optimizer step (default 1); global batch = batch_size
            x cores x accum_steps, which scales the LR; the one-cycle counts optimizer steps.
        ema: Decay of a device weight EMA (timm ``ModelEmaV3`` warm-up, :mod:`xla_utils.ema`)
            that validation, ``evaluate`` and ``predict`` use; default None (off).
        mixup, cutmix, label_smoothing: timm-style, on the device (:mod:`xla_utils.mixup`):
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
            over the mesh's ``fsdp`` axis). See :mod:`xla_utils.strategy`.
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
        if not isinstance(self.keep_checkpoints, int) or self.keep_checkpoints < 1:
            raise ValueError(f"keep_checkpoints must be an int >= 1 (this run's newest epoch files "
                             f"kept), got {self.keep_checkpoints!r}")
        if self.on_nan not in ON_NAN:
            raise ValueError(f"on_nan must be one of {ON_NAN}, got {self.on_nan!r}")
        runtime._check_compile_cache_option(self.compile_cache)
        device_plan.check_config(self)
        check_step_options(self)
        check_monitor(self.monitor, self.patience)
        _strategy.check_config(self)

    def val_batch_size(self, samples: int, cores: int) -> int:
        """The per-epoch validation's batch per core for ``samples`` items over ``cores``:
        ``eval_batch_size``, else ``max(batch_size, min(64, ceil(samples / cores)))`` (no
        gradients, so larger than a tiny training batch; pass ``eval_batch_size=batch_size``
        if validation runs out of memory)."""
        if self.eval_batch_size:
            return self.eval_batch_size
        return max(self.batch_size, min(64, -(-samples // cores)))

    @property
    def scaling_rule(self) -> str:
        if self.lr_scaling is not None:
            return self.lr_scaling
        return "linear" if self.optimizer == "sgd" else "sqrt"


class OneCycleTrainer:
    """Train ``model`` with the one-cycle policy on all TPU cores.

    Args:
        model: An ``nn.Module`` or a zero-argument factory returning one. It is created
            once, here in the calling process (seeded with ``seed``), and every
            replica starts from exactly these weights.
        loss: ``loss(outputs, targets) -> scalar`` (e.g. ``nn.CrossEntropyLoss()``;
            ``nn.BCEWithLogitsLoss()`` for multi-label). Validation uses its
            per-sample form (``reduction="none"``) when it has one.
        train_data, val_data: A :class:`~xla_utils.data.CachedImageDataset` (uint8 batches,
            normalised and flipped on the device) or any map-style dataset returning ``(input,
            target)``: uint8 images ``[H, W, C]`` or ``[C, H, W]`` (``read_image``,
            ``PILToTensor``, ``tv_tensors.Image``) are normalised and flipped on the device
            too, PIL images are converted on the host, other numeric inputs go to the model
            unchanged (decided once per dataset from its first sample, see
            :func:`xla_utils.inputs.inspect_inputs`); other samples are refused before any
            device time.
        train_step: Optional hook ``train_step(model, (x, y), loss) -> loss tensor`` for
            other problem types. ``eval_step(model, (x, y)) -> outputs`` likewise.
        **config: Any field of :class:`TrainerConfig` (batch_size, epochs, max_lr, ...).
    """

    def __init__(self, model: torch.nn.Module | Callable[[], torch.nn.Module], loss: Callable,
                 train_data, val_data=None, *, train_step: Callable | None = None,
                 eval_step: Callable | None = None, **config: Any):
        try:
            self.config = TrainerConfig(**config)
        except TypeError as exc:
            if "unexpected keyword" not in str(exc):
                raise
            names = [f.name for f in dataclasses.fields(TrainerConfig)]
            raise TypeError(f"{exc}; OneCycleTrainer options are {names}") from None
        if isinstance(model, torch.nn.Module):
            self.model = model
        elif callable(model):
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(self.config.seed)
                self.model = model()
            if not isinstance(self.model, torch.nn.Module):
                raise TypeError(f"model factory returned {type(self.model).__name__}, not nn.Module")
        else:
            raise TypeError("model must be an nn.Module or a zero-argument factory")
        self.loss = loss
        self.train_data = train_data
        self.val_data = val_data
        self.train_step = train_step or loop.default_train_step
        self.eval_step = eval_step or loop.default_eval_step
        self.lr_finder_result = None
        self._from_factory = not isinstance(model, torch.nn.Module)
        self._epochs_trained = 0  # epochs earlier fit() calls put into self.model
        self.ema_state: dict[str, torch.Tensor] | None = None  # EMA weights of the last fit
        self._mix = None  # the fit run's MixConfig (set by fit on the host)
        # Set by fine_tune for one phase's fit: layer-group LRs, and what its
        # checkpoints record beside the run's state (the phase).
        self._lr_groups: Callable[..., Any] | None = None
        self._ckpt_extra: dict[str, Any] | None = None
        # Without a TPU, XLA runs only on simulated cores: start their interpreter now,
        # so that the first fit/predict/evaluate(simulate=N) does not wait for it.
        runtime._prestart_if_simulation_likely()

    # ------------------------------------------------------------------ API
    def find_lr(self, simulate: int | None = None, *, on_mesh: bool | None = None,
                tpu: Any = None, cores: int | str = "all", **kwargs: Any):
        """Run :func:`xla_utils.lr_find` with this trainer's model, loss, data, batch size,
        optimizer and image normalisation; the result is also kept in
        ``self.lr_finder_result``. Extra keywords go to ``lr_find``.

        ``"spawn"``: one core, per-core batch (``accum_steps=8`` answers for 8 cores).
        ``"spmd"``/``"fsdp"``: for the fit's global batch, on one core (micro-batches
        accumulated) or, when one core of the target TPU cannot hold the model
        (:func:`xla_utils.mesh_tasks.sweep_placement`) or when asked, on the mesh; a line
        and ``result.placement`` say which and why. Runs in another process: this
        trainer's model, optimizer and RNGs are untouched.

        Args:
            simulate: N simulated XLA:CPU devices (the one-core sweep uses one of them, a
                mesh run all N); default None (this TPU).
            on_mesh: True: sweep on the mesh; False: on one core; None (default): the
                config's ``lr_find_on_mesh`` (None there: automatic).
            tpu: The target TPU of the automatic choice, as in :meth:`check` (a name such
                as ``"v5e"`` or a :class:`~xla_utils.readiness.TPUChip`); default this
                machine's TPU, else v5e.
            cores: The fit's ``cores`` the answer is for (mesh strategies): ``"all"``
                (default) or 1.
        """
        devices = _strategy.planned_world_size(cores, simulate)
        self.lr_finder_result = _mesh_tasks.find_lr(self, simulate, on_mesh, tpu, kwargs, devices)
        return self.lr_finder_result

    def fine_tune(self, epochs: int, freeze_epochs: int = 1, **kwargs: Any) -> History:
        """fastai's recipe: the head with the body frozen for ``freeze_epochs``, then
        everything for ``epochs`` with discriminative LRs; see
        :func:`xla_utils.finetune.fine_tune` for every argument."""
        from .finetune import fine_tune
        return fine_tune(self, epochs, freeze_epochs, **kwargs)

    def freeze(self, head: Any = None, train_bn: bool = True) -> list[str]:
        """Freeze all but the head (normalisation layers stay trainable with
        ``train_bn``); :func:`xla_utils.finetune.freeze_trainer`. Returns the head's names."""
        from .finetune import freeze_trainer
        return freeze_trainer(self, head, train_bn)

    def unfreeze(self) -> None:
        """Train every parameter again (:func:`xla_utils.finetune.unfreeze_trainer`)."""
        from .finetune import unfreeze_trainer
        unfreeze_trainer(self)

    def debug(self, steps: int = 5, simulate: int | None = None) -> DebugReport:
        """Run a few plain training steps on ONE core and explain what XLA did.

        :func:`xla_utils.debug.debug_run` with this trainer's model, loss,
        training data, per-core batch size, optimizer, ``train_step``,
        ``eval_step`` and image normalisation; labels are checked first, as in
        :meth:`fit`. It runs in a forked child, so :meth:`fit` can launch all
        cores afterwards. Under ``strategy="spmd"``/``"fsdp"`` the same steps run as
        the mesh run (``report.devices``, ``report.strategy``).

        Args:
            steps: Steps to run (default 5: 2 to warm up, the rest must not compile).
            simulate: Mesh strategies only: N simulated XLA:CPU devices; default None:
                this TPU's devices, else 8 simulated ones.

        Returns:
            The :class:`~xla_utils.debug.DebugReport` (also printed).
        """
        return self._debug(self._check_inputs()["train"][1], steps, simulate)

    def _debug(self, spec: InputSpec, steps: int = 5, simulate: int | None = None) -> DebugReport:
        cfg = self.config
        sim = 8 if simulate is None and not runtime._tpu_present() else simulate
        plan = (None if cfg.strategy == "spawn" else
                _strategy.plan_strategy(cfg, self.model, _strategy.planned_world_size("all", sim), sim))
        return debug_run(self.model, self.loss, self.train_data, batch_size=cfg.batch_size,
                         steps=steps, optimizer=cfg.optimizer, train_step=self.train_step,
                         prepare=self._prepare(spec, train=False), eval_step=self.eval_step,
                         inputs=spec, mesh=plan, precision=cfg.precision,
                         channels_last=cfg.channels_last)

    def fit(self, *, cores: int | str = "all", simulate: int | None = None,
            max_lr: float | str | None = None, resume: str | os.PathLike | None = None,
            debug: bool = False, timeout: float | None = None,
            check: bool = False) -> "History | DebugReport":
        """Train on all cores (``cores="all"``) or one (``cores=1``).

        Labels are checked against the model's output width and the dataset's
        classes before anything runs. ``self.model`` receives the weights only
        after the run: the final ones, or after a stop on a non-finite loss
        (``on_nan="stop"``) those of the last epoch that ended finite.

        Args:
            cores: ``"all"`` (default) or 1.
            simulate: Run N simulated XLA:CPU cores (no TPU needed); default None.
            max_lr: Overrides the configured one (``"find"`` runs the LR finder
                first); default None: the configured ``max_lr``.
            resume: Continue an earlier run exactly at its next epoch: an epoch
                checkpoint file, a folder (its newest good ``epoch_*.pt``) or
                ``"last"`` (the newest in ``checkpoint_dir``). The checkpoint's
                configuration is compared with this one first; anything the
                schedule or optimizer state depends on (optimizer, batch size,
                epochs, max_lr, cores, steps per epoch, ...) must match.
            debug: Deprecated: use :meth:`debug` (returns its report instead of
                training).
            timeout: Seconds after which the replicas are killed (default none).
            check: First run :meth:`check` and print its report; default False.

        Returns:
            The run's :class:`History`.

        Raises:
            ResumeError: ``resume`` cannot continue exactly; lists every difference.
            CheckpointError: A corrupt checkpoint; names the newest good one beside it.
            ~xla_utils.readiness.ReadinessError: ``check=True`` found errors (before
                any training or TPU time; warnings only print).
            ValueError: Labels outside the model's outputs, unlabelled data, or a
                training set smaller than one global batch.
            ~xla_utils.inputs.InputRefused: A sample the trainer cannot feed (a
                ``TypeError`` naming its type, shape, dtype and the fix).
        """
        cfg = self.config
        runtime._prestart_simulation(simulate)
        device_plan.check_before_launch(cfg.precision, simulate=simulate, mesh=cfg.strategy != "spawn")
        inputs = self._check_inputs()
        if check:
            self._check_before_fit()
        if debug:
            warnings.warn("fit(debug=True) is deprecated: use trainer.debug(), which returns "
                          "the same DebugReport", DeprecationWarning, stacklevel=2)
            return self._debug(inputs["train"][1])
        check_monitor_data(cfg.monitor, cfg.metrics, self.val_data is not None,
                           bool(getattr(self.train_data, "multilabel", False)),
                           getattr(self.train_data, "num_classes", None))
        world = _strategy.planned_world_size(cores, simulate)
        check_batches(self.train_data, cfg.batch_size, world * cfg.accum_steps)
        self._mix = self._mix_config(inputs["train"])
        if cfg.strategy != "spawn":
            plan = _strategy.plan_strategy(cfg, self.model, world, simulate)
        ckpt = None
        if resume is not None:
            path, ckpt = resolve_resume(resume, cfg.checkpoint_dir)
            # On a TPU the world is detected, not known (pod slices span hosts):
            # the replica compares cores and steps per epoch there.
            exact = cores == 1 or simulate is not None or runtime.backend() != "xla"
            check_resume(path, ckpt, cfg, self.model, max_lr, world if exact else None,
                         len(self.train_data) // (cfg.batch_size * world) // cfg.accum_steps)
            base_lr, lr_world = ckpt["base_lr"], ckpt.get("lr_world", 1)
        else:
            base_lr, lr_world = self._new_run_lr(max_lr, simulate, world)
        if not (isinstance(base_lr, (int, float)) and base_lr > 0):
            raise ValueError(f"max_lr must be a positive number or 'find', got {base_lr!r}")
        run_id = time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(2)
        args = (float(base_lr), lr_world, ckpt, run_id, inputs)
        if cfg.strategy == "spawn":
            out = runtime._launch(self._replica, args, cores=cores, simulate=simulate,
                                  timeout=timeout, sim_threads=True)
        else:
            out = _strategy.launch(_strategy.fit_replica, (self, *args), plan, timeout)
        if out.state_dict:  # empty when no epoch of this fit ended with finite weights
            self.model.load_state_dict(out.state_dict)
            self._epochs_trained = len(out.epochs) + (0 if ckpt is not None
                                                      else self._epochs_trained)
            self.ema_state = out.ema_state_dict or None
        for w in out.warnings:
            warnings.warn(w, RuntimeWarning, stacklevel=2)
        return out

    def _mix_config(self, train: tuple[Any, InputSpec]) -> MixConfig | None:
        """The fit run's :class:`~xla_utils.mixup.MixConfig` (None: no mixing or smoothing)
        for the checked training data ``train`` (``_check_inputs()["train"]``)."""
        return mix_config_for(self.config, self.loss, self.model, *train,
                              self._prepare(train[1], train=False), self.eval_step)

    def _check_inputs(self) -> dict[str, tuple[Any, InputSpec] | None]:
        """Refuse unlabelled data, samples the trainer cannot feed and labels the model
        cannot output, before any device time. Returns ``{"train": (data as the loader
        collates it, its InputSpec), "val": ... or None}``."""
        require_labels(self.train_data, "train_data")
        require_labels(self.val_data, "val_data")
        out: dict[str, tuple[Any, InputSpec] | None] = {"val": None}
        for data, name in ((self.train_data, "train_data"), (self.val_data, "val_data")):
            if data is not None:
                spec = self._inspect(data, name, "training" if name == "train_data" else
                                     "validation")
                fed = spec.feed(data)
                check_targets(self.model, self.loss, fed, name, self._prepare(spec, train=False),
                              self.eval_step)
                out[name[:-5]] = (fed, spec)
        return out

    def _inspect(self, data, name: str, verb: str, need_target: bool = True) -> InputSpec:
        """``data``'s :class:`~xla_utils.inputs.InputSpec` (its samples refused here, on the
        host, when the trainer cannot feed them)."""
        return inspect_inputs(data, name, need_target=need_target, verb=verb, mean=self.config.mean)

    def _new_run_lr(self, max_lr: float | str | None, simulate: int | None,
                    world: int) -> tuple[float | str, int]:
        """``(base_lr, lr_world)`` of a run that does not resume: the configured or
        given ``max_lr`` for one core, or ``lr_find``'s answer for ``world`` cores."""
        cfg = self.config
        base_lr = cfg.max_lr if max_lr is None else max_lr
        if self._epochs_trained:
            warnings.warn(
                f"this trainer's model was already trained by an earlier fit() "
                f"({self._epochs_trained} epoch(s)); this fit starts a new one-cycle schedule "
                "from those trained weights"
                + (" (the model factory is called once, in OneCycleTrainer(...), not per fit)"
                   if self._from_factory else "")
                + ". For a fresh start create a new OneCycleTrainer; to continue a run "
                "exactly use fit(resume=<checkpoint>).", UserWarning, stacklevel=3)
        if base_lr != "find":
            return base_lr, 1
        # Measure at the run's own global batch: k accumulated micro-batches of the per-core
        # batch are exactly one k-core step's gradient (a mesh strategy's find_lr does this
        # itself, or sweeps on the mesh): no scaling rule on top of the finder's rule.
        extra = dict(accum_steps=world * cfg.accum_steps) if cfg.strategy == "spawn" else {}
        res = self.find_lr(simulate=simulate, epochs=cfg.epochs, cores=1 if world == 1 else "all",
                           **extra)
        base_lr = res.suggestion
        if not math.isfinite(base_lr):
            raise RuntimeError(f"lr_find gave no suggestion (stopped: {res.stop_reason}); pass "
                               "max_lr=<number> or look at trainer.lr_finder_result.plot()")
        on = "one core" if res.strategy is None else f"a mesh of {res.devices} devices"
        print(f"lr_find suggests max_lr {base_lr:.3g} for the global batch "
              f"{res.batch_size} ({res.micro_batch_size} x {res.accum_steps} micro-batches on "
              f"{on}, rule {res.rule}, run of {res.planned_steps} steps).", flush=True)
        if not res.confident:
            warnings.warn(f"fit(max_lr='find'): {res.warning}. Training with max_lr "
                          f"{base_lr:.3g} anyway; check trainer.lr_finder_result.plot() "
                          "and pass fit(max_lr=<number>)", RuntimeWarning, stacklevel=3)
        return base_lr, world * cfg.accum_steps

    def predict(self, data, tta: int = 1, cores: int | str = "all", simulate: int | None = None,
                batch_size: int | None = None, activation: str | None = "auto",
                weights: str | os.PathLike | None = None) -> np.ndarray:
        """Run the model over every item of ``data`` on all cores; return its outputs.

        Args:
            data: a :class:`~xla_utils.data.CachedImageDataset` (labelled or built with
                ``unlabeled=True``) or any map-style dataset returning ``x`` or ``(x, y, ...)``.
            tta: views averaged per image (default 1). The views are, in this order,
                the cache's stored variants ``0 .. V-1`` as stored, then (only when the
                trainer trains with ``flip=True``) the same variants mirrored
                horizontally on the device: ``tta=1`` is variant 0, a plain test cache
                (``V=1``) with ``tta=2`` is image + mirror image, a cache with
                ``variants=4`` and ``tta=4`` its four crops. At most ``V`` (``2V`` with
                flips) views; other datasets have ``V=1``. The result is the mean of
                the k single-view predictions (after the activation).
            cores, simulate: as in :meth:`fit` (``"all"`` or 1; ``simulate=N`` runs N
                simulated XLA:CPU cores).
            batch_size: per core; default the trainer's ``batch_size``. Every batch has
                this shape (the tail is padded with repeated images and dropped again),
                so nothing compiles after the first batch.
            activation: ``"auto"`` (default): sigmoid when the training data is
                multi-label (``train_data.multilabel``), the loss is
                ``BCEWithLogitsLoss``, or the model has one output; softmax otherwise.
                ``"softmax"``, ``"sigmoid"`` or ``None`` (raw model outputs).
            weights: a checkpoint to use instead of the trainer's current weights:
                ``final.pt`` (a state dict) or an ``epoch_<n>.pt`` of :meth:`fit`.
                ``self.model`` is not changed.

        Returns:
            ``float32[N, num_outputs]`` in dataset order: every item exactly once,
            gathered from all cores.

        Raises:
            ValueError: before any device time, when the images of ``data`` have
                another shape than the training data's (a test cache built at another
                size), ``tta`` exceeds the views ``data`` offers, or ``weights`` does
                not fit the model.
            ~xla_utils.inputs.InputRefused: before any device time, a sample the
                trainer cannot feed (its type, shape and dtype named, with the fix).
        """
        runtime._prestart_simulation(simulate)
        plan = self._inference_plan(data, tta, batch_size, activation, weights, labelled=False)
        return self._launch_inference(plan, cores, simulate)

    def evaluate(self, data, tta: int = 1, cores: int | str = "all", simulate: int | None = None,
                 batch_size: int | None = None) -> dict[str, float]:
        """Validation metrics of the current model on a labelled dataset, on all cores.

        Returns the dict :meth:`fit` reports per epoch: ``loss``, the configured
        metrics (accuracy, ``top<k>``, F1 for multi-label) and ``samples`` (every
        item counted once). ``tta``, ``cores``, ``simulate`` and ``batch_size`` are as in
        :meth:`predict`. With ``tta=k > 1`` the metrics are those of the averaged
        probabilities (exactly what :meth:`predict` returns): the loss receives
        ``log(mean softmax)`` (single-label) or ``logit(mean sigmoid)`` (multi-label),
        which makes ``CrossEntropyLoss`` / ``BCEWithLogitsLoss`` the loss of the
        averaged prediction.
        """
        require_labels(data, "data", action="evaluate")
        runtime._prestart_simulation(simulate)
        activation = "auto" if isinstance(tta, int) and tta > 1 else None
        plan = self._inference_plan(data, tta, batch_size, activation, None, labelled=True)
        return self._launch_inference(plan, cores, simulate)

    def _launch_inference(self, plan: loop.InferencePlan, cores: int | str,
                          simulate: int | None) -> Any:
        """Run ``plan`` on every core (``"spawn"``) or on the strategy's mesh."""
        device_plan.check_before_launch(self.config.precision, simulate=simulate,
                                        mesh=self.config.strategy != "spawn")
        if self.config.strategy == "spawn":
            return live_or_launch(self, self._inference_replica, (plan,), cores, simulate)
        world = _strategy.planned_world_size(cores, simulate)
        splan = _strategy.plan_strategy(self.config, self.model, world, simulate)
        return _strategy.launch(_strategy.inference_replica, (self, plan), splan, None)

    # ------------------------------------------------------------- inference
    def _inference_plan(self, data, tta, batch_size, activation, weights, labelled: bool
                        ) -> loop.InferencePlan:
        """Every check that can fail, done here in the calling process (no device time)."""
        if data is None or len(data) == 0:
            raise ValueError("data is empty: nothing to predict")
        bs = self.config.batch_size if batch_size is None else batch_size
        if not isinstance(bs, int) or bs < 1:
            raise ValueError(f"batch_size must be a positive int (per core), got {batch_size!r}")
        if activation not in ("auto", "softmax", "sigmoid", None):
            raise ValueError(f"activation must be 'auto', 'softmax', 'sigmoid' or None, got {activation!r}")
        if activation == "auto":
            multilabel = getattr(self.train_data, "multilabel", None)
            if multilabel is None:
                multilabel = isinstance(self.loss, torch.nn.BCEWithLogitsLoss) or \
                    self.loss is torch.nn.functional.binary_cross_entropy_with_logits
            activation = "sigmoid" if multilabel else "softmax"
        spec = self._inspect(data, "data", "evaluate", need_target=labelled)
        if self.train_data is not None:
            why = shape_mismatch(data, spec, self.train_data,
                                 self._inspect(self.train_data, "train_data", "training",
                                               need_target=False))
            if why is not None:
                raise ValueError(why)
        views = loop.tta_views(data, tta, spec.shape, self.config.flip)
        model = (with_weights(self.model, self.ema_state) if weights is None
                 else model_with_weights(self.model, weights))
        fed = spec.feed(data)
        return loop.InferencePlan(data=fed if isinstance(data, CachedImageDataset) else AsPairs(fed),
                                  inputs=spec, n=len(data), views=views, batch_size=bs,
                                  activation=activation, model=model, labelled=labelled, tta=tta)

    def _inference_replica(self, plan: loop.InferencePlan):
        """One replica of :meth:`predict` / :meth:`evaluate` (see :func:`loop.inference_pass`)."""
        runtime._enable_compile_cache(self.config.compile_cache)  # before anything compiles
        ws, rk, dev = runtime.world_size(), runtime.rank(), runtime.device()
        model = (_resident.replica_model(plan.model, dev, rk) if _resident.in_live_job()
                 else loop.replica_model(plan.model, dev)).eval()  # a live job keeps device copies
        acc, targets = loop.inference_pass(model, plan, cfg=self.config, eval_step=self.eval_step,
                                           world_size=ws, rank=rk, dev=dev)
        if plan.labelled:
            return loop.inference_metrics(acc, targets, plan, cfg=self.config, loss_fn=self.loss,
                                          dev=dev)
        return loop.gather_predictions(acc, plan, world_size=ws, rank=rk, dev=dev)

    def check(self, *, steps: int = 4, tpu: str | None = None, measure_loader: bool = True,
              timeout: float | None = None, devices: int | None = None) -> "ReadinessReport":
        """:func:`xla_utils.check` with this trainer's model, loss, optimizer, ``train_step``,
        bf16, normalisation (and flips) on the first ``batch_size`` batch of ``train_data``;
        ``measure_loader`` (default True) compares the loader's samples/s with the TPU's step
        rate; ``tpu`` as in :func:`xla_utils.check` (default this TPU, else v5e). Under
        ``"spmd"``/``"fsdp"`` the sharded step also runs on ``devices`` devices (default: the
        slice ``tpu`` names, else 8): :func:`xla_utils.mesh_tasks.check_on_mesh`."""
        from .readiness import check as readiness_check

        cfg = self.config
        spec = self._inspect(self.train_data, "train_data", "training")
        data = spec.feed(self.train_data)
        if len(data) < cfg.batch_size:
            raise ValueError(f"train_data has fewer than batch_size={cfg.batch_size} samples")
        x, y, _ = next(iter(iterate_batches(data, cfg.batch_size, shuffle=False, drop_last=True,
                                            num_workers=0)))
        loader = (iterate_batches(data, cfg.batch_size, seed=cfg.seed,
                                  num_workers=cfg.num_workers) if measure_loader else None)
        report = readiness_check(self.model, (x.clone(), y.clone()), loss=self.loss,
                                 optimizer=cfg.optimizer, steps=steps, data=loader, tpu=tpu,
                                 prepare=self._prepare(spec, train=True),
                                 train_step=self.train_step, bf16=cfg.bf16, timeout=timeout,
                                 inputs=spec.describe(flip=cfg.flip), compile_cache=cfg.compile_cache)
        if cfg.strategy != "spawn":
            _mesh_tasks.check_on_mesh(self, report, spec=spec, steps=steps, tpu=tpu, devices=devices)
        return report

    def _check_before_fit(self) -> None:
        from .readiness import ReadinessError

        report = self.check()
        print(report, flush=True)
        if report.errors:
            raise ReadinessError(report)

    # ------------------------------------------------------------- replica
    def _replica(self, base_lr: float, lr_world: int, ckpt: dict | None, run_id: str,
                 inputs: dict[str, tuple[Any, InputSpec] | None],
                 strategy: _strategy.MeshRun | None = None) -> History:
        """One replica of :meth:`fit`: set up, then per epoch train, evaluate and checkpoint
        (``strategy``: the one SPMD process of ``"spmd"``/``"fsdp"``)."""
        cfg = self.config
        train_data, spec = inputs["train"]
        cache = runtime._enable_compile_cache(cfg.compile_cache)  # before anything compiles
        counters0 = runtime.xla_counters()
        s = loop.set_up(self.model, cfg, train_data, base_lr=base_lr, lr_world=lr_world,
                        ckpt=ckpt, mix=self._mix, lr_groups=self._lr_groups,
                        strategy=strategy, inputs=spec)
        state = loop.TrainState(step=s.start_epoch * s.steps_per_epoch,
                                initial_loss=None if ckpt is None else ckpt.get("initial_loss"))
        master_bar, progress_bar = runtime.progress_bars()
        epochs = range(s.start_epoch, cfg.epochs)
        best = BestTracker.resume(cfg.monitor, cfg.patience, s.history) if cfg.monitor else None
        mb = master_bar(epochs) if runtime.is_master() else None
        for epoch in (mb if mb is not None else epochs):
            pb = progress_bar(range(s.steps_per_epoch * s.accum_steps),
                              parent=mb) if mb is not None else None
            batches = s.batches(train_data, cfg, epoch, train=True)
            res = loop.train_one_epoch(epoch, s, state, batches, cfg=cfg,
                                       train_step=self.train_step, loss_fn=self.loss,
                                       inputs=spec, progress=pb)
            if state.stop_reason is not None:
                break
            record = self._epoch_record(epoch, s, state, res, inputs["val"])
            s.history.append(record)
            if mb is not None:
                mb.write(loop.epoch_line(record))
            self._end_epoch(epoch, s, state, run_id, finite=math.isfinite(res.train_loss))
            if epoch_files(best, record, loop.eval_module(s), s.history, cfg.checkpoint_dir):
                break
        if state.stop_reason is not None:
            final = state.finite_state or {}
        else:
            final = state.finite_state if state.finite_state is not None else s.state_dict()
            final = best.best_state if best is not None and best.best_state else final
            if cfg.checkpoint_dir is not None:
                self._save_final(s, final, best is not None and bool(best.best_state))
        return History(epochs=s.history, world_size=s.world_size,
                       global_batch=s.world_size * cfg.batch_size * s.accum_steps,
                       base_lr=s.base_lr,
                       max_lr=s.max_lr, lr_scaling=s.rule, lr_note=s.lr_note,
                       backend=runtime.backend(), state_dict=final,
                       stop_reason=state.stop_reason or (best and best.stop_reason),
                       monitor=cfg.monitor, best_epoch=best and best.best_epoch,
                       best_score=best and best.best_score,
                       warnings=state.warnings, run_id=run_id,
                       compile_cache=runtime._compile_cache_summary(cache, counters0,
                                                                    runtime.xla_counters()),
                       ema_state_dict={} if s.ema is None else s.ema.state_dict())

    def _save_final(self, s: loop.Setup, final: dict[str, torch.Tensor], is_best: bool) -> None:
        """``final.pt``: the weights ``predict`` uses (the best epoch's, else the EMA
        ones when ``ema`` is set, else ``final``); with EMA also ``final_raw.pt``
        (the last epoch's trained weights). Every rank calls (the master writes)."""
        folder = Path(self.config.checkpoint_dir)
        if s.ema is None:
            runtime.save(final, folder / "final.pt")
            return
        runtime.save(final if is_best else s.ema.state_dict(), folder / "final.pt")
        runtime.save(s.state_dict(), folder / "final_raw.pt")

    def _epoch_record(self, epoch: int, s: loop.Setup, state: loop.TrainState,
                      res: loop.EpochResult, val: tuple[Any, InputSpec] | None) -> dict[str, Any]:
        """The history record of a finished epoch (validation included), warning
        once per key when a loss explodes."""
        cfg = self.config
        record: dict[str, Any] = {"epoch": epoch + 1, "train_loss": res.train_loss}
        if val is not None:
            metrics = loop.evaluate(loop.eval_module(s), s.batches(val[0], cfg, epoch, train=False),
                                    cfg=cfg, loss_fn=self.loss, eval_step=self.eval_step,
                                    autocast=s.autocast, dev=s.device, inputs=val[1], feed=s.feed,
                                    memory_format=s.plan.memory_format)
            record.update({"val_loss": metrics.pop("loss")}, **metrics)
        for key in ("train_loss", "val_loss"):
            msg = loop.exploded(key, record.get(key), state.initial_loss, epoch + 1)
            if msg and not state.diverged and not any(w.startswith(key) for w in state.warnings):
                runtime.master_print(msg)
                state.warnings.append(msg)
        record.update(lr_max=s.max_lr, lr_last=res.lr_last,
                      images_per_s=s.steps_per_epoch * s.accum_steps * cfg.batch_size * s.world_size
                      / res.seconds,
                      compiles=runtime.xla_counters()["compiles"],
                      host_reads_per_step=res.to_host / s.steps_per_epoch, seconds=res.seconds)
        if res.skipped_steps is not None:
            record["skipped_steps"] = res.skipped_steps
        return record

    def _end_epoch(self, epoch: int, s: loop.Setup, state: loop.TrainState, run_id: str,
                   finite: bool) -> None:
        """Keep a host copy of finite weights (master, ``on_nan="stop"``) and
        write the epoch checkpoint when configured and the loss is finite."""
        cfg = self.config
        if finite and cfg.on_nan == "stop" and runtime.is_master():
            state.finite_state = loop.host_copy(s.state_dict())
        if cfg.checkpoint_dir is None:
            return
        if finite:
            written = save_checkpoint(
                s.model, s.opt, cfg, epoch=epoch + 1, history=s.history, base_lr=s.base_lr,
                lr_world=s.lr_world, world_size=s.world_size, steps_per_epoch=s.steps_per_epoch,
                run_id=run_id, host_state=state.finite_state if state.finite_state is not None
                else s.state_dict(), initial_loss=state.initial_loss,
                ema=None if s.ema is None else s.ema.state_dict(),
                scaler=s.plan.scaler_state(), extra=self._ckpt_extra)
            if s.mesh is not None:  # its sharded twin (strategy="spmd"/"fsdp")
                s.mesh.save_sharded(s.model, s.opt, cfg.checkpoint_dir, epoch + 1, run_id,
                                    cfg.keep_checkpoints, meta=sharded_meta(written, cfg.strategy),
                                    ema=s.ema)
        else:
            runtime.master_print(f"epoch {epoch + 1}: no checkpoint written "
                                 "(non-finite loss); older checkpoints are kept")

    def eval_weights(self) -> dict[str, torch.Tensor]:
        """The weights ``evaluate``/``predict`` use: the last fit's EMA weights when
        ``ema`` is set, else ``self.model``'s."""
        return self.ema_state or self.model.state_dict()

    def _prepare(self, spec: InputSpec, train: bool) -> Callable[[torch.Tensor], torch.Tensor]:
        """``x -> model input`` for batches of a dataset described by ``spec``."""
        return lambda x, cfg=self.config: loop.prepare_input(x, cfg, train, spec)
