"""Gradient clipping by the global norm (``grad_clip=``), inside the step's graph.

:class:`GradClip` rescales a step's gradients so that their total L2 norm is at most
``max_norm`` (``torch.nn.utils.clip_grad_norm_``, no ``error_if_nonfinite``: nothing is read
on the host, and on XLA the clip is more ops of the step's one graph, so nothing compiles
again). The device plan calls it at the one point where the gradients are final
(:meth:`xla_utils.step.device_plan.DevicePlan.step`): after they are averaged over the
replicas (``xm.reduce_gradients`` on XLA, during backward under DistributedDataParallel),
after an fp16 gradient scaler unscaled them, before the optimizer step. Under
``strategy="fsdp"`` the gradients are sharded, but each is one logical global tensor in the
SPMD program, so the norm is the whole model's (XLA inserts the reductions across shards).

What it measured stays on the device: per step the total norm before clipping and after it,
summed and maximised into one small tensor that :meth:`GradClip.take` reads once per epoch
(one host read; the history's ``grad_norm``, ``grad_norm_max``, ``clipped_steps`` and
``grad_norm_clipped_max``). The norm after clipping is measured, not derived: one more norm
of the clipped gradients per step (on XLA fused with the clip's own multiply). A step whose
gradients hold an inf or NaN (one the fp16 scaler skips) is left out of the figures.
"""
from __future__ import annotations

import math
from typing import Any

import torch

from .. import runtime

__all__ = ["GradClip", "check_grad_clip"]


def check_grad_clip(value: Any) -> float | None:
    """``grad_clip`` as a float, or None (off).

    Raises:
        ValueError: neither None nor a positive finite number.
    """
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 \
            or not math.isfinite(value):
        raise ValueError(f"grad_clip must be None (off) or a positive finite number (the largest "
                         f"total L2 norm of a step's gradients, e.g. grad_clip=1.0), got {value!r}")
    return float(value)


class GradClip:
    """Clip a step's gradients to a total L2 norm of ``max_norm`` and keep the epoch's norms
    on ``device``.

    Args:
        max_norm: The largest total norm (> 0).
        device: The replica's device (the figures live there).
    """

    def __init__(self, max_norm: float, device: torch.device) -> None:
        self.max_norm = float(max_norm)
        self.device = device
        self._acc: torch.Tensor | None = None  # [sum before, steps, clipped, max before, max after]

    def __call__(self, opt: torch.optim.Optimizer) -> None:
        """Clip the gradients of ``opt``'s parameters in place (device ops only)."""
        grads = [p for group in opt.param_groups for p in group["params"] if p.grad is not None]
        if not grads:
            return
        before = torch.nn.utils.clip_grad_norm_(grads, self.max_norm).float()
        after = torch.linalg.vector_norm(
            torch.stack([torch.linalg.vector_norm(p.grad.detach(), dtype=torch.float32)
                         for p in grads]))
        ok = torch.isfinite(before)
        kept = torch.where(ok, before, 0.0)
        sums = torch.stack([kept, ok.float(), (ok & (before > self.max_norm)).float()])
        maxes = torch.stack([kept, torch.where(ok, after, 0.0)])
        if self._acc is None:
            # device data, not a torch.zeros op: every step stays the same graph
            self._acc = runtime.to_device(torch.zeros(5), before.device)
        self._acc = torch.cat([self._acc[:3] + sums, torch.maximum(self._acc[3:], maxes)])

    def take(self) -> dict[str, float | int]:
        """The figures since the last call (one host read), then start over: ``grad_norm``
        (mean total norm before clipping over the steps with finite gradients; NaN when
        none), ``grad_norm_max``, ``clipped_steps`` (steps whose norm exceeded ``max_norm``)
        and ``grad_norm_clipped_max`` (the largest norm after clipping, measured)."""
        vals = [0.0] * 5 if self._acc is None else self._acc.cpu().tolist()
        self._acc = None
        total, steps, clipped, top, top_after = vals
        return {"grad_norm": total / steps if steps else math.nan, "grad_norm_max": top,
                "clipped_steps": int(round(clipped)), "grad_norm_clipped_max": top_after}
