"""One-cycle training on every TPU core, plus the single-core debug loop.

``OneCycleTrainer(model, loss, train_data, val_data, batch_size=32, ...).fit()``
launches one replica per core through :func:`xla_utils.runtime.launch` (fork,
so models and functions defined in a notebook work), scales the LR by the world
size, drives LR and momentum with :class:`~xla_utils.schedule.OneCycleSchedule`
every optimizer step, and returns a :class:`History` to the notebook.

The step loop owns its step boundary: each step is forward, backward,
``runtime.optimizer_step`` (gradients averaged over replicas) and one
``runtime.sync()``. The loss is accumulated on the device and read only every
``log_every`` steps; validation metrics are device sums reduced once per pass.
Every rank gets the same number of full batches (training drops the ragged
tail of the global shuffle; validation pads and masks), so after the first
epoch nothing compiles again.
"""
from __future__ import annotations

import copy
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

from . import runtime
from .data import (IMAGENET_MEAN, IMAGENET_STD, CachedImageDataset, images_to_float, is_image_batch,
                   iterate_batches)
from .metrics import MetricAccumulator, resolve_metrics
from .optim import make_optimizer, resolve_optimizer
from .schedule import OneCycleSchedule

if TYPE_CHECKING:
    from .readiness import ReadinessReport

__all__ = ["TrainerConfig", "OneCycleTrainer", "History", "DebugReport", "debug_run",
           "scale_lr", "CheckpointError", "ResumeError"]

LR_SCALING = ("linear", "sqrt", "none")
ON_NAN = ("stop", "continue")
# Samples read to check the targets of a dataset that keeps no label array.
LABEL_SCAN_SAMPLES = 512
LABEL_SCAN_SECONDS = 5.0
# An epoch loss this many times the untrained model's is reported as exploding.
VAL_LOSS_EXPLODES = 10.0


class CheckpointError(ValueError):
    """A checkpoint file is corrupt, truncated or not an epoch checkpoint."""


class ResumeError(ValueError):
    """A checkpoint cannot be continued exactly with this trainer's configuration."""


@dataclass
class TrainerConfig:
    """Hyper-parameters of :class:`OneCycleTrainer` (all keyword arguments of it).

    batch_size: samples per core per step (global batch = batch_size x cores). Default 32.
    epochs: passes over the training data. Default 1.
    max_lr: peak LR for ONE core at ``batch_size`` (scaled by ``lr_scaling``), or
        ``"find"`` to run the LR finder first. Default 1e-3.
    optimizer: ``"sgd"`` (momentum), ``"adam"``, ``"adamw"`` (any case; stored
        lower-case) or a callable ``f(params, lr=..., weight_decay=...)``.
        Default ``"adamw"``. An unknown name raises ``ValueError`` here.
    weight_decay: default 0.0 (AdamW: decoupled).
    pct_start, div_factor, final_div_factor, moms: one-cycle shape (torch
        ``OneCycleLR`` defaults 0.3, 25, 1e4; momentum/beta1 0.95 -> 0.85 -> 0.95).
    lr_scaling: how ``max_lr`` grows with the number of cores k: ``"linear"``
        (x k, Goyal et al. 2017), ``"sqrt"`` (x sqrt k) or ``"none"``. Default
        None = linear for SGD, sqrt for Adam/AdamW and callables.
    bf16: run forward/backward under ``torch.autocast(dtype=bfloat16)``. Default False.
    metrics: validation metrics (``"accuracy"``, ``"top5"``/``"top<k>"``, ``"f1"``);
        None = accuracy (+top5 above 10 classes), F1 for multi-label data.
    checkpoint_dir: write ``epoch_<nnn>-<run id>.pt`` after every epoch whose loss
        is finite and ``final.pt`` (weights only) at the end of a run that was not
        stopped; None = no files.
        keep_checkpoints: this run's newest epoch files kept (default 2, >= 1);
        files of other runs in the same folder are never deleted.
    on_nan: what to do when the training loss read (every ``log_every`` steps
        and at each epoch end) is NaN or infinite: ``"stop"`` (default) stops
        there; the model keeps the weights of the last epoch that ended finite
        (a host copy made at each epoch end) and ``History.stop_reason`` says
        why. ``"continue"`` warns and trains on (no checkpoint is written for a
        non-finite epoch).
    seed: seeds data order and device RNG (flips, dropout). Default 0.
    flip: random horizontal flip of uint8 image batches on the device. Default True.
    mean, std: per-channel normalisation of uint8 images, in 0..1 units (ImageNet).
    log_every: steps between loss reads for the progress bar (default 20; each
        read waits for the device).
    num_workers: host threads/processes assembling batches (None = automatic).
    """

    batch_size: int = 32
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

    def __post_init__(self) -> None:
        self.optimizer = resolve_optimizer(self.optimizer)
        if not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise ValueError(f"batch_size must be a positive int (per core), got {self.batch_size!r}")
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

    @property
    def scaling_rule(self) -> str:
        if self.lr_scaling is not None:
            return self.lr_scaling
        return "linear" if self.optimizer == "sgd" else "sqrt"


def scale_lr(lr: float, world_size: int, rule: str) -> float:
    """``lr`` for ``world_size`` cores under ``rule`` (linear, sqrt or none)."""
    factor = {"linear": world_size, "sqrt": math.sqrt(world_size), "none": 1.0}[rule]
    return lr * factor


@dataclass
class History:
    """What :meth:`OneCycleTrainer.fit` returns.

    ``epochs`` holds one dict per epoch: ``epoch``, ``train_loss``, ``val_loss`` and
    validation metrics (when ``val_data`` was given), ``lr_max`` (peak LR used),
    ``lr_last`` (LR of the epoch's last step), ``images_per_s`` (global, this
    epoch including any compilation), ``compiles`` (XLA compilations so far in
    the run, cumulative), ``host_reads_per_step`` (device->host transfers per
    training step in this process, all its replicas together: the progress-bar
    loss reads), ``seconds``. ``state_dict`` is the final model state on the CPU
    (after a stop: the last finite epoch's; empty when no epoch ended finite).
    ``stop_reason`` is None for a complete run, else why it stopped early;
    ``warnings`` lists what the run warned about (divergence, exploding
    validation loss); ``run_id`` names this run's checkpoint files.
    """

    epochs: list[dict[str, Any]]
    world_size: int
    global_batch: int
    base_lr: float
    max_lr: float
    lr_scaling: str
    lr_note: str
    backend: str
    state_dict: dict[str, torch.Tensor] = field(repr=False, default_factory=dict)
    stop_reason: str | None = None
    warnings: list[str] = field(default_factory=list)
    run_id: str | None = None

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.epochs[i]

    def __len__(self) -> int:
        return len(self.epochs)

    def table(self) -> str:
        """The per-epoch history as an aligned text table."""
        if not self.epochs:
            return "(no epochs)"
        keys = [k for k in self.epochs[-1] if k != "epoch"]
        head = ["epoch"] + keys
        rows = [[str(e["epoch"])] + [_fmt(e.get(k)) for k in keys] for e in self.epochs]
        widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
        lines = ["  ".join(h.rjust(w) for h, w in zip(head, widths))]
        lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
        return "\n".join(lines)

    def __str__(self) -> str:
        cores = f"{self.world_size} core{'s' if self.world_size > 1 else ''}"
        return (f"{cores} x {self.global_batch // self.world_size} = {self.global_batch} global "
                f"batch, max_lr {self.max_lr:.3g} (from {self.base_lr:.3g}: {self.lr_note}), "
                f"backend {self.backend}\n" + self.table()
                + (f"\nSTOPPED: {self.stop_reason}" if self.stop_reason else ""))


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return "-" if v is None else str(v)


def _default_train_step(model: torch.nn.Module, batch: tuple, loss_fn: Callable) -> torch.Tensor:
    x, y = batch
    return loss_fn(model(x), y)


def _default_eval_step(model: torch.nn.Module, batch: tuple) -> torch.Tensor:
    x, _ = batch
    return model(x)


class OneCycleTrainer:
    """Train ``model`` with the one-cycle policy on all TPU cores.

    Parameters
    ----------
    model:
        An ``nn.Module`` or a zero-argument factory returning one. It is created
        once, here in the calling process (seeded with ``seed``), and every
        replica starts from exactly these weights.
    loss:
        ``loss(outputs, targets) -> scalar`` (e.g. ``nn.CrossEntropyLoss()``;
        ``nn.BCEWithLogitsLoss()`` for multi-label). Validation uses its
        per-sample form (``reduction="none"``) when it has one.
    train_data, val_data:
        A :class:`~xla_utils.data.CachedImageDataset` (uint8 batches, normalised
        and flipped on the device) or any map-style dataset returning
        ``(input, target)``.
    train_step:
        Optional hook ``train_step(model, (x, y), loss) -> loss tensor`` for
        other problem types. ``eval_step(model, (x, y)) -> outputs`` likewise.
    **config:
        Any field of :class:`TrainerConfig` (batch_size, epochs, max_lr, ...).
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
        self.train_step = train_step or _default_train_step
        self.eval_step = eval_step or _default_eval_step
        self.lr_finder_result = None
        self._from_factory = not isinstance(model, torch.nn.Module)
        self._epochs_trained = 0  # epochs earlier fit() calls put into self.model

    # ------------------------------------------------------------------ API
    def find_lr(self, simulate: int | None = None, **kwargs: Any):
        """Run :func:`xla_utils.lr_find` on one core with this trainer's model,
        loss, data, per-core batch size, optimizer and image normalisation; the
        result is also kept in ``self.lr_finder_result``. Extra keywords go to
        ``lr_find`` (e.g. ``accum_steps=8`` to answer for an 8-core run)."""
        from .lr_finder import lr_find

        cfg = self.config
        _require_labels(self.train_data, "train_data")
        kwargs.setdefault("batch_tfm", lambda x: self._prepare(x, train=False))
        self.lr_finder_result = lr_find(self.model, self.loss, self.train_data, cfg.batch_size,
                                        optimizer=cfg.optimizer, weight_decay=cfg.weight_decay,
                                        seed=cfg.seed, simulate=simulate, **kwargs)
        return self.lr_finder_result

    def fit(self, *, cores: int | str = "all", simulate: int | None = None,
            max_lr: float | str | None = None, resume: str | os.PathLike | None = None,
            debug: bool = False, timeout: float | None = None,
            check: bool = False) -> "History | DebugReport":
        """Train on all cores (``cores="all"``) or one (``cores=1``).

        ``simulate=N`` runs N simulated XLA:CPU cores (no TPU needed). ``max_lr``
        overrides the configured one (``"find"`` runs the LR finder first).
        ``resume`` continues an earlier run exactly at its next epoch: an epoch
        checkpoint file, a folder (its newest good ``epoch_*.pt``) or ``"last"``
        (the newest in ``checkpoint_dir``). The checkpoint's configuration is
        compared with this one first; anything the schedule or optimizer state
        depends on (optimizer, batch size, epochs, max_lr, cores, steps per
        epoch, ...) must match, else :class:`ResumeError` lists every
        difference. A corrupt file raises :class:`CheckpointError` naming the
        newest good checkpoint beside it. ``debug=True`` runs :func:`debug_run`
        instead (one core, a few steps, XLA report).

        Labels are checked against the model's output width and the dataset's
        classes before anything runs. ``self.model`` receives the weights only
        after the run: the final ones, or after a stop on a non-finite loss
        (``on_nan="stop"``) those of the last epoch that ended finite.
        ``check=True`` first runs :meth:`check` and prints its report; it raises
        :class:`~xla_utils.readiness.ReadinessError` (before any training or TPU
        time) when the report has errors, and goes on after warnings.
        """
        cfg = self.config
        runtime._prestart_simulation(simulate)
        _require_labels(self.train_data, "train_data")
        _require_labels(self.val_data, "val_data")
        for data, name in ((self.train_data, "train_data"), (self.val_data, "val_data")):
            if data is not None:
                _check_targets(self.model, self.loss, data, name,
                               lambda x: self._prepare(x, train=False), self.eval_step)
        if check:
            self._check_before_fit()
        if debug:
            return debug_run(self.model, self.loss, self.train_data,
                             batch_size=cfg.batch_size, optimizer=cfg.optimizer,
                             train_step=self.train_step,
                             prepare=lambda x: self._prepare(x, train=False),
                             eval_step=self.eval_step)
        world = _planned_world_size(cores, simulate)
        _check_batches(self.train_data, cfg.batch_size, world)
        base_lr = cfg.max_lr if max_lr is None else max_lr
        lr_world = 1  # the world size base_lr is meant for
        ckpt = None
        if resume is not None:
            path, ckpt = _resolve_resume(resume, cfg.checkpoint_dir)
            # On a TPU the world is detected, not known (pod slices span hosts):
            # the replica compares cores and steps per epoch there.
            exact = cores == 1 or simulate is not None or runtime.backend() != "xla"
            _check_resume(path, ckpt, cfg, self.model, max_lr, world if exact else None,
                          len(self.train_data) // (cfg.batch_size * world))
            base_lr, lr_world = ckpt["base_lr"], ckpt.get("lr_world", 1)
        else:
            if self._epochs_trained:
                warnings.warn(
                    f"this trainer's model was already trained by an earlier fit() "
                    f"({self._epochs_trained} epoch(s)); this fit starts a new one-cycle schedule "
                    "from those trained weights"
                    + (" (the model factory is called once, in OneCycleTrainer(...), not per fit)"
                       if self._from_factory else "")
                    + ". For a fresh start create a new OneCycleTrainer; to continue a run "
                    "exactly use fit(resume=<checkpoint>).", UserWarning, stacklevel=2)
            if base_lr == "find":
                # Measure at the run's own global batch: k accumulated micro-batches
                # of the per-core batch are exactly one k-core step's gradient, so
                # the answer needs no scaling rule on top of the finder's rule.
                lr_world = world
                res = self.find_lr(simulate=1 if simulate is not None else None,
                                   accum_steps=lr_world, epochs=cfg.epochs)
                base_lr = res.suggestion
                if not math.isfinite(base_lr):
                    raise RuntimeError(f"lr_find gave no suggestion (stopped: {res.stop_reason}); "
                                       "pass max_lr=<number> or look at "
                                       "trainer.lr_finder_result.plot()")
                print(f"lr_find suggests max_lr {base_lr:.3g} for the global batch "
                      f"{res.batch_size} ({cfg.batch_size} x {lr_world} micro-batches on one "
                      f"core, rule {res.rule}, run of {res.planned_steps} steps).", flush=True)
                if not res.confident:
                    warnings.warn(f"fit(max_lr='find'): {res.warning}. Training with max_lr "
                                  f"{base_lr:.3g} anyway; check trainer.lr_finder_result.plot() "
                                  "and pass fit(max_lr=<number>)", RuntimeWarning, stacklevel=2)
        if not (isinstance(base_lr, (int, float)) and base_lr > 0):
            raise ValueError(f"max_lr must be a positive number or 'find', got {base_lr!r}")
        run_id = time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(2)
        out = runtime._launch(self._replica, (float(base_lr), lr_world, ckpt, run_id),
                              cores=cores, simulate=simulate, timeout=timeout, sim_threads=True)
        if out.state_dict:  # empty when no epoch of this fit ended with finite weights
            self.model.load_state_dict(out.state_dict)
            self._epochs_trained = len(out.epochs) + (0 if ckpt is not None
                                                      else self._epochs_trained)
        for w in out.warnings:
            warnings.warn(w, RuntimeWarning, stacklevel=2)
        return out

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
        """
        plan = self._inference_plan(data, tta, batch_size, activation, weights, labelled=False)
        return runtime._launch(self._inference_replica, (plan,), cores=cores, simulate=simulate,
                               timeout=None, sim_threads=True)

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
        _require_labels(data, "data", action="evaluate")
        activation = "auto" if isinstance(tta, int) and tta > 1 else None
        plan = self._inference_plan(data, tta, batch_size, activation, None, labelled=True)
        return runtime._launch(self._inference_replica, (plan,), cores=cores, simulate=simulate,
                               timeout=None, sim_threads=True)

    # ------------------------------------------------------------- inference
    def _inference_plan(self, data, tta, batch_size, activation, weights, labelled: bool
                        ) -> "_InferencePlan":
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
        first = data[0] if not isinstance(data, CachedImageDataset) else None
        shape = _input_shape(data, first)
        train_shape = _input_shape(self.train_data, None) if self.train_data is not None else None
        if shape is not None and train_shape is not None and shape != train_shape:
            raise ValueError(_shape_mismatch(data, shape, self.train_data, train_shape))
        if not isinstance(data, CachedImageDataset):
            if labelled and not (isinstance(first, (tuple, list)) and len(first) >= 2):
                raise TypeError("evaluate needs a dataset of (input, target) pairs; item 0 is a "
                                f"{type(first).__name__}")
        views = self._tta_views(data, tta, shape)
        model = self.model if weights is None else _model_with_weights(self.model, weights)
        return _InferencePlan(data=data if isinstance(data, CachedImageDataset) else _Inputs(data),
                              n=len(data), views=views, batch_size=bs, activation=activation,
                              model=model, labelled=labelled, tta=tta)

    def _tta_views(self, data, tta: int, shape) -> list[tuple[int, bool]]:
        """The (stored variant, mirrored) pair of each TTA view, in order (see :meth:`predict`)."""
        if not isinstance(tta, int) or isinstance(tta, bool) or tta < 1:
            raise ValueError(f"tta must be a positive int (views per image), got {tta!r}")
        v = data.num_variants if isinstance(data, CachedImageDataset) else 1
        can_flip = self.config.flip and shape is not None and len(shape) == 3
        views = [(j, f) for f in ((False, True) if can_flip else (False,)) for j in range(v)]
        if tta > len(views):
            if can_flip:
                why = f"{v} stored variant(s), each also mirrored"
            elif not self.config.flip:
                why = f"{v} stored variant(s); no mirrored views because the trainer has flip=False"
            else:
                why = f"{v} stored variant(s); inputs of shape {shape} cannot be mirrored"
            raise ValueError(f"tta={tta} but data offers {len(views)} distinct view(s): {why}. Build the "
                             f"test cache with more variants (build_cache(..., variants={tta}, "
                             "unlabeled=True)) or lower tta")
        return views[:tta]

    def _inference_replica(self, plan: "_InferencePlan"):
        """One replica of :meth:`predict` / :meth:`evaluate`: every view is one pass in
        dataset order over this rank's share of the padded index list; per batch the
        activation output is added to a device accumulator (one graph for every batch
        and view: the mirror flag is device data); at the end one all_reduce of a
        zero-filled ``[batches, world, batch, C]`` tensor, where each rank fills its own
        slots, gathers the predictions exactly."""
        cfg = self.config
        ws, rk, dev = runtime.world_size(), runtime.rank(), runtime.device()
        model = plan.model
        if runtime.is_simulated() or runtime.backend() == "torch":
            model = copy.deepcopy(model)  # threads share Python objects; keep the caller's intact
        model = model.to(dev).eval()
        bs = plan.batch_size
        autocast = torch.autocast(device_type=dev.type, dtype=torch.bfloat16, enabled=cfg.bf16)
        mirror = any(f for _, f in plan.views)
        batches = iterate_batches(plan.data, bs, world_size=ws, rank=rk, shuffle=False,
                                  drop_last=False, num_workers=cfg.num_workers)
        nb = len(batches)
        acc: list[torch.Tensor | None] = [None] * nb
        targets: list[tuple[torch.Tensor, torch.Tensor]] = []
        zeros = None
        _, progress_bar = runtime.progress_bars()
        total = nb * len(plan.views)
        pb = progress_bar(range(total)) if runtime.is_master() else None

        def steps():
            for variant, flip in plan.views:
                flag = runtime.to_device(torch.tensor(flip), dev) if mirror else None
                for k, (x, y, valid) in enumerate(runtime.device_prefetch(
                        iterate_batches(plan.data, bs, world_size=ws, rank=rk, shuffle=False,
                                        epoch=variant, drop_last=False, num_workers=cfg.num_workers))):
                    yield k, flag, x, y, valid

        t0 = time.perf_counter()
        it = steps()
        with torch.no_grad():
            for done, (_, (k, flag, x, y, valid)) in enumerate(
                    zip(pb if pb is not None else range(total), it), 1):
                x = self._prepare(x, train=False)
                if flag is not None:
                    x = torch.where(flag, x.flip(3), x)
                with autocast:
                    out = self.eval_step(model, (x, y))
                out = out.float()
                if out.dim() == 1:
                    out = out.unsqueeze(1)
                p = _activate(out, plan.activation)
                if zeros is None:  # device data, so the first view's steps use the same graph
                    zeros = runtime.to_device(torch.zeros(tuple(p.shape)), dev)
                acc[k] = (zeros if acc[k] is None else acc[k]) + p
                if plan.labelled and len(targets) < nb:
                    targets.append((y.clone(), valid.clone()))  # loader buffers are reused
                runtime.sync()
                if pb is not None and (done % cfg.log_every == 0 or done == total):
                    pb.comment = f"{done * bs * ws / (time.perf_counter() - t0):.0f} img/s"
        it.close()
        if plan.labelled:
            return self._inference_metrics(acc, targets, plan, dev)
        local = torch.stack(acc)  # [nb, B, C]
        if plan.tta > 1:
            local = local / plan.tta
        if ws > 1:
            mine = runtime.to_device(torch.arange(ws) == rk, dev).view(1, ws, 1, 1)
            local = runtime.all_reduce(torch.where(mine, local.unsqueeze(1), local.new_zeros(())))
        runtime.sync()
        if not runtime.is_master():
            return None
        c = local.shape[-1]
        return local.cpu().numpy().reshape(-1, c)[:plan.n].astype(np.float32, copy=False)

    def _inference_metrics(self, acc, targets, plan: "_InferencePlan", dev) -> dict[str, float]:
        metrics = None
        for out, (y, valid) in zip(acc, targets):
            if plan.tta > 1:  # averaged probabilities -> the logits the loss expects
                p = out / plan.tta
                if plan.activation == "sigmoid":
                    p = p.clamp(1e-7, 1 - 1e-7)
                    out = torch.log(p) - torch.log1p(-p)
                else:
                    out = torch.log(p.clamp_min(1e-30))
            if metrics is None:
                multilabel = y.dtype.is_floating_point and y.dim() == 2
                names = resolve_metrics(self.config.metrics, multilabel, out.shape[1])
                metrics = MetricAccumulator(names, self.loss, dev)
            metrics.update(out, y, valid)
            runtime.sync()
        return metrics.compute()

    def check(self, *, steps: int = 4, tpu: str | None = None, measure_loader: bool = True,
              timeout: float | None = None) -> "ReadinessReport":
        """:func:`xla_utils.check` with this trainer's model, loss, optimizer,
        ``train_step``, bf16 setting, image normalisation (and flips) and the
        first ``batch_size`` batch of ``train_data``; with ``measure_loader``
        (default True) the training loader's samples/s is compared with the TPU's
        step rate. ``tpu`` as in :func:`xla_utils.check` (default: this TPU, else v5e)."""
        from .readiness import check as readiness_check

        cfg = self.config
        first = next(iter(iterate_batches(self.train_data, cfg.batch_size, shuffle=False,
                                          drop_last=True, num_workers=0)), None)
        if first is None:
            raise ValueError(f"train_data has fewer than batch_size={cfg.batch_size} samples")
        x, y, _ = first
        loader = (iterate_batches(self.train_data, cfg.batch_size, seed=cfg.seed,
                                  num_workers=cfg.num_workers) if measure_loader else None)
        return readiness_check(self.model, (x.clone(), y.clone()), loss=self.loss,
                               optimizer=cfg.optimizer, steps=steps, data=loader, tpu=tpu,
                               prepare=lambda t: self._prepare(t, train=True),
                               train_step=self.train_step, bf16=cfg.bf16, timeout=timeout)

    def _check_before_fit(self) -> None:
        from .readiness import ReadinessError

        report = self.check()
        print(report, flush=True)
        if report.errors:
            raise ReadinessError(report)

    # ------------------------------------------------------------- replica
    def _replica(self, base_lr: float, lr_world: int, ckpt: dict | None, run_id: str) -> History:
        cfg = self.config
        ws, rk, dev = runtime.world_size(), runtime.rank(), runtime.device()
        model = self.model
        if runtime.is_simulated() or runtime.backend() == "torch":
            # Threads share one Python object (and in-process we keep the
            # caller's model untouched until success): give each replica its own.
            model = copy.deepcopy(model)
        if ckpt is not None:
            model.load_state_dict(ckpt["model"])
        model = model.to(dev)
        rule = cfg.scaling_rule
        # base_lr is for lr_world cores (1, or the world lr_find measured for)
        max_lr = scale_lr(base_lr, ws, rule) / scale_lr(1.0, lr_world, rule)
        how = f"{rule} scaling" if lr_world == 1 else \
            f"measured by lr_find for {lr_world} cores, {rule} scaling beyond"
        runtime.master_print(
            f"{ws} core{'s' if ws > 1 else ''} x {cfg.batch_size} per core = "
            f"{ws * cfg.batch_size} global batch; max_lr {base_lr:.3g} x "
            f"{max_lr / base_lr:.3g} = {max_lr:.3g} ({how})")
        opt = make_optimizer(cfg.optimizer, model.parameters(), lr=max_lr / cfg.div_factor,
                             weight_decay=cfg.weight_decay)

        def batches(data, epoch: int, train: bool):
            return iterate_batches(data, cfg.batch_size, world_size=ws, rank=rk, shuffle=train,
                                   seed=cfg.seed, epoch=epoch, drop_last=train,
                                   num_workers=cfg.num_workers)

        steps_per_epoch = len(batches(self.train_data, 0, True))
        sched = OneCycleSchedule(total_steps=cfg.epochs * steps_per_epoch, max_lr=max_lr,
                                 pct_start=cfg.pct_start, div_factor=cfg.div_factor,
                                 final_div_factor=cfg.final_div_factor, moms=cfg.moms)
        history: list[dict[str, Any]] = []
        start_epoch = 0
        if ckpt is not None:
            # fit() compared against the planned world; this is the actual one.
            if (ckpt["world_size"], ckpt["steps_per_epoch"]) != (ws, steps_per_epoch):
                raise ResumeError(
                    f"checkpoint was written with {ckpt['world_size']} cores and "
                    f"{ckpt['steps_per_epoch']} steps/epoch; this run has {ws} and "
                    f"{steps_per_epoch}: the one-cycle schedule would not continue exactly")
            opt.load_state_dict(ckpt["optimizer"])
            start_epoch, history = ckpt["epoch"], list(ckpt["history"])
        autocast = torch.autocast(device_type=dev.type, dtype=torch.bfloat16, enabled=cfg.bf16)
        master_bar, progress_bar = runtime.progress_bars()
        mb = master_bar(range(start_epoch, cfg.epochs)) if runtime.is_master() else None
        step = start_epoch * steps_per_epoch
        # Host copy of the weights of the last epoch that ended finite (master only;
        # what the caller gets if a later epoch diverges).
        finite_state: dict[str, torch.Tensor] | None = None
        stop_reason: str | None = None
        warns: list[str] = []
        diverged = False
        # The loss of the untrained model (read once, at this run's first step):
        # the yardstick for "the loss exploded" warnings.
        initial_loss: float | None = None if ckpt is None else ckpt.get("initial_loss")
        for epoch in (mb if mb is not None else range(start_epoch, cfg.epochs)):
            runtime.set_seed(cfg.seed * 1_000_003 + epoch * 1_009 + rk)
            model.train()
            t0 = time.perf_counter()
            to_host0 = runtime.xla_counters()["to_host"]
            # Device data, not torch.zeros(device=xla): a zeros *op* would make
            # each epoch's first step a different graph (one recompile).
            loss_sum = runtime.to_device(torch.zeros(()), dev)
            lr_last = sched.lr(step)
            train_loss = math.nan
            it = runtime.device_prefetch(batches(self.train_data, epoch, True))
            pb = progress_bar(range(steps_per_epoch), parent=mb) if mb is not None else None
            for i, (x, y, _valid) in zip(pb if pb is not None else range(steps_per_epoch), it):
                x = self._prepare(x, train=True)
                lr_last = sched.apply(opt, step)
                opt.zero_grad(set_to_none=True)
                with autocast:
                    loss = self.train_step(model, (x, y), self.loss)
                loss.backward()
                runtime.optimizer_step(opt)
                loss_sum = loss_sum + loss.detach().float()
                runtime.sync()
                step += 1
                if step == 1:
                    initial_loss = runtime.all_reduce(float(loss.detach().float().cpu()), op="mean")
                if (i + 1) % cfg.log_every == 0 or i + 1 == steps_per_epoch:
                    # Every rank reads and the mean is exchanged on the host, so all
                    # ranks see the same value and stop at the same step.
                    train_loss = runtime.all_reduce(float(loss_sum.cpu()) / (i + 1), op="mean")
                    if pb is not None:
                        seen = (i + 1) * cfg.batch_size * ws
                        pb.comment = (f"loss {train_loss:.4f}  "
                                      f"{seen / (time.perf_counter() - t0):.0f} img/s")
                    if not math.isfinite(train_loss) and not diverged:
                        diverged = True
                        msg = self._divergence_message(train_loss, epoch, i + 1, steps_per_epoch,
                                                       lr_last, base_lr, max_lr, finite_state,
                                                       start_epoch)
                        runtime.master_print(msg)
                        warns.append(msg)
                        if cfg.on_nan == "stop":
                            stop_reason = msg
                            break
            if stop_reason is not None:
                break
            to_host = runtime.xla_counters()["to_host"] - to_host0
            seconds = time.perf_counter() - t0
            record: dict[str, Any] = {"epoch": epoch + 1, "train_loss": train_loss}
            if self.val_data is not None:
                val = self._evaluate(model, dev, batches(self.val_data, epoch, False), autocast)
                record.update({"val_loss": val.pop("loss")}, **val)
            for key in ("train_loss", "val_loss"):
                msg = _exploded(key, record.get(key), initial_loss, epoch + 1)
                if msg and not diverged and not any(w.startswith(key) for w in warns):
                    runtime.master_print(msg)
                    warns.append(msg)
            record.update(lr_max=max_lr, lr_last=lr_last,
                          images_per_s=steps_per_epoch * cfg.batch_size * ws / seconds,
                          compiles=runtime.xla_counters()["compiles"],
                          host_reads_per_step=to_host / steps_per_epoch, seconds=seconds)
            history.append(record)
            if mb is not None:
                mb.write(_epoch_line(record))
            finite = math.isfinite(train_loss)
            if finite and cfg.on_nan == "stop" and runtime.is_master():
                finite_state = _host_copy(model.state_dict())
            if cfg.checkpoint_dir is not None:
                if finite:
                    self._checkpoint(model, opt, epoch + 1, history, base_lr, lr_world, ws,
                                     steps_per_epoch, run_id, finite_state, initial_loss)
                else:
                    runtime.master_print(f"epoch {epoch + 1}: no checkpoint written "
                                         "(non-finite loss); older checkpoints are kept")
        if stop_reason is not None:
            state = finite_state or {}
        else:
            state = finite_state if finite_state is not None else model.state_dict()
            if cfg.checkpoint_dir is not None:
                runtime.save(state, Path(cfg.checkpoint_dir) / "final.pt")
        return History(epochs=history, world_size=ws, global_batch=ws * cfg.batch_size,
                       base_lr=base_lr, max_lr=max_lr, lr_scaling=rule, lr_note=how,
                       backend=runtime.backend(), state_dict=state, stop_reason=stop_reason,
                       warnings=warns, run_id=run_id)

    def _divergence_message(self, value: float, epoch: int, step: int, steps_per_epoch: int,
                            lr: float, base_lr: float, max_lr: float,
                            finite_state: dict | None, start_epoch: int) -> str:
        cfg = self.config
        msg = (f"train_loss became {value} in epoch {epoch + 1} by step {step}/{steps_per_epoch} "
               f"(LR then {lr:.3g}; peak max_lr {max_lr:.3g} from max_lr {base_lr:.3g}). ")
        if cfg.on_nan == "stop":
            if finite_state is not None:
                kept = f"keeps the weights of epoch {epoch} (the last finite ones, a host copy)"
            elif start_epoch:
                kept = ("is unchanged (no epoch of this fit ended finite; the resumed "
                        "checkpoint holds the last finite weights)")
            else:
                kept = "is unchanged (no epoch ended finite)"
            msg += (f"Training stopped (on_nan='stop'); trainer.model {kept}; no checkpoint "
                    "was written for it. ")
        else:
            msg += "Training goes on (on_nan='continue'); no checkpoint is written for non-finite epochs. "
        return msg + (f"Fix: lower max_lr (e.g. {base_lr / 10:.3g}) or let trainer.find_lr() / "
                      "fit(max_lr='find') pick it; check inputs, targets and the loss for "
                      "inf/NaN (log of 0, division by 0)"
                      + ("; with bf16=True try bf16=False" if cfg.bf16 else "") + ".")

    def _prepare(self, x: torch.Tensor, train: bool) -> torch.Tensor:
        if is_image_batch(x):
            cfg = self.config
            return images_to_float(x, cfg.mean, cfg.std, flip=train and cfg.flip)
        return x

    def _evaluate(self, model, dev, val_batches, autocast) -> dict[str, float]:
        model.eval()
        acc = None
        with torch.no_grad():
            for x, y, valid in runtime.device_prefetch(val_batches):
                with autocast:
                    out = self.eval_step(model, (self._prepare(x, train=False), y))
                if acc is None:
                    multilabel = y.dtype.is_floating_point and y.dim() == 2
                    names = resolve_metrics(self.config.metrics, multilabel,
                                            out.shape[1] if out.dim() == 2 else None)
                    acc = MetricAccumulator(names, self.loss, dev)
                acc.update(out, y, valid)
                runtime.sync()
        if acc is None:
            raise ValueError("val_data yielded no batch")
        return acc.compute()

    def _checkpoint(self, model, opt, epoch: int, history, base_lr, lr_world, ws,
                    steps_per_epoch, run_id: str, host_state: dict | None,
                    initial_loss: float | None) -> None:
        cfg = self.config
        directory = Path(cfg.checkpoint_dir)
        state = {
            "model": host_state if host_state is not None else model.state_dict(),
            "optimizer": opt.state_dict(), "epoch": epoch,
            "history": history, "base_lr": base_lr, "lr_world": lr_world, "world_size": ws,
            "steps_per_epoch": steps_per_epoch, "run_id": run_id, "initial_loss": initial_loss,
            "optimizer_name": _optimizer_name(cfg.optimizer),
            "config": {k: v for k, v in dataclasses.asdict(cfg).items() if k != "optimizer"},
        }
        runtime.save(state, directory / f"epoch_{epoch:03d}-{run_id}.pt")
        if runtime.is_master():
            # Only this run's files, ranked by epoch number: a rerun into the same
            # folder never deletes another run's checkpoints, nor its own newest.
            mine = sorted((_epoch_of(p), p) for p in directory.glob(f"epoch_*-{run_id}.pt")
                          if _epoch_of(p) is not None)
            for _, p in mine[:-cfg.keep_checkpoints]:
                p.unlink(missing_ok=True)


def _epoch_of(path: Path) -> int | None:
    """Epoch number in an ``epoch_<nnn>[-<run id>].pt`` file name."""
    head = path.name[len("epoch_"):].split("-", 1)[0].split(".", 1)[0]
    return int(head) if head.isdigit() else None


def _optimizer_name(spec: Any) -> str:
    if isinstance(spec, str):
        return spec
    return f"callable {getattr(spec, '__module__', '?')}.{getattr(spec, '__qualname__', repr(spec))}"


def _host_copy(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A CPU copy that later in-place updates of ``state`` cannot reach."""
    return {k: v.detach().to("cpu", copy=True) for k, v in state.items()}


def _exploded(key: str, value: float | None, initial: float | None, epoch: int) -> str | None:
    """A warning when an epoch's loss is non-finite (validation) or more than
    ``VAL_LOSS_EXPLODES`` times the untrained model's loss at the first step."""
    if value is None:
        return None
    if not math.isfinite(value):
        if key == "train_loss":
            return None  # the divergence message covers it
        why = f"is {value}"
    elif initial is not None and math.isfinite(initial) and initial > 0 \
            and value > VAL_LOSS_EXPLODES * initial:
        why = (f"is {value / initial:.3g}x the untrained model's loss at the first step "
               f"({initial:.4g})")
    else:
        return None
    return (f"{key} {value:.4g} at epoch {epoch} {why}: training is diverging. Lower max_lr "
            "(or use fit(max_lr='find')), check the data and labels"
            + (", add weight_decay" if key == "val_loss" else "") + ".")


def _check_batches(data, batch_size: int, world: int) -> None:
    """Refuse a training set smaller than one global batch, naming the trainer's fix."""
    n = len(data)
    if n < batch_size * world:
        fit = n // world
        raise ValueError(
            f"train_data has {n} samples, fewer than one global batch ({batch_size} per core x "
            f"{world} core{'s' if world > 1 else ''} = {batch_size * world}); the trainer drops "
            "the ragged last batch so every core gets equal full batches (no recompiles). Fix: "
            + (f"batch_size={fit} or lower, or more training samples." if fit >= 1 else
               f"at least {world} training samples (one per core), or fit(cores=1)."))


def _targets_of(data) -> tuple[np.ndarray | None, np.ndarray | None]:
    """``(targets, sample index of each)`` without decoding inputs where possible:
    a label array for cached data, ``TensorDataset`` and torchvision datasets;
    otherwise a bounded, evenly spread scan (index array given)."""
    from .data import CachedImageDataset

    if isinstance(data, CachedImageDataset):
        return np.asarray(data.labels), None
    if isinstance(data, torch.utils.data.Subset):
        inner, where = _targets_of(data.dataset)
        if inner is not None and where is None:
            return inner[np.asarray(data.indices)], None
    if isinstance(data, torch.utils.data.TensorDataset) and len(data.tensors) >= 2:
        return data.tensors[1].detach().cpu().numpy(), None
    targets = getattr(data, "targets", None)
    if targets is not None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            t = np.asarray(targets.cpu() if isinstance(targets, torch.Tensor) else targets)
        if t.dtype != object and len(t) == len(data):
            return t, None
    n = len(data)
    where = np.unique(np.linspace(0, n - 1, min(n, LABEL_SCAN_SAMPLES)).astype(np.int64))
    found, idx = [], []
    t0 = time.perf_counter()
    for i in where:
        sample = data[int(i)]
        if not isinstance(sample, (tuple, list)) or len(sample) < 2:
            return None, None
        y = sample[1]
        y = y.detach().cpu().numpy() if isinstance(y, torch.Tensor) else np.asarray(y)
        if y.dtype == object:
            return None, None
        found.append(y)
        idx.append(int(i))
        if time.perf_counter() - t0 > LABEL_SCAN_SECONDS:
            break
    if not found or len({f.shape for f in found}) != 1:
        return None, None
    return np.stack(found), np.asarray(idx)


def _output_width(model: torch.nn.Module, data, prepare: Callable, eval_step: Callable) -> int | None:
    """Width of the model's 2-D output for two samples, from one CPU forward in
    eval mode (None when that is not possible: the forward is then left to fit)."""
    params = list(model.parameters())
    if params and params[0].device.type not in ("cpu", "cuda"):
        return None
    modes = [m.training for m in model.modules()]
    try:
        batch = torch.utils.data.default_collate([data[i] for i in range(min(2, len(data)))])
        x, y = batch[0], batch[1]
        if params:
            x = x.to(params[0].device) if isinstance(x, torch.Tensor) else x
        model.eval()
        with torch.no_grad():
            out = eval_step(model, (prepare(x), y))
    except Exception:
        return None
    finally:
        for m, mode in zip(model.modules(), modes):
            m.training = mode
    if isinstance(out, torch.Tensor) and out.dim() == 2:
        return int(out.shape[1])
    return None


def _check_targets(model: torch.nn.Module, loss: Callable, data, name: str,
                   prepare: Callable, eval_step: Callable) -> None:
    """Check class-index targets (or multi-hot widths) of ``data`` against the
    model's output width and the dataset's classes, before any training."""
    targets, where = _targets_of(data)
    if targets is None or targets.size == 0:
        return
    int_labels = targets.dtype.kind in "iu" and targets.ndim == 1
    multi_hot = targets.dtype.kind == "f" and targets.ndim == 2
    if not (int_labels or multi_hot):
        return  # regression or something else: nothing to check
    classes = getattr(data, "num_classes", None)
    if classes is None and isinstance(getattr(data, "classes", None), (list, tuple)):
        classes = len(data.classes)
    width = _output_width(model, data, prepare, eval_step)
    scope = "" if where is None else f" (checked {len(where)} evenly spread samples)"
    if multi_hot:
        if width is not None and targets.shape[1] != width:
            raise ValueError(f"{name} has multi-label targets of width {targets.shape[1]} but the "
                             f"model outputs {width} values per sample: build the model with "
                             f"{targets.shape[1]} outputs (num_classes={targets.shape[1]})")
        return
    limits = [v for v in (width, classes) if v is not None]
    if not limits:
        return
    limit = min(limits)
    bad = (targets < 0) | (targets >= limit)
    ignore = getattr(loss, "ignore_index", None)
    if isinstance(ignore, int):
        bad &= targets != ignore
    if bad.any():
        j = int(np.argmax(bad))
        label, sample = int(targets[j]), int(j if where is None else where[j])
        what = (f"the model's {width} outputs (class indices 0..{width - 1})"
                if limit == width else f"the dataset's {classes} classes (0..{classes - 1})")
        if label == -1 and classes is not None:
            fix = ("-1 marks an unlabelled image: build the cache with labels= (a CSV "
                   "path,label or a dict), or one sub-folder per class")
        elif classes is not None and width is not None and label < classes:
            fix = f"build the model with {classes} outputs (num_classes={classes})"
        else:
            fix = ("fix the labels, or build the model with "
                   f"num_classes={int(targets.max()) + 1}")
        raise ValueError(
            f"{name}: label {label} at sample {sample} is outside {what}"
            + (f"; {name} has {classes} classes" if classes is not None else "")
            + f" ({int(bad.sum())} such sample(s){scope}). On XLA an out-of-range label "
            f"trains silently on garbage. Fix: {fix}.")
    if width is not None and classes is not None and width != classes:
        warnings.warn(f"the model outputs {width} classes but {name} has {classes}: build "
                      f"it with num_classes={classes}", UserWarning, stacklevel=3)


@dataclass
class _InferencePlan:
    """What :meth:`OneCycleTrainer._inference_replica` runs (built and checked on the host)."""

    data: Any
    n: int
    views: list[tuple[int, bool]]
    batch_size: int
    activation: str | None
    model: torch.nn.Module
    labelled: bool
    tta: int


class _Inputs:
    """A map-style dataset of ``x`` or ``(x, y, ...)`` as ``(x, y)`` pairs (``y = 0`` when absent)."""

    def __init__(self, data):
        self.data = data

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int):
        item = self.data[i]
        if isinstance(item, (tuple, list)):
            return item[0], (item[1] if len(item) > 1 else 0)
        return item, 0


def _activate(out: torch.Tensor, activation: str | None) -> torch.Tensor:
    if activation is None:
        return out
    if activation == "sigmoid" or out.shape[1] == 1:
        return torch.sigmoid(out)
    return torch.softmax(out, dim=1)


def _input_shape(data, first) -> tuple[int, ...] | None:
    """Shape of one input (HWC for caches), or None when it has none."""
    if isinstance(data, CachedImageDataset):
        return (*data.image_size, 3)
    if first is None:
        try:
            first = data[0]
        except Exception:
            return None
    x = first[0] if isinstance(first, (tuple, list)) else first
    shape = getattr(x, "shape", None)
    return tuple(int(d) for d in shape) if shape is not None else None


def _shape_mismatch(data, shape, train_data, train_shape) -> str:
    where = f" ({data.path})" if isinstance(data, CachedImageDataset) else ""
    train_where = f" ({train_data.path})" if isinstance(train_data, CachedImageDataset) else ""
    msg = (f"the inputs of data{where} have shape {shape} but the training data{train_where} has "
           f"{train_shape}: the model was trained at another size")
    if isinstance(data, CachedImageDataset):
        msg += (f"; rebuild it at the training size: build_cache(SOURCE, {str(data.path)!r}, "
                f"size={tuple(train_shape[:2])}, unlabeled=True, overwrite=True)")
    return msg


def _require_labels(data, name: str, action: str = "train") -> None:
    """Refuse an unlabelled cache (every label -1) where labels are needed."""
    if getattr(data, "unlabeled", False):
        raise ValueError(
            f"{name} {getattr(data, 'path', '')} is an unlabelled cache (built from a flat folder "
            f"without labels, or with unlabeled=True), so it cannot be used to {action}. Rebuild it "
            "with its labels: build_cache(SOURCE, OUT, labels=\"train.csv\", overwrite=True) "
            "(tpu_cache_ds build SOURCE OUT --labels train.csv --overwrite; rows of file,label), or "
            "one sub-folder per class. Unlabelled caches are for trainer.predict().")


def _model_with_weights(model: torch.nn.Module, path: str | os.PathLike) -> torch.nn.Module:
    """A copy of ``model`` with the weights of ``final.pt`` or an epoch checkpoint."""
    path = _run_epoch_file(Path(path), "using")
    if not path.is_file():
        raise FileNotFoundError(f"weights={str(path)!r} does not exist")
    try:
        obj = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as exc:
        raise ValueError(f"weights={str(path)!r} cannot be read ({type(exc).__name__}: {exc}); "
                         "the file is corrupt or truncated, or not a torch checkpoint") from None
    state = obj["model"] if isinstance(obj, dict) and isinstance(obj.get("model"), dict) else obj
    if not isinstance(state, dict):
        raise ValueError(f"weights={str(path)!r} holds a {type(state).__name__}, not a state dict "
                         "or an xla_utils checkpoint")
    net = copy.deepcopy(model)
    try:
        net.load_state_dict(state)
    except RuntimeError as exc:
        raise ValueError(f"weights={str(path)!r} do not fit this trainer's model: {exc}") from None
    return net


def _epoch_line(r: dict[str, Any]) -> str:
    parts = [f"epoch {r['epoch']}", f"train_loss {r['train_loss']:.4f}"]
    for k in ("val_loss", "accuracy", "f1"):
        if k in r:
            parts.append(f"{k} {r[k]:.4f}")
    parts += [f"{r['images_per_s']:.0f} img/s", f"{r['compiles']} compiles"]
    return "  ".join(parts)


def _planned_world_size(cores: int | str, simulate: int | None) -> int:
    """The world size a launch will have, found without touching the XLA runtime."""
    if cores == 1:
        return 1
    if simulate is not None:
        return simulate
    if runtime.backend() == "xla":
        from . import env

        return max(env.detect().num_devices or 1, 1)
    return 1


_CKPT_KEYS = {"model", "optimizer", "epoch", "history", "base_lr", "world_size", "steps_per_epoch"}
# Config fields the optimizer state and the one-cycle schedule depend on: a
# resumed run with any of them changed would not continue the same run.
_RESUME_FIXED = ("batch_size", "epochs", "weight_decay", "pct_start", "div_factor",
                 "final_div_factor", "moms", "lr_scaling", "mean", "std")


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
    files.sort(key=lambda p: (p.stat().st_mtime, _epoch_of(p) or 0, p.name), reverse=True)
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
        raise FileNotFoundError(f"checkpoint {path} does not exist")
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


def _resolve_resume(resume: str | os.PathLike, checkpoint_dir) -> tuple[Path, dict]:
    """``resume`` is a file, a folder, or ``"last"`` (the configured
    ``checkpoint_dir``); a folder means its newest good epoch checkpoint."""
    if isinstance(resume, str) and resume == "last":
        if checkpoint_dir is None:
            raise ValueError("resume='last' needs checkpoint_dir=...; or pass a checkpoint file")
        resume = checkpoint_dir
    path = _run_epoch_file(Path(resume), "resuming from")
    if path.is_dir():
        good = _newest_good_checkpoint(path)
        if good is None:
            raise FileNotFoundError(f"no readable epoch checkpoint (epoch_*.pt) in {path}")
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


def _check_resume(path: Path, ckpt: dict, cfg: TrainerConfig, model: torch.nn.Module,
                  max_lr: float | str | None, world: int | None, steps_per_epoch: int) -> None:
    """Compare a checkpoint with the new run before anything is loaded; refuse
    (one error listing every difference) what would not continue exactly, and
    say what was kept and what changed."""
    old = dict(ckpt.get("config", {}))
    new = {k: v for k, v in dataclasses.asdict(cfg).items() if k != "optimizer"}
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
    if world is None:
        pass  # checked in the replica, where the world size is known
    elif ckpt["world_size"] != world:
        fixed.append(f"cores: {ckpt['world_size']} in the checkpoint, {world} now")
    elif ckpt["steps_per_epoch"] != steps_per_epoch:
        fixed.append(f"steps per epoch: {ckpt['steps_per_epoch']} in the checkpoint, "
                     f"{steps_per_epoch} now (the training set has changed size)")
    want = cfg.max_lr if max_lr is None else max_lr
    if want != "find" and not math.isclose(float(want), ckpt["base_lr"], rel_tol=1e-9):
        fixed.append(f"max_lr: {ckpt['base_lr']:.6g} in the checkpoint, {want!r} now")
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
    total = old.get("epochs", cfg.epochs)
    print(f"resuming run {ckpt.get('run_id', '(unnamed)')} from {path.name} after epoch "
          f"{ckpt['epoch']} of {total}: kept max_lr {ckpt['base_lr']:.3g}"
          + (" (found by lr_find)" if want == "find" else "")
          + f", optimizer {now_opt}, batch {cfg.batch_size} x {ckpt['world_size']} cores, "
          "its schedule, "
          "optimizer state and history"
          + (f"; changed: {', '.join(changed)}" if changed else "") + ".", flush=True)


# ---------------------------------------------------------------------------
# Single-core debug mode
# ---------------------------------------------------------------------------
@dataclass
class DebugReport:
    """What :func:`debug_run` measured. ``per_step`` holds the counter deltas
    (compiles, executions, to_host, ...) of every step; ``report`` is the text."""

    backend: str
    steps: int
    losses: list[float]
    per_step: list[dict[str, Any]]
    fallback_ops: dict[str, int]
    report: str

    def __str__(self) -> str:
        return self.report


def debug_run(model: torch.nn.Module | Callable[[], torch.nn.Module], loss: Callable, data,
              batch_size: int = 8, steps: int = 5, optimizer: Any = "sgd", lr: float = 1e-3,
              train_step: Callable | None = None, prepare: Callable | None = None,
              print_report: bool = True, eval_step: Callable | None = None) -> DebugReport:
    """Run a few plain training steps on ONE core and explain what XLA did.

    A plain ``torch.utils.data.DataLoader`` (no prefetch thread), and every step
    ends with ``xm.optimizer_step(opt, barrier=True)``, so an error surfaces at
    the step that caused it. Afterwards it reports compilations, graph
    executions, host transfers and CPU-fallback ops per step. It runs in a
    forked child (on a TPU, or on one XLA:CPU device when there is none), so the
    notebook can still launch all cores afterwards. ``steps`` default 5, ``lr``
    constant (default 1e-3), ``batch_size`` default 8. ``prepare(x)`` turns an
    input batch on the device into model input (default: uint8 NHWC images are
    normalised with ImageNet mean/std; ``fit(debug=True)`` passes the trainer's).
    ``optimizer`` is a name (any case) or a callable, as for the trainer. Class
    labels are checked against the model's output width first (``eval_step(model,
    (x, y)) -> outputs`` computes it; default ``model(x)``).
    """
    optimizer = resolve_optimizer(optimizer)
    if isinstance(model, torch.nn.Module):
        module = model
    else:
        module = model()

    def to_input(x: torch.Tensor) -> torch.Tensor:
        if prepare is not None:
            return prepare(x)
        return images_to_float(x) if is_image_batch(x) else x

    _check_targets(module, loss, data, "data", to_input, eval_step or _default_eval_step)
    step_fn = train_step or _default_train_step
    simulate = None if runtime._tpu_present() else 1
    if simulate is not None and not runtime.xla_available():
        simulate = None  # no torch_xla: the same loop on plain torch

    def job() -> DebugReport:
        dev = runtime.device()
        net = copy.deepcopy(module).to(dev)
        opt = make_optimizer(optimizer, net.parameters(), lr=lr)
        loader = torch.utils.data.DataLoader(data, batch_size=batch_size, shuffle=False,
                                             drop_last=True)
        losses, per_step = [], []
        first = prev = runtime.xla_counters()
        n = 0
        for x, y in loader:
            if n == steps:
                break
            x, y = runtime.to_device((x, y), dev)
            x = to_input(x)
            opt.zero_grad(set_to_none=True)
            loss_t = step_fn(net, (x, y), loss)
            loss_t.backward()
            runtime.optimizer_step(opt, barrier=True)
            losses.append(float(loss_t.detach().cpu()))
            now = runtime.xla_counters()
            per_step.append({k: now[k] - prev[k] for k in
                             ("compiles", "executions", "to_device", "to_host")})
            prev = now
            n += 1
        if n == 0:
            raise ValueError(f"data gave no full batch of {batch_size}; lower batch_size")
        fb = {k: v - first["fallback_ops"].get(k, 0) for k, v in prev["fallback_ops"].items()
              if v - first["fallback_ops"].get(k, 0) > 0}
        text = [f"debug_run on {runtime.backend()} device {dev}: {n} steps, "
                f"losses {', '.join(f'{v:.4g}' for v in losses)}"]
        text.append(runtime.xla_counters_report(first, prev, steps=n))
        if n > 2 and any(s["compiles"] for s in per_step[2:]):
            bad = [i + 1 for i, s in enumerate(per_step) if i >= 2 and s["compiles"]]
            text.append(
                f"Steps {bad} compiled again after warm-up: the graph changes between steps "
                "(a ragged last batch, a varying input shape, a Python scalar of exactly 0 or 1, "
                ".item() or a Python condition on a tensor inside the step).")
        elif n > 2:
            text.append("Steps 3.. reused the compiled graph: no recompilation.")
        return DebugReport(backend=runtime.backend(), steps=n, losses=losses, per_step=per_step,
                           fallback_ops=fb, report="\n".join(text))

    rep = runtime._launch(job, (), cores=1, simulate=simulate, timeout=None, sim_threads=True)
    if print_report:
        print(rep.report, flush=True)
    return rep
