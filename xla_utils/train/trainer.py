"""One-cycle training on every TPU core: :class:`OneCycleTrainer`.

``OneCycleTrainer(model, loss, train_data, val_data, batch_size=32, ...).fit()``
launches one replica per core through :func:`xla_utils.runtime.launch` (fork,
so models and functions defined in a notebook work), scales the LR by the world
size, drives LR and momentum with :class:`~xla_utils.train.schedule.OneCycleSchedule`
every optimizer step, and returns a :class:`History` to the notebook.

This module holds the API and the host-side planning (checks, LR, resume); its
configuration is :class:`~xla_utils.train.config.TrainerConfig` (also importable from here); each
replica's work is :mod:`xla_utils.train.replica_loops` (given a plan, not the trainer), built from
the plain functions of :mod:`xla_utils.train.loop` (set-up, one training epoch, evaluation,
inference); checkpoints are :mod:`xla_utils.train.checkpoint`,
the input checks :mod:`xla_utils.step.inputs` and the single-core debug loop
(:meth:`OneCycleTrainer.debug`) :mod:`xla_utils.diagnostics.debug`.
"""
from __future__ import annotations

import math
import os
import warnings
from typing import TYPE_CHECKING, Any, Callable

import numpy as np
import torch

from . import inference, loop
from ..step import device_plan
from .. import runtime
from . import mesh_tasks as _mesh_tasks
from ..step import strategy as _strategy
from .checkpoint import (CheckpointError, ResumeError, check_extra, check_resume, check_run_id,
                         earlier_runs_note, model_with_weights, new_run_id, resume_on_every_host)
from .config import LOSS_MONITORS, TrainerConfig, check_option_names
from ..data import CachedImageDataset, check_transform, iterate_batches
from ..diagnostics.debug import DebugReport, debug_run
from .ema import with_weights
from ..diagnostics.findings import ReadinessError
from .history import History, check_monitor_data
from ..step.plain import default_eval_step, default_train_step
from ..step.inputs import (AsPairs, InputSpec, TargetPlan, check_batch_transform, check_batches,
                           inspect_inputs, output_width, plan_targets, require_labels,
                           shape_mismatch, targets_of)
from .loop import scale_lr
from .lr_finder import FIT_SHARE
from .metrics import check_metrics
from .mirror import staged
from .mixup import MixConfig, mix_config_for
from .session import StopPlan, checkpoint_interval, run_deadline, stop_signals
from ..env.detection import platform_name
from .replica_loops import (FitPlan, completed_run, fit_on_mesh, fit_replica, inference_on_mesh,
                            inference_replica)
from ..simulate.live import live_or_launch
from .steps import TrainerStepPlan
from .submission import missing_note, training_multilabel
from .torch_compile import check_compile_option, graph_breaks_report, refuse_on_xla
from ..utils.suggest import choice, deprecated, keyword_help

if TYPE_CHECKING:
    from ..diagnostics.device_check import DeviceCheckReport
    from ..diagnostics.readiness import ReadinessReport

__all__ = ["TrainerConfig", "OneCycleTrainer", "History", "DebugReport", "debug_run",
           "scale_lr", "CheckpointError", "ResumeError"]


def _check_plan_args(lr_groups: Any, checkpoint_extra: Any, run_id: Any, resume: Any) -> None:
    """Refuse ``fit``'s ``lr_groups``, ``checkpoint_extra`` and ``run_id`` when they are not
    what they must be (``run_id`` with ``resume``: the resumed run keeps its own)."""
    if lr_groups is not None and not callable(lr_groups):
        raise TypeError(f"lr_groups must be a callable model -> param-group dicts (e.g. "
                        f"xla_utils.train.finetune.layer_group_lrs(...)) or None, got {lr_groups!r}")
    check_extra(checkpoint_extra)
    if run_id is not None:
        check_run_id(run_id)
        if resume is not None:
            raise ValueError("fit(run_id=..., resume=...): a resumed run goes on under its "
                             "checkpoint's run id. Fix: drop run_id")


def _host_model(model: torch.nn.Module) -> tuple[torch.nn.Module, str]:
    """``(model as the trainer keeps it, what was done, in words or "")``: unwrapped from
    ``nn.DataParallel`` / ``DistributedDataParallel`` (each replica gets the plain module and
    the trainer averages gradients itself) and on the CPU (``fit`` places it on each
    replica's device; a model left on a GPU would be copied to every replica from there)."""
    done = []
    wrappers = (torch.nn.DataParallel, torch.nn.parallel.DistributedDataParallel)
    while isinstance(model, wrappers):
        done.append(f"unwrapped from {type(model).__name__}")
        model = model.module
    devices = sorted({str(t.device) for t in (*model.parameters(), *model.buffers())
                      if t.device.type != "cpu"})
    if devices:
        model = model.cpu()
        done.append(f"moved from {', '.join(devices)} to the CPU")
    if not done:
        return model, ""
    return model, (f"the model was {' and '.join(done)}: fit places it on every replica's device "
                   "itself, so pass it as built (a factory, or a model on the CPU)")


class OneCycleTrainer:
    """Train ``model`` with the one-cycle policy on all TPU cores.

    Args:
        model: An ``nn.Module`` or a zero-argument factory returning one. It is created
            once, here in the calling process (seeded with ``seed``), and every
            replica starts from exactly these weights. One wrapped in ``nn.DataParallel`` /
            ``DistributedDataParallel`` is unwrapped and one on a GPU moved to the CPU (the
            first fit's first line says so): ``fit`` places the model itself.
        loss: ``loss(outputs, targets) -> scalar`` (e.g. ``nn.CrossEntropyLoss()``;
            ``nn.BCEWithLogitsLoss()`` for multi-label). Validation uses its
            per-sample form (``reduction="none"``) when it has one.
        train_data, val_data: A :class:`~xla_utils.data.CachedImageDataset` (uint8 batches,
            normalised and flipped on the device) or any map-style dataset returning ``(input,
            target)``: uint8 images ``[H, W, C]`` or ``[C, H, W]`` (``read_image``,
            ``PILToTensor``, ``tv_tensors.Image``) are normalised and flipped on the device
            too, PIL images are converted on the host, other numeric inputs go to the model
            unchanged (decided once per dataset from its first sample, see
            :func:`xla_utils.step.inputs.inspect_inputs`); other samples are refused before any
            device time.
        train_step: Optional hook ``train_step(model, (x, y), loss) -> loss tensor`` for
            other problem types. ``eval_step(model, (x, y)) -> outputs`` likewise.
        **config: Any option of :class:`TrainerConfig` (batch_size, epochs, max_lr, ...),
            flat: each goes to its group (``self.config.schedule.max_lr``; docs/TRAINER.md's
            table). An unknown one is refused with the nearest name and its group.
    """

    def __init__(self, model: torch.nn.Module | Callable[[], torch.nn.Module], loss: Callable,
                 train_data, val_data=None, *, train_step: Callable | None = None,
                 eval_step: Callable | None = None, **config: Any):
        check_option_names("OneCycleTrainer()", config)
        self.config = TrainerConfig(**config)
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
        self.model, self._model_note = _host_model(self.model)
        self.loss = loss
        self.train_data = train_data
        self.val_data = val_data
        self.train_step = train_step or default_train_step
        self.eval_step = eval_step or default_eval_step
        self.lr_finder_result = None
        self._from_factory = not isinstance(model, torch.nn.Module)
        self._epochs_trained = 0  # epochs earlier fit() calls put into self.model
        self.ema_state: dict[str, torch.Tensor] | None = None  # EMA weights of the last fit
        # Layer-group LRs of later fits (trainable parameters only), set by freeze().
        self._lr_groups: Callable[..., Any] | None = None
        # Without a TPU, XLA runs only on simulated cores: start their interpreter now,
        # so that the first fit/predict/evaluate(simulate=N) does not wait for it.
        runtime.prestart_if_simulation_likely()

    # ------------------------------------------------------------------ API
    def find_lr(self, simulate: int | None = None, *, on_mesh: bool | None = None,
                tpu: Any = None, cores: int | str = "all", **kwargs: Any):
        """Run :func:`xla_utils.lr_find` with this trainer's model, loss, data, batch size,
        optimizer and image normalisation; the result is also kept in
        ``self.lr_finder_result``. Extra keywords go to ``lr_find``.

        ``"spawn"``: one core, per-core batch (``accum_steps=8`` answers for 8 cores).
        ``"spmd"``/``"fsdp"``: for the fit's global batch, on one core (micro-batches
        accumulated) or, when one core of the target TPU cannot hold the model
        (:func:`xla_utils.train.mesh_tasks.sweep_placement`) or when asked, on the mesh; a line
        and ``result.placement`` say which and why. Runs in another process: this
        trainer's model, optimizer and RNGs are untouched.

        Args:
            simulate: N simulated XLA:CPU devices (the one-core sweep uses one of them, a
                mesh run all N); default None (this TPU).
            on_mesh: True: sweep on the mesh; False: on one core; None (default): the
                config's ``lr_find_on_mesh`` (None there: automatic).
            tpu: The target TPU of the automatic choice, as in :meth:`check` (a name such
                as ``"v5e"`` or a :class:`~xla_utils.diagnostics.readiness.TPUChip`); default this
                machine's TPU, else v5e.
            cores: The fit's ``cores`` the answer is for (mesh strategies): ``"all"``
                (default) or 1.
        """
        placement = runtime.resolve(cores, simulate)
        self.lr_finder_result = _mesh_tasks.find_lr(self, placement, on_mesh, tpu, kwargs)
        return self.lr_finder_result

    def fine_tune(self, epochs: int, freeze_epochs: int = 1, **kwargs: Any) -> History:
        """fastai's recipe: the head with the body frozen for ``freeze_epochs``, then
        everything for ``epochs`` with discriminative LRs; see
        :func:`xla_utils.train.finetune.fine_tune` for every argument."""
        from .finetune import fine_tune
        return fine_tune(self, epochs, freeze_epochs, **kwargs)

    def freeze(self, head: Any = None, train_bn: bool = True) -> list[str]:
        """Freeze all but the head (normalisation layers stay trainable with ``train_bn``;
        :func:`xla_utils.train.finetune.freeze`); later :meth:`fit` calls give the optimizer the
        trainable parameters only. Returns the head's names."""
        from .finetune import freeze, layer_group_lrs

        heads = freeze(self.model, head, train_bn)
        self._lr_groups = layer_group_lrs([[n for n, _ in self.model.named_parameters()]], [1.0])
        return heads

    def unfreeze(self) -> None:
        """Train every parameter again, at one LR (:func:`xla_utils.train.finetune.unfreeze`)."""
        from .finetune import unfreeze

        unfreeze(self.model)
        self._lr_groups = None

    @keyword_help
    def debug(self, steps: int = 5, simulate: int | None = None) -> DebugReport:
        """Run a few of the trainer's steps on ONE core and explain what XLA did.

        :func:`xla_utils.diagnostics.debug.debug_run` with this trainer's data, per-core batch size,
        ``eval_step`` and its own step as :meth:`fit` runs it (:mod:`xla_utils.train.steps`:
        optimizer with the one-cycle LR and momentum, accumulation, bf16, EMA, mixing);
        labels are checked first. It runs in a forked child, so :meth:`fit` can launch all
        cores afterwards. Under ``strategy="spmd"``/``"fsdp"`` the same steps run as
        the mesh run (``report.devices``, ``report.strategy``).

        Args:
            steps: Steps to run (default 5: 2 to warm up, the rest must not compile).
            simulate: Mesh strategies only: N simulated XLA:CPU devices; default None:
                this TPU's devices, else 8 simulated ones.

        Returns:
            The :class:`~xla_utils.diagnostics.debug.DebugReport`, printed once (as :meth:`check`).
        """
        placement = None if self.config.strategy == "spawn" else runtime.resolve(
            simulate=8 if simulate is None and not runtime.tpu_present() else simulate)
        return self._debug(self._check_inputs()["train"], steps, placement)

    def _debug(self, train: tuple[Any, InputSpec], steps: int,
               placement: runtime.Placement | None) -> DebugReport:
        """:meth:`debug` on ``placement``'s mesh (None: ``"spawn"``, one core)."""
        cfg, spec = self.config, train[1]
        plan = (None if placement is None else
                _strategy.plan_strategy(cfg.devices, cfg.batch_size, self.model, placement))
        return debug_run(self.model, self.loss, self.train_data, batch_size=cfg.batch_size,
                         steps=steps, optimizer=cfg.optimizer, train_step=self.train_step,
                         prepare=self._prepare(spec, train=False), eval_step=self.eval_step,
                         inputs=spec, mesh=plan, make_step=self._step_plan(train),
                         precision=cfg.precision, channels_last=cfg.channels_last)

    def _step_plan(self, train: tuple[Any, InputSpec]) -> TrainerStepPlan:
        """This trainer's step as ``fit`` runs it, for check() and debug() (:mod:`xla_utils.train.steps`)."""
        return TrainerStepPlan(self.config, train[0], self.train_step, self.loss, train[1],
                               self._mix_config(train), self._lr_groups)

    @keyword_help
    def fit(self, *, cores: int | str = "all", simulate: int | None = None,
            max_lr: float | str | None = None, resume: str | os.PathLike | None = None,
            debug: bool = False, timeout: float | None = None, check: bool = False,
            epochs: int | None = None, pct_start: float | None = None,
            div_factor: float | None = None, final_div_factor: float | None = None,
            lr_scaling: str | None = None, moms: tuple[float, float, float] | None = None,
            lr_groups: Callable[[torch.nn.Module], list[dict[str, Any]]] | None = None,
            checkpoint_extra: dict[str, Any] | None = None, warn_if_trained: bool = True,
            compile: bool | str | None = None, time_limit: float | str | None = None,
            run_id: str | None = None) -> "History | DebugReport":
        """Train on all cores (``cores="all"``) or one (``cores=1``).

        Labels are checked against the model's output width and the dataset's classes
        before anything runs. ``self.model`` receives the weights only after the run: the
        final ones, or after a stop on a non-finite loss (``on_nan="stop"``) those of the
        last epoch that ended finite. The schedule group's fields override the configured
        ones for this run only (fastai's ``fit_one_cycle(n_epoch, pct_start=...)``).

        Args:
            cores: ``"all"`` (default) or 1.
            simulate: Run N simulated XLA:CPU cores (no TPU needed); default None.
            max_lr: Overrides the configured one (``"find"`` runs the LR finder
                first); default None: the configured ``max_lr``.
            resume: Continue an earlier run exactly at its next epoch (an in-epoch checkpoint:
                at its step): a checkpoint file, a folder (its newest good ``epoch_*.pt``) or
                ``"last"`` (the newest in ``checkpoint_dir``). Its configuration is compared
                with this run's (with the overrides below) first: anything the schedule or
                optimizer state depends on (optimizer, batch size, epochs, cores, ...) must match. The run
                keeps the checkpoint's max_lr (as given to or found for it); a different
                ``max_lr`` given here is refused. It goes on as the same run (its run id, its
                epoch numbers: ``Epoch 4/6``). A checkpoint of the run's last epoch is a
                complete run: ``fit`` says so and returns its history, writing no file.
            debug: Deprecated: use :meth:`debug` (returns its report instead of training).
            timeout: Seconds after which the replicas are killed (default none).
            check: First run :meth:`check` and print its report; default False.
            epochs, pct_start, div_factor, final_div_factor, lr_scaling, moms: This run's
                :class:`~xla_utils.train.config.ScheduleSettings` (default None: configured).
            lr_groups: ``lr_groups(model) -> param-group dicts`` (each with ``lr_mult``, the
                group's share of the scheduled LR) for discriminative LRs and frozen layers
                (:func:`xla_utils.train.finetune.layer_group_lrs`); default None: every parameter
                at one LR (after :meth:`freeze`, the trainable ones).
            checkpoint_extra: Fields every epoch checkpoint of this run records beside its
                state (``fine_tune`` records its phase); default None.
            warn_if_trained: Warn when an earlier fit trained this model and this run starts a
                new schedule from its weights (default True; ``fine_tune``'s phases: False).
            compile: This run's ``TrainerConfig.compile`` (default None: the configured one).
            time_limit: Stop in time (``"2h30min"``, ``"auto"``; default None); see docs/TRAINER.md
                "Long runs and session limits" (and SIGTERM/SIGINT: ``KeyboardInterrupt``).
            run_id: Names the epoch files (default None: new; not with ``resume``);
                ``<run>+<phase>`` is a phase of ``<run>`` (fine_tune's): one run for keep_runs.

        Returns:
            The run's :class:`History`.

        Raises:
            ResumeError: ``resume`` cannot continue exactly; lists every difference.
            CheckpointError: A corrupt checkpoint; names the newest good one beside it.
            ~xla_utils.diagnostics.readiness.ReadinessError: ``check=True`` found errors (before any
                training or TPU time; warnings only print).
            ValueError: Labels outside the model's outputs, unlabelled data, a training set
                smaller than one global batch, a bad schedule override or ``compile=``.
            ~xla_utils.step.inputs.InputRefused: A sample the trainer cannot feed (a ``TypeError``
                naming its type, shape, dtype and the fix).
        """
        placement = runtime.resolve(cores, simulate)
        cfg = self._run_config(placement, epochs=epochs, max_lr=max_lr, pct_start=pct_start,
                               div_factor=div_factor, final_div_factor=final_div_factor,
                               lr_scaling=lr_scaling, moms=moms, compile=compile)
        max_lr = None if max_lr is None else cfg.schedule.max_lr  # as read (strip, lower)
        deadline = run_deadline(time_limit, cfg.checkpoint_dir, platform_name())
        runtime.prestart_simulation(placement)
        device_plan.check_before_launch(cfg.precision, placement, mesh=cfg.strategy != "spawn")
        inputs = self._check_inputs()
        if check and (report := self.check()).errors:
            raise ReadinessError(report)
        if debug:
            return self._fit_debug(cfg, inputs["train"])
        fit_plan, plan = self._plan_fit(cfg, inputs, placement, max_lr, resume, lr_groups,
                                        checkpoint_extra, warn_if_trained, run_id)
        return self._run_fit(fit_plan, plan, placement, timeout, deadline)

    def _run_fit(self, fit_plan: FitPlan, plan: _strategy.StrategyPlan | None,
                 placement: runtime.Placement, timeout: float | None,
                 deadline: float | None) -> History:
        """Launch ``fit_plan`` with its :class:`~xla_utils.train.session.StopPlan` (the
        ``deadline``, ``checkpoint_every``, this process's SIGTERM/SIGINT caught meanwhile:
        :func:`~xla_utils.train.session.stop_signals`), take its result and warn with its
        warnings; raise ``KeyboardInterrupt`` after a signal's checkpoint."""
        every = checkpoint_interval(fit_plan.config.checkpoint_every, platform_name())
        with stop_signals() as signals:
            fit_plan.stop = StopPlan(deadline=deadline, every_steps=every[0], every_s=every[1],
                                     stop_file=signals.path, caller_pid=os.getpid())
            out = self._launch_fit(fit_plan, plan, placement, timeout)
        self._take_result(out, resumed=fit_plan.ckpt is not None)
        for w in out.warnings:
            warnings.warn(w, RuntimeWarning, stacklevel=4)  # fit's caller: past keyword_help
        if (out.stop_reason or "").startswith("stopped by "):  # a signal: after its checkpoint
            raise KeyboardInterrupt(out.stop_reason)
        if signals.received is not None:
            raise KeyboardInterrupt(f"{signals.received} arrived as the run ended; it is complete")
        return out

    def _fit_debug(self, cfg: TrainerConfig, train: tuple) -> DebugReport:
        """``fit(debug=True)`` (deprecated): :meth:`debug`'s report, on 8 simulated devices
        under a mesh strategy when there is no TPU."""
        deprecated("fit(debug=True)", "trainer.debug(), which returns the same DebugReport")
        return self._debug(train, 5, None if cfg.strategy == "spawn" else
                           runtime.resolve(simulate=None if runtime.tpu_present() else 8))

    @staticmethod
    def _launch_fit(fit_plan: FitPlan, plan: _strategy.StrategyPlan | None,
                    placement: runtime.Placement, timeout: float | None) -> History:
        """Run ``fit_plan`` on every core (``"spawn"``) or on the strategy's mesh; a complete
        run (its checkpoint holds the last epoch) runs nothing: its history, as saved."""
        if fit_plan.ckpt is not None and fit_plan.ckpt["epoch"] >= fit_plan.config.epochs:
            return completed_run(fit_plan)  # said so by _plan_fit: no launch, no file written
        if plan is None:
            return runtime.launch_job(fit_replica, (fit_plan,), placement=placement,
                                      timeout=timeout, sim_threads=True)
        return _strategy.launch(fit_on_mesh, (fit_plan,), plan, timeout)

    def _take_result(self, out: History, resumed: bool) -> None:
        """The trainer's model and EMA weights after a fit run (``out``), and the epochs its
        model has been trained for (a resumed run's history counts from the first epoch)."""
        if out.state_dict:  # empty when no epoch of this fit ended with finite weights
            self.model.load_state_dict(out.state_dict)
            self._epochs_trained = len(out.epochs) + (0 if resumed else self._epochs_trained)
            self.ema_state = out.ema_state_dict or None

    def _run_config(self, placement: runtime.Placement, **overrides: Any) -> TrainerConfig:
        """This fit run's configuration: ``self.config`` with ``fit``'s schedule overrides
        (None: the configured value), checked by the schedule group before any device time, and
        its ``compile=`` (the devices group's), refused on XLA (``placement`` is the run's)."""
        given = {k: v for k, v in overrides.items() if v is not None}
        cfg = self.config
        if given:
            try:
                cfg = self.config.replace(**given)
            except (TypeError, ValueError) as exc:
                args = ", ".join(f"{k}={v!r}" for k, v in given.items())
                raise ValueError(f"fit({args}): {exc}") from None
        self._refuse_compile(cfg.compile, placement)  # issue 45
        return cfg

    def _plan_fit(self, cfg: TrainerConfig, inputs: dict[str, tuple[Any, InputSpec] | None],
                  placement: runtime.Placement, max_lr: float | str | None,
                  resume: str | os.PathLike | None, lr_groups: Callable[..., Any] | None,
                  checkpoint_extra: dict[str, Any] | None, warn_if_trained: bool,
                  run_id: str | None = None) -> tuple[FitPlan, _strategy.StrategyPlan | None]:
        """Every check and decision of a fit run, here on the host before any device time:
        the replicas' :class:`~xla_utils.train.replica_loops.FitPlan` and the mesh plan (None
        under ``"spawn"``)."""
        _check_plan_args(lr_groups, checkpoint_extra, run_id, resume)
        cfg, mirror = staged(cfg)  # checkpoint_dir at a URL: its local folder, pulled
        check_monitor_data(cfg.monitor, self._check_metrics(cfg, inputs["val"], "val_data"),
                           self.val_data is not None)
        world = placement.replicas
        check_batches(self.train_data, cfg.batch_size, world * cfg.accum_steps)
        mix = self._mix_config(inputs["train"])
        plan = None
        if cfg.strategy != "spawn":
            plan = _strategy.plan_strategy(cfg.devices, cfg.batch_size, self.model, placement)
        ckpt, run_id = None, runtime.same_everywhere(run_id or new_run_id(), placement)
        if resume is not None:
            path, ckpt = resume_on_every_host(resume, cfg.checkpoint_dir, placement)
            # On a TPU the world is detected, not known (pod slices span hosts):
            # the replica compares cores and steps per epoch there.
            exact = placement.world_known
            print(check_resume(path, ckpt, cfg, self.model, max_lr, world if exact else None,
                               len(self.train_data) // (cfg.batch_size * world) // cfg.accum_steps),
                  flush=True)
            base_lr, lr_world = ckpt["base_lr"], ckpt.get("lr_world", 1)
            run_id = ckpt.get("run_id") or run_id  # the same run goes on (its files, keep_runs)
        else:
            base_lr, lr_world = self._new_run_lr(cfg, max_lr, placement, warn_if_trained)
        if not (isinstance(base_lr, (int, float)) and base_lr > 0):
            raise ValueError(f"max_lr must be a positive number or 'find', got {base_lr!r}")
        if ckpt is None or ckpt["epoch"] < cfg.epochs:  # a complete run trains nothing
            earlier_runs_note(cfg.checkpoint_dir, cfg.keep_runs, show=True, current=run_id)
        lr_groups = self._lr_groups if lr_groups is None else lr_groups
        note, self._model_note = self._model_note, ""  # said once, in the first run's first line
        return FitPlan(model=self.model, loss=self.loss, config=cfg, train_step=self.train_step,
                       eval_step=self.eval_step, inputs=inputs, base_lr=float(base_lr),
                       lr_world=lr_world, ckpt=ckpt, run_id=run_id, mix=mix, lr_groups=lr_groups,
                       ckpt_extra=checkpoint_extra, note=note, mirror=mirror), plan

    def _check_metrics(self, cfg: TrainerConfig, val: tuple[Any, InputSpec] | None,
                       name: str) -> tuple[str, ...] | None:
        """The run's validation metrics for ``val`` (``(data as the loader collates it, its
        InputSpec)``), each tried on a sample of its targets and made-up predictions of the
        model's width, here on the host (:func:`xla_utils.train.metrics.check_metrics`); None
        without ``val``, or when neither metrics nor a metric monitor were configured (nothing
        to check)."""
        if val is None or (cfg.metrics is None and cfg.monitor in (None, *LOSS_MONITORS)):
            return None
        fed, spec = val
        targets, _ = targets_of(fed)
        width = output_width(self.model, fed, self._prepare(spec, train=False), self.eval_step)
        return check_metrics(cfg.metrics, targets=targets, width=width, loss_fn=self.loss,
                             where=name)

    def _mix_config(self, train: tuple[Any, InputSpec]) -> MixConfig | None:
        """The fit run's :class:`~xla_utils.train.mixup.MixConfig` (None: no mixing or smoothing)
        for the checked training data ``train`` (``_check_inputs()["train"]``)."""
        return mix_config_for(self.config.augment, self.loss, self.model, *train,
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
                spec, _ = self._plan_targets(data, spec, name)
                fed = spec.feed(data)
                if name == "train_data":  # the augmentation hooks keep the batch's shapes
                    check_transform(fed, self.config.transform, name)
                    check_batch_transform(self.config.batch_transform, fed,
                                          self._prepare(spec, train=True))
                out[name[:-5]] = (fed, spec)
        return out

    def _plan_targets(self, data, spec: InputSpec, name: str) -> tuple[InputSpec, TargetPlan]:
        """:func:`~xla_utils.step.inputs.plan_targets` with this trainer's model and loss."""
        return plan_targets(self.model, self.loss, data, spec, name,
                            self._prepare(spec, train=False), self.eval_step)

    @property
    def task(self) -> str | None:
        """The problem the training data and the loss make, found on the host (one CPU
        forward of two samples): ``"multiclass"``, ``"multilabel"``, ``"binary"`` (two
        classes, a one-output model, ``BCEWithLogitsLoss``), ``"regression"`` (a regression
        cache, or an MSE/L1/Huber/SmoothL1 loss), or None when the targets do not say.
        It decides :meth:`predict`'s ``activation="auto"`` and what
        :func:`~xla_utils.train.submission.write_submission` writes."""
        if self.train_data is None:
            return None
        spec = self._inspect(self.train_data, "train_data", "training", need_target=False)
        return self._plan_targets(self.train_data, spec, "train_data")[1].kind

    def _inspect(self, data, name: str, verb: str, need_target: bool = True) -> InputSpec:
        """``data``'s :class:`~xla_utils.step.inputs.InputSpec` (its samples refused here, on the
        host, when the trainer cannot feed them)."""
        return inspect_inputs(data, name, need_target=need_target, verb=verb, mean=self.config.mean)

    def _new_run_lr(self, cfg: TrainerConfig, max_lr: float | str | None,
                    placement: runtime.Placement, warn_if_trained: bool = True
                    ) -> tuple[float | str, int]:
        """``(base_lr, lr_world)`` of a run (configured as ``cfg``) that does not resume: the
        configured or given ``max_lr`` for one core, or ``lr_find``'s answer for the
        ``placement``'s world of cores."""
        base_lr = cfg.max_lr if max_lr is None else max_lr
        if self._epochs_trained and warn_if_trained:
            warnings.warn(
                f"this trainer's model was already trained by an earlier fit() "
                f"({self._epochs_trained} epoch(s)); this fit starts a new one-cycle schedule "
                "from those trained weights"
                + (" (the model factory is called once, in OneCycleTrainer(...), not per fit)"
                   if self._from_factory else "")
                + ". For a fresh start create a new OneCycleTrainer; to continue a run "
                "exactly use fit(resume=<checkpoint>).", UserWarning, stacklevel=5)
        if base_lr != "find":
            return base_lr, 1
        if placement.kind == "tpu" and placement.hosts > 1:  # no channel between the hosts yet
            raise ValueError(
                f"max_lr='find' on host {placement.host} of a {placement.hosts}-host TPU pod slice: "
                "each host would sweep on its own and might pick another LR. Fix: find it once "
                "(on one host, or in the rehearsal: python -m xla_utils.simulate --hosts "
                f"{placement.hosts} ...) and pass max_lr=<that number> on every host")
        # Measure at the run's own global batch: k accumulated micro-batches of the per-core
        # batch are exactly one k-core step's gradient (a mesh strategy's find_lr does this
        # itself, or sweeps on the mesh): no scaling rule on top of the finder's rule.
        world = placement.replicas
        extra = dict(accum_steps=world * cfg.accum_steps) if cfg.strategy == "spawn" else {}
        res = self.lr_finder_result = _mesh_tasks.find_lr(
            self, placement, None, None,
            dict(epochs=cfg.epochs, max_share=FIT_SHARE, run_cores=world, **extra))
        base_lr = res.suggestion
        if not math.isfinite(base_lr):
            raise RuntimeError(f"lr_find gave no suggestion (stopped: {res.stop_reason}); pass "
                               "max_lr=<number> or look at trainer.lr_finder_result.plot()")
        print(res.summary(), flush=True)  # says whether it is confident, and why not
        return base_lr, world * cfg.accum_steps

    @keyword_help
    def predict(self, data, tta: int = 1, cores: int | str = "all", simulate: int | None = None,
                batch_size: int | None = None, activation: str | None = "auto",
                weights: str | os.PathLike | None = None,
                compile: bool | str | None = None) -> np.ndarray:
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
            activation: ``"auto"`` (default), by :attr:`task`: none for regression (the
                model's raw outputs), sigmoid for a one-logit binary model (column 0 is the
                positive class's probability) or multi-label data (``train_data.multilabel``,
                or a ``BCEWithLogitsLoss``), softmax otherwise. ``"softmax"``,
                ``"sigmoid"`` or ``None`` (raw model outputs) choose.
            weights: a checkpoint to use instead of the trainer's current weights:
                ``final.pt`` (a state dict) or an ``epoch_<nnn>-<run id>.pt`` of :meth:`fit`.
                ``self.model`` is not changed.
            compile: ``torch.compile`` of the model for this call (as
                ``TrainerConfig.compile``; on CUDA ``True`` is mode ``"reduce-overhead"``: every
                batch has one shape); default None: the configured one.

        Returns:
            ``float32[N, num_outputs]`` in dataset order: every item exactly once,
            gathered from all cores (images a cache's build skipped have none: named first).
            A one-logit binary model gives ``[N, 1]`` (the positive class's probability),
            a regression model ``[N, k]`` (its raw outputs).

        Raises:
            ValueError: before any device time, when the images of ``data`` have
                another shape than the training data's (a test cache built at another
                size), ``tta`` exceeds the views ``data`` offers, or ``weights`` does
                not fit the model.
            ~xla_utils.step.inputs.InputRefused: before any device time, a sample the
                trainer cannot feed (its type, shape and dtype named, with the fix).
        """
        placement = runtime.resolve(cores, simulate)
        self._refuse_before_launch(compile, placement)
        runtime.prestart_simulation(placement)
        plan = self._inference_plan(data, tta, batch_size, activation, weights, labelled=False)
        missing_note(data, show=True)  # images the cache build skipped get no row
        return self._launch_inference(plan, placement, compile)

    @keyword_help
    def evaluate(self, data, tta: int = 1, cores: int | str = "all", simulate: int | None = None,
                 batch_size: int | None = None, compile: bool | str | None = None
                 ) -> dict[str, float]:
        """Validation metrics of the current model on a labelled dataset, on all cores.

        Returns the dict :meth:`fit` reports per epoch: ``loss``, the configured
        metrics (``TrainerConfig.metrics``, each tried on a sample of ``data`` first; None:
        the task's defaults) and ``samples`` (every item counted once). ``tta``, ``cores``, ``simulate``, ``batch_size`` and ``compile`` are
        as in :meth:`predict`. With ``tta=k > 1`` the metrics are those of the averaged
        probabilities (exactly what :meth:`predict` returns): the loss receives
        ``log(mean softmax)`` (single-label) or ``logit(mean sigmoid)`` (multi-label),
        which makes ``CrossEntropyLoss`` / ``BCEWithLogitsLoss`` the loss of the
        averaged prediction.
        """
        require_labels(data, "data", action="evaluate")
        placement = runtime.resolve(cores, simulate)
        self._refuse_before_launch(compile, placement)
        runtime.prestart_simulation(placement)
        activation = "auto" if isinstance(tta, int) and tta > 1 else None
        plan = self._inference_plan(data, tta, batch_size, activation, None, labelled=True)
        return self._launch_inference(plan, placement, compile)

    def _launch_inference(self, plan: inference.InferencePlan, placement: runtime.Placement,
                          compile: bool | str | None = None) -> Any:
        """Run ``plan`` on every core of ``placement`` (``"spawn"``) or on the strategy's mesh."""
        if compile is not None:  # this call's compile= (issue 45), checked as the config's
            plan = dataclasses.replace(plan, config=dataclasses.replace(self.config,
                                                                        compile=compile))
        if self.config.strategy == "spawn":
            return live_or_launch(self, inference_replica, (plan,), placement)
        splan = _strategy.plan_strategy(self.config.devices, self.config.batch_size, self.model,
                                        placement)
        return _strategy.launch(inference_on_mesh, (plan,), splan, None)

    def _refuse_before_launch(self, compile: bool | str | None,
                              placement: runtime.Placement) -> None:
        """What ``predict``/``evaluate`` refuse before anything else (no forward on the host,
        no device time): ``compile=`` on XLA, a precision ``placement`` cannot run."""
        self._refuse_compile(compile, placement)  # issue 45
        device_plan.check_before_launch(self.config.precision, placement,
                                        mesh=self.config.strategy != "spawn")

    def _refuse_compile(self, compile: bool | str | None, placement: runtime.Placement) -> None:
        """A run's ``compile=`` (None: the configured one), refused on XLA."""
        value = self.config.compile if compile is None else check_compile_option(compile)
        refuse_on_xla(value, placement, mesh=self.config.strategy != "spawn")

    # ------------------------------------------------------------- inference
    def _inference_plan(self, data, tta, batch_size, activation, weights, labelled: bool
                        ) -> inference.InferencePlan:
        """Every check that can fail, done here in the calling process (no device time)."""
        if data is None or len(data) == 0:
            raise ValueError("data is empty: nothing to predict")
        bs = self.config.batch_size if batch_size is None else batch_size
        if not isinstance(bs, int) or bs < 1:
            raise ValueError(f"batch_size must be a positive int (per core), got {batch_size!r}")
        activation = choice(activation, ("auto", "softmax", "sigmoid"), "activation", "None")
        if activation is not None and not isinstance(activation, str):
            raise ValueError(f"activation must be 'auto', 'softmax', 'sigmoid' or None, got {activation!r}")
        if activation == "auto":
            activation = self._auto_activation()
        spec = self._inspect(data, "data", "evaluate", need_target=labelled)
        if labelled:  # targets fed as fit feeds them (float32 for regression, one-logit binary)
            spec, _ = self._plan_targets(data, spec, "data")
        if self.train_data is not None:
            why = shape_mismatch(data, spec, self.train_data,
                                 self._inspect(self.train_data, "train_data", "training",
                                               need_target=False))
            if why is not None:
                raise ValueError(why)
        views = inference.tta_views(data, tta, spec.shape, self.config.flip)
        if labelled:  # the metrics, tried on a sample before any device time
            self._check_metrics(self.config, (spec.feed(data), spec), "data")
        model = (with_weights(self.model, self.ema_state) if weights is None
                 else model_with_weights(self.model, weights))
        fed = spec.feed(data)
        return inference.InferencePlan(data=fed if isinstance(data, CachedImageDataset) else AsPairs(fed),
                                  inputs=spec, n=len(data), views=views, batch_size=bs,
                                  activation=activation, model=model, labelled=labelled, tta=tta,
                                  config=self.config, eval_step=self.eval_step, loss=self.loss)

    def _auto_activation(self) -> str | None:
        """``activation="auto"``: none for regression (raw outputs), sigmoid for one-logit
        binary and multi-label (a BCE loss or multi-label data), softmax otherwise."""
        try:
            task = self.task
        except ValueError:  # labels fit would refuse: predict still follows the loss
            task = None
        if task == "regression":
            return None
        if task in ("binary", "multilabel") or training_multilabel(self):
            return "sigmoid"
        return "softmax"

    @keyword_help
    def check(self, *, steps: int = 4, tpu: str | None = None, measure_loader: bool = True,
              timeout: float | None = None, devices: int | None = None
              ) -> "ReadinessReport | DeviceCheckReport":
        """Check this trainer's own step as :meth:`fit` runs it (as :meth:`debug`), for the
        device this notebook trains on and for a TPU; print each report, titled by its device.

        * Without a TPU, on the torch backend (GPUs, ``XLA_UTILS_CPU_REPLICAS``, or the CPU
          without torch_xla):
          :func:`xla_utils.diagnostics.device_check.check_device`: the step as ``fit`` feeds it
          against the no-loader ceiling, the loader's speed, the precision and layout chosen,
          host reads per step, memory headroom on CUDA.
        * With torch_xla (or on a TPU): :func:`xla_utils.check` of the step on the first
          ``batch_size`` batch of ``train_data`` (the TPU readiness report: recompiles, host
          syncs, padding, memory against the chip, ...). ``measure_loader`` (default True)
          compares the loader's samples/s with the TPU's step rate; ``tpu`` as in
          :func:`xla_utils.check` (default this TPU, else v5e). Under ``"spmd"``/``"fsdp"``
          the sharded step also runs on ``devices`` devices (default: the slice ``tpu``
          names, else 8): :func:`xla_utils.train.mesh_tasks.check_on_mesh`. Without
          torch_xla this part is skipped with one line saying how to get it
          (``xla_utils.setup(install=True)``).

        Returns:
            The TPU :class:`~xla_utils.diagnostics.readiness.ReadinessReport` when it ran (its
            ``device_check`` holds the device's report, if one ran), else the
            :class:`~xla_utils.diagnostics.device_check.DeviceCheckReport`.
        """
        cfg = self.config
        spec = self._inspect(self.train_data, "train_data", "training")
        spec, _ = self._plan_targets(self.train_data, spec, "train_data")
        data = spec.feed(self.train_data)
        if len(data) < cfg.batch_size:
            raise ValueError(f"train_data has fewer than batch_size={cfg.batch_size} samples")
        step = self._step_plan((data, spec))
        device = None
        if self._trains_on_torch():
            from ..diagnostics.device_check import check_device

            device = check_device(self.model, step, data, batch_size=cfg.batch_size,
                                  replicas=runtime.resolve().replicas,
                                  steps=steps, timeout=timeout)
            print(device.report, flush=True)
            if cfg.compile:  # issue 45: where dynamo breaks the model's forward, and why
                x = next(iter(iterate_batches(data, min(cfg.batch_size, 2), shuffle=False,
                                                num_workers=0)))[0]
                print(graph_breaks_report(self.model, self._prepare(spec, train=False)(x)),
                      flush=True)
        if device is not None and not runtime.xla_installed():
            print("xla_utils.check for a TPU: skipped, torch_xla is not installed here "
                  "(xla_utils.setup(install=True) installs the one that pairs with this torch; "
                  "then trainer.check() answers for a TPU too)", flush=True)
            return device
        report = self._check_tpu(data, spec, step, steps, tpu, measure_loader, timeout, devices)
        report.device_check = device
        print(report.report, flush=True)
        return report

    def _trains_on_torch(self) -> bool:
        """Whether this notebook's ``fit()`` trains on the torch backend (so :meth:`check`
        reports on its device): no TPU, ``strategy="spawn"``, and GPUs, torch replicas
        (``XLA_UTILS_CPU_REPLICAS``) or no torch_xla; a CPU notebook with torch_xla rehearses
        a TPU run on simulated cores instead."""
        if runtime.tpu_present() or self.config.strategy != "spawn":
            return False
        devs = runtime.torch_devices()
        return not runtime.xla_installed() or devs.kind == "cuda" or devs.count > 1

    def _check_tpu(self, data: Any, spec: InputSpec, step: TrainerStepPlan, steps: int,
                   tpu: str | None, measure_loader: bool, timeout: float | None,
                   devices: int | None) -> "ReadinessReport":
        """The TPU readiness report of :meth:`check` (not printed)."""
        from ..diagnostics.readiness import check as readiness_check

        cfg = self.config
        x, y, _ = next(iter(iterate_batches(data, cfg.batch_size, shuffle=False, drop_last=True,
                                            num_workers=0)))
        loader = (iterate_batches(data, cfg.batch_size, seed=cfg.seed,
                                  num_workers=cfg.num_workers) if measure_loader else None)
        report = readiness_check(self.model, (x.clone(), y.clone()), loss=self.loss,
                                 optimizer=cfg.optimizer, steps=steps, data=loader, tpu=tpu,
                                 prepare=self._prepare(spec, train=True),
                                 train_step=self.train_step, bf16=cfg.precision == "bf16",
                                 timeout=timeout,
                                 inputs=spec.describe(flip=cfg.flip),
                                 compile_cache=cfg.compile_cache, make_step=step,
                                 print_report=False)
        if cfg.strategy != "spawn":
            _mesh_tasks.check_on_mesh(self, report, spec=spec, steps=steps, tpu=tpu,
                                      devices=devices, make_step=step)
        return report

    def eval_weights(self) -> dict[str, torch.Tensor]:
        """The weights ``evaluate``/``predict`` use: the last fit's EMA weights when
        ``ema`` is set, else ``self.model``'s."""
        return self.ema_state or self.model.state_dict()

    def _prepare(self, spec: InputSpec, train: bool) -> Callable[[torch.Tensor], torch.Tensor]:
        """``x -> model input`` for batches of a dataset described by ``spec``."""
        return loop.input_preparer(self.config.data, spec, train)

