"""The plain training step that :func:`xla_utils.check` and :func:`xla_utils.debug_run` measure
by default, and the trainer's default ``train_step`` / ``eval_step``.

A *step factory* is called in the child with the host model and, on a mesh, the
:class:`~xla_utils.step.strategy.MeshRun`; it returns a *stepper*: ``model`` (on the
device), ``optimizer``, ``accum_steps``, ``description``, ``plan`` (its
:class:`~xla_utils.step.device_plan.DevicePlan`), ``micro_batch(x, y) -> loss``
(one micro-batch of a device batch, up to the step boundary: the caller calls
``runtime.sync()``) and ``tensors()`` (what a step updates, for the graph text).
:class:`PlainStep` is one; the trainer's own is
:class:`~xla_utils.train.steps.TrainerStepPlan`, which the trainer passes in.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from .. import runtime
from .device_plan import DevicePlan
from .optim import optimizer_label

__all__ = ["PlainStep", "optimizer_tensors", "default_train_step", "default_eval_step"]


def default_train_step(model: torch.nn.Module, batch: tuple, loss_fn: Callable) -> torch.Tensor:
    """``loss_fn(model(x), y)``: the trainer's default ``train_step``."""
    x, y = batch
    return loss_fn(model(x), y)


def default_eval_step(model: torch.nn.Module, batch: tuple) -> torch.Tensor:
    """``model(x)``: the trainer's default ``eval_step``."""
    x, _ = batch
    return model(x)


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
        plan: The run's :class:`~xla_utils.step.device_plan.DevicePlan` (precision, layout,
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
