"""The trainer's own step, as :func:`xla_utils.check` and :func:`xla_utils.debug_run` measure
it for ``OneCycleTrainer.check()`` and ``debug()``.

:class:`TrainerStepPlan` is a step factory (see :mod:`xla_utils.step.plain`, whose
:class:`~xla_utils.step.plain.PlainStep` is their default): built on the host, called in the
child, where :func:`xla_utils.train.loop.set_up` builds the trainer's step and
:func:`xla_utils.train.loop.micro_step`, the function ``fit`` runs, runs it micro-batch by
micro-batch: the configured optimizer with the one-cycle LR and momentum set every step,
gradient accumulation, bf16 autocast, the device EMA and mixup/cutmix/label smoothing as
configured. So their recompile verdicts are ``fit``'s. The trainer passes it in: the
diagnostics never import the trainer.
"""
from __future__ import annotations

import contextlib
import io
from dataclasses import dataclass
from typing import Any, Callable

import torch

from . import loop
from .. import runtime
from ..step.optim import optimizer_label
from ..step.plain import optimizer_tensors

__all__ = ["TrainerStepPlan", "TrainerStep"]


@dataclass
class TrainerStepPlan:
    """The trainer's step, as a picklable step factory (built on the host by
    :class:`~xla_utils.train.trainer.OneCycleTrainer`, called in the child).

    Attributes:
        cfg: The trainer's :class:`~xla_utils.train.trainer.TrainerConfig`.
        train_data: The training data as the loader collates it (sets the schedule's
            steps per epoch, as in ``fit``).
        train_step, loss_fn: The trainer's ``train_step`` and loss.
        inputs: The training data's :class:`~xla_utils.step.inputs.InputSpec`.
        mix: The run's :class:`~xla_utils.train.mixup.MixConfig`, or None.
        lr_groups: The trainer's layer groups (:mod:`xla_utils.train.finetune`), or None.
    """

    cfg: Any
    train_data: Any
    train_step: Callable
    loss_fn: Callable
    inputs: Any
    mix: Any = None
    lr_groups: Callable | None = None

    @property
    def flip(self) -> bool:
        """Whether the step mirrors image batches (the trainer's ``flip``)."""
        return bool(self.cfg.flip)

    def __call__(self, module: torch.nn.Module, mesh: Any = None) -> "TrainerStep":
        cfg = self.cfg
        base_lr = cfg.max_lr if isinstance(cfg.max_lr, (int, float)) else 1e-3  # "find": any
        with contextlib.redirect_stdout(io.StringIO()):  # set_up's global-batch line is fit's
            s = loop.set_up(module, cfg, self.train_data, base_lr=base_lr, lr_world=1, ckpt=None,
                            mix=self.mix, lr_groups=self.lr_groups, strategy=mesh,
                            inputs=self.inputs)
        return TrainerStep(s, self)


class TrainerStep:
    """The stepper of a :class:`TrainerStepPlan`: ``fit``'s first epoch, micro-batch by
    micro-batch (:func:`xla_utils.train.loop.micro_step`), as a one-core run (or ``s.mesh``'s)."""

    def __init__(self, s: loop.Setup, plan: TrainerStepPlan) -> None:
        self.s, self.recipe = s, plan
        self.model, self.optimizer, self.accum_steps = s.model, s.opt, s.accum_steps
        self.plan = s.plan
        self.state = loop.TrainState(step=0, initial_loss=None)
        self.m = 0
        loop.begin_epoch(s, plan.cfg.data, 0)
        self.loss_sum = runtime.to_device(torch.zeros(()), s.device)  # as train_one_epoch's
        cfg = plan.cfg
        parts = [f"the trainer's: {optimizer_label(s.opt)}, one-cycle LR "
                 f"{s.sched.lr(0):.3g} -> {s.max_lr:.3g} and momentum set every step"]
        if s.accum_steps > 1:
            parts.append(f"{s.accum_steps} micro-batches accumulated")
        if s.plan.precision != "fp32":
            parts.append(f"{s.plan.precision} autocast")
        if s.ema is not None:
            parts.append(f"EMA {cfg.ema}")
        if s.mix is not None:
            parts.append("mixup/cutmix/label smoothing on the device")
        self.description = ", ".join(parts)

    def micro_batch(self, x: Any, y: Any) -> torch.Tensor:
        """The next micro-batch on the device batch ``(x, y)``; returns its loss (not synced)."""
        p = self.recipe
        loss, _ = loop.micro_step(self.s, self.state.step, self.m, x, y, data=p.cfg.data,
                                  train_step=p.train_step, loss_fn=p.loss_fn, inputs=p.inputs)
        self.loss_sum = self.loss_sum + loss.detach().float()
        self.m += 1
        if self.m % self.accum_steps == 0:
            self.state.step += 1
        return loss

    def tensors(self) -> list[torch.Tensor]:
        ema = [] if self.s.ema is None else list(self.s.ema.module.parameters())
        return (list(self.model.parameters()) + optimizer_tensors(self.optimizer) + ema
                + [self.loss_sum])
