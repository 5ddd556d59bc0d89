"""The training loop as plain functions with explicit arguments (as timm's ``train.py``).

:meth:`OneCycleTrainer.fit <xla_utils.train.trainer.OneCycleTrainer.fit>`'s replicas
(:func:`xla_utils.train.replica_loops.fit_replica`) run :func:`set_up`, then per epoch
:func:`train_one_epoch`, :func:`evaluate` and :func:`~xla_utils.train.checkpoint.save_checkpoint`;
``predict`` and ``evaluate`` (:func:`~xla_utils.train.replica_loops.inference_replica`, the
passes in :mod:`xla_utils.train.inference`) share :func:`replica_model`, :func:`prepare_input`,
:func:`loader` and :func:`metric_accumulator` with it.

Each step is forward, backward, ``runtime.optimizer_step`` (gradients averaged
over replicas; through the gradient scaler of an fp16 run; with ``grad_clip=`` clipped
first, :mod:`xla_utils.step.clip`) and one ``runtime.sync()``. On the replicas of a multi-replica torch launch (GPUs, or
``XLA_UTILS_CPU_REPLICAS``) the forward goes through torch's DistributedDataParallel
(``Setup.ddp``), which averages the gradients during backward, once per optimizer step
(accumulation micro-batches run under ``no_sync()``); ``train_step`` still gets the plain
model. The loss is accumulated on the device and read only every
``log_every`` steps (an fp16 run's skipped steps once per epoch); validation
metrics are device sums reduced once per pass. Precision, memory layout and host
buffers are the run's :class:`~xla_utils.step.device_plan.DevicePlan`. Every rank gets
the same number of full batches (training drops the ragged tail of the global
shuffle; validation pads and masks), so after the first epoch nothing compiles again.
"""
from __future__ import annotations

import contextlib
import copy
import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterable

import numpy as np
import torch

from .. import runtime
from ..data import apply_batch_transform, iterate_batches, plan_loading
from ..step.clip import GradClip
from ..step.device_plan import DevicePlan, DeviceRequest
from .metrics import MetricAccumulator, metric_keys, resolve_metrics, target_kind
from ..step.optim import make_optimizer, optimizer_label
from .schedule import OneCycleSchedule

if TYPE_CHECKING:
    from .config import DataSettings, DiagnosticsSettings, TrainerConfig
    from .ema import DeviceEMA
    from ..step.inputs import InputSpec
    from .mixup import DeviceMix, MixConfig
    from ..step.strategy import MeshRun

__all__ = ["prepare_input", "input_preparer",
           "replica_model", "loader", "run_lr",
           "scale_lr", "Setup", "TrainState", "set_up", "EpochResult", "train_one_epoch",
           "begin_epoch", "step_seed",
           "micro_step", "evaluate", "metric_accumulator", "exploded", "explosion",
           "epoch_line", "VAL_LOSS_EXPLODES", "loader_words", "SKIPPED_WARN"]

# An epoch's training or validation loss this many times the untrained model's (at the
# run's first step) counts as diverged: the run stops there (on_nan="stop"), as on a NaN.
VAL_LOSS_EXPLODES = 10.0
# An fp16 epoch whose gradient scaler skipped more than this share of its steps is warned about.
SKIPPED_WARN = 0.5


def prepare_input(x: torch.Tensor, data: DataSettings, train: bool, inputs: InputSpec,
                  memory_format: torch.memory_format = torch.contiguous_format) -> torch.Tensor:
    """Model input from a device batch of a dataset whose inputs are described by
    ``inputs`` (its :class:`~xla_utils.step.inputs.InputSpec`, decided once on the host):
    uint8 images in either layout are normalised with ``data.mean`` / ``data.std``
    (and flipped when ``train and data.flip``) into ``memory_format`` (the run's
    :attr:`DevicePlan.memory_format <xla_utils.step.device_plan.DevicePlan.memory_format>`);
    other inputs are returned unchanged."""
    return inputs.prepare(x, data.mean, data.std, flip=train and data.flip,
                          memory_format=memory_format)


def input_preparer(data: DataSettings, inputs: InputSpec, train: bool
                   ) -> Callable[[torch.Tensor], torch.Tensor]:
    """``x -> model input`` for batches of a dataset described by ``inputs``:
    :func:`prepare_input` with ``data`` (the data settings) and ``train`` bound (what
    ``check``, ``debug`` and ``find_lr`` are given)."""
    return lambda x: prepare_input(x, data, train, inputs)


def replica_model(model: torch.nn.Module, dev: torch.device | None,
                  state_dict: dict | None = None) -> torch.nn.Module:
    """This replica's model on ``dev`` (None: left on the host, for a strategy that
    places it itself), optionally loaded with ``state_dict`` first.

    Simulated replica threads share Python objects, and in-process (torch
    backend) the caller's model must stay untouched until success: both get
    their own copy. A forked replica owns its process's model already.
    """
    if runtime.is_simulated() or runtime.backend() == "torch":
        model = copy.deepcopy(model)
    if state_dict is not None:
        model.load_state_dict(state_dict)
    return model if dev is None else model.to(dev)


def loader(data, settings: DataSettings, *, world_size: int, rank: int, epoch: int, train: bool,
           pin_memory: bool = False, start: int = 0):
    """This rank's batches of ``data`` for one epoch: shuffled full batches of
    ``settings.batch_size`` for training (ragged tail dropped), padded and masked ones of
    ``settings.val_batch_size`` otherwise; in pinned host memory with ``pin_memory``;
    training batches through ``settings.transform``; from the epoch's batch ``start`` on (a
    run resumed inside the epoch)."""
    bs = settings.batch_size if train else settings.val_batch_size(len(data), world_size)
    return iterate_batches(data, bs, world_size=world_size, rank=rank, shuffle=train,
                           seed=settings.seed, epoch=epoch, drop_last=train,
                           num_workers=settings.num_workers, pin_memory=pin_memory,
                           transform=settings.transform if train else None, start=start)


def loader_words(data, settings: DataSettings, train: bool = False) -> str:
    """How ``data`` is loaded, for the run's first line: ``"4 loader threads"`` (a cache;
    a dataset around one and the training ``transform=`` are named) or ``"DataLoader with
    0 worker processes"`` (a dataset around a cache: why, and ``transform=``)."""
    return plan_loading(data).words(settings.num_workers, settings.transform if train else None)


def eval_module(s: "Setup") -> torch.nn.Module:
    """The model validation uses: the EMA copy when ``cfg.ema`` is set, else the model."""
    return s.model if s.ema is None else s.ema.module


def scale_lr(lr: float, world_size: int, rule: str) -> float:
    """``lr`` for ``world_size`` cores under ``rule`` (linear, sqrt or none)."""
    factor = {"linear": world_size, "sqrt": math.sqrt(world_size), "none": 1.0}[rule]
    return lr * factor


@dataclass
class Setup:
    """What :func:`set_up` prepared in one replica for a fit run.

    Attributes:
        model, opt, sched: The replica's model (on ``device``), optimizer and
            one-cycle schedule (driven per optimizer step).
        world_size, rank, device: This replica's world.
        base_lr: ``max_lr`` for ``lr_world`` cores, as given or found.
        lr_world: The world size ``base_lr`` is meant for.
        max_lr: The peak LR of this run (``base_lr`` scaled to ``world_size``).
        rule: The LR scaling rule (linear, sqrt or none).
        lr_note: How ``max_lr`` came from ``base_lr``, in words.
        steps_per_epoch: Optimizer steps per epoch on every rank.
        start_epoch: First epoch to run (0, or the resumed checkpoint's epoch).
        history: Per-epoch records so far (the resumed checkpoint's).
        steps: Per-step records so far (the resumed checkpoint's): one per loss read
            (``epoch`` 1-based, ``step`` the run's optimizer step, ``train_loss`` the epoch's
            running mean as the progress bar shows it, ``lr``).
        start_step: Optimizer steps of ``start_epoch`` already done (an in-epoch checkpoint's;
            else 0).
        start_loss: The running training loss of ``start_epoch`` at ``start_step`` (NaN when
            ``start_step`` is 0).
        autocast: The forward's autocast context (``plan.autocast``).
        accum_steps: Micro-batches per optimizer step.
        ema: The :class:`~xla_utils.train.ema.DeviceEMA` (``cfg.ema`` set) or None.
        mix: The :class:`~xla_utils.train.mixup.DeviceMix` (mixup/cutmix/smoothing on) or None.
        mesh: The SPMD strategy's :class:`~xla_utils.step.strategy.MeshRun`, or None
            (``strategy="spawn"``: one replica per core).
        plan: The run's :class:`~xla_utils.step.device_plan.DevicePlan` (precision, layout,
            host buffers, gradient scaler).
        ddp: ``model`` in torch's DistributedDataParallel on the replicas of a multi-replica
            torch launch (:func:`xla_utils.runtime.data_parallel`: gradients averaged as
            backward runs; the training forward goes through it), else None.
        compiled: ``compile=``'s :class:`~xla_utils.train.torch_compile.CompiledRun` (the
            compiled forward ``train_step`` and validation get), else None (eager).
        batch_transform: ``cfg.augment.batch_transform``: ``fn(x, y) -> (x, y)`` on each
            normalised training micro-batch, in the step's graph; or None.
        clip: ``grad_clip=``'s :class:`~xla_utils.step.clip.GradClip` (the gradients'
            total norm clipped before each optimizer step), else None.
    """

    model: torch.nn.Module
    opt: torch.optim.Optimizer
    sched: OneCycleSchedule
    world_size: int
    rank: int
    device: torch.device
    base_lr: float
    lr_world: int
    max_lr: float
    rule: str
    lr_note: str
    steps_per_epoch: int
    start_epoch: int
    history: list[dict[str, Any]]
    autocast: Any
    steps: list[dict[str, Any]] = field(default_factory=list)
    start_step: int = 0
    start_loss: float = math.nan
    accum_steps: int = 1
    ema: DeviceEMA | None = None
    mix: DeviceMix | None = None
    mesh: MeshRun | None = None
    plan: DevicePlan | None = None
    ddp: torch.nn.Module | None = None
    compiled: Any = None  # issue 45: a CompiledRun (compile=), set by fit_replica
    batch_transform: Callable | None = None
    clip: GradClip | None = None

    def batches(self, data, settings: DataSettings, epoch: int, train: bool, start: int = 0):
        """This replica's host batches of ``data`` for ``epoch`` (global ones on a mesh), from
        its batch ``start`` on."""
        if self.mesh is not None:
            return self.mesh.loader(data, settings, epoch, train, start)
        return loader(data, settings, world_size=self.world_size, rank=self.rank, epoch=epoch,
                      train=train, pin_memory=self.plan is not None and self.plan.pinned,
                      start=start)

    def feed(self, batches: Iterable):
        """``batches`` on the device(s): sharded over the mesh, or prefetched."""
        return runtime.device_prefetch(batches) if self.mesh is None else self.mesh.feed(batches)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The model's state under the plain model's names (consolidated on a mesh)."""
        return self.model.state_dict() if self.mesh is None else self.mesh.state_dict(self.model)


@dataclass
class TrainState:
    """What changes over a fit run in one replica.

    Attributes:
        step: Optimizer steps done (counting resumed epochs).
        initial_loss: The untrained model's loss at the run's first step, the
            yardstick for "the loss exploded" warnings.
        finite_state: Host copy of the weights of the last epoch that ended
            finite (master only, ``on_nan="stop"``); what the caller gets if a
            later epoch diverges.
        stop_reason: Why the run stopped early (``None``: it did not).
        diverged: Whether the training loss was read non-finite.
        exploded: Whether an epoch's loss exploded (:func:`explosion`).
        warnings: What the run warned about.
        paused: Why the run paused at a step with a checkpoint to resume from (a time
            limit, a signal: :mod:`xla_utils.train.session`), else None.
    """

    step: int
    initial_loss: float | None
    finite_state: dict[str, torch.Tensor] | None = None
    stop_reason: str | None = None
    diverged: bool = False
    exploded: bool = False
    warnings: list[str] = field(default_factory=list)
    paused: str | None = None


def set_up(model: torch.nn.Module, cfg: TrainerConfig, train_data, *, base_lr: float,
           lr_world: int, ckpt: dict | None, mix: MixConfig | None = None,
           lr_groups: Callable | None = None, strategy: MeshRun | None = None,
           inputs: InputSpec | None = None, note: str = "") -> Setup:
    """Prepare one replica for a fit run: model, optimizer, schedule, resumed state, and
    its :class:`~xla_utils.step.device_plan.DevicePlan`, which the first line reports on the
    torch backend (precision, layout, host buffers, loader) after the LR scaling.

    Args:
        model: The trainer's model (copied where replicas share objects).
        cfg: The run's :class:`~xla_utils.train.config.TrainerConfig`.
        train_data: The training dataset (sets the steps per epoch).
        base_lr: ``max_lr`` for ``lr_world`` cores.
        lr_world: The global-batch multiple ``base_lr`` is meant for (1, or the
            cores x accum_steps ``lr_find`` measured for).
        ckpt: A checkpoint to resume from, or ``None``.
        mix: The run's :class:`~xla_utils.train.mixup.MixConfig`, or None.
        lr_groups: ``lr_groups(model) -> param-group dicts`` (with ``lr_mult``), for
            discriminative LRs and frozen layers (:mod:`xla_utils.train.finetune`); None =
            every parameter at one LR.
        strategy: A :class:`~xla_utils.step.strategy.MeshRun` (``"spmd"``/``"fsdp"``: this one
            process feeds ``strategy.devices`` devices), or None.
        inputs: The training data's :class:`~xla_utils.step.inputs.InputSpec` (image inputs
            go channels_last on CUDA), or None.
        note: Said at the end of the run's first line (e.g. the model was unwrapped).

    Raises:
        ResumeError: The checkpoint's world size or steps per epoch differ from
            this run's (the schedule would not continue exactly).
    """
    from .ema import DeviceEMA
    from .mixup import DeviceMix

    ws, rk, dev = runtime.world_size(), runtime.rank(), runtime.device()
    k = cfg.accum_steps
    ema_from = None if cfg.ema is None else copy.deepcopy(model).cpu()  # before it moves
    # A mesh strategy places the model itself ("fsdp": straight into the shards).
    sharded = ckpt is not None and "sharded" in ckpt  # a .dcp: loaded onto the mesh below
    model = replica_model(model, None if strategy is not None else dev,
                          None if ckpt is None or sharded else ckpt["model"])
    if strategy is not None:
        ws, model = strategy.devices, strategy.wrap(model)
    plan = DevicePlan.build(DeviceRequest(cfg.precision, cfg.channels_last, inputs), dev, model)
    max_lr, rule, how = run_lr(cfg, base_lr, lr_world, ws)
    runtime.master_print(_first_line(cfg, ws, base_lr, max_lr, how, plan, train_data, dev.type, note))
    opt = make_optimizer(cfg.optimizer, model.parameters() if lr_groups is None else lr_groups(model),
                         lr=max_lr / cfg.div_factor, weight_decay=cfg.weight_decay)
    steps_per_epoch = len(loader(train_data, cfg.data, world_size=ws, rank=rk, epoch=0, train=True)) // k
    sched = OneCycleSchedule(total_steps=cfg.epochs * steps_per_epoch, max_lr=max_lr,
                             pct_start=cfg.pct_start, div_factor=cfg.div_factor,
                             final_div_factor=cfg.final_div_factor, moms=cfg.moms)
    history, steps, start_epoch, start_step, start_loss = _resumed(
        ckpt, opt, plan, ws, steps_per_epoch, sharded)
    ema = None if cfg.ema is None else DeviceEMA(
        plan.place(ema_from), cfg.ema, start_epoch * steps_per_epoch + start_step, dev,
        state=None if ckpt is None or sharded else ckpt.get("ema", ckpt["model"]),
        place=None if strategy is None else strategy.place)
    if sharded:  # model, optimizer and EMA filled from the shards, nothing gathered
        strategy.resume_sharded(model, opt, ckpt, ema=ema)
    return Setup(model=model, opt=opt, sched=sched, world_size=ws, rank=rk, device=dev,
                 base_lr=base_lr, lr_world=lr_world, max_lr=max_lr, rule=rule, lr_note=how,
                 steps_per_epoch=steps_per_epoch, start_epoch=start_epoch, history=history,
                 steps=steps, start_step=start_step, start_loss=start_loss,
                 autocast=plan.autocast, accum_steps=k, ema=ema,
                 mix=None if mix is None else DeviceMix(mix, dev), mesh=strategy, plan=plan,
                 ddp=None if strategy is not None else runtime.data_parallel(model),
                 batch_transform=cfg.augment.batch_transform,
                 clip=None if cfg.grad_clip is None else GradClip(cfg.grad_clip, dev))


def _resumed(ckpt: dict | None, opt: torch.optim.Optimizer, plan: DevicePlan, ws: int,
             steps_per_epoch: int, sharded: bool) -> tuple[list, list, int, int, float]:
    """``(history, step records, start epoch, start step in it, its running loss)`` of a run
    resumed from ``ckpt`` (its optimizer and gradient-scaler state loaded here; a sharded
    one's optimizer from the shards later), or a new run's.

    Raises:
        ResumeError: The checkpoint's world size or steps per epoch differ from ``ws`` and
            ``steps_per_epoch`` (the schedule would not continue exactly).
    """
    from .checkpoint import ResumeError

    if ckpt is None:
        return [], [], 0, 0, math.nan
    # fit() compared against the planned world; this is the actual one.
    if (ckpt["world_size"], ckpt["steps_per_epoch"]) != (ws, steps_per_epoch):
        raise ResumeError(
            f"checkpoint was written with {ckpt['world_size']} cores and "
            f"{ckpt['steps_per_epoch']} steps/epoch; this run has {ws} and "
            f"{steps_per_epoch}: the one-cycle schedule would not continue exactly")
    if not sharded:
        opt.load_state_dict(ckpt["optimizer"])
    plan.load_scaler_state(ckpt.get("scaler"))
    start_step, start_loss = 0, math.nan
    if ckpt.get("in_epoch"):  # an in-epoch checkpoint: the epoch goes on at its step
        start_step, start_loss = ckpt["in_epoch"]["step"], ckpt["in_epoch"]["train_loss"]
    return (list(ckpt["history"]), list(ckpt.get("steps") or []), ckpt["epoch"], start_step,
            start_loss)


def run_lr(cfg: TrainerConfig, base_lr: float, lr_world: int, world_size: int
           ) -> tuple[float, str, str]:
    """``(max_lr, rule, how)``: the peak LR of a run on ``world_size`` replicas (times
    ``accum_steps``) from ``base_lr``, meant for ``lr_world``; its scaling rule, in words."""
    rule = cfg.scaling_rule
    max_lr = scale_lr(base_lr, world_size * cfg.accum_steps, rule) / scale_lr(1.0, lr_world, rule)
    how = f"{rule} scaling" if lr_world == 1 else \
        f"measured by lr_find for {lr_world} cores, {rule} scaling beyond"
    return max_lr, rule, how


def _first_line(cfg: TrainerConfig, ws: int, base_lr: float, max_lr: float, how: str,
                plan: DevicePlan, train_data: Any, device_type: str, note: str = "") -> str:
    """The run's first line: the replicas in their device's words (cores, GPUs, processes),
    the global batch, the optimizer and the LR scaling (``how``), on the torch backend what
    the device plan chose and the loader, then ``note``."""
    k = cfg.accum_steps
    hosts = runtime.slice_host()
    return (f"{runtime.replicas_word(ws, device_type)}"
            + (f" on {hosts[1]} hosts" if hosts else "") + f" x {cfg.batch_size} per "
            f"{runtime.replica_noun(device_type)}"
            + (f" x {k} accumulated" if k > 1 else "") + f" = "
            f"{ws * cfg.batch_size * k} global batch; {optimizer_label(cfg.optimizer)}, max_lr "
            f"{base_lr:.3g} x {max_lr / base_lr:.3g} = {max_lr:.3g} ({how})"
            + (f"; {plan.words}, {loader_words(train_data, cfg.data, train=True)}" if plan.words
               else f"; {loader_words(train_data, cfg.data, train=True)}"
               if _loads_specially(train_data, cfg) else "")
            + (f"; {note}" if note else ""))


def _loads_specially(data: Any, cfg: TrainerConfig) -> bool:
    """The first line names the loader on XLA too: a dataset around a cache, or ``transform=``."""
    how = plan_loading(data)
    return cfg.data.transform is not None or (how.kind != "cache" and bool(how.caches))


@dataclass
class EpochResult:
    """What :func:`train_one_epoch` measured.

    Attributes:
        train_loss: Mean training loss over all replicas at the epoch's last
            read (NaN when never read).
        lr_last: LR of the epoch's last step.
        to_host: Device->host transfers in this process during the epoch.
        seconds: Wall time of the epoch's training steps.
        skipped_steps: Optimizer steps the gradient scaler skipped (inf/NaN gradients) in
            an fp16 run; None without a scaler.
        steps: Optimizer steps run by this call (fewer than the epoch's when it resumed
            inside it or paused; None: all of them).
        ended: Whether the epoch ran to its last step (False: the run paused inside it).
        grad_norms: ``grad_clip=``'s figures (:meth:`~xla_utils.step.clip.GradClip.take`:
            ``grad_norm``, ``grad_norm_max``, ``clipped_steps``, ``grad_norm_clipped_max``),
            read once at the epoch's end; None without clipping.
    """

    train_loss: float
    lr_last: float
    to_host: int
    seconds: float
    skipped_steps: int | None = None
    steps: int | None = None
    ended: bool = True
    grad_norms: dict[str, float | int] | None = None


def train_one_epoch(epoch: int, s: Setup, state: TrainState, batches: Iterable, *,
                    cfg: TrainerConfig, train_step: Callable, loss_fn: Callable, inputs: InputSpec,
                    progress: Any = None, start: int = 0,
                    at_read: Callable[[int, int, float], str | None] | None = None
                    ) -> EpochResult:
    """Run one training epoch in this replica.

    On a non-finite loss read the divergence warning is recorded in ``state``;
    with ``cfg.on_nan == "stop"`` the epoch ends there and ``state.stop_reason``
    says why. An fp16 epoch whose gradient scaler skipped more than
    :data:`SKIPPED_WARN` of its steps is warned about too.

    At every loss read (:func:`_loss_read`: every ``log_every`` optimizer steps and at the
    epoch's last) the RNGs are seeded again (:func:`begin_epoch`), so a run resumed at a read
    draws what the uninterrupted run drew; ``at_read`` may pause the run (``state.paused``).

    Args:
        epoch: 0-based epoch number.
        s: The replica's :class:`Setup`.
        state: The run's :class:`TrainState` (``step``, ``initial_loss``,
            divergence are updated).
        batches: This rank's host batches ``(x, y, valid)`` for the epoch.
        cfg: The trainer's configuration.
        train_step: ``train_step(model, (x, y), loss_fn) -> loss tensor``.
        loss_fn: The loss.
        inputs: The training data's :class:`~xla_utils.step.inputs.InputSpec`.
        progress: A progress bar over the micro-batches from ``start * accum_steps`` on
            (master only), or ``None``.
        start: Optimizer steps of the epoch already done (a resumed in-epoch checkpoint's;
            ``batches`` start after them); default 0.
        at_read: ``at_read(epoch, steps done in the epoch, train_loss)`` at every loss read
            (returns a note for the progress bar, e.g. the time left, or None), or None.

    Returns:
        The epoch's :class:`EpochResult`.
    """
    spe, k = s.steps_per_epoch, s.accum_steps
    begin_epoch(s, cfg.data, epoch, start)
    t0 = time.perf_counter()
    to_host0 = runtime.xla_counters()["to_host"]
    # Device data, not torch.zeros(device=xla): a zeros *op* would make each
    # epoch's first step a different graph (one recompile). Resumed inside the epoch: the
    # running mean so far, as a sum (the same value on every replica).
    loss_sum = runtime.to_device(torch.tensor(s.start_loss * start * k if start else 0.0,
                                              dtype=torch.float32), s.device)
    lr_last = s.sched.lr(state.step)
    train_loss = math.nan
    it = s.feed(batches)
    i = start - 1
    for m, (x, y, _valid) in zip(progress if progress is not None else range(start * k, spe * k),
                                 it):
        loss, lr = micro_step(s, state.step, m, x, y, data=cfg.data, train_step=train_step,
                              loss_fn=loss_fn, inputs=inputs)
        lr_last = lr_last if lr is None else lr
        i, last = divmod(m, k)[0], m % k == k - 1  # i: optimizer step in the epoch
        loss_sum = loss_sum + loss.detach().float()
        runtime.sync()
        if not last:
            continue
        state.step += 1
        if state.step == 1:
            state.initial_loss = runtime.all_reduce(float(loss.detach().float().cpu()), op="mean")
        if (i + 1) % cfg.log_every == 0 or i + 1 == spe:
            train_loss = _loss_read(epoch, i + 1, m + 1 - start * k, loss_sum, s, state, cfg=cfg,
                                    lr=lr_last, t0=t0, progress=progress, at_read=at_read)
            if state.stop_reason is not None or (state.paused is not None and i + 1 < spe):
                break
    if hasattr(it, "close"):
        it.close()  # micro-batches beyond the last full accumulation group are not used
    skipped = _skipped_steps(s, state, epoch)
    grad_norms = None if s.clip is None else s.clip.take()  # one host read an epoch
    return EpochResult(train_loss=train_loss, lr_last=lr_last,
                       to_host=runtime.xla_counters()["to_host"] - to_host0,
                       seconds=time.perf_counter() - t0, skipped_steps=skipped,
                       steps=i + 1 - start, ended=i + 1 == spe, grad_norms=grad_norms)


def _skipped_steps(s: Setup, state: TrainState, epoch: int) -> int | None:
    """The optimizer steps of ``epoch`` (0-based) that an fp16 run's gradient scaler skipped
    (None without a scaler); more than :data:`SKIPPED_WARN` of the epoch's are warned about."""
    skipped, spe = s.plan.take_skipped(), s.steps_per_epoch
    if skipped and skipped > SKIPPED_WARN * spe:
        msg = (f"epoch {epoch + 1}: the fp16 gradient scaler skipped {skipped} of {spe} optimizer "
               "steps (inf/NaN gradients), so the weights barely trained. Fix: lower max_lr, check "
               "the loss and inputs for inf/NaN, or train in precision='fp32'.")
        runtime.master_print(msg)
        state.warnings.append(msg)
    return skipped


def _loss_read(epoch: int, done: int, micro: int, loss_sum: torch.Tensor, s: Setup,
               state: TrainState, *, cfg: TrainerConfig, lr: float, t0: float, progress: Any,
               at_read: Callable[[int, int, float], str | None] | None) -> float:
    """A loss read after ``done`` optimizer steps of ``epoch`` (``micro``: micro-batches run by
    this call): every rank reads and the mean is exchanged on the host, so all ranks see the
    same value and stop at the same step; the progress bar, the divergence check
    (``state.stop_reason``), the step record, the RNGs seeded again and ``at_read``.
    Returns the epoch's running training loss."""
    spe, k = s.steps_per_epoch, s.accum_steps
    train_loss = runtime.all_reduce(float(loss_sum.cpu()) / (done * k), op="mean")
    if progress is not None:
        seen = micro * cfg.batch_size * s.world_size
        progress.comment = (f"loss {train_loss:.4f}  "
                            f"{seen / (time.perf_counter() - t0):.0f} img/s")
    if not math.isfinite(train_loss) and not state.diverged:
        state.diverged = True
        msg = divergence_message(cfg.diagnostics, train_loss, epoch, done, s, lr,
                                 state.finite_state is not None)
        state.warnings.append(msg)  # fit() warns with it once the run returns
        if cfg.on_nan == "stop":
            state.stop_reason = msg
            return train_loss
        runtime.master_print(msg)  # going on: say it now as well
    s.steps.append({"epoch": epoch + 1, "step": state.step, "train_loss": train_loss, "lr": lr})
    if done < spe:
        begin_epoch(s, cfg.data, epoch, done)
    note = None if at_read is None else at_read(epoch, done, train_loss)
    if note and progress is not None:
        progress.comment += f"  {note}"
    return train_loss


def step_seed(seed: int, epoch: int, step: int, rank: int) -> int:
    """The RNG seed of ``rank`` from optimizer step ``step`` (0-based, in the epoch) of
    ``epoch`` on: the epoch's seed at its start, a hash of all four at a later loss read."""
    if step == 0:
        return seed * 1_000_003 + epoch * 1_009 + rank
    return int(np.random.SeedSequence([seed, epoch, step, rank]).generate_state(1)[0])


def begin_epoch(s: Setup, data: DataSettings, epoch: int, step: int = 0) -> None:
    """What every epoch starts with in every replica, and every loss read inside it (``step``:
    the epoch's optimizer steps done): its RNG seeds (Python, NumPy, torch, the device RNG:
    flips, dropout; :func:`step_seed` of ``data.seed``), its mixing draws and train mode, so
    a run resumed at ``step`` draws what the uninterrupted run drew."""
    runtime.set_seed(step_seed(data.seed, epoch, step, s.rank))
    if s.mix is not None:
        s.mix.start_epoch()  # the next draws come from this seed (exact resume)
    s.model.train()


def micro_step(s: Setup, step: int, m: int, x: Any, y: Any, *, data: DataSettings,
               train_step: Callable,
               loss_fn: Callable, inputs: InputSpec | None) -> tuple[torch.Tensor, float | None]:
    """Micro-batch ``m`` (0-based, counted from the epoch's start) of the run's optimizer step
    ``step``, as ``fit`` runs it, up to the step boundary (the caller calls
    ``runtime.sync()``): mixing, the input's device preparation (``data``: the
    normalisation and flip settings), at a step's first
    micro-batch the one-cycle LR and momentum and ``zero_grad``, forward and backward under
    the run's autocast, and at its last micro-batch the optimizer step (with ``grad_clip=``
    the gradients clipped first, :class:`~xla_utils.step.clip.GradClip`) and the EMA update.
    :meth:`OneCycleTrainer.check <xla_utils.train.trainer.OneCycleTrainer.check>` and ``debug()``
    measure this very function (:mod:`xla_utils.train.steps`).

    Returns:
        ``(loss, lr)``: the micro-batch's loss tensor, and the LR set at this micro-batch
        (None when it is not a step's first).
    """
    k, lr = s.accum_steps, None
    if s.mix is not None:
        s.mix.prepare()  # the next chunk of draws, as a graph of its own, when one is used up
    x = prepare_input(x, data, True, inputs, s.plan.memory_format)
    if s.batch_transform is not None:  # batch_transform=: the user's device augmentation
        x, y = apply_batch_transform(s.batch_transform, x, y)
        x = s.plan.layout(x)
    if s.mix is not None:
        x, y = s.mix(x, y)
        x = s.plan.layout(x)
    if m % k == 0:
        lr = s.sched.apply(s.opt, step)
        s.opt.zero_grad(set_to_none=True)
    last = m % k == k - 1
    # compile=: train_step gets the compiled forward (the same parameters), also under DDP
    model = s.model if s.compiled is None else s.compiled.module(s.model)
    run_step = train_step if s.compiled is None else (lambda _m, *a: train_step(model, *a))
    with contextlib.nullcontext() if last else runtime.no_sync(s.ddp):  # average once a step
        with s.autocast:
            loss = (train_step(model, (x, y), loss_fn) if s.ddp is None else
                    s.ddp(run_step, (x, y), loss_fn))  # train_step gets the (compiled) model
        s.plan.backward(loss / k if k > 1 else loss)
    if last:
        # a step the fp16 scaler skips still advances the schedule
        s.plan.step(s.opt, averaged=s.ddp is not None, clip=s.clip)
        if s.ema is not None:
            s.ema.update(s.model)
    return loss, lr


def _kept(s: Setup, epoch: int, kept_finite: bool) -> str:
    """What ``trainer.model`` holds after a stop in ``epoch`` (0-based)."""
    if kept_finite:
        return f"keeps the weights of epoch {epoch} (the last good ones, a host copy)"
    if s.start_epoch:
        return ("is unchanged (no epoch of this fit ended good; the resumed checkpoint holds "
                "the last good weights)")
    return "is unchanged (no epoch ended good)"


def _fix(s: Setup) -> str:
    return (f"Fix: lower max_lr (e.g. {s.base_lr / 10:.3g}) or let trainer.find_lr() / "
            "fit(max_lr='find') pick it; check inputs, targets and the loss for "
            "inf/NaN (log of 0, division by 0)"
            + (f"; with {s.plan.precision} autocast try precision='fp32'"
               if s.plan.precision != "fp32" else "")
            + ".")


def divergence_message(diag: DiagnosticsSettings, value: float, epoch: int, step: int, s: Setup,
                       lr: float, kept_finite: bool) -> str:
    """The warning for a non-finite training loss read at ``step`` of ``epoch``
    (0-based), saying what happens next (``diag.on_nan``) and how to fix it."""
    msg = (f"train_loss became {value} in epoch {epoch + 1} by step {step}/{s.steps_per_epoch} "
           f"(LR then {lr:.3g}; peak max_lr {s.max_lr:.3g} from max_lr {s.base_lr:.3g}). ")
    if diag.on_nan == "stop":
        msg += (f"Training stopped (on_nan='stop'); trainer.model {_kept(s, epoch, kept_finite)}; "
                "no checkpoint was written for it. ")
    else:
        msg += "Training goes on (on_nan='continue'); no checkpoint is written for non-finite epochs. "
    return msg + _fix(s)


def metric_accumulator(names: Any, loss_fn: Callable, out: torch.Tensor, y: torch.Tensor,
                       dev: torch.device) -> MetricAccumulator:
    """An accumulator of the configured metrics ``names`` (``None``: the defaults for the
    task), for the task a first output/target pair shows
    (:func:`~xla_utils.train.metrics.target_kind`)."""
    kind = target_kind(out, y, loss_fn)
    width = out.shape[1] if out.dim() == 2 else 1
    return MetricAccumulator(resolve_metrics(names, kind, width), loss_fn, dev, kind=kind)


def evaluate(model: torch.nn.Module, batches: Iterable, *, data: DataSettings,
             diag: DiagnosticsSettings, loss_fn: Callable, eval_step: Callable, autocast: Any,
             dev: torch.device,
             inputs: InputSpec, feed: Callable | None = None,
             memory_format: torch.memory_format = torch.contiguous_format) -> dict[str, float]:
    """Validation loss and metrics of ``model`` over this rank's ``batches``,
    reduced over all replicas.

    Args:
        model: The replica's model (set to eval mode here).
        batches: This rank's padded host batches ``(x, y, valid)``.
        data, diag: The run's data settings (normalisation) and diagnostics (``metrics``).
        loss_fn, eval_step: The trainer's loss and ``eval_step``.
        autocast: The autocast context of the run.
        dev: The replica's device.
        inputs: The data's :class:`~xla_utils.step.inputs.InputSpec`.
        feed: Moves host batches to the device(s); default ``runtime.device_prefetch``.
        memory_format: Image batches are normalised into it (the run's plan's).

    Raises:
        ValueError: ``batches`` yielded nothing.
    """
    model.eval()
    acc = None
    with torch.no_grad():
        for x, y, valid in (feed or runtime.device_prefetch)(batches):
            with autocast:
                out = eval_step(model, (prepare_input(x, data, False, inputs, memory_format), y))
            if acc is None:
                acc = metric_accumulator(diag.metrics, loss_fn, out, y, dev)
            acc.update(out, y, valid)
            runtime.sync()
    if acc is None:
        raise ValueError("val_data yielded no batch")
    return acc.compute()


def exploded(key: str, value: float | None, initial: float | None, epoch: int) -> str | None:
    """Why epoch ``epoch``'s (1-based) ``key`` loss counts as exploded, or None: a non-finite
    validation loss (a non-finite training loss is :func:`divergence_message`'s), or a loss
    more than ``VAL_LOSS_EXPLODES`` (10) times the untrained model's at the run's first step."""
    if value is None:
        return None
    if not math.isfinite(value):
        return None if key == "train_loss" else f"{key} at epoch {epoch} is {value}"
    if initial is not None and math.isfinite(initial) and initial > 0 \
            and value > VAL_LOSS_EXPLODES * initial:
        return (f"{key} {value:.4g} at epoch {epoch} is {value / initial:,.3g}x the untrained "
                f"model's loss at the first step ({initial:.4g})")
    return None


def explosion(record: dict[str, Any], state: TrainState, diag: DiagnosticsSettings, s: Setup,
              epoch: int) -> None:
    """At the end of epoch ``epoch`` (0-based, its ``record`` complete): when its training or
    validation loss exploded (:func:`exploded`), record one message per run in
    ``state.warnings`` and, with ``diag.on_nan == "stop"``, in ``state.stop_reason``: the
    caller then stops before this epoch's checkpoint and host copy, so the run keeps the
    last good epoch's weights, as on a NaN. With ``"continue"`` it says so now and goes on."""
    if state.diverged or state.exploded:
        return
    whys = [w for key in ("train_loss", "val_loss")
            if (w := exploded(key, record.get(key), state.initial_loss, epoch + 1))]
    if not whys:
        return
    state.exploded = True
    msg = "; ".join(whys) + ": training is diverging. "
    if diag.on_nan == "stop":
        msg += (f"Training stopped (on_nan='stop': a loss above {VAL_LOSS_EXPLODES:g}x the "
                f"untrained model's counts as diverged, as a NaN does); trainer.model "
                f"{_kept(s, epoch, state.finite_state is not None)}; no checkpoint was written "
                f"for epoch {epoch + 1}. ")
        state.stop_reason = msg + _fix(s)
    else:
        msg += "Training goes on (on_nan='continue'). "
        runtime.master_print(msg + _fix(s))
    state.warnings.append(msg + _fix(s))


def epoch_line(r: dict[str, Any]) -> str:
    parts = [f"epoch {r['epoch']}", f"train_loss {r['train_loss']:.4f}"]
    for k in ["val_loss"] * ("val_loss" in r) + metric_keys(r):  # every validation metric
        parts.append(f"{k} {r[k]:.4f}")
    parts.append(f"{r['images_per_s']:.0f} img/s")
    if "compiles" in r:  # XLA runs, and compile= on the torch backend
        parts.append(f"{r['compiles']} compiles")
    if r.get("compile_seconds"):  # compile=: seconds compiling in this epoch
        parts.append(f"{r['compile_seconds']:.1f} s compiling")
    if r.get("skipped_steps"):  # fp16 runs: steps the gradient scaler skipped
        parts.append(f"{r['skipped_steps']} skipped fp16 steps")
    return "  ".join(parts)
