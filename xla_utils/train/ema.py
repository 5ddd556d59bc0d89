"""Weight EMA on the device, as timm's ``ModelEmaV3(model, decay, use_warmup=True)``.

``OneCycleTrainer(..., ema=0.999)`` keeps an exponential moving average of the
model's floating-point parameters and buffers (integer buffers such as
BatchNorm's ``num_batches_tracked`` are copied), updated after every optimizer
step inside the step's graph. The decay warms up as timm's ``ModelEmaV3`` with
``use_warmup=True`` and its defaults (``warmup_gamma=1``, ``warmup_power=2/3``,
``update_after_step=0``, ``min_decay=0``): after optimizer step ``n`` (1-based)

    ``decay(n) = 0`` for ``n <= 1`` (the EMA starts as a copy),
    ``decay(n) = min(ema, 1 - (1 + (n - 1)) ** (-2/3))`` afterwards,

so short runs average over their recent steps and long ones reach ``ema``.
The step count lives on the device (device data, updated in the graph), so the
decay never compiles in as a constant. ``evaluate``/``predict`` and the
validation of each epoch use the EMA weights; checkpoints hold them (key
``"ema"``) and a resumed run continues them exactly.
"""
from __future__ import annotations

import copy
from typing import Any

import torch

__all__ = ["WARMUP_GAMMA", "WARMUP_POWER", "check_ema", "ema_decay", "DeviceEMA", "with_weights"]

WARMUP_GAMMA = 1.0
WARMUP_POWER = 2.0 / 3.0


def check_ema(decay: Any) -> None:
    """Refuse a bad ``ema`` setting (``TrainerConfig`` calls it).

    Raises:
        ValueError: ``decay`` is not a number in (0, 1).
    """
    if decay is None:
        return
    if isinstance(decay, bool) or not isinstance(decay, (int, float)) or not 0 < decay < 1:
        raise ValueError(f"ema is the EMA decay per optimizer step and must be in (0, 1) "
                         f"(usual 0.999 or 0.9999; None = off), got {decay!r}")


def with_weights(model: torch.nn.Module, state: dict[str, torch.Tensor] | None
                 ) -> torch.nn.Module:
    """``model`` itself when ``state`` is empty/None, else a copy holding ``state``."""
    if not state:
        return model
    net = copy.deepcopy(model)
    net.load_state_dict(state)
    return net


def ema_decay(decay: float, step: int) -> float:
    """The decay used after optimizer step ``step`` (1-based), as timm's
    ``ModelEmaV3(decay=decay, use_warmup=True).get_decay(step)``."""
    s = max(0, step - 1)
    if s <= 0:
        return 0.0
    return max(min(1 - (1 + s / WARMUP_GAMMA) ** -WARMUP_POWER, decay), 0.0)


class DeviceEMA:
    """The EMA copy of a replica's model, updated on its device.

    Args:
        model: The replica's model (already on ``dev``).
        decay: The target decay (``TrainerConfig.ema``).
        step: Optimizer steps already done (0, or the resumed run's).
        dev: The replica's device.
        state: The EMA weights to start from (a resumed checkpoint's), or None
            (a copy of ``model``).
        place: Moves the (host) EMA copy to the devices as the strategy places its
            model (``"fsdp"``: each parameter straight into the shards its parameter
            has); None: ``module.to(dev)``.
    """

    def __init__(self, model: torch.nn.Module, decay: float, step: int, dev: torch.device,
                 state: dict[str, torch.Tensor] | None = None,
                 place: Any = None):
        from .. import runtime

        self.decay = float(decay)
        self.module = copy.deepcopy(model).eval()
        if state is not None:
            self.module.load_state_dict(state)
        self._sharded = place is not None
        if place is None:
            self.module.to(dev)
        else:
            self.module = place(self.module)
        for p in self.module.parameters():
            p.requires_grad_(False)
        # Device data: the count and decay change every step without recompiling.
        self._step = runtime.to_device(torch.tensor(float(step)), dev)
        # 1 - decay never goes below this (computed in float64 on the host, as timm's)
        self._floor = runtime.to_device(torch.tensor(1.0 - self.decay), dev)
        self._cached: tuple[Any, list, list] | None = None

    def _lists(self, model: torch.nn.Module) -> tuple[list, list]:
        """``[(ema floats, model floats) per dtype], [(ema, model) integer pairs]`` of
        ``model``, built once per model (the replica's model does not change)."""
        if self._cached is not None and self._cached[0] is model:
            return self._cached[1], self._cached[2]
        mine = list(self.module.parameters()) + list(self.module.buffers())
        theirs = list(model.parameters()) + list(model.buffers())
        by_dtype: dict[torch.dtype, tuple[list, list]] = {}
        ints = []
        for e, m in zip(mine, theirs):
            if e.is_floating_point():
                es, ms = by_dtype.setdefault(e.dtype, ([], []))
                es.append(e)
                ms.append(m)
            else:
                ints.append((e, m))
        self._cached = (model, list(by_dtype.values()), ints)
        return self._cached[1], ints

    @torch.no_grad()
    def update(self, model: torch.nn.Module) -> None:
        """One EMA step after an optimizer step of ``model`` (no sync: it joins the step's graph).

        ``ema + (1 - decay) * (weights - ema)`` for all floating-point tensors of a
        dtype at once (three out-of-place ``torch._foreach_*`` calls, not a Python loop
        over the tensors); each EMA tensor then takes its new value (``t.data = new``).
        torch_xla traces 2.3-3.2x less host work for this than for in-place ``_foreach``
        ops. Neither the in-place form nor the out-of-place one with its old buffers
        donated is used: both alias the old EMA to an output of the step, and XLA pairs
        buffers with outputs by shape, so the EMA's buffer goes to another output of
        that shape (a weight, a gradient) and XLA copies each EMA tensor twice to keep
        the values right (docs/BENCHMARKS.md: 39 MB more copies per step on a 4.9 M
        weight ResNet, +4-5% of its step time on XLA:CPU, and no memory saved). Under a
        mesh strategy the EMA's shards are updated in place (their sharding annotations
        stay on the same tensors). The integer buffers are then copied. After optimizer
        step ``n``, ``1 - decay(n)`` is ``max(n ** (-2/3), 1 - ema)``: :func:`ema_decay`'s
        complement (``warmup_gamma=1``), three small ops on the device step count."""
        self._step = self._step + 1
        weight = torch.maximum(self._step ** -WARMUP_POWER, self._floor)
        floats, ints = self._lists(model)
        for es, ms in floats:
            w = weight if es[0].dtype == weight.dtype else weight.to(es[0].dtype)
            if ms[0].dtype != es[0].dtype:  # a bf16 model, say: its EMA keeps its own dtype
                ms = [m.to(es[0].dtype) for m in ms]
            diff = torch._foreach_mul(torch._foreach_sub(ms, es), w)
            if self._sharded:
                torch._foreach_add_(es, diff)
            else:
                for e, new in zip(es, torch._foreach_add(es, diff)):
                    e.data = new
        for e, m in ints:
            e.copy_(m)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The EMA weights (on the device)."""
        return self.module.state_dict()

