"""The training step that :func:`xla_utils.check` and :func:`xla_utils.debug_run` measure.

Both run a step a few times and read XLA's counters after each. Which step:

* :class:`PlainStep` (their default): forward, backward and an optimizer step at a
  constant LR, one micro-batch per step.
* :class:`TrainerStepPlan` (what ``OneCycleTrainer.check()`` and ``debug()`` pass): the
  trainer's own step, built in the child by :func:`xla_utils.train.loop.set_up` and run
  micro-batch by micro-batch by :func:`xla_utils.train.loop.micro_step`, the function
  ``fit`` runs: the configured optimizer with the one-cycle LR and momentum set every
  step, gradient accumulation, bf16 autocast, the device EMA and mixup/cutmix/label
  smoothing as configured. So their recompile verdicts are ``fit``'s.

A *step factory* is called in the child with the host model and, on a mesh, the
:class:`~xla_utils.train.strategy.MeshRun`; it returns a *stepper*: ``model`` (on the
device), ``optimizer``, ``accum_steps``, ``description``, ``plan`` (its
:class:`~xla_utils.train.device_plan.DevicePlan`), ``micro_batch(x, y) -> loss``
(one micro-batch of a device batch, up to the step boundary: the caller calls
``runtime.sync()``) and ``tensors()`` (what a step updates, for the graph text).
"""
from __future__ import annotations

import contextlib
import io
from dataclasses import dataclass
from typing import Any, Callable

import torch

from . import loop
from .. import runtime
from .device_plan import DevicePlan
from .optim import optimizer_label

__all__ = ["PlainStep", "TrainerStepPlan", "TrainerStep", "optimizer_tensors"]


def optimizer_tensors(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The optimizer's state tensors on the device (momentum buffers, moments)."""
    dev = runtime.device().type
    return [t for st in opt.state.values() for t in st.values()
            if isinstance(t, torch.Tensor) and t.device.type == dev]


class PlainStep:
    """Forward, backward and an optimizer step at a constant LR, one micro-batch per step.

    Args:
        model: The module, on the device and in train mode.
        optimizer: An optimizer over ``model``'s parameters.
        loss_fn: ``loss_fn(outputs, y) -> scalar``.
        train_step: ``train_step(model, (x, y), loss_fn) -> loss tensor``.
        prepare: ``prepare(x) -> model input`` on the device, or None.
        bf16: Forward/backward under bfloat16 autocast (default False; ignored with ``plan``).
        plan: The run's :class:`~xla_utils.train.device_plan.DevicePlan` (precision, layout,
            gradient scaler on the torch backend), or None: ``bf16`` decides the autocast.
    """

    accum_steps = 1

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
                 loss_fn: Callable, train_step: Callable, prepare: Callable | None = None,
                 bf16: bool = False, plan: DevicePlan | None = None) -> None:
        self.model, self.optimizer, self.loss_fn = model, optimizer, loss_fn
        self.train_step, self.prepare = train_step, prepare
        if plan is None:
            dev = runtime.device()
            plan = DevicePlan(dev, "bf16" if bf16 else "fp32", False, False, "",
                              torch.autocast(dev.type, dtype=torch.bfloat16, enabled=bf16))
        self.plan = plan
        lr = optimizer.param_groups[0].get("lr")
        name = optimizer_label(optimizer)
        self.description = (f"forward, backward and a {name} step at the constant LR {lr:.3g}"
                            if isinstance(lr, float) else f"forward, backward and a {name} step")

    def micro_batch(self, x: Any, y: Any) -> torch.Tensor:
        """One step on the device batch ``(x, y)``; returns its loss (not synced)."""
        self.optimizer.zero_grad(set_to_none=True)
        if self.prepare is not None:
            x = self.prepare(x)
        with self.plan.autocast:
            loss = self.train_step(self.model, (self.plan.layout(x), y), self.loss_fn)
        self.plan.backward(loss)
        self.plan.step(self.optimizer)
        return loss

    def tensors(self) -> list[torch.Tensor]:
        return list(self.model.parameters()) + optimizer_tensors(self.optimizer)


@dataclass
class TrainerStepPlan:
    """The trainer's step, as a picklable step factory (built on the host by
    :class:`~xla_utils.train.trainer.OneCycleTrainer`, called in the child).

    Attributes:
        cfg: The trainer's :class:`~xla_utils.train.trainer.TrainerConfig`.
        train_data: The training data as the loader collates it (sets the schedule's
            steps per epoch, as in ``fit``).
        train_step, loss_fn: The trainer's ``train_step`` and loss.
        inputs: The training data's :class:`~xla_utils.train.inputs.InputSpec`.
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
