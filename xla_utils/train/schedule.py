"""One-cycle learning-rate and momentum schedule (Smith 2018), per optimizer step.

With the defaults and ``moms[0] == moms[2]`` it reproduces
``torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr, total_steps,
pct_start, anneal_strategy, cycle_momentum=True, base_momentum=moms[1],
max_momentum=moms[0], div_factor, final_div_factor, three_phase=False)``:

* phase 1, steps ``0 .. pct_start*total_steps - 1``: LR ``max_lr/div_factor ->
  max_lr``, momentum ``moms[0] -> moms[1]``;
* phase 2, up to step ``total_steps - 1``: LR ``max_lr -> max_lr/(div_factor *
  final_div_factor)``, momentum ``moms[1] -> moms[2]``.

Unlike the torch scheduler it is a pure function of the step number, so a
trainer can resume at any step, and it never returns a value that is 0.0 or
1.0 in float32 (those scalars are compiled into XLA graphs as constants; any
other value is uploaded as data and reuses the compiled graph; see
:mod:`xla_utils.step.optim`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from ..step.optim import avoid_special, avoid_special_momentum, set_hparams

__all__ = ["OneCycleSchedule"]


def _anneal_cos(start: float, end: float, pct: float) -> float:
    return end + (start - end) / 2.0 * (math.cos(math.pi * pct) + 1)


def _anneal_linear(start: float, end: float, pct: float) -> float:
    return (end - start) * pct + start


_ANNEAL = {"cos": _anneal_cos, "linear": _anneal_linear}


@dataclass(frozen=True)
class OneCycleSchedule:
    """One-cycle LR and momentum over ``total_steps`` optimizer steps.

    Attributes
    ----------
    total_steps:
        Number of optimizer steps in the whole run (epochs x steps per epoch).
    max_lr:
        Peak learning rate, reached at step ``pct_start*total_steps - 1``.
    pct_start:
        Fraction of the steps spent warming up (default 0.3, as torch).
    div_factor:
        Initial LR is ``max_lr / div_factor`` (default 25).
    final_div_factor:
        Final LR is ``max_lr / (div_factor * final_div_factor)`` (default 1e4).
    moms:
        Momentum (SGD ``momentum``, Adam/AdamW ``betas[0]``) at the start, at the
        peak and at the end (default (0.95, 0.85, 0.95)). ``None`` leaves the
        optimizer's momentum untouched.
    anneal:
        ``"cos"`` (default) or ``"linear"`` interpolation within each phase.
    """

    total_steps: int
    max_lr: float
    pct_start: float = 0.3
    div_factor: float = 25.0
    final_div_factor: float = 1e4
    moms: tuple[float, float, float] | None = (0.95, 0.85, 0.95)
    anneal: str = "cos"

    def __post_init__(self) -> None:
        if not isinstance(self.total_steps, (int, np.integer)) or self.total_steps < 1:
            raise ValueError(f"total_steps must be a positive int, got {self.total_steps!r}")
        if not (self.max_lr > 0 and math.isfinite(self.max_lr)):
            raise ValueError(f"max_lr must be a positive finite float, got {self.max_lr!r}")
        if not 0.0 <= self.pct_start <= 1.0:
            raise ValueError(f"pct_start must be in [0, 1], got {self.pct_start!r}")
        if self.div_factor <= 0 or self.final_div_factor <= 0:
            raise ValueError("div_factor and final_div_factor must be positive")
        if self.anneal not in _ANNEAL:
            raise ValueError(f"anneal must be one of {sorted(_ANNEAL)}, got {self.anneal!r}")
        if self.moms is not None:
            if len(self.moms) != 3:
                raise ValueError(f"moms must be (start, peak, end), got {self.moms!r}")
            object.__setattr__(self, "moms", tuple(float(m) for m in self.moms))

    @property
    def initial_lr(self) -> float:
        return self.max_lr / self.div_factor

    @property
    def final_lr(self) -> float:
        return self.initial_lr / self.final_div_factor

    def _phase(self, step: int) -> tuple[int, float]:
        """(phase index, fraction of that phase done) exactly as torch's OneCycleLR."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        step = min(int(step), self.total_steps - 1)
        warm_end = float(self.pct_start * self.total_steps) - 1
        if step <= warm_end:
            start, end, phase = 0.0, warm_end, 0
        else:
            start, end, phase = warm_end, float(self.total_steps - 1), 1
        # A zero-length phase (e.g. pct_start*total_steps == 1): it is complete.
        pct = (step - start) / (end - start) if end > start else 1.0
        return phase, pct

    def lr(self, step: int) -> float:
        """Learning rate for optimizer step ``step`` (0-based; steps past the end
        keep the final LR). Never 0.0 or 1.0 in float32."""
        phase, pct = self._phase(step)
        f = _ANNEAL[self.anneal]
        if phase == 0:
            value = f(self.initial_lr, self.max_lr, pct)
        else:
            value = f(self.max_lr, self.final_lr, pct)
        return avoid_special(value)

    def momentum(self, step: int) -> float | None:
        """Momentum / beta1 for optimizer step ``step`` (``None`` when ``moms`` is
        None). Neither it nor 1 - it is 0.0 or 1.0 in float32."""
        if self.moms is None:
            return None
        phase, pct = self._phase(step)
        m0, m1, m2 = self.moms
        f = _ANNEAL[self.anneal]
        value = f(m0, m1, pct) if phase == 0 else f(m1, m2, pct)
        return avoid_special_momentum(value)

    def apply(self, optimizer: torch.optim.Optimizer, step: int) -> float:
        """Set LR and momentum for step ``step`` on every param group of
        ``optimizer`` (see :func:`xla_utils.step.optim.set_hparams`); call it before
        that step's ``optimizer.step()``. Returns the LR set."""
        lr = self.lr(step)
        set_hparams(optimizer, lr, self.momentum(step))
        return lr

    def lrs(self) -> np.ndarray:
        """LR of every step, float64[total_steps] (for plots)."""
        return np.array([self.lr(s) for s in range(self.total_steps)], dtype=np.float64)

    def momentums(self) -> np.ndarray:
        """Momentum of every step, float64[total_steps] (NaN when ``moms`` is None)."""
        return np.array([np.nan if self.moms is None else self.momentum(s)
                         for s in range(self.total_steps)], dtype=np.float64)
