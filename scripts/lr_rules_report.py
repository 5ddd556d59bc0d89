"""Score LR-finder rules on the cached runs of scripts/bench_lr_rules.py.

No training here: every rule is applied to the stored raw loss curves of the
finder sweeps (with the library's smoothing and trimming), and its max_lr is
scored against the stored grid (see ``bench_lr_rules.loss_at``).
"""
from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np

import bench_lr_rules as bench
from xla_utils import lr_finder as lf

Sweep = dict[str, Any]
Rule = Callable[[Sweep, dict[str, Any]], float]


def _curve(sw: Sweep, beta: float = lf.BETA) -> tuple[np.ndarray, np.ndarray]:
    lrs = np.asarray(sw["lrs"], dtype=np.float64)
    raw = np.array([np.nan if v is None else v for v in sw["losses"]], dtype=np.float64)
    return lrs, lf.smooth_losses(raw, beta)


def library_rule(name: str) -> Rule:
    """A rule of :mod:`xla_utils.lr_finder` as the library applies it (with the
    problem's planned steps and sweep facts for the rules that use them)."""
    def rule(sw: Sweep, meta: dict[str, Any]) -> float:
        lrs, sm = _curve(sw)
        return lf.suggest(lrs, sm, num_it=lf.NUM_IT, planned_steps=meta["steps"])[name]
    return rule


def scaled(base: str, s0: float, a: float) -> Rule:
    """``base`` x min(1, planned_steps / s0) ** a."""
    def rule(sw: Sweep, meta: dict[str, Any]) -> float:
        lrs, sm = _curve(sw)
        v = lf.suggest(lrs, sm, num_it=lf.NUM_IT)[base]
        return v * min(1.0, meta["steps"] / s0) ** a
    return rule


def _trimmed(sw: Sweep) -> tuple[np.ndarray, np.ndarray]:
    lrs, sm = _curve(sw)
    return lf._usable(lrs, sm, lf.NUM_IT, 5)


def steep_pre(lrs: np.ndarray, losses: np.ndarray) -> float:
    """Steepest fall per log-LR, looked for only up to the loss minimum."""
    m = int(np.argmin(losses))
    if m < 2:
        return float(lrs[m])
    grads = np.diff(losses[:m + 1]) / np.diff(np.log(lrs[:m + 1]))
    return float(lrs[int(np.argmin(grads))])


def candidate(kind: str, factor: float = 1.0, s0: float | None = None, a: float = 0.0) -> Rule:
    def rule(sw: Sweep, meta: dict[str, Any]) -> float:
        lrs, sm = _trimmed(sw)
        if len(lrs) < 3:
            return math.nan
        mn = lf.suggest_minimum(lrs, sm)
        if kind == "minimum":
            v = mn
        elif kind == "steep_pre":
            v = steep_pre(lrs, sm)
        elif kind == "between_pre":
            v = math.sqrt(mn * steep_pre(lrs, sm))
        elif kind == "valley":
            v = lf.suggest_valley(lrs, sm)
        else:
            raise ValueError(kind)
        if s0 is not None:
            v *= min(1.0, meta["steps"] / s0) ** a
        return v * factor
    return rule


def scores(cache: dict[str, Any], names: list[str], rules: dict[str, Rule]
           ) -> dict[str, dict[str, float]]:
    """{rule: {problem: mean over the problem's sweeps of loss(suggestion) / best}}."""
    out: dict[str, dict[str, float]] = {r: {} for r in rules}
    for n in names:
        e = cache["problems"].get(n)
        if not e or len(e.get("sweeps", {})) < len(bench.SEEDS):
            continue
        curve = bench.grid_curve(e)
        if len(curve) < 9:
            continue
        best = min(curve.values())
        for r, fn in rules.items():
            ratios = [bench.loss_at(curve, fn(sw, e)) / best for sw in e["sweeps"].values()]
            out[r][n] = float(np.mean(ratios))
    return out


def worst_median(sc: dict[str, float], names: list[str] | None = None) -> tuple[float, float]:
    v = [sc[n] for n in (names or sc) if n in sc]
    return (max(v), float(np.median(v))) if v else (math.nan, math.nan)


def family() -> dict[str, Rule]:
    """Candidate rules for selection (fixed library rules + planned-step scalings)."""
    rules: dict[str, Rule] = {r: library_rule(r) for r in lf.RULES}
    for base in ("between", "minimum"):
        for s0 in (100, 300, 1000):
            for a in (0.25, 0.5):
                rules[f"{base}*min(1,steps/{s0})^{a}"] = scaled(base, s0, a)
    for kind in ("minimum", "steep_pre", "between_pre", "valley"):
        for fac in ((0.5, 1.0, 2.0) if kind != "valley" else (3.0, 10.0)):
            rules[f"{kind}x{fac}"] = candidate(kind, fac)
            for s0 in (100, 300):
                rules[f"{kind}x{fac}*min(1,steps/{s0})^0.5"] = candidate(kind, fac, s0, 0.5)
    return rules


def select(sc: dict[str, dict[str, float]], names: list[str]) -> str:
    """The rule with the smallest worst case on ``names`` (ties: median)."""
    return min(sc, key=lambda r: worst_median(sc[r], names))


def report(cache: dict[str, Any], names: list[str]) -> str:
    fam = family()
    sc = scores(cache, names, fam)
    done = [n for n in names if n in sc[lf.DEFAULT_RULE]]
    shown = list(lf.RULES) + ["fastai_minimum/10"] if False else list(lf.RULES)
    lines = [f"{len(done)} problems with complete results", ""]
    lines.append("| problem | steps | best max_lr | best val loss | "
                 + " | ".join(shown) + " |")
    lines.append("|---|---|---|---|" + "---|" * len(shown))
    for n in done:
        e = cache["problems"][n]
        curve = bench.grid_curve(e)
        b = min(curve, key=curve.get)
        lines.append(f"| {n} | {e['steps']} | 1e{b:+.1f} | {curve[b]:.4f} | "
                     + " | ".join(f"{sc[r][n]:.2f}" for r in shown) + " |")
    lines += ["", "| rule | worst | median | problems > 2x |", "|---|---|---|---|"]
    ranked = sorted(fam, key=lambda r: worst_median(sc[r], done))
    for r in shown + [r for r in ranked[:15] if r not in shown]:
        w, m = worst_median(sc[r], done)
        lines.append(f"| {r} | {w:.2f} | {m:.2f} | {sum(sc[r][n] > 2 for n in done)} |")
    half_a, half_b = done[0::2], done[1::2]
    lines += ["", "Out of sample (select by worst case on one half, report on the other):", ""]
    for sel_on, rep_on, label in ((half_a, half_b, "A->B"), (half_b, half_a, "B->A")):
        r = select(sc, sel_on)
        ws, ms = worst_median(sc[r], sel_on)
        wr, mr = worst_median(sc[r], rep_on)
        lines.append(f"- {label}: selected `{r}` (worst {ws:.2f}, median {ms:.2f} in sample); "
                     f"out of sample worst {wr:.2f}, median {mr:.2f}")
    return "\n".join(lines)
