"""Single-core debug mode: a few training steps on ONE core, explained.

Reached as :meth:`OneCycleTrainer.debug() <xla_utils.train.trainer.OneCycleTrainer.debug>`
(the trainer's own step, :mod:`xla_utils.train.steps`: its model, loss, data, optimizer with
the one-cycle LR and momentum, accumulation, EMA, mixing and normalisation) or as
:func:`debug_run` with explicit arguments (a plain step by default). The report counts
compilations, graph executions and host transfers per step and names CPU-fallback ops.
Like :func:`xla_utils.check`, it prints its report once and returns it.
"""
from __future__ import annotations

import copy
import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import torch

from .. import runtime
from ..data import IMAGENET_MEAN, IMAGENET_STD
from ..step.device_plan import DevicePlan, DeviceRequest
from .findings import WARMUP_STEPS
from ..step.inputs import InputSpec, inspect_inputs, plan_targets
from ..step.plain import default_eval_step, default_train_step
from ..step.optim import make_optimizer, resolve_optimizer
from ..step.plain import PlainStep

if TYPE_CHECKING:
    from ..step.strategy import MeshRun, StrategyPlan

__all__ = ["DebugReport", "debug_run"]


@dataclass
class DebugReport:
    """What :func:`debug_run` measured.

    Attributes:
        backend: ``"xla"`` or ``"torch"``.
        steps: Steps run.
        losses: The loss of every step.
        per_step: The counter deltas (``compiles``, ``executions``,
            ``to_device``, ``to_host``) of every step.
        fallback_ops: ``{"aten::op": count}`` run on the host CPU.
        report: The explanation as text (:func:`debug_run` prints it once; ``str()`` is a
            one-line summary, so ``print(trainer.debug())`` does not show it twice).
        inputs: The input layout seen and what was done with it, in words
            (``"inputs: uint8 [B,3,32,32] channels-first images (torch.Tensor),
            normalised on the device"``); also a line of ``report``.
        devices, strategy: 1 and None on one core; the mesh size and ``"spmd"`` /
            ``"fsdp"`` when the steps ran as a mesh run (``debug_run(mesh=)``).
        step: The step that ran, in words (:mod:`xla_utils.train.steps`).
    """

    backend: str
    steps: int
    losses: list[float]
    per_step: list[dict[str, Any]]
    fallback_ops: dict[str, int]
    report: str
    inputs: str = ""
    devices: int = 1
    strategy: str | None = None
    step: str = ""

    def __str__(self) -> str:
        return (f"xla_utils.debug on {self.backend}: {self.steps} steps, compiles per step "
                f"{[s['compiles'] for s in self.per_step]}")

    def __repr__(self) -> str:  # the report itself is printed by debug_run
        return (f"<DebugReport on {self.backend}: {self.steps} steps, compiles per step "
                f"{[s['compiles'] for s in self.per_step]}; print(report.report) for the report>")


def debug_run(model: torch.nn.Module | Callable[[], torch.nn.Module], loss: Callable, data,
              batch_size: int = 8, steps: int = 5, optimizer: Any = "sgd", lr: float = 1e-3,
              train_step: Callable | None = None, prepare: Callable | None = None,
              print_report: bool = True, eval_step: Callable | None = None,
              inputs: InputSpec | None = None, mesh: StrategyPlan | None = None,
              make_step: Callable | None = None, precision: str = "auto",
              channels_last: bool | str = "auto") -> DebugReport:
    """Run a few training steps on ONE core and explain what XLA did.

    A plain ``torch.utils.data.DataLoader`` (no prefetch thread; passes over the data as
    often as the steps need), a step boundary after every micro-batch, so an error surfaces
    at the step that caused it; then compilations, graph executions, host transfers and
    CPU-fallback ops per step. It runs in a forked child (a TPU, else one XLA:CPU device),
    so the notebook can still launch all cores afterwards. Class labels are checked against
    the model's output width first.

    Args:
        model: An ``nn.Module`` or a zero-argument factory returning one.
        loss: ``loss(outputs, targets) -> scalar``.
        data: A map-style dataset of ``(input, target)``; its inputs are fed as by the
            trainer (:func:`xla_utils.step.inputs.inspect_inputs`: uint8 images in either
            layout normalised on the device, PIL images converted on the host; a
            sample that cannot be fed is refused before any device time).
        batch_size: Samples per step (default 8).
        steps: Steps to run (default 5: 2 to warm up, the rest must not compile).
        optimizer: A name (any case) or a callable, as for the trainer (default ``"sgd"``).
        lr: Constant learning rate (default 1e-3).
        train_step: ``train_step(model, (x, y), loss) -> loss tensor``; default
            ``loss(model(x), y)``.
        prepare: Turns an input batch on the device into model input; default:
            uint8 images are normalised with ImageNet mean/std (``trainer.debug()``
            passes the trainer's).
        print_report: Print the report when it is ready (default True; as
            :func:`xla_utils.check`): ``report = debug_run(...)`` shows it once.
        eval_step: ``eval_step(model, (x, y)) -> outputs`` for the label check;
            default ``model(x)``.
        inputs: ``data``'s :class:`~xla_utils.step.inputs.InputSpec` when already decided
            (the trainer's); default: decided here from the first sample.
        mesh: A :class:`~xla_utils.step.strategy.StrategyPlan`: run the same debug steps as
            that ``"spmd"``/``"fsdp"`` mesh run instead (one process owning the plan's
            devices, :func:`xla_utils.step.strategy.launch`): the model replicated or sharded,
            each batch of ``batch_size`` x devices split over the mesh, the same
            step boundary and counters. Default None (one core).
        make_step: The step to run, a step factory (:mod:`xla_utils.train.steps`; the trainer
            passes its own). Default None: a plain step of ``optimizer``, ``lr``,
            ``train_step`` and ``prepare`` (which also serves the label check).
        precision, channels_last: As ``TrainerConfig``'s where the steps run on the torch
            backend (no torch_xla: a GPU or the CPU, :mod:`xla_utils.step.device_plan`); the XLA
            steps run in float32 as before.
    """
    optimizer = resolve_optimizer(optimizer)
    spec = inputs if inputs is not None else inspect_inputs(data, "data", verb="debug")
    module = model if isinstance(model, torch.nn.Module) else model()
    to_input = functools.partial(_to_input, prepare, spec)
    planned, _ = plan_targets(module, loss, data, spec, "data", to_input, eval_step or default_eval_step)
    if spec.targets is None:  # (a given spec says how its targets are fed already)
        spec = planned
    data = spec.feed(data)
    args = (module, loss, data, train_step or default_train_step, to_input, optimizer, lr,
            batch_size, steps, make_step)
    rep = _launch_steps(args, mesh, DeviceRequest(precision, channels_last, spec))
    rep.inputs = spec.describe(flip=bool(getattr(make_step, "flip", False)))
    head, _, rest = rep.report.partition("\n")
    rep.report = "\n".join([head, rep.inputs] + ([rest] if rest else []))
    if print_report:
        print(rep.report, flush=True)
    return rep


def _to_input(prepare: Callable | None, spec: InputSpec, x: torch.Tensor) -> torch.Tensor:
    """A batch on the device as model input: ``prepare``'s, else ``spec``'s (uint8 images
    normalised with ImageNet mean/std)."""
    if prepare is not None:
        return prepare(x)
    return spec.prepare(x, IMAGENET_MEAN, IMAGENET_STD, flip=False)


def _launch_steps(args: tuple, mesh: StrategyPlan | None, device: DeviceRequest) -> DebugReport:
    """Run the debug steps ``args`` (``module, loss, data, step_fn, to_input, optimizer, lr,
    batch_size, steps, make_step``) as ``mesh``'s mesh run, else on one core: a TPU core,
    one XLA:CPU device, or plain torch when torch_xla is missing."""
    if mesh is not None:
        from ..step.strategy import launch

        return launch(_mesh_debug_steps, args, mesh, None)
    simulate = None if runtime.tpu_present() else 1
    if simulate is not None and not runtime.xla_installed():
        simulate = None  # no torch_xla: the same loop on plain torch (the zygote imports it)
    module, loss, data, step_fn, to_input, optimizer, lr, batch_size, steps, make_step = args

    def job() -> DebugReport:
        return _debug_steps(module, loss, data, step_fn, to_input, optimizer=optimizer, lr=lr,
                            batch_size=batch_size, steps=steps, make_step=make_step,
                            device=device)

    return runtime.launch_job(job, (), placement=runtime.resolve(1, simulate), timeout=None,
                              sim_threads=True)


def _passes(loader: Any) -> Any:
    """``loader``'s batches, pass after pass (a small data set still gives every step)."""
    while True:
        seen = False
        for batch in loader:
            seen = True
            yield batch
        if not seen:
            return


def _mesh_debug_steps(plan: StrategyPlan, module: torch.nn.Module, loss: Callable, data, step_fn: Callable,
                      to_input: Callable, optimizer: Any, lr: float, batch_size: int,
                      steps: int, make_step: Callable | None) -> DebugReport:
    """:func:`debug_run`'s steps in the SPMD process, on ``plan``'s mesh."""
    from ..step.strategy import enter_mesh

    _, run = enter_mesh(plan, None)
    return _debug_steps(module, loss, data, step_fn, to_input, optimizer=optimizer, lr=lr,
                        batch_size=batch_size, steps=steps, mesh=run, make_step=make_step)


def _debug_steps(module: torch.nn.Module, loss: Callable, data, step_fn: Callable,
                 to_input: Callable, *, optimizer: Any, lr: float, batch_size: int,
                 steps: int, mesh: MeshRun | None = None, make_step: Callable | None = None,
                 device: DeviceRequest = DeviceRequest()) -> DebugReport:
    """The replica of :func:`debug_run`: run the steps, reading the XLA counters after each
    (``mesh``: a :class:`~xla_utils.step.strategy.MeshRun`, batches of ``batch_size`` x devices;
    ``make_step``: the step factory, else a plain step; ``device``: precision and layout of
    the plain step on the torch backend)."""
    dev = runtime.device()
    if make_step is not None:
        stepper = make_step(module, mesh)
    else:
        net = copy.deepcopy(module).to(dev) if mesh is None else mesh.wrap(copy.deepcopy(module))
        amp = DevicePlan.build(device if dev.type != "xla" else DeviceRequest("fp32"), dev, net)
        stepper = PlainStep(net, make_optimizer(optimizer, net.parameters(), lr=lr), loss_fn=loss,
                            train_step=step_fn, prepare=to_input, plan=amp)
    loader = torch.utils.data.DataLoader(data, batch_size=batch_size * (mesh.devices if mesh else 1),
                                         shuffle=False, drop_last=True)
    batches = _passes(loader)  # pass after pass: a small data set still gives every step
    if mesh is not None:  # split over the mesh on its way
        batches = mesh.feed(batches)
    losses, per_step = [], []
    first = prev = runtime.xla_counters()
    n, y = 0, None
    while n < steps:
        for _ in range(stepper.accum_steps):
            batch = next(batches, None)
            if batch is None:
                raise ValueError(f"data gave no full batch of {batch_size}; lower batch_size")
            x, y = batch if mesh is not None else runtime.to_device(tuple(batch), dev)
            loss_t = stepper.micro_batch(x, y)
            runtime.sync()
        losses.append(float(loss_t.detach().cpu()))
        now = runtime.xla_counters()
        per_step.append({k: now[k] - prev[k] for k in
                         ("compiles", "executions", "to_device", "to_host")})
        prev = now
        n += 1
    fb = {k: v - first["fallback_ops"].get(k, 0) for k, v in prev["fallback_ops"].items()
          if v - first["fallback_ops"].get(k, 0) > 0}
    where = "" if mesh is None else (f" (strategy {mesh.plan.strategy!r}: one process, a mesh of "
                                     f"{mesh.devices} devices, batch {len(y)} split over it)")
    where += f" ({stepper.plan.words})" if stepper.plan.words else ""
    text = [f"debug_run on {runtime.backend()} device {dev}{where}: {n} steps, "
            f"losses {', '.join(f'{v:.4g}' for v in losses)}",
            f"step: {stepper.description}",
            runtime.xla_counters_report(first, prev, steps=n)]
    w = WARMUP_STEPS
    if n > w and any(s["compiles"] for s in per_step[w:]):
        bad = [i + 1 for i, s in enumerate(per_step) if i >= w and s["compiles"]]
        text.append(
            f"Steps {bad} compiled again after warm-up: the graph changes between steps "
            "(a ragged last batch, a varying input shape, a Python scalar of exactly 0 or 1, "
            ".item() or a Python condition on a tensor inside the step).")
    elif n > w:
        text.append(f"Steps {w + 1}.. reused the compiled graph: no recompilation.")
    return DebugReport(backend=runtime.backend(), steps=n, losses=losses, per_step=per_step,
                       fallback_ops=fb, report="\n".join(text),
                       devices=1 if mesh is None else mesh.devices,
                       strategy=None if mesh is None else mesh.plan.strategy,
                       step=stepper.description)
