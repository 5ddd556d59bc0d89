"""What each replica of a fit or an inference run does, as plain functions with explicit
arguments (as timm's ``train_one_epoch`` / ``validate``).

:meth:`OneCycleTrainer.fit <xla_utils.train.trainer.OneCycleTrainer.fit>` checks and plans on
the host, then launches :func:`fit_replica` on every core (``strategy="spawn"``) or
:func:`fit_on_mesh` in the one SPMD process (``"spmd"``/``"fsdp"``) with a :class:`FitPlan`:
everything a replica needs, and nothing of the trainer. ``predict`` / ``evaluate`` launch
:func:`inference_replica` / :func:`inference_on_mesh` with a
:class:`~xla_utils.train.inference.InferencePlan`. Each is built from :mod:`xla_utils.train.loop`'s steps
(set-up, one training epoch, evaluation, inference passes) and writes checkpoints
through :mod:`xla_utils.train.checkpoint`.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch

from . import inference, loop
from .. import runtime
from .board import EpochBoard
from .checkpoint import save_checkpoint, sharded_meta
from .history import BestTracker, History, epoch_files
from .mirror import CheckpointMirror
from .session import RunSession, StopPlan
from ..simulate import resident as _resident
from ..step.strategy import MeshRun, StrategyPlan, enter_mesh
from .torch_compile import CompiledRun, compile_caches

if TYPE_CHECKING:
    from .config import CheckpointSettings, TrainerConfig
    from ..step.inputs import InputSpec
    from .mixup import MixConfig

__all__ = ["FitPlan", "fit_replica", "fit_on_mesh", "completed_run", "epoch_record", "end_epoch",
           "in_epoch_read", "push_checkpoints",
           "save_final", "inference_replica", "inference_on_mesh"]


@dataclass
class FitPlan:
    """What each replica of a fit run needs, decided and checked on the host by
    :meth:`OneCycleTrainer.fit <xla_utils.train.trainer.OneCycleTrainer.fit>`.

    Attributes:
        model: The model to train (copied where replicas share objects).
        loss: ``loss(outputs, targets) -> scalar``.
        config: The run's configuration: the trainer's, with ``fit``'s per-run overrides.
        train_step: ``train_step(model, (x, y), loss) -> loss tensor``.
        eval_step: ``eval_step(model, (x, y)) -> outputs``.
        inputs: ``{"train": (data as the loader collates it, its InputSpec), "val": ...
            or None}``.
        base_lr: ``max_lr`` for ``lr_world`` cores, as given or found.
        lr_world: The global-batch multiple ``base_lr`` is meant for.
        ckpt: The checkpoint to resume from, or None.
        run_id: The run's id (in its checkpoint file names).
        mix: The run's :class:`~xla_utils.train.mixup.MixConfig`, or None.
        lr_groups: ``lr_groups(model) -> param-group dicts`` (with ``lr_mult``), or None:
            every parameter at one LR.
        ckpt_extra: Fields every epoch checkpoint records beside the run's state, or None.
        note: Said at the end of the run's first line (what the trainer did to the model it
            was given), or "".
        stop: When to write in-epoch checkpoints and to stop early (time limit, signals):
            :class:`~xla_utils.train.session.StopPlan`.
        mirror: ``checkpoint_dir`` at a URL: the :class:`~xla_utils.train.mirror.CheckpointMirror`
            the master uploads the local checkpoint folder through after every checkpoint; None
            for a local folder.
    """

    model: torch.nn.Module
    loss: Callable
    config: TrainerConfig
    train_step: Callable
    eval_step: Callable
    inputs: dict[str, tuple[Any, InputSpec] | None]
    base_lr: float
    lr_world: int
    ckpt: dict | None
    run_id: str
    mix: MixConfig | None = None
    lr_groups: Callable[..., Any] | None = None
    ckpt_extra: dict[str, Any] | None = None
    note: str = ""
    stop: StopPlan = dataclasses.field(default_factory=StopPlan)
    mirror: CheckpointMirror | None = None


def fit_replica(plan: FitPlan, strategy: MeshRun | None = None) -> History:
    """One replica of :meth:`~xla_utils.train.trainer.OneCycleTrainer.fit`: set up, then per epoch
    train, evaluate and checkpoint (``strategy``: the one SPMD process of
    ``"spmd"``/``"fsdp"``, :func:`fit_on_mesh`); with ``compile=``, inside inductor's
    persistent caches (:func:`~xla_utils.train.torch_compile.compile_caches`)."""
    cfg = plan.config
    with compile_caches(cfg.compile, cfg.compile_cache, cfg.checkpoint_dir):
        return _fit_replica(plan, strategy)


def _fit_replica(plan: FitPlan, strategy: MeshRun | None = None) -> History:
    cfg, ckpt, run_id, inputs = plan.config, plan.ckpt, plan.run_id, plan.inputs
    base_lr, lr_world = plan.base_lr, plan.lr_world
    train_data, spec = inputs["train"]
    cache = runtime.enable_compile_cache(cfg.compile_cache)  # before anything compiles
    counters0 = runtime.xla_counters()
    # issue 45: compile= (the torch backend; refused on XLA by the trainer)
    compiled = CompiledRun.start(cfg.compile, cfg.compile_cache, cfg.checkpoint_dir,
                                 runtime.device())
    s = loop.set_up(plan.model, cfg, train_data, base_lr=base_lr, lr_world=lr_world,
                    ckpt=ckpt, mix=plan.mix, lr_groups=plan.lr_groups,
                    strategy=strategy, inputs=spec,
                    note="; ".join(filter(None, [plan.note, compiled and compiled.words])))
    s.compiled = compiled
    state = loop.TrainState(step=s.start_epoch * s.steps_per_epoch + s.start_step,
                            initial_loss=None if ckpt is None else ckpt.get("initial_loss"))
    session = RunSession(plan.stop, state.step)
    session.catch_sigterm()

    def at_read(epoch: int, done: int, train_loss: float) -> str | None:
        return in_epoch_read(epoch, done, train_loss, s, state, session, run_id, cfg=cfg,
                             extra=plan.ckpt_extra, mirror=plan.mirror)

    master_bar, progress_bar = runtime.progress_bars()
    epochs = range(cfg.epochs)  # the whole run's: a resumed run's bar says Epoch 4/6
    best = BestTracker.resume(cfg.monitor, cfg.patience, s.history) if cfg.monitor else None
    mb = master_bar(epochs) if runtime.is_master() else None
    board = EpochBoard.open(cfg.tensorboard, cfg.checkpoint_dir, run_id, runtime.is_master())
    for epoch in (mb if mb is not None else epochs):
        if epoch < s.start_epoch:  # done before the checkpoint
            continue
        start = s.start_step if epoch == s.start_epoch else 0
        pb = progress_bar(range(start * s.accum_steps, s.steps_per_epoch * s.accum_steps),
                          parent=mb) if mb is not None else None
        batches = s.batches(train_data, cfg.data, epoch, train=True, start=start * s.accum_steps)
        res = loop.train_one_epoch(epoch, s, state, batches, cfg=cfg,
                                   train_step=plan.train_step, loss_fn=plan.loss,
                                   inputs=spec, progress=pb, start=start, at_read=at_read)
        if state.stop_reason is not None or not res.ended:  # diverged, or paused inside
            break
        record = epoch_record(epoch, s, state, res, inputs["val"], cfg=cfg, loss_fn=plan.loss,
                              eval_step=plan.eval_step)
        s.history.append(record)
        if mb is not None:
            mb.write(loop.epoch_line(record))
        if board is not None:
            board.epoch(record)
        if state.stop_reason is not None:  # the epoch's loss exploded: no checkpoint for it
            break
        end_epoch(epoch, s, state, run_id, finite=math.isfinite(res.train_loss), cfg=cfg,
                  extra=plan.ckpt_extra, mirror=plan.mirror)
        session.checkpointed(state.step)
        if epoch + 1 == cfg.epochs:
            state.paused = None  # a stop asked at the run's last step: the run is complete
        if epoch_files(best, record, loop.eval_module(s), s.history, cfg.checkpoint_dir,
                       steps=s.steps) or state.paused is not None:
            break
    final = _final_weights(s, state, best, cfg, plan.mirror)
    history = History(epochs=s.history, world_size=s.world_size,
                   global_batch=s.world_size * cfg.batch_size * s.accum_steps,
                   base_lr=s.base_lr,
                   max_lr=s.max_lr, lr_scaling=s.rule, lr_note=s.lr_note,
                   backend=runtime.backend(), device_type=s.device.type, state_dict=final,
                   stop_reason=state.stop_reason or state.paused or (best and best.stop_reason),
                   monitor=cfg.monitor, best_epoch=best and best.best_epoch,
                   best_score=best and best.best_score,
                   warnings=state.warnings, run_id=run_id,
                   compile_cache=(compiled.summary() if compiled is not None else
                                  runtime.compile_cache_summary(cache, counters0,
                                                                runtime.xla_counters())),
                   ema_state_dict={} if s.ema is None else s.ema.state_dict(), steps=s.steps)
    if board is not None:
        board.close(history)  # its per-step rows, when it has them
    return history


def in_epoch_read(epoch: int, done: int, train_loss: float, s: loop.Setup,
                  state: loop.TrainState, session: RunSession, run_id: str, *,
                  cfg: TrainerConfig, extra: dict[str, Any] | None = None,
                  mirror: CheckpointMirror | None = None) -> str | None:
    """At a loss read after ``done`` optimizer steps of ``epoch`` (0-based): what the
    replicas agreed (:meth:`RunSession.at_read <xla_utils.train.session.RunSession.at_read>`):
    an in-epoch checkpoint (``checkpoint_dir`` set, the epoch not at its end: the epoch
    checkpoint follows then) and a pause (``state.paused``). Every rank calls.

    Returns:
        The progress bar's note: the time left under a time limit, else None.
    """
    decision = session.at_read(state.step)
    if decision.stop is not None:
        state.paused = decision.stop
    if not decision.checkpoint or done == s.steps_per_epoch or cfg.checkpoint_dir is None \
            or not math.isfinite(train_loss):
        return session.time_left_words()
    save_checkpoint(
        s.model, s.opt, cfg, epoch=epoch, history=s.history, base_lr=s.base_lr,
        lr_world=s.lr_world, world_size=s.world_size, steps_per_epoch=s.steps_per_epoch,
        run_id=run_id, host_state=s.state_dict(), initial_loss=state.initial_loss,
        ema=None if s.ema is None else s.ema.state_dict(), scaler=s.plan.scaler_state(),
        extra=extra, steps=s.steps,
        in_epoch={"step": done, "train_loss": train_loss, "log_every": cfg.log_every})
    push_checkpoints(mirror)
    session.checkpointed(state.step)
    return session.time_left_words()


def _final_weights(s: loop.Setup, state: loop.TrainState, best: BestTracker | None,
                   cfg: TrainerConfig, mirror: CheckpointMirror | None = None
                   ) -> dict[str, torch.Tensor]:
    """The weights a fit run returns: after a divergence the last good epoch's (or none),
    after a pause this step's (its checkpoint holds the rest), else the best epoch's or the
    last ones, also written as ``final.pt`` (:func:`save_final`); then the checkpoint folder
    is mirrored to its URL (``mirror``: the files written since the last checkpoint)."""
    if state.stop_reason is not None:
        final = state.finite_state or {}
    elif state.paused is not None:  # final.pt is for the end
        final = s.state_dict()
    else:
        final = state.finite_state if state.finite_state is not None else s.state_dict()
        final = best.best_state if best is not None and best.best_state else final
        if cfg.checkpoint_dir is not None:
            save_final(s, final, best is not None and bool(best.best_state),
                       checkpoints=cfg.checkpoints)
    push_checkpoints(mirror)
    return final


def push_checkpoints(mirror: CheckpointMirror | None) -> None:
    """On the master, upload the checkpoint folder's new files to ``mirror``'s URL (a
    ``checkpoint_dir`` at a URL; nothing for a local one). Every rank may call."""
    if mirror is not None and runtime.is_master():
        mirror.push()


def completed_run(plan: FitPlan) -> History:
    """The history of a run whose checkpoint (``plan.ckpt``) holds its last epoch, as its
    fit returned it, read on the host: nothing is launched, trained or written."""
    cfg, ckpt = plan.config, plan.ckpt
    ws, history = ckpt["world_size"], list(ckpt["history"])
    max_lr, rule, how = loop.run_lr(cfg, plan.base_lr, plan.lr_world, ws)
    best = BestTracker.resume(cfg.monitor, cfg.patience, history) if cfg.monitor else None
    return History(epochs=history, world_size=ws,
                   global_batch=ws * cfg.batch_size * cfg.accum_steps, base_lr=plan.base_lr, max_lr=max_lr, lr_scaling=rule, lr_note=how,
                   backend=runtime.backend(),
                   state_dict={} if "sharded" in ckpt else dict(ckpt["model"]),
                   monitor=cfg.monitor, best_epoch=best and best.best_epoch,
                   best_score=best and best.best_score, run_id=plan.run_id,
                   ema_state_dict=dict(ckpt.get("ema") or {}), steps=list(ckpt.get("steps") or []))


def save_final(s: loop.Setup, final: dict[str, torch.Tensor], is_best: bool, *,
               checkpoints: CheckpointSettings) -> None:
    """``final.pt``: the weights ``predict`` uses (the best epoch's, else the EMA
    ones when ``ema`` is set, else ``final``); with EMA also ``final_raw.pt``
    (the last epoch's trained weights), in ``checkpoints.checkpoint_dir``. Every rank calls
    (the master writes)."""
    folder = Path(checkpoints.checkpoint_dir)
    if s.ema is None:
        runtime.save(final, folder / "final.pt")
        return
    runtime.save(final if is_best else s.ema.state_dict(), folder / "final.pt")
    runtime.save(s.state_dict(), folder / "final_raw.pt")


def epoch_record(epoch: int, s: loop.Setup, state: loop.TrainState, res: loop.EpochResult,
                 val: tuple[Any, InputSpec] | None, *, cfg: TrainerConfig, loss_fn: Callable,
                 eval_step: Callable) -> dict[str, Any]:
    """The finished epoch's history record (validation of ``val`` included;
    :func:`loop.explosion`)."""
    record: dict[str, Any] = {"epoch": epoch + 1, "train_loss": res.train_loss}
    if val is not None:
        model = loop.eval_module(s)
        model = model if s.compiled is None else s.compiled.module(model)  # compile=
        metrics = loop.evaluate(model, s.batches(val[0], cfg.data, epoch, train=False),
                                data=cfg.data, diag=cfg.diagnostics, loss_fn=loss_fn,
                                eval_step=eval_step,
                                autocast=s.autocast, dev=s.device, inputs=val[1], feed=s.feed,
                                memory_format=s.plan.memory_format)
        record.update({"val_loss": metrics.pop("loss")}, **metrics)
    steps = s.steps_per_epoch if res.steps is None else res.steps  # fewer when resumed inside
    record.update(lr_max=s.max_lr, lr_last=res.lr_last,
                  images_per_s=steps * s.accum_steps * cfg.batch_size * s.world_size
                  / res.seconds)
    if s.device.type == "xla":  # XLA's own counts; on the torch backend only compile= compiles
        record.update(compiles=runtime.xla_counters()["compiles"],
                      host_reads_per_step=res.to_host / s.steps_per_epoch)
    elif s.compiled is not None:  # compile=: dynamo's graphs and seconds (issue 45)
        fields, warning = s.compiled.epoch_end(epoch)
        record.update(fields)
        if warning is not None:
            runtime.master_print(warning)
            state.warnings.append(warning)
    record["seconds"] = res.seconds
    if res.skipped_steps is not None:  # a gradient scaler's (fp16 on a GPU)
        record["skipped_steps"] = res.skipped_steps
    record.update(res.grad_norms or {})  # grad_clip=
    loop.explosion(record, state, cfg.diagnostics, s, epoch)
    return record


def end_epoch(epoch: int, s: loop.Setup, state: loop.TrainState, run_id: str, finite: bool, *,
              cfg: TrainerConfig, extra: dict[str, Any] | None = None,
              mirror: CheckpointMirror | None = None) -> None:
    """Keep a host copy of finite weights (master, ``on_nan="stop"``) and
    write the epoch checkpoint when configured and the loss is finite (``extra``: fields
    recorded beside the run's state, :func:`~xla_utils.train.checkpoint.save_checkpoint`;
    ``mirror``: then uploaded to the checkpoint folder's URL)."""
    if finite and cfg.on_nan == "stop" and runtime.is_master():
        state.finite_state = runtime.host_copy(s.state_dict())
    if cfg.checkpoint_dir is None:
        return
    if finite:
        written = save_checkpoint(
            s.model, s.opt, cfg, epoch=epoch + 1, history=s.history, base_lr=s.base_lr,
            lr_world=s.lr_world, world_size=s.world_size, steps_per_epoch=s.steps_per_epoch,
            run_id=run_id, host_state=state.finite_state if state.finite_state is not None
            else s.state_dict(), initial_loss=state.initial_loss,
            ema=None if s.ema is None else s.ema.state_dict(),
            scaler=s.plan.scaler_state(), extra=extra, steps=s.steps)
        if s.mesh is not None:  # its sharded twin (strategy="spmd"/"fsdp")
            s.mesh.save_sharded(s.model, s.opt, cfg.checkpoint_dir, epoch + 1, run_id,
                                cfg.keep_checkpoints, meta=sharded_meta(written, cfg.strategy),
                                ema=s.ema)
        push_checkpoints(mirror)
    else:
        runtime.master_print(f"epoch {epoch + 1}: no checkpoint written "
                             "(non-finite loss); older checkpoints are kept")


def fit_on_mesh(mesh: StrategyPlan, plan: FitPlan) -> History:
    """:func:`fit_replica` in the SPMD process (:func:`xla_utils.step.strategy.launch`), on the
    mesh of ``mesh``."""
    _, run = enter_mesh(mesh, plan.config.compile_cache)
    return fit_replica(plan, strategy=run)


def inference_replica(plan: inference.InferencePlan) -> Any:
    """One replica of ``predict`` / ``evaluate`` (see :func:`~xla_utils.train.inference.inference_pass`):
    the predictions in dataset order (on the master), or the metrics; with ``compile=``, inside
    inductor's persistent caches."""
    cfg = plan.config
    with compile_caches(cfg.compile, cfg.compile_cache, cfg.checkpoint_dir):
        return _inference_replica(plan)


def _inference_replica(plan: inference.InferencePlan) -> Any:
    runtime.enable_compile_cache(plan.config.compile_cache)  # before anything compiles
    ws, rk, dev = runtime.world_size(), runtime.rank(), runtime.device()
    model = (_resident.replica_model(plan.model, dev, rk) if _resident.in_live_job()
             else loop.replica_model(plan.model, dev)).eval()  # a live job keeps device copies
    acc, targets = inference.inference_pass(model, plan, cfg=plan.config, eval_step=plan.eval_step,
                                       world_size=ws, rank=rk, dev=dev)
    if plan.labelled:
        return inference.inference_metrics(acc, targets, plan, cfg=plan.config, loss_fn=plan.loss,
                                      dev=dev)
    return inference.gather_predictions(acc, plan, world_size=ws, rank=rk, dev=dev)


def inference_on_mesh(plan: StrategyPlan, iplan: inference.InferencePlan) -> Any:
    """``predict`` / ``evaluate`` in the SPMD process: global batches split over the mesh."""
    _, run = enter_mesh(plan, iplan.config.compile_cache)
    dev = runtime.device()
    model = run.wrap(loop.replica_model(iplan.model, None)).eval()
    iplan = dataclasses.replace(iplan, batch_size=iplan.batch_size * run.devices)
    acc, targets = inference.inference_pass(model, iplan, cfg=iplan.config,
                                       eval_step=iplan.eval_step, world_size=1, rank=0,
                                       dev=dev, feed=run.feed)
    if iplan.labelled:
        return inference.inference_metrics(acc, targets, iplan, cfg=iplan.config,
                                      loss_fn=iplan.loss, dev=dev)
    return inference.gather_predictions(acc, iplan, world_size=1, rank=0, dev=dev)
