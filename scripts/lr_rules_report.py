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
from xla_utils.train import lr_finder as lf

Sweep = dict[str, Any]
Rule = Callable[[Sweep, dict[str, Any]], float]


def _curve(sw: Sweep, beta: float = lf.BETA) -> tuple[np.ndarray, np.ndarray]:
    lrs = np.asarray(sw["lrs"], dtype=np.float64)
    raw = np.array([np.nan if v is None else v for v in sw["losses"]], dtype=np.float64)
    return lrs, lf.smooth_losses(raw, beta)


def library_rule(name: str) -> Rule:
    """A rule of :mod:`xla_utils.train.lr_finder` as the library applies it (with the
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


def candidate(kind: str, factor: float = 1.0, s0: float | None = None, a: float = 0.0,
              e0: float | None = None, small_batch_beta: float | None = None) -> Rule:
    """``kind``'s LR x ``factor``, optionally x min(1, steps/s0)**a (short planned
    runs), x min(1, e0/sweep_epochs)**0.5 (sweeps that revisit a small data set
    many times), and re-smoothed with ``small_batch_beta`` for batches < 32."""
    def rule(sw: Sweep, meta: dict[str, Any]) -> float:
        if small_batch_beta is not None and meta["batch_size"] < 32:
            lrs, sm = _curve(sw, small_batch_beta)
            lrs, sm = lf._usable(lrs, sm, lf.NUM_IT, 5)
        else:
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
        if e0 is not None:
            v *= min(1.0, e0 * meta["n_train"] / (lf.NUM_IT * meta["batch_size"])) ** 0.5
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
    rules["minimum x 0.3"] = candidate("minimum", 0.3)
    for base in ("between", "minimum"):
        for s0 in (100, 300, 1000):
            for a in (0.25, 0.5):
                rules[f"{base}*min(1,steps/{s0})^{a}"] = scaled(base, s0, a)
    for kind in ("minimum", "steep_pre", "between_pre", "valley"):
        for fac in ((0.35, 0.5, 0.7, 1.0, 1.4) if kind != "valley" else (3.0, 10.0)):
            rules[f"{kind}x{fac}"] = candidate(kind, fac)
            for s0 in (100, 300):
                rules[f"{kind}x{fac}*min(1,steps/{s0})^0.5"] = candidate(kind, fac, s0, 0.5)
            for e0 in (2, 5):
                rules[f"{kind}x{fac}*min(1,{e0}/sweep_epochs)^0.5"] = candidate(kind, fac, e0=e0)
            rules[f"{kind}x{fac} beta.99 below batch 32"] = candidate(kind, fac, small_batch_beta=0.99)
    return rules


def select(sc: dict[str, dict[str, float]], names: list[str]) -> str:
    """The rule with the smallest worst case on ``names`` (ties: median)."""
    return min(sc, key=lambda r: worst_median(sc[r], names))


# Problems whose results came in after the first choice of the default (descent
# with factor 0.5, on the first 15 problems): a held-out check of that choice.
LATE = ("digits1297_mlp_adamw_b8_e12", "mc5000_mlpbn_sgd_b64_e4", "mc600_mlpdrop_adam_b16_e10",
        "shapes1000_resnet_sgd_b32_e5", "shapesml1000_cnn_adamw_b32_e6", "mc20k_mlp_sgd_b256_e5",
        "mc2000_mlp_adam_b32_e8", "ml2000_mlp_adam_b32_e10", "mc4000_mlp_sgd_b64_e16",
        "wine118_mlp_adamw_b8_e6", "digits1297_mlp_sgd_b256_e10", "mc20k_linear_adam_b256_e2")


def raised_for_short_runs(factor: float, s0: float, a: float) -> Rule:
    """``between_pre`` x ``factor`` x max(1, s0 / planned_steps) ** a: a *higher* LR
    for runs shorter than ``s0`` steps (what the short SGD runs of issue 19 prefer)."""
    base = candidate("between_pre", factor)

    def rule(sw: Sweep, meta: dict[str, Any]) -> float:
        return base(sw, meta) * max(1.0, s0 / meta["steps"]) ** a
    return rule


def short_run_table(cache: dict[str, Any], names: list[str], short: list[str]) -> list[str]:
    """Markdown rows: the default against short-run up-scalings, overall, on the short
    runs and on each half (A/B as in :func:`report`)."""
    rules: dict[str, Rule] = {lf.DEFAULT_RULE: library_rule(lf.DEFAULT_RULE)}
    for s0 in (60, 100, 150):
        for a in (0.25, 0.5):
            rules[f"descent x max(1,{s0}/steps)^{a}"] = raised_for_short_runs(0.7, s0, a)
    sc = scores(cache, names, rules)
    done = [n for n in names if n in sc[lf.DEFAULT_RULE]]
    short = [n for n in short if n in done]
    lines = ["| rule | all: worst / median | short runs: worst / median | > 2x | A worst | B worst |",
             "|---|---|---|---|---|---|"]
    for r, v in sc.items():
        w, m = worst_median(v, done)
        ws, ms = worst_median(v, short)
        lines.append(f"| {r} | {w:.2f} / {m:.2f} | {ws:.2f} / {ms:.2f} | "
                     f"{sum(v[n] > 2 for n in done)} | {worst_median(v, done[0::2])[0]:.2f} | "
                     f"{worst_median(v, done[1::2])[0]:.2f} |")
    return lines


def report(cache: dict[str, Any], names: list[str]) -> str:
    """Markdown for docs/BENCHMARKS.md: per-problem ratios of the library's rules,
    worst case and median of every candidate, and the two-fold out-of-sample check."""
    fam = family()
    sc = scores(cache, names, fam)
    done = [n for n in names if n in sc[lf.DEFAULT_RULE]]
    shown = list(lf.RULES)
    head = {r: r + (" (default)" if r == lf.DEFAULT_RULE else "") for r in shown}
    lines = [f"Per problem: loss at the rule's max_lr / best grid loss, mean over the "
             f"{len(bench.SEEDS)} seeds' sweeps ({len(done)} problems).", "",
             "| problem | n train | batch | steps | best max_lr | best val loss | "
             + " | ".join(head[r] for r in shown) + " |",
             "|---|---|---|---|---|---|" + "---|" * len(shown)]
    for n in done:
        e = cache["problems"][n]
        curve = bench.grid_curve(e)
        b = min(curve, key=curve.get)
        cells = " | ".join(f"**{sc[r][n]:.2f}**" if sc[r][n] > 2 else f"{sc[r][n]:.2f}"
                           for r in shown)
        lines.append(f"| {n} | {e['n_train']} | {e['batch_size']} | {e['steps']} | "
                     f"{10 ** b:.2g} | {curve[b]:.3f} | {cells} |")
    lines += ["", "| rule | worst | median | problems > 2x |", "|---|---|---|---|"]
    ranked = sorted(fam, key=lambda r: worst_median(sc[r], done))
    for r in shown + [r for r in ranked[:12] if r not in shown]:
        w, m = worst_median(sc[r], done)
        lines.append(f"| {head.get(r, r)} | {w:.2f} | {m:.2f} | "
                     f"{sum(sc[r][n] > 2 for n in done)} |")
    half_a, half_b = done[0::2], done[1::2]
    lines += ["", f"Out of sample: the {len(fam)} candidates above (and their variants) "
              "selected by worst case on one half of the problems (A: 1st, 3rd, ... in "
              "table order; B: 2nd, 4th, ...), reported on the other half:", "",
              "| selected on | rule selected | in sample worst / median | "
              "out of sample worst / median | default out of sample worst / median |",
              "|---|---|---|---|---|"]
    for sel_on, rep_on, label in ((half_a, half_b, "A, reported on B"),
                                  (half_b, half_a, "B, reported on A")):
        r = select(sc, sel_on)
        ws, ms = worst_median(sc[r], sel_on)
        wr, mr = worst_median(sc[r], rep_on)
        wd, md = worst_median(sc[lf.DEFAULT_RULE], rep_on)
        lines.append(f"| {label} | `{r}` | {ws:.2f} / {ms:.2f} | {wr:.2f} / {mr:.2f} | "
                     f"{wd:.2f} / {md:.2f} |")
    late = [n for n in done if n in LATE]
    if late:
        w, m = worst_median(sc["between_prex0.5"], late)
        wv, mv = worst_median(sc["valley"], late)
        lines += ["", f"Held-out check of the first choice: `descent` with factor 0.5, fixed on "
                  f"the first 15 problems, on the {len(late)} problems that finished later: worst "
                  f"{w:.2f}, median {m:.2f} (valley: worst {wv:.2f}, median {mv:.2f})."]
    short = [n for n in done if n in getattr(bench.lp, "SHORT", ())]
    if short:
        w, m = worst_median(sc[lf.DEFAULT_RULE], short)
        lines += ["", f"Short runs (20-60 steps, the last {len(short)} problems): default worst "
                  f"{w:.2f}, median {m:.2f}. A higher LR for short runs, against the default:", ""]
        lines += short_run_table(cache, done, short)
    flagged = sum(lf.assess(sw["lrs"], [math.nan if v is None else v for v in sw["losses"]],
                            _curve(sw)[1], num_it=lf.NUM_IT) is not None
                  for n in done for sw in cache["problems"][n]["sweeps"].values())
    lines += ["", f"Sweeps flagged as flat or noisy (`confident=False`): {flagged} of "
              f"{len(done) * len(bench.SEEDS)}."]
    return "\n".join(lines)
