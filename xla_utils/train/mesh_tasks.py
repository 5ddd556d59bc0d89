"""``find_lr``, ``check`` and ``debug`` of a mesh strategy (``"spmd"``/``"fsdp"``) as mesh runs.

What :class:`~xla_utils.train.trainer.OneCycleTrainer` does on top of :mod:`xla_utils.step.strategy`
when the strategy is not ``"spawn"``: where the LR sweep runs (:func:`sweep_placement`:
one core, accumulating to the fit's global batch, or the mesh when one core of the target
TPU cannot hold the model), the sweep itself (:func:`find_lr`) and the mesh half of
``check`` (:func:`check_on_mesh`). Imports run one way: trainer -> this module ->
strategy, loop, inputs, lr_finder, debug, readiness, findings, memory (none of which imports
this one).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import torch

from .. import runtime
from ..data import iterate_batches
from ..step.inputs import inspect_inputs, plan_targets, require_labels
from .loop import input_preparer
from ..step.strategy import plan_strategy
from ..utils.units import format_bytes

if TYPE_CHECKING:
    from .config import TrainerConfig
    from ..diagnostics.readiness import ReadinessReport
    from ..step.inputs import InputSpec
    from .trainer import OneCycleTrainer

__all__ = ["sweep_placement", "find_lr", "check_on_mesh"]


def sweep_placement(cfg: TrainerConfig, model: torch.nn.Module, sample: Callable[[], tuple], *,
                    step: Callable, loss: Callable, devices: int, on_mesh: bool | None,
                    tpu: Any = None) -> tuple[bool, str]:
    """Where ``OneCycleTrainer.find_lr`` sweeps under ``cfg.strategy``: ``(on_mesh, why)``.

    ``"spawn"``, or ``on_mesh=False``: one core. ``on_mesh=True``: the mesh. ``None``
    (automatic): the mesh when one core of the target TPU (``tpu``: a name or
    :class:`~xla_utils.diagnostics.readiness.TPUChip`; None: this machine's TPU, else v5e) cannot
    hold the model whole: parameters + gradients + optimizer state (from the parameter
    sizes, :func:`xla_utils.diagnostics.memory.state_bytes`) + the activations of one
    ``batch_size`` batch (:func:`xla_utils.diagnostics.memory.activation_bytes`: one host forward of
    ``sample()``'s few rows, scaled; skipped
    when the states alone do not fit) above ``HBM_USABLE`` (90%) of its HBM.
    """
    from ..diagnostics.memory import activation_bytes, state_bytes
    from ..diagnostics.findings import HBM_USABLE, resolve_tpu

    if cfg.strategy == "spawn" and on_mesh:
        raise ValueError("on_mesh=True sweeps as a mesh run, but strategy='spawn' has no mesh. "
                         "Fix: strategy='spmd' or 'fsdp', or on_mesh=None")
    if cfg.strategy == "spawn" or on_mesh is False:
        why = "strategy='spawn'" if cfg.strategy == "spawn" else "asked: on_mesh=False"
        return False, f"on one core ({why})"
    mesh = f"on the {devices}-device mesh as strategy={cfg.strategy!r} runs"
    if on_mesh:
        return True, f"{mesh} (asked: on_mesh=True)"
    chip = resolve_tpu(tpu)
    usable = chip.hbm_per_device * HBM_USABLE
    states, act = state_bytes(model, cfg.optimizer), 0
    if states <= usable:
        x, y = sample()
        act = activation_bytes(model, x, y, step=step, loss=loss, batch_size=cfg.batch_size,
                               bf16=cfg.precision == "bf16")
    need = (f"parameters + gradients + optimizer state {format_bytes(states)}"
            + (f" + activations at batch {cfg.batch_size} {format_bytes(act)}" if act else "")
            + f" = {format_bytes(states + act)}; {format_bytes(usable)} usable of {format_bytes(chip.hbm_per_device)}")
    if states + act > usable:
        return True, f"{mesh}: one {chip.name} core cannot hold the model whole ({need})"
    return False, (f"on one core: the model fits one {chip.name} core ({need}); its "
                   "micro-batches are accumulated to the fit's global batch")


def _sample(trainer: OneCycleTrainer, spec: InputSpec, n: int) -> tuple[torch.Tensor, Any]:
    """The first ``n`` training samples as a prepared host batch ``(x, y)``."""
    x, y, _ = next(iter(iterate_batches(spec.feed(trainer.train_data), n, shuffle=False,
                                        drop_last=True, num_workers=0)))
    return input_preparer(trainer.config.data, spec, train=False)(x), y


def find_lr(trainer: OneCycleTrainer, placement: runtime.Placement, on_mesh: bool | None,
            tpu: Any, kwargs: dict) -> Any:
    """:meth:`OneCycleTrainer.find_lr <xla_utils.train.trainer.OneCycleTrainer.find_lr>`: place
    the sweep (:func:`sweep_placement`), size its batch for the global batch of a fit on
    ``placement`` under a mesh strategy, run :func:`xla_utils.lr_find` there (the mesh, or
    one of its devices); returns its result."""
    from .lr_finder import lr_find

    cfg, devices = trainer.config, placement.replicas
    require_labels(trainer.train_data, "train_data")
    spec = inspect_inputs(trainer.train_data, "train_data", verb="lr_find", mean=cfg.mean)
    kwargs.setdefault("batch_tfm", input_preparer(cfg.data, spec, train=False))
    spec, _ = plan_targets(trainer.model, trainer.loss, trainer.train_data, spec, "train_data",
                           input_preparer(cfg.data, spec, train=False), trainer.eval_step)
    kwargs.setdefault("compile_cache", cfg.compile_cache)
    kwargs.setdefault("precision", cfg.precision)
    kwargs.setdefault("channels_last", cfg.channels_last)
    mesh, where = sweep_placement(
        cfg, trainer.model, lambda: _sample(trainer, spec, min(2, cfg.batch_size)),
        step=trainer.train_step, loss=trainer.loss, devices=devices, tpu=tpu,
        on_mesh=cfg.lr_find_on_mesh if on_mesh is None else on_mesh)
    bs, plan = cfg.batch_size, None
    if mesh:  # micro-batches of the global batch, split over the mesh as in the fit
        plan, bs = plan_strategy(cfg.devices, cfg.batch_size, trainer.model, placement), bs * devices
        kwargs.setdefault("accum_steps", cfg.accum_steps)
        if "run_cores" in kwargs:  # a sweep step on the mesh costs what a run step does
            kwargs["run_cores"] = 1
    else:
        if cfg.strategy != "spawn":  # one core, accumulating to the fit's global batch
            kwargs.setdefault("accum_steps", devices * cfg.accum_steps)
    if cfg.strategy != "spawn":
        print(f"lr_find: {where}", flush=True)
    res = lr_find(trainer.model, trainer.loss, trainer.train_data, bs, optimizer=cfg.optimizer,
                  weight_decay=cfg.weight_decay, seed=cfg.seed, mesh=plan,
                  placement=None if plan is not None else placement.one(), **kwargs)
    res.placement = where
    return res


def check_on_mesh(trainer: OneCycleTrainer, report: ReadinessReport, *, spec: InputSpec,
                  steps: int, tpu: Any, devices: int | None,
                  make_step: Callable | None = None) -> None:
    """The mesh half of :meth:`OneCycleTrainer.check <xla_utils.train.trainer.OneCycleTrainer.check>`
    under ``"spmd"``/``"fsdp"``: run the trainer's step ``steps`` times as the mesh run
    (:func:`xla_utils.diagnostics.debug.debug_run` with ``mesh=``) on ``devices`` XLA:CPU devices
    (None: the slice ``tpu`` names, e.g. ``"v5e-8"``, else this TPU's devices, else 8) and
    add its findings to ``report``: ``"strategy"`` (compiles, executions and transfers per
    step, CPU fallbacks), ``"recompile"`` (a step after the two warm-up steps compiled) and
    ``"cpu_fallback"``; under ``"fsdp"`` the ``"memory"`` verdict is the per-device one of
    the sharded states (:func:`_sharded_memory`). In place; the per-step counters go to
    ``report.measurements["mesh"]``. ``make_step``: the trainer's step
    (:class:`~xla_utils.train.steps.TrainerStepPlan`), as ``trainer.debug()`` runs it; None: a
    plain step.
    """
    from ..diagnostics.debug import debug_run
    from ..env.tpus import tpu_devices
    from ..diagnostics.findings import Finding

    cfg = trainer.config
    if devices is None:
        devices = (tpu_devices(tpu) if isinstance(tpu, str) else None) or \
            (runtime.resolve().replicas if runtime.tpu_present() else 8)
    plan = plan_strategy(cfg.devices, cfg.batch_size, trainer.model, runtime.resolve(simulate=devices))
    rep = debug_run(trainer.model, trainer.loss, trainer.train_data, batch_size=cfg.batch_size,
                    steps=steps, optimizer=cfg.optimizer, train_step=trainer.train_step,
                    prepare=input_preparer(cfg.data, spec, train=True), eval_step=trainer.eval_step,
                    inputs=spec, mesh=plan, print_report=False, make_step=make_step)
    per = {k: [d[k] for d in rep.per_step] for k in ("compiles", "executions", "to_device",
                                                      "to_host")}
    report.measurements["mesh"] = {"devices": devices, "per_step": rep.per_step,
                                   "fallback_ops": rep.fallback_ops, "losses": rep.losses}
    where = (f"strategy={cfg.strategy!r}: the sharded step on {devices} XLA:CPU devices (one "
             f"process, batch {cfg.batch_size} per device, {cfg.batch_size * devices} global)")
    late = [i + 1 for i, c in enumerate(per["compiles"]) if i >= 2 and c]
    if late:
        report.findings.append(Finding(
            "recompile", "error", f"{where} compiled again at steps {late} (compiles per step "
            f"{per['compiles']}): every such step pays a full compilation on the TPU too.",
            "keep shapes and Python scalars the same every step; trainer.debug() runs the mesh "
            "step by step"))
    if rep.fallback_ops:
        report.findings.append(Finding(
            "cpu_fallback", "warning", f"{where} ran ops on the host CPU: "
            + ", ".join(f"{k} x{v}" for k, v in rep.fallback_ops.items()),
            "replace those ops (see trainer.debug()); each one copies tensors to the host"))
    report.findings.append(Finding(
        "strategy", "info", f"{where}, {rep.steps} steps with a barrier each: compiles per step "
        f"{per['compiles']} (steps 1-2 warm up, the optimizer state appears in step 1), graph "
        f"executions {per['executions']}, host->device transfers {per['to_device']}, "
        f"device->host {per['to_host']} (the loop reads each step's loss once); "
        + ("no CPU-fallback ops." if not rep.fallback_ops else "CPU-fallback ops, see above."),
        ""))
    if cfg.strategy == "fsdp":
        _sharded_memory(report, devices, tpu)


def _sharded_memory(report: ReadinessReport, devices: int, tpu: Any) -> None:
    """Replace ``report``'s one-core memory verdict by FSDPv2's per-device one: the states
    sharded by the rules of :func:`xla_utils.diagnostics.memory.paper_memory`, activations as measured
    at the per-device batch (each device runs ``batch_size`` samples, as one core does)."""
    import math

    from ..diagnostics.memory import paper_memory
    from ..diagnostics.findings import HBM_USABLE, Finding, resolve_tpu

    meas = report.measurements
    at = next((i for i, f in enumerate(report.findings) if f.code == "memory"), None)
    if at is None or not meas.get("param_shapes"):
        return
    chip = resolve_tpu(tpu)
    n = max(sum(math.prod(s) for s in meas["param_shapes"]), 1)
    per = max(round(meas["param_bytes"] / n), 1)
    act = meas.get("activation_bytes") or 0
    row = paper_memory(meas["param_shapes"], devices, bytes_per_param=per, activations=act,
                       optimizer_states=round(meas["optimizer_state_bytes"] /
                                              max(meas["param_bytes"], 1)))["fsdp"]
    usable = chip.hbm_per_device * HBM_USABLE
    fits = row.total <= usable
    old = report.findings[at]
    report.findings[at] = Finding(
        "memory", "info" if fits else "error",
        f"{old.message} Under strategy='fsdp' on {devices} {chip.name} devices (sharding rules "
        f"on paper): about {format_bytes(row.total)} per device ({format_bytes(row.states)} of sharded states + "
        f"{format_bytes(act)} of activations) of {format_bytes(usable)} usable: "
        + ("it fits." if fits else "it does not fit either."),
        "" if fits else "more devices (a larger slice), bf16 weights, activation_checkpointing="
        "True or a smaller per-core batch")
