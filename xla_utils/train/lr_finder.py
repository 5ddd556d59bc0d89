"""Learning-rate range test ("LR finder") on one core.

:func:`lr_find` trains a model for at most ``num_it`` optimizer steps while the
learning rate grows exponentially from ``start_lr`` to ``end_lr``, records the
training loss of every step, and suggests a ``max_lr`` for a one-cycle run.

Why one core: the predecessor ran its finder on 8 cores, where each core stopped
on its own, the loss came from one core's batch, the replicas could start from
different weights, and the answer was for a batch 8x larger than the one it
reported. Here there is one replica and one decision, and the result states
the batch size its answer is valid for (:attr:`LRFinderResult.batch_size`).

Where it runs (:func:`xla_utils.runtime.launch` with ``cores=1``): on a TPU host,
and with ``simulate=1``, in a forked child on one XLA device, so the notebook
process never initialises the XLA runtime and can launch a multi-core fit later;
the caller's model, optimizer and RNGs are untouched by construction. Without
a TPU it runs in-process on the CUDA device or the CPU, and restores the
model's parameters, buffers, gradients and train/eval flags and the Python,
NumPy and torch (CPU and CUDA) RNG states afterwards, bit for bit.
"""
from __future__ import annotations

import functools
import math
import os
import random
import time
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterator

import numpy as np
import torch

from .. import runtime
from ..step.device_plan import DevicePlan, DeviceRequest, check_before_launch
# The rules are lr_rules'; they are also this module's names (xla_utils.train.lr_finder.suggest, ...).
from .lr_rules import (BETA, BUDGET_POWER, BUDGET_STEPS, DEFAULT_RULE, DESCENT_FACTOR, NUM_IT,
                       RULES, assess, curve_drop, smooth_losses, suggest, suggest_between,
                       suggest_budget, suggest_descent, suggest_minimum, suggest_slide,
                       suggest_steep, suggest_valley)
from ..step.optim import OptimizerSpec, make_optimizer, resolve_optimizer, set_hparams
from ..step.strategy import launch as launch_on_mesh
from ..utils.progress import progress_bar
from ..utils.suggest import choice, keyword_help

if TYPE_CHECKING:
    from ..step.strategy import MeshRun, StrategyPlan

__all__ = ["LRFinderResult", "lr_find", "suggest", "assess", "smooth_losses", "RULES",
           "DEFAULT_RULE", "suggest_between", "suggest_minimum", "suggest_steep", "suggest_valley",
           "suggest_slide", "suggest_budget", "suggest_descent", "sweep_length", "BETA", "NUM_IT",
           "MIN_NUM_IT", "FIT_SHARE", "SHORT_RUN", "SHORT_START_LR", "DESCENT_FACTOR",
           "BUDGET_STEPS", "BUDGET_POWER", "sweep_threads"]

# fit(max_lr="find") lets the sweep cost at most this share of the planned run. A shortened
# sweep starts at SHORT_START_LR (the decades below it rarely matter) and has at least
# MIN_NUM_IT steps. On the rules' 38 benchmark problems (worst / median of the loss at the
# suggestion over the best run's) no shortened sweep kept the full sweep's 1.98x / 1.22x:
# 75 steps from 1e-5 scored 2.38x / 1.25x (2 problems above 2x), 60: 2.67x, 50: 3.07x
# (4 above 2x), 30: 4.47x; docs/BENCHMARKS.md "LR finder: shorter sweeps". 75 is the
# shortest length measured at the best worst case, so the floor trades at most a quarter
# of the sweep for that, and the note says the suggestion is less precise.
FIT_SHARE = 0.25
MIN_NUM_IT = 75
SHORT_START_LR = 1e-5
# Planned runs shorter than this were never part of the rules' benchmark (its shortest: 24
# steps, docs/BENCHMARKS.md "LR finder rules"): their suggestion is reported not confident.
SHORT_RUN = 24

# --------------------------------------------------------------------------
# Result
# --------------------------------------------------------------------------
@dataclass
class LRFinderResult:
    """What :func:`lr_find` measured.

    Attributes:
        lrs: Learning rate of every completed optimizer step, float64[n].
        losses: Raw training loss of each step (mean over its batch; NaN/inf kept as
            recorded), float64[n].
        smoothed: Exponentially smoothed, bias-corrected loss (``beta``), float64[n]; NaN
            from the first non-finite raw loss on.
        suggestions: ``{rule: lr}`` for every rule in :data:`RULES` (NaN when the sweep was
            too short to say).
        rule, suggestion: The rule used for the answer and its LR (``suggestions[rule]``).
        planned_steps: Optimizer steps of the one-cycle run the answer is for (what the
            ``"budget"`` rule assumed; the default rule does not depend on it);
            None when unknown (``"budget"`` then assumes a run of at least
            ``BUDGET_STEPS`` = 1000 steps).
        confident, warning: ``confident`` is False when the curve gave no trustworthy answer (flat,
            noisy, or stopped too early, see :func:`assess`); ``warning`` says why
            (None when confident). :func:`lr_find` also issues it as a warning.
        batch_size: The batch the answer is valid for: samples per optimizer step, i.e.
            ``micro_batch_size * accum_steps``. ``fit(max_lr="find")`` measures at
            its global batch (``accum_steps`` = the number of cores) and uses the
            answer as is; only a ``max_lr`` number passed to ``fit`` is scaled.
        micro_batch_size, accum_steps: Samples per forward pass and micro-batches accumulated
            per step.
        optimizer: Name of the optimizer class the sweep used (e.g. ``"SGD"``).
        stop_reason: ``"num_it"`` (the sweep ran to ``end_lr``), ``"diverged"`` (smoothed loss
            above ``diverge_factor`` x best) or ``"nan"`` (a non-finite loss).
        backend, device: Where it ran (``"xla"``/``"torch"``, e.g. ``"xla:0"``, ``"cpu"``).
        compiles: XLA graph compilations during each step, int[n] (zeros on plain torch);
            after the first two steps they should be 0.
        devices: Devices the sweep's step ran on: 1 (one core), or the mesh size when
            it ran as a ``"spmd"``/``"fsdp"`` mesh run (``micro_batch_size`` is then the
            global micro-batch, split over the devices).
        strategy: ``"spmd"``/``"fsdp"`` for a mesh run, else None.
        num_it: The sweep's planned length in optimizer steps (``len(lrs)`` is those run).
        note: How the sweep was sized against the planned run, in words (None: as asked).
        placement: Which way it ran and why, in words (set by
            :meth:`OneCycleTrainer.find_lr <xla_utils.train.trainer.OneCycleTrainer.find_lr>`
            under a mesh strategy; ``""`` for a plain ``lr_find``).
        shardings: Seen inside a mesh run: the XLA sharding of the largest parameter and
            of the first input batch (``{"parameter": ..., "batch": ...}``); empty on one core.
    """

    lrs: np.ndarray
    losses: np.ndarray
    smoothed: np.ndarray
    suggestions: dict[str, float]
    rule: str
    suggestion: float
    batch_size: int
    micro_batch_size: int
    accum_steps: int
    optimizer: str
    stop_reason: str
    backend: str
    device: str
    compiles: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    planned_steps: int | None = None
    confident: bool = True
    warning: str | None = None
    devices: int = 1
    strategy: str | None = None
    placement: str = ""
    shardings: dict[str, str] = field(default_factory=dict)
    num_it: int = NUM_IT
    note: str | None = None

    def summary(self) -> str:
        """One line: the suggestion, the batch it is for, and whether it is confident
        (and why not), as ``fit(max_lr="find")`` prints it."""
        where = "one core" if self.strategy is None else f"a mesh of {self.devices} devices"
        run = "" if self.planned_steps is None else f", run of {self.planned_steps} steps"
        head = (f"lr_find suggests max_lr {self.suggestion:.3g} for the global batch "
                f"{self.batch_size} ({self.micro_batch_size} x {self.accum_steps} micro-batches on "
                f"{where}, rule {self.rule}{run}, {len(self.lrs)} sweep steps)")
        if not self.confident:
            return (f"{head}: NOT confident: {self.warning}. Look at result.plot() "
                    "(trainer.lr_finder_result) and consider max_lr=<number>.")
        fall = curve_drop(self.lrs, self.smoothed, self.num_it)
        why = "" if fall is None else (
            f" (the smoothed loss fell {100 * (fall[0] - fall[1]) / max(abs(fall[0]), 1e-12):.0f}%, "
            f"{fall[0]:.3g} -> {fall[1]:.3g}, before the LR grew too high)")
        return f"{head}: confident{why}."

    def __repr__(self) -> str:
        others = ", ".join(f"{r}={v:.3g}" for r, v in self.suggestions.items())
        budget = "unknown" if self.planned_steps is None else f"{self.planned_steps} steps"
        doubt = "" if self.confident else f"; NOT CONFIDENT: {self.warning}"
        return (f"LRFinderResult(suggestion={self.suggestion:.3g} ({self.rule}, planned run "
                f"{budget}) for batch {self.batch_size} with {self.optimizer}; {others}; "
                f"{len(self.lrs)} sweep steps, stopped: {self.stop_reason}; on {self.device}"
                f"{'' if self.strategy is None else f' (mesh of {self.devices}, {self.strategy})'}"
                f"{doubt})")

    def plot(self, path: str | os.PathLike | None = None, skip_start: int = 0,
             skip_end: int = 0):
        """Plot loss against LR (log scale), marking every rule's suggestion and
        the chosen one. Needs matplotlib (``pip install 'xla_utils[plot]'``).

        ``path``: write a PNG there and return the figure (no window is opened);
        without it the figure is made with pyplot, so a notebook shows it.
        ``skip_start`` / ``skip_end``: points left out at either end (default 0).
        Returns the ``matplotlib.figure.Figure``.
        """
        try:
            import matplotlib
        except ImportError:
            raise ImportError("LRFinderResult.plot needs matplotlib: pip install 'xla_utils[plot]' "
                              "(or pip install matplotlib)") from None
        if path is not None:
            from matplotlib.backends.backend_agg import FigureCanvasAgg
            from matplotlib.figure import Figure

            fig = Figure(figsize=(6.4, 4.2))
            FigureCanvasAgg(fig)
            ax = fig.add_subplot()
        else:
            import matplotlib.pyplot as plt

            fig, ax = plt.subplots(figsize=(6.4, 4.2))
        del matplotlib
        end = len(self.lrs) - skip_end
        lrs, raw, sm = (a[skip_start:end] for a in (self.lrs, self.losses, self.smoothed))
        ax.plot(lrs, raw, color="0.75", lw=0.8, label="loss")
        ax.plot(lrs, sm, color="C0", lw=1.6, label="smoothed loss")
        ok = np.isfinite(sm)
        markers = {"descent": "*", "budget": "P", "between": "o", "minimum": "v", "steep": "^",
                   "valley": "s", "slide": "D"}
        for r, lr in self.suggestions.items():
            if not math.isfinite(lr) or not ok.any():
                continue
            y = float(np.interp(np.log(lr), np.log(lrs[ok]), sm[ok]))
            chosen = r == self.rule
            ax.plot([lr], [y], linestyle="none", marker=markers.get(r, "o"),
                    ms=10 if chosen else 6, color="C3" if chosen else "0.3",
                    label=f"{r}: {lr:.2g}" + (" (suggestion)" if chosen else ""))
        if ok.any():  # keep the divergence tail from squashing the interesting part
            finite_raw = raw[np.isfinite(raw)]
            lo = min(float(sm[ok].min()), float(finite_raw.min()) if finite_raw.size else math.inf)
            hi = float(sm[ok][0])
            ax.set_ylim(lo - 0.1 * (hi - lo + 1e-12), hi + 0.6 * (hi - lo + 1e-12))
        ax.set_xscale("log")
        ax.set_xlabel("learning rate")
        ax.set_ylabel("training loss")
        ax.set_title(f"LR finder: {self.optimizer}, batch {self.batch_size}, "
                     f"suggestion {self.suggestion:.2g}")
        ax.legend(fontsize=8)
        ax.grid(True, which="both", alpha=0.3)
        if path is not None:
            fig.savefig(os.fspath(path), dpi=110, bbox_inches="tight")
        return fig


# --------------------------------------------------------------------------
# lr_find
# --------------------------------------------------------------------------
@dataclass
class _Config:
    model: Any
    loss: Callable[..., torch.Tensor]
    data: Any
    batch_size: int
    optimizer: OptimizerSpec
    weight_decay: float
    start_lr: float
    end_lr: float
    num_it: int
    beta: float
    diverge_factor: float
    accum_steps: int
    rule: str
    planned_steps: int | None
    seed: int
    shuffle: bool
    num_workers: int | None
    batch_tfm: Callable[[torch.Tensor], torch.Tensor]
    show_progress: bool
    parent_pid: int
    compile_cache: Any = "auto"
    mesh: StrategyPlan | None = None  # sweep on that mesh
    device: DeviceRequest = DeviceRequest()


@keyword_help
def lr_find(model: torch.nn.Module | Callable[[], torch.nn.Module],
            loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
            data: Any, batch_size: int, optimizer: OptimizerSpec = "sgd",
            start_lr: float = 1e-7, end_lr: float = 10.0, num_it: int | None = None, *,
            planned_steps: int | None = None, epochs: int | None = None,
            max_share: float | None = None, run_cores: int = 1,
            weight_decay: float = 0.0, beta: float = BETA, diverge_factor: float = 4.0,
            accum_steps: int = 1, rule: str = DEFAULT_RULE, seed: int = 0,
            shuffle: bool = True, num_workers: int | None = None,
            batch_tfm: Callable[[torch.Tensor], torch.Tensor] | None = None,
            show_progress: bool = True, simulate: int | None = None,
            placement: runtime.Placement | None = None,
            timeout: float | None = None, compile_cache: Any = "auto",
            mesh: StrategyPlan | None = None, precision: str = "auto",
            channels_last: bool | str = "auto") -> LRFinderResult:
    """LR range test on one core; returns an :class:`LRFinderResult` (docs/LR_FINDER.md).

    Args:
        model: An ``nn.Module`` or a zero-argument factory; its weights are unchanged after.
        loss: ``loss(model_output, target) -> scalar``, mean over the batch.
        data: Map-style dataset, batched by :func:`xla_utils.data.iterate_batches` (shuffled,
            full batches, as many passes as needed) and fed as by the trainer.
        batch_size: Samples per forward pass: the per-core batch of the run you plan.
        optimizer: ``"sgd"`` (momentum 0.9), ``"adam"``, ``"adamw"`` or a callable; the
            finder builds its own, so yours is never touched.
        start_lr, end_lr, num_it: Step ``i`` uses ``start_lr * (end_lr/start_lr) **
            (i/(num_it-1))``; defaults 1e-7, 10 and None (100 steps, fewer under ``max_share``).
        planned_steps, epochs: The one-cycle run you plan, in optimizer steps or epochs (at
            most one; None: unknown). Used by the ``"budget"`` rule; under ``SHORT_RUN`` (24)
            steps the result is not confident.
        max_share, run_cores: The sweep may cost at most ``max_share`` of the planned run on
            ``run_cores`` cores, else it is shortened and says so (:func:`sweep_length`;
            default None: no limit; ``fit(max_lr="find")`` passes :data:`FIT_SHARE`).
        weight_decay: Passed to the optimizer (default 0.0).
        beta: Loss smoothing, bias corrected (default 0.98).
        diverge_factor: Stop when the smoothed loss exceeds this multiple of its best
            (default 4); a NaN or infinite loss stops too.
        accum_steps: Micro-batches per step (default 1): the answer is for the global batch
            ``accum_steps * batch_size`` (``fit(max_lr="find")`` uses its core count).
        rule: One of :data:`RULES` for ``result.suggestion`` (default ``"descent"``, chosen by
            its worst case over 38 problems; every rule's answer is in ``result.suggestions``).
        seed: Seeds the data order and the finder's RNGs (default 0); yours are restored.
        shuffle, num_workers: Passed to :func:`xla_utils.data.iterate_batches`.
        batch_tfm: ``x -> x`` on the device instead of the default input preparation.
        show_progress: A titled progress bar with its time left (default True).
        simulate: ``1``: one simulated XLA:CPU device (see :func:`xla_utils.runtime.launch`).
        placement: Instead of ``simulate``: the caller's resolved placement
            (:func:`xla_utils.runtime.resolve`); the sweep runs on one of its devices.
        timeout: Seconds before a forked run is killed (``TimeoutError``); default none.
        compile_cache: As ``TrainerConfig.compile_cache`` (default ``"auto"``: TPUs only).
        mesh: A :class:`~xla_utils.step.strategy.StrategyPlan`: sweep as that mesh run (each
            micro-batch split over the mesh). Default None (one core).
        precision, channels_last: As ``TrainerConfig``'s on the torch backend (default
            ``"auto"``); XLA sweeps in float32 (:mod:`xla_utils.step.device_plan`).

    The host reads the previous step's loss after each step boundary: one transfer per
    step that never stalls the device (the divergence test is one step late).
    """
    optimizer = _refused(data, optimizer, batch_size)
    runtime.check_compile_cache_option(compile_cache)
    placement = (placement or runtime.resolve(1, simulate)).one()
    runtime.prestart_simulation(placement)
    check_before_launch(precision, placement, mesh=mesh is not None)
    data, batch_tfm, spec = _fed(data, batch_tfm, model, loss)
    planned_steps = _check_sweep(data, batch_size, start_lr, end_lr, num_it, accum_steps,
                                 beta, diverge_factor, rule, planned_steps, epochs)
    num_it, start_lr, beta, note = _sized(num_it, planned_steps, run_cores, max_share,
                                          start_lr, end_lr, beta)
    cfg = _Config(model=model, loss=loss, data=data, batch_size=batch_size, optimizer=optimizer,
                  weight_decay=weight_decay, start_lr=float(start_lr), end_lr=float(end_lr),
                  num_it=int(num_it), beta=float(beta), diverge_factor=float(diverge_factor),
                  accum_steps=int(accum_steps), rule=choice(rule, RULES, "rule"),
                  planned_steps=planned_steps, seed=int(seed), shuffle=shuffle, num_workers=num_workers, batch_tfm=batch_tfm,
                  show_progress=show_progress,
                  parent_pid=os.getpid(), compile_cache=compile_cache,
                  device=DeviceRequest(precision, channels_last, spec))
    res = (launch_on_mesh(_mesh_replica, (cfg,), mesh, timeout) if mesh is not None else
           runtime.launch_job(_replica, (cfg,), placement=placement, timeout=timeout,
                              sim_threads=True))
    return _judged(res, cfg, note)


def _judged(res: LRFinderResult, cfg: _Config, note: str | None) -> LRFinderResult:
    """``res`` with the sweep's length, its note and how far to trust it (a
    ``RuntimeWarning`` at :func:`lr_find`'s caller when not confident)."""
    res.num_it, res.note = cfg.num_it, note
    res.warning = _doubt(res, cfg)
    if res.warning is not None:
        res.confident = False
        warnings.warn(f"LR finder: {res.warning}. The suggestion ({res.suggestion:.3g}, rule "
                      f"{res.rule}) is not trustworthy: look at result.plot() and pick max_lr "
                      "yourself", RuntimeWarning, stacklevel=4)  # lr_find's caller
    return res


def _refused(data: Any, optimizer: OptimizerSpec, batch_size: int) -> OptimizerSpec:
    """:func:`lr_find`'s checks of its data, optimizer and batch size before any device
    time (``TypeError`` / ``ValueError`` with the fix); returns the resolved optimizer spec."""
    if isinstance(data, torch.utils.data.DataLoader):
        raise TypeError("lr_find takes the dataset, not a DataLoader: it batches the data itself "
                        "so that it knows the batch size its answer is for (pass loader.dataset)")
    if isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError("pass the optimizer spec ('sgd', 'adam', 'adamw' or a callable), not an "
                        "optimizer instance: lr_find builds its own so that yours stays untouched")
    optimizer = resolve_optimizer(optimizer)  # a typo fails here, not inside a replica
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    return optimizer


def _sized(num_it: int | None, planned_steps: int | None, run_cores: int,
           max_share: float | None, start_lr: float, end_lr: float,
           beta: float) -> tuple[int, float, float, str | None]:
    """``(num_it, start_lr, beta, note)`` of the sweep (:func:`sweep_length`); a shortened one
    starts at :data:`SHORT_START_LR` with the same smoothing per decade of LR as the full
    sweep (unless ``beta`` was chosen). The note is printed here."""
    sized, note = sweep_length(num_it, planned_steps, run_cores, max_share)
    if num_it is None and sized < NUM_IT:
        decades = math.log10(end_lr / start_lr)
        start_lr = max(start_lr, min(SHORT_START_LR, end_lr / 10))
        if beta == BETA:
            beta = BETA ** (NUM_IT / decades * math.log10(end_lr / start_lr) / sized)
    if note is not None:
        print(note, flush=True)
    return sized, start_lr, beta, note


def _doubt(res: LRFinderResult, cfg: _Config) -> str | None:
    """Why ``res``'s suggestion should not be trusted (None: it can be): no suggestion, a
    flat or noisy curve (:func:`~xla_utils.train.lr_rules.assess`), a planned run too short."""
    if not math.isfinite(res.suggestion):
        return (f"the sweep stopped ({res.stop_reason}) after {len(res.lrs)} steps, too early "
                f"for a suggestion; lower start_lr ({cfg.start_lr:g}) or check the data")
    why = assess(res.lrs, res.losses, res.smoothed, num_it=cfg.num_it)
    if why is None and cfg.planned_steps is not None and cfg.planned_steps < SHORT_RUN:
        why = (f"the planned run has only {cfg.planned_steps} optimizer steps, fewer than any run "
               f"the rules were validated on ({SHORT_RUN}+, docs/BENCHMARKS.md): a run that "
               "short barely leaves its warm-up")
    return why


def _fed(data: Any, batch_tfm: Callable | None, model: Any, loss: Callable
         ) -> tuple[Any, Callable, Any]:
    """``data`` as the loader collates it, the device transform of its inputs (the
    trainer's feeding, :func:`xla_utils.step.inputs.inspect_inputs`) and their ``InputSpec``;
    refuses, before any device time, a sample that cannot be fed. Targets are fed as a fit
    feeds them (:func:`xla_utils.step.inputs.plan_targets`: float32 for regression and
    one-logit binary), when ``model`` is a module and the loss or data is of those kinds."""
    from ..data import IMAGENET_MEAN, IMAGENET_STD
    from ..step.inputs import inspect_inputs, loss_kind, plan_targets

    spec = inspect_inputs(data, "data", verb="lr_find")
    if batch_tfm is None:
        batch_tfm = functools.partial(spec.prepare, mean=IMAGENET_MEAN, std=IMAGENET_STD,
                                      flip=False)
    floats = loss_kind(loss) in ("regression", "binary") or getattr(data, "task", None) == "regression"
    if floats and isinstance(model, torch.nn.Module):  # (its one CPU forward only where it matters)
        spec, _ = plan_targets(model, loss, data, spec, "data", batch_tfm, lambda m, b: m(b[0]))
    return spec.feed(data), batch_tfm, spec


def sweep_length(num_it: int | None, planned_steps: int | None, run_cores: int = 1,
                 max_share: float | None = None) -> tuple[int, str | None]:
    """``(steps, note)``: how long :func:`lr_find` sweeps. ``num_it`` when given; else
    :data:`NUM_IT` (100), unless that costs more than ``max_share`` of the planned run
    (``planned_steps`` optimizer steps shared by ``run_cores`` cores, so a sweep step costs
    ``run_cores`` run steps): then as many steps as ``max_share`` allows, never fewer than
    :data:`MIN_NUM_IT` (75), from :data:`SHORT_START_LR` (1e-5), and ``note`` says so (None
    when nothing was shortened)."""
    if num_it is not None or max_share is None or planned_steps is None:
        return (NUM_IT if num_it is None else num_it), None
    share = NUM_IT * run_cores / planned_steps
    if share <= max_share:
        return NUM_IT, None
    allowed = int(max_share * planned_steps / run_cores)
    n = max(MIN_NUM_IT, allowed)
    cores = f"{run_cores} cores" if run_cores > 1 else "one core"
    note = (f"lr_find: a sweep of {NUM_IT} steps would take about {share:.2g}x as long as the "
            f"planned run ({planned_steps} steps on {cores}); sweeping {n} steps from LR "
            f"{SHORT_START_LR:g} instead of {NUM_IT}")
    cost = n * run_cores / planned_steps
    note += (f" (about {cost:.2g}x the run, the fewest it shortens to)" if n > allowed else
             f" (at most {max_share:.0%} of the run)")
    note += (": the suggestion is less precise (docs/BENCHMARKS.md, \"LR finder: shorter "
             f"sweeps\"). Pass num_it={NUM_IT} to sweep the whole range: trainer.find_lr("
             f"num_it={NUM_IT}) (or lr_find(num_it={NUM_IT})), then "
             "fit(max_lr=trainer.lr_finder_result.suggestion).")
    if cost >= 1:
        note += " For a run this short a fixed max_lr may serve as well."
    return n, note


def _check_sweep(data: Any, batch_size: int, start_lr: float, end_lr: float, num_it: int | None,
                 accum_steps: int, beta: float, diverge_factor: float, rule: str,
                 planned_steps: int | None, epochs: int | None) -> int | None:
    """Refuse invalid :func:`lr_find` arguments (``ValueError``); return the planned
    optimizer steps (from ``epochs`` over ``data`` when given)."""
    if not 0 < start_lr < end_lr:
        raise ValueError(f"need 0 < start_lr < end_lr, got {start_lr!r}, {end_lr!r}")
    if num_it is not None and (not isinstance(num_it, int) or num_it < 2):
        raise ValueError(f"num_it must be an int >= 2 (or None), got {num_it!r}")
    if accum_steps < 1:
        raise ValueError(f"accum_steps must be >= 1, got {accum_steps!r}")
    if not 0.0 <= beta < 1.0:
        raise ValueError(f"beta must be in [0, 1), got {beta!r}")
    if diverge_factor <= 1.0:
        raise ValueError(f"diverge_factor must be > 1, got {diverge_factor!r}")
    if choice(rule, RULES, "rule") not in RULES:  # a string: any case, else a suggestion
        raise ValueError(f"rule must be one of {RULES}, got {rule!r}")
    if len(data) < batch_size:
        raise ValueError(f"data has {len(data)} samples, fewer than one batch of {batch_size}: "
                         "lower batch_size or give more data")
    if epochs is not None:
        if planned_steps is not None:
            raise ValueError("give planned_steps or epochs, not both")
        if not isinstance(epochs, int) or epochs < 1:
            raise ValueError(f"epochs must be a positive int, got {epochs!r}")
        planned_steps = max(epochs * (len(data) // (batch_size * accum_steps)), 1)
    if planned_steps is not None and (not isinstance(planned_steps, int) or planned_steps < 1):
        raise ValueError(f"planned_steps must be a positive int, got {planned_steps!r}")
    return planned_steps


def _replica(cfg: _Config) -> LRFinderResult:
    # In a forked child nothing of the caller's can change; in-process, the
    # caller's model and RNGs are restored, whatever happens.
    in_process = os.getpid() == cfg.parent_pid
    saved = _CallerState.take(cfg.model if isinstance(cfg.model, torch.nn.Module) else None) \
        if in_process else None
    threads = torch.get_num_threads()
    try:
        if in_process:  # a forked replica may not resize torch's pool (forksafe)
            torch.set_num_threads(sweep_threads(cfg.data, cfg.num_workers))
        runtime.enable_compile_cache(cfg.compile_cache)  # before anything compiles
        # (autograd after fork is handled by runtime.launch for every replica)
        return _sweep(cfg)
    finally:
        if in_process:
            torch.set_num_threads(threads)
        if saved is not None:
            saved.restore()


def sweep_threads(data: Any, num_workers: int | None) -> int:
    """torch's intra-op threads for a sweep in the calling process: the cores this process
    may run on, less the loader's threads (a cache's ring: ``num_workers``, default
    :func:`~xla_utils.data.default_loader_threads`), at least 1.

    torch's default, every core, on top of the loader's threads oversubscribes a small host:
    an OpenMP team whose threads wait for each other on a busy CPU spins instead of
    computing (a ResNet-18 sweep on a loaded 2-core host: 268 s with 2 threads, 53 s with
    1; docs/BENCHMARKS.md "LR finder: threads").
    """
    from ..data import CachedImageDataset, default_loader_threads

    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    if num_workers is not None:
        loader = num_workers if isinstance(data, CachedImageDataset) else 0  # else processes
    else:
        loader = default_loader_threads() if isinstance(data, CachedImageDataset) else 0
    return max(1, cores - loader)


def _mesh_replica(plan: StrategyPlan, cfg: _Config) -> LRFinderResult:
    """The sweep in the SPMD process, on ``plan``'s mesh (the caller's model is a copy)."""
    from ..step.strategy import enter_mesh

    _, run = enter_mesh(plan, cfg.compile_cache)
    return _sweep(cfg, run)


@dataclass
class _CallerState:
    """Bit-exact snapshot of what an in-process sweep changes."""

    py_rng: Any
    np_rng: Any
    torch_rng: torch.Tensor
    cuda_rng: list[torch.Tensor] | None
    module: torch.nn.Module | None
    device: torch.device | None
    tensors: dict[str, torch.Tensor]
    grads: dict[str, torch.Tensor | None]
    training: dict[str, bool]

    @classmethod
    def take(cls, module: torch.nn.Module | None) -> "_CallerState":
        tensors: dict[str, torch.Tensor] = {}
        grads: dict[str, torch.Tensor | None] = {}
        training: dict[str, bool] = {}
        dev = None
        if module is not None:
            with torch.no_grad():
                for name, p in module.named_parameters():
                    dev = dev or p.device
                    tensors["p:" + name] = p.detach().clone()
                    grads[name] = None if p.grad is None else p.grad.detach().clone()
                # named_buffers includes non-persistent buffers, unlike state_dict
                for name, b in module.named_buffers():
                    tensors["b:" + name] = b.detach().clone()
            training = {name: m.training for name, m in module.named_modules()}
        return cls(
            py_rng=random.getstate(), np_rng=np.random.get_state(),
            torch_rng=torch.get_rng_state(),
            # is_initialized, not is_available: asking would start the driver (no fork after)
            cuda_rng=torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None,
            module=module, device=dev, tensors=tensors, grads=grads, training=training)

    def restore(self) -> None:
        random.setstate(self.py_rng)
        np.random.set_state(self.np_rng)
        torch.set_rng_state(self.torch_rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.cuda_rng)
        m = self.module
        if m is None:
            return
        if self.device is not None:
            m.to(self.device)
        with torch.no_grad():
            for name, p in m.named_parameters():
                p.copy_(self.tensors["p:" + name])
                g = self.grads[name]
                p.grad = None if g is None else g.clone()
            for name, b in m.named_buffers():
                b.copy_(self.tensors["b:" + name])
        for name, mod in m.named_modules():
            mod.training = self.training[name]


class _StepClock:
    """The sweep's time estimate, measured: after :data:`WARM_STEPS` steps (compilation,
    first allocations) it times :data:`TIMED_STEPS` more and prints, once, what the whole
    sweep will take at that pace.

    Args:
        num_it: The sweep's steps.
        show: Print the estimate (the progress bar is shown).
    """

    WARM_STEPS, TIMED_STEPS = 3, 5  # past the loader ring's head start

    def __init__(self, num_it: int, show: bool) -> None:
        self.num_it, self.show = num_it, show
        self.t0 = time.perf_counter()
        self.ends: list[float] = []
        self.estimate: float | None = None  # seconds for all num_it steps

    def step_done(self, bar: Any = None) -> None:
        """A step ended (its loss read or queued): estimate once enough are timed."""
        self.ends.append(time.perf_counter())
        n, warm, timed = len(self.ends), self.WARM_STEPS, self.TIMED_STEPS
        if n != warm + timed or n >= self.num_it:
            return
        per_step = (self.ends[-1] - self.ends[warm - 1]) / timed
        self.estimate = self.ends[-1] - self.t0 + per_step * (self.num_it - n)
        if self.show:
            if hasattr(bar, "close_line"):
                bar.close_line()  # a redrawn bar line ends before this one
            print(f"lr_find: {per_step:.3g} s per step after {warm} warm-up steps: about "
                  f"{self.estimate:.0f} s for all {self.num_it} steps (less if the loss "
                  "diverges first)", flush=True)


def _micro_batches(cfg: _Config) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(x, y) host batches, passing over the data as often as needed."""
    from ..data import iterate_batches

    epoch = 0
    while True:
        batches = iterate_batches(cfg.data, cfg.batch_size, shuffle=cfg.shuffle, seed=cfg.seed,
                                  epoch=epoch, drop_last=True, num_workers=cfg.num_workers)
        n = 0
        for x, y, _valid in batches:
            n += 1
            yield x, y
        if n == 0:  # would loop forever
            raise ValueError(f"no batch of {cfg.batch_size} in a dataset of {len(cfg.data)} samples")
        epoch += 1


class _Curve:
    """The sweep's loss curve: raw and smoothed losses, and when to stop.

    Args:
        beta: Smoothing, ``avg = beta*avg + (1-beta)*loss``, bias corrected.
        diverge_factor: Stop when the smoothed loss exceeds this multiple of its best.
    """

    def __init__(self, beta: float, diverge_factor: float) -> None:
        self.beta, self.diverge_factor = beta, diverge_factor
        self.raw: list[float] = []
        self.smoothed: list[float] = []
        self.avg, self.best = 0.0, math.inf
        self.stop_reason = "num_it"

    def record(self, loss_value: float) -> bool:
        """Add one step's loss; True when the sweep must stop."""
        self.raw.append(loss_value)
        if not math.isfinite(loss_value) or self.stop_reason == "nan":
            self.smoothed.append(math.nan)
            self.stop_reason = "nan"
            return True
        self.avg = self.beta * self.avg + (1 - self.beta) * loss_value
        sm = self.avg / (1 - self.beta ** len(self.raw))
        self.smoothed.append(sm)
        self.best = min(self.best, sm)
        if sm > self.diverge_factor * self.best:
            self.stop_reason = "diverged"
            return True
        return False


def _placed(cfg: _Config, run: MeshRun | None, dev: torch.device) -> tuple[torch.nn.Module, Iterator]:
    """The sweep's model on the device(s) and its device micro-batches: on one core,
    or (``run``: a :class:`~xla_utils.step.strategy.MeshRun`) placed and split as the mesh run."""
    model = cfg.model if isinstance(cfg.model, torch.nn.Module) else cfg.model()
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be an nn.Module or a factory returning one, got {type(model).__name__}")
    if run is not None:
        return run.wrap(model).train(), run.feed(_micro_batches(cfg))
    # Prefetching to the CPU would only alias host buffers that the data
    # iterator may recycle; on a real device it overlaps transfers with compute.
    depth = 0 if dev.type == "cpu" else 2
    return model.to(dev).train(), runtime.device_prefetch(_micro_batches(cfg), depth=depth)


def _mesh_shardings(model: torch.nn.Module, x: torch.Tensor) -> dict[str, str]:
    """The shardings a mesh sweep runs with: its largest parameter's and the batch's."""
    from ..runtime.spmd import sharding_spec

    big = max(model.parameters(), key=lambda p: p.numel())
    return {"parameter": sharding_spec(big) or "{replicated}",
            "batch": sharding_spec(x) or "{replicated}"}


def _sweep(cfg: _Config, run: MeshRun | None = None) -> LRFinderResult:
    dev = runtime.device()
    runtime.set_seed(cfg.seed)
    model, batches = _placed(cfg, run, dev)
    # a fit's precision and layout on the torch backend; XLA sweeps in float32, as it always has
    amp = DevicePlan.build(cfg.device if dev.type != "xla" else DeviceRequest("fp32"), dev, model)
    opt = make_optimizer(cfg.optimizer, model.parameters(), lr=cfg.start_lr,
                         weight_decay=cfg.weight_decay)
    tfm = cfg.batch_tfm
    k = cfg.accum_steps
    shardings: dict[str, str] = {}
    ratio = cfg.end_lr / cfg.start_lr

    lrs: list[float] = []
    compiles: list[int] = []
    curve = _Curve(cfg.beta, cfg.diverge_factor)
    record, raw, smoothed = curve.record, curve.raw, curve.smoothed
    pending: torch.Tensor | None = None  # the last step's loss, still on the device

    where = "one core" if run is None else f"a mesh of {run.devices} devices"
    pb = progress_bar(cfg.num_it, show=cfg.show_progress, console=runtime.text_progress(),
                      title=f"lr_find: {cfg.num_it} steps x {k} micro-batch{'es' if k > 1 else ''} "
                            f"on {where}")
    clock = _StepClock(cfg.num_it, show=cfg.show_progress)
    try:
        for i in pb:
            before = runtime.xla_counters()["compiles"]
            lr = cfg.start_lr * ratio ** (i / (cfg.num_it - 1))
            set_hparams(opt, lr)
            opt.zero_grad(set_to_none=True)
            total = None
            for j in range(k):
                x, y = next(batches)
                if run is not None and not shardings:
                    shardings = _mesh_shardings(model, x)
                with amp.autocast:
                    step_loss = cfg.loss(model(amp.layout(tfm(x))), y)
                amp.backward(step_loss / k if k > 1 else step_loss)
                total = step_loss.detach() if total is None else total + step_loss.detach()
                if j < k - 1:
                    runtime.sync()
            amp.step(opt)
            runtime.sync()
            lrs.append(float(opt.param_groups[0]["lr"]))
            stop = pending is not None and record(pending.item() / k)
            compiles.append(runtime.xla_counters()["compiles"] - before)
            clock.step_done(pb)
            pending = total
            if hasattr(pb, "comment") and smoothed:
                pb.comment = f"lr {lrs[len(smoothed) - 1]:.2e}  loss {smoothed[-1]:.4f}"
            if stop:
                if hasattr(pb, "on_iter_end"):
                    pb.on_iter_end()
                break
        if pending is not None:
            record(pending.item() / k)
    finally:
        batches.close()
        amp.release(model)  # an in-process sweep ran on the caller's own model

    lrs_a = np.asarray(lrs, dtype=np.float64)
    sm_a = np.asarray(smoothed, dtype=np.float64)
    suggestions = suggest(lrs_a, sm_a, num_it=cfg.num_it, planned_steps=cfg.planned_steps)
    return LRFinderResult(
        lrs=lrs_a, losses=np.asarray(raw, dtype=np.float64), smoothed=sm_a,
        suggestions=suggestions, rule=cfg.rule, suggestion=suggestions[cfg.rule],
        batch_size=cfg.batch_size * k, micro_batch_size=cfg.batch_size, accum_steps=k,
        optimizer=type(opt).__name__, stop_reason=curve.stop_reason, backend=runtime.backend(),
        device=str(dev), compiles=np.asarray(compiles, dtype=np.int64),
        planned_steps=cfg.planned_steps, devices=1 if run is None else run.devices,
        strategy=None if run is None else run.plan.strategy, shardings=shardings)
