"""The LR finder's reading of a sweep: smoothing, the suggestion rules and how far to trust them.

Pure NumPy over a recorded sweep (increasing LRs and their losses), shared by
:func:`xla_utils.lr_find` and ``scripts/bench_lr_rules.py``: :func:`smooth_losses`
(fastai's bias-corrected exponential smoothing), :func:`suggest` (every rule of
:data:`RULES`, fastai's trimming first) and :func:`assess` (why a curve's suggestion
should not be trusted). :mod:`xla_utils.train.lr_finder` re-exports all of them.
"""
from __future__ import annotations

import math
from typing import Callable, Sequence

import numpy as np

__all__ = ["RULES", "DEFAULT_RULE", "BETA", "NUM_IT", "MIN_DROP", "suggest", "assess",
           "smooth_losses", "curve_drop", "suggest_between", "suggest_minimum", "suggest_steep",
           "suggest_valley", "suggest_slide", "suggest_budget", "suggest_descent",
           "DESCENT_FACTOR", "BUDGET_STEPS", "BUDGET_POWER"]

RULES = ("descent", "budget", "between", "minimum", "steep", "valley", "slide")
# Chosen by its worst case over the 38 problems of scripts/bench_lr_rules.py
# (docs/BENCHMARKS.md "LR finder rules"), checked out of sample.
DEFAULT_RULE = "descent"
BETA = 0.98  # loss smoothing of the sweep (fastai's)
NUM_IT = 100  # sweep steps by default
DESCENT_FACTOR = 0.7
# budget rule: between x min(1, planned_steps / BUDGET_STEPS) ** BUDGET_POWER (the
# planned-run candidate of the benchmark; measured worse than descent, kept as an option)
BUDGET_STEPS = 1000
BUDGET_POWER = 0.5


# --------------------------------------------------------------------------
# Suggestion rules. Each takes the LRs and the smoothed losses of the usable
# part of the sweep (increasing LRs, finite losses, at least 3 points).
# --------------------------------------------------------------------------
def suggest_minimum(lrs: np.ndarray, losses: np.ndarray) -> float:
    """LR at the lowest smoothed loss, divided by 10 (fastai ``minimum``)."""
    return float(lrs[int(np.argmin(losses))]) / 10.0


def suggest_steep(lrs: np.ndarray, losses: np.ndarray) -> float:
    """LR where the loss falls fastest per unit of log(LR) (fastai ``steep``)."""
    grads = np.diff(losses) / np.diff(np.log(lrs))
    return float(lrs[int(np.argmin(grads))])


def suggest_valley(lrs: np.ndarray, losses: np.ndarray) -> float:
    """fastai ``valley``: find the longest run over which the loss keeps falling
    (longest decreasing subsequence, O(n^2)) and take the LR
    ``int(len/3) + int(len/6)`` points after its start, about half way down."""
    n = len(losses)
    lds = [1] * n
    max_start = max_end = 0
    for i in range(1, n):
        for j in range(i):
            if losses[i] < losses[j] and lds[i] < lds[j] + 1:
                lds[i] = lds[j] + 1
            if lds[max_end] < lds[i]:
                max_end = i
                max_start = max_end - lds[max_end]
    sections = (max_end - max_start) / 3
    idx = max_start + int(sections) + int(sections / 2)
    return float(lrs[idx])


def suggest_slide(lrs: np.ndarray, losses: np.ndarray, lr_diff: int = 15,
                  thresh: float = 0.005, adjust_value: float = 1.0) -> float:
    """fastai ``slide``: walk left from the end of the sweep, comparing the loss
    gradient (per point, loss units) at two points ``lr_diff`` apart, until they
    agree within ``thresh``; the left point's LR (times ``adjust_value``)."""
    grad = np.gradient(losses)
    lr_diff = min(lr_diff, len(losses) - 1)
    r_idx = -1
    l_idx = r_idx - lr_diff
    local_min_lr = lrs[l_idx]
    while l_idx >= -len(losses) and abs(grad[r_idx] - grad[l_idx]) > thresh:
        local_min_lr = lrs[l_idx]
        r_idx -= 1
        l_idx -= 1
    return float(local_min_lr) * adjust_value


def suggest_between(lrs: np.ndarray, losses: np.ndarray) -> float:
    """Geometric mean of :func:`suggest_minimum` and :func:`suggest_steep`: the
    log-space midpoint of fastai's two classic markers, whose errors point in
    different directions often enough to partly cancel."""
    return math.sqrt(suggest_minimum(lrs, losses) * suggest_steep(lrs, losses))


def suggest_descent(lrs: np.ndarray, losses: np.ndarray) -> float:
    """``DESCENT_FACTOR`` (0.7) x the geometric mean of :func:`suggest_minimum`
    (LR at the lowest loss / 10) and the LR of the steepest fall *before* that
    minimum. Unlike :func:`suggest_steep`, a dip of the diverging tail after the
    minimum can never be picked; the factor keeps the answer off the cliff
    that small data sets and short runs have just above their best LR."""
    m = int(np.argmin(losses))
    steep = float(lrs[m])
    if m >= 1:
        grads = np.diff(losses[:m + 1]) / np.diff(np.log(lrs[:m + 1]))
        steep = float(lrs[int(np.argmin(grads))])
    return DESCENT_FACTOR * math.sqrt(float(lrs[m]) / 10.0 * steep)


def suggest_budget(lrs: np.ndarray, losses: np.ndarray, planned_steps: int | None = None) -> float:
    """:func:`suggest_between` scaled down for short runs:
    ``between * min(1, planned_steps / BUDGET_STEPS) ** BUDGET_POWER``.

    A one-cycle run of few optimizer steps spends them at a high LR with no
    time to recover from what it does there, and the sweep over a small data
    set (100 steps revisit every sample many times) keeps falling at LRs that
    already overfit such a run. ``planned_steps=None`` (budget unknown) applies
    no scaling, i.e. assumes a run of at least ``BUDGET_STEPS`` steps.
    """
    lr = suggest_between(lrs, losses)
    if planned_steps is None:
        return lr
    if planned_steps < 1:
        raise ValueError(f"planned_steps must be >= 1, got {planned_steps!r}")
    return lr * min(1.0, planned_steps / BUDGET_STEPS) ** BUDGET_POWER


_RULE_FNS: dict[str, Callable[[np.ndarray, np.ndarray], float]] = {
    "descent": suggest_descent,
    "between": suggest_between,
    "minimum": suggest_minimum,
    "steep": suggest_steep,
    "valley": suggest_valley,
    "slide": suggest_slide,
}


def smooth_losses(losses: Sequence[float], beta: float = BETA) -> np.ndarray:
    """Exponentially smoothed, bias-corrected losses, as the sweep records them:
    ``avg = beta*avg + (1-beta)*loss``, ``smoothed[i] = avg / (1 - beta**(i+1))``;
    NaN from the first non-finite loss on. ``beta`` default 0.98."""
    raw = np.asarray(losses, dtype=np.float64)
    out = np.full(len(raw), np.nan)
    avg = 0.0
    for i, v in enumerate(raw):
        if not math.isfinite(v):
            break
        avg = beta * avg + (1 - beta) * v
        out[i] = avg / (1 - beta ** (i + 1))
    return out


def _usable(lrs: np.ndarray, losses: np.ndarray, num_it: int,
            skip_end: int) -> tuple[np.ndarray, np.ndarray]:
    """fastai's trimming: drop the first ``num_it // 10`` and the last
    ``skip_end`` points and everything from the first non-finite loss on."""
    stop = len(losses) - skip_end
    bad = np.flatnonzero(~np.isfinite(losses[:max(stop, 0)]))
    if len(bad):
        stop = int(bad[0])
    return lrs[num_it // 10:stop], losses[num_it // 10:stop]


def suggest(lrs: Sequence[float], smoothed: Sequence[float], num_it: int | None = None,
            skip_end: int = 5, *, planned_steps: int | None = None) -> dict[str, float]:
    """Every rule's suggestion for a recorded sweep, as ``{rule: lr}``.

    As fastai does, the first ``num_it // 10`` points (``num_it`` defaults to
    the number of points) and the last ``skip_end`` (default 5) are dropped, as
    is everything from the first non-finite loss on. A rule gets NaN when fewer
    than 3 points remain. ``planned_steps``: optimizer steps of the one-cycle
    run the answer is for (used by ``"budget"``; None = unknown, no scaling).
    """
    lrs = np.asarray(lrs, dtype=np.float64)
    losses = np.asarray(smoothed, dtype=np.float64)
    num_it = len(lrs) if num_it is None else num_it
    lrs, losses = _usable(lrs, losses, num_it, skip_end)
    if len(lrs) < 3:
        return {r: math.nan for r in RULES}
    out = {r: fn(lrs, losses) for r, fn in _RULE_FNS.items()}
    out["budget"] = suggest_budget(lrs, losses, planned_steps)
    return {r: out[r] for r in RULES}


# A sweep whose smoothed loss falls by less than this fraction of its starting
# value, or by less than the scatter of the raw per-batch losses at low LR, has
# no valley for a rule to read (a converged or untrainable model, a loss
# dominated by batch noise): its suggestion is not trustworthy. 1%: the
# benchmark's learnable problems fall by 2-60% and by 1-40x their scatter.
MIN_DROP = 0.01


def curve_drop(lrs: Sequence[float], smoothed: Sequence[float], num_it: int | None = None,
               skip_end: int = 5) -> tuple[float, float, float, float, int] | None:
    """``(first, lowest, lr_lo, lr_hi, points)`` of the usable part of a sweep (fastai's
    trimming, as :func:`suggest`): its first and lowest smoothed loss, its LR range and
    length; None when fewer than 3 points remain."""
    lrs_a = np.asarray(lrs, dtype=np.float64)
    num_it = len(lrs_a) if num_it is None else num_it
    use_lrs, use_sm = _usable(lrs_a, np.asarray(smoothed, dtype=np.float64), num_it, skip_end)
    if len(use_sm) < 3:
        return None
    return float(use_sm[0]), float(use_sm.min()), float(use_lrs[0]), float(use_lrs[-1]), len(use_sm)


def assess(lrs: Sequence[float], losses: Sequence[float], smoothed: Sequence[float],
           num_it: int | None = None, skip_end: int = 5) -> str | None:
    """Why a sweep's suggestion should not be trusted, or None when it can be.

    ``losses`` are the raw per-step losses, ``smoothed`` as recorded. Flags a
    flat curve (the smoothed loss falls by less than ``MIN_DROP`` = 1% of its
    value at the start of the usable part) and a noisy one (it falls by less
    than the standard deviation of the raw losses over the first quarter of the
    usable part, where the LR is too small to change much).
    """
    raw = np.asarray(losses, dtype=np.float64)
    num_it = len(lrs) if num_it is None else num_it
    fall = curve_drop(lrs, smoothed, num_it, skip_end)
    if fall is None:
        return "the sweep stopped too early for a suggestion"
    first, low, lo_lr, hi_lr, n_usable = fall
    start = num_it // 10
    use_raw = raw[start:start + n_usable]
    drop = first - low
    if drop < MIN_DROP * abs(first):
        return (f"the loss curve is flat: the smoothed loss fell only from {first:.4g} to "
                f"{low:.4g} ({100 * drop / max(abs(first), 1e-12):.1f}%) over LRs "
                f"{lo_lr:.2g}..{hi_lr:.2g}")
    q = max(len(use_raw) // 4, 3)
    noise = float(np.std(use_raw[:q]))
    if drop < noise:
        return (f"the loss curve is noisy: the smoothed loss fell by {drop:.4g}, less than the "
                f"scatter of the per-batch losses ({noise:.4g}); use a larger batch_size, "
                f"beta closer to 1 or more num_it")
    return None
