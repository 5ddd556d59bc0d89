"""Will this model run well on a TPU? Answered on a CPU, before any TPU quota is spent.

``report = xla_utils.check(model, batch)`` runs a few real training steps
(forward, backward, optimizer step, one ``sync`` per step; ``OneCycleTrainer.check()``
runs the trainer's own step, see :mod:`xla_utils.train.steps`) on one XLA:CPU device
in a forked child process and turns what XLA did into findings a user can act
on: recompilations, host syncs, CPU fallbacks, data-dependent shapes, float64 /
float16 math, matrix-unit padding, memory against the target TPU's HBM and,
with ``data=``, whether the input pipeline can feed the chip. The verdict and the
rules behind each finding are :mod:`xla_utils.diagnostics.findings`.

Everything is measured, not guessed from source text:

* XLA's own counters per step (compilations, device->host transfers, ``aten::``
  CPU fallbacks) and the pending graph's IR text per step (what changed when a
  step compiled again), through :mod:`xla_utils.runtime`;
* one extra forward/backward on the CPU (in the same child) under a dispatch
  recorder: every op's output dtype, the data-dependent ops and host reads with
  the source line that called them, the shape of every matmul/convolution, the
  tensors autograd saves for backward (activation memory) and
  ``torch.utils.flop_counter`` FLOPs.

The caller's process never touches the XLA runtime, and the caller's model,
optimizer and RNG states are left exactly as they were: all of it happens in the
forked child. The package exports :func:`check` as ``xla_utils.check``.

The child's measurements are one dict (``report.measurements``) that
:mod:`xla_utils.diagnostics.measure` writes and
:func:`xla_utils.diagnostics.findings.findings_from` reads; this module checks the inputs on
the host, launches the child and makes the report.
"""
from __future__ import annotations

import functools
import time
from typing import Any, Callable

import torch

from .. import runtime
from .findings import (CODES, HBM_USABLE, UTILIZATION, Finding, ReadinessError,
                       ReadinessReport, findings_from, resolve_tpu)
from .measure import MeasureJob, _param_positions, fast_xla_cpu_compile
from ..env.tpus import TPU_CHIPS, TPUChip, tpu_devices

# The report's names are also this module's (``xla_utils.diagnostics.readiness.TPU_CHIPS``, ...).
__all__ = ["check", "ReadinessReport", "Finding", "ReadinessError", "TPU_CHIPS", "TPUChip",
           "CODES", "UTILIZATION", "HBM_USABLE", "resolve_tpu"]


# ---------------------------------------------------------------------------
# Public entry point
# ---------------------------------------------------------------------------
def check(model: torch.nn.Module | Callable[[], torch.nn.Module], batch: Any,
          loss: Callable | None = None, optimizer: Any = "sgd", steps: int = 4, data: Any = None,
          tpu: str | TPUChip | None = None, *, prepare: Callable | None = None,
          train_step: Callable | None = None, bf16: bool = False, verbose: bool = True,
          timeout: float | None = None, inputs: str | None = None,
          compile_cache: runtime.CompileCacheOption = "auto", make_step: Callable | None = None,
          print_report: bool = True) -> ReadinessReport:
    """Run a few real training steps on one XLA:CPU device and say what would hurt on a TPU.

    Runs in a forked child (``runtime.launch(..., cores=1, simulate=1)``): the
    calling process never initialises the XLA runtime (it can launch all cores
    afterwards) and the caller's model, optimizer and RNG states are unchanged.
    Needs torch_xla (any host; no TPU is used even on a TPU machine).

    Args:
        model: an ``nn.Module`` (or a zero-argument factory returning one) on the CPU.
        batch: one training batch as ``(x, y)``; ``x`` alone (or ``(x,)``) means
            no target. Its rows are the per-core batch the estimates are for. uint8
            images ``[B, H, W, C]`` or ``[B, C, H, W]`` are normalised on the device as
            by the trainer (ImageNet mean/std) unless ``prepare`` is given.
        loss: ``loss(outputs, y) -> scalar`` (``loss(outputs)`` without ``y``).
            Default None: cross-entropy for integer (class-index) targets, binary
            cross-entropy with logits for 0/1 float targets of the output's shape,
            mean squared error for other float targets, and the sum of all
            outputs when the batch has no target.
        optimizer: ``"sgd"`` (default; momentum 0.9), ``"adam"``, ``"adamw"``, a
            callable ``f(params, lr=...)`` (see :func:`xla_utils.step.optim.make_optimizer`;
            lr 1e-3) or an optimizer instance over ``model``'s parameters (rebuilt
            on the device with its hyper-parameters and state; the original is
            not touched).
        steps: training steps to run, at least 3 (default 4). Steps 1 and 2 warm up
            (step 1 compiles the step; step 2 may compile once more, for the state
            step 1 created), as in ``fit``; every step from 3 on must reuse them.
        data: optional dataset (map-style ``(input, target)``, a
            :class:`~xla_utils.data.CachedImageDataset` or its directory) or an
            iterable of batches: its loader's samples/s on this host is compared
            with the TPU's step rate (``input_bound``).
        tpu: target generation for the estimates: ``"v2"``, ``"v3"``, ``"v4"``,
            ``"v5e"``, ``"v5p"`` or ``"v6e"`` (a slice name such as ``"v5e-8"``
            works too), or a :class:`TPUChip` with your own figures. Default None:
            this machine's TPU if it has one, else ``"v5e"`` (Kaggle's and Colab's TPU).
        prepare: ``prepare(x) -> model input`` applied on the device every step.
        train_step: ``train_step(model, (x, y), loss) -> loss tensor``, as in
            :class:`~xla_utils.train.trainer.OneCycleTrainer`.
        bf16: run forward/backward under ``torch.autocast(dtype=bfloat16)`` (the
            trainer's ``precision='bf16'``). Default False.
        verbose: show a progress bar of the steps. Default True.
        timeout: seconds after which the child is killed (default: none).
        inputs: the report's input layout line; default: described from ``batch``.
        compile_cache: torch_xla's persistent compilation cache, as
            ``TrainerConfig.compile_cache``; ``"auto"`` (default) leaves it off
            here, since the check always runs on XLA:CPU.
        make_step: The step to measure, a step factory (:mod:`xla_utils.train.steps`; the trainer
            passes its own). Default None: a plain step of ``optimizer``, ``prepare``,
            ``train_step`` and ``bf16``.
        print_report: Print the report when it is ready (default True, as ``debug_run``).

    Returns a :class:`ReadinessReport`: ``report.verdict`` (``"READY"``, ``"READY, could
    be faster (n suggestions)"`` or ``"NOT READY (...)"``), ``report.findings``.

    Raises:
        XLAUnavailableError: torch_xla is missing or does not match torch.
        ReplicaError: the training step itself raised (its traceback included).
    """
    _check_options(compile_cache, steps)
    chip = resolve_tpu(tpu)
    module, x, y, prepare, inputs, loss_fn, loss_name = _step_inputs(
        model, batch, optimizer, loss, prepare, inputs)
    t0 = time.perf_counter()
    job = MeasureJob(module, x, y, loss_fn, optimizer, steps, data, prepare, train_step, bf16, verbose)
    job.compile_cache, job.make_step = compile_cache, make_step
    with fast_xla_cpu_compile():
        meas = runtime.launch_job(job, (), placement=runtime.resolve(1, simulate=1), timeout=timeout,
                                  sim_threads=True)
    report = _report_of(meas, module, loss_name, tpu, chip, steps, inputs, time.perf_counter() - t0)
    if print_report:
        print(report.report, flush=True)
    return report


def _check_options(compile_cache: Any, steps: Any) -> None:
    runtime.check_compile_cache_option(compile_cache)
    if not isinstance(steps, int) or steps < 3:
        raise ValueError(f"steps must be an int >= 3 (1-2 warm up, 3.. must not compile), "
                         f"got {steps!r}")


def _step_inputs(model: Any, batch: Any, optimizer: Any, loss: Callable | None,
                 prepare: Callable | None, inputs: str | None) -> tuple:
    """``(module, x, y, prepare, inputs line, loss function, loss name)`` checked on the
    host before any child starts (torch_xla loadable too)."""
    prepare, inputs = (prepare, inputs) if prepare is not None else _default_prepare(batch)
    x, y = _split_batch(batch)
    module = model if isinstance(model, torch.nn.Module) else model()
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"model must be an nn.Module or a factory returning one, got {type(module).__name__}")
    if isinstance(optimizer, torch.optim.Optimizer):
        _param_positions(module, optimizer)  # fail here, not in the child
    loss_fn, loss_name = (loss, "your loss") if loss is not None else _auto_loss(y)
    if not runtime.xla_installed():  # without importing it here: the zygote does
        try:
            runtime.load_xla()
        except runtime.XLAUnavailableError as exc:
            raise runtime.XLAUnavailableError(
                "xla_utils.check measures a TPU run on an XLA:CPU device, so it needs torch_xla, "
                "which is not installed here. Fix: xla_utils.setup(install=True) installs the one "
                "that pairs with this torch. On a GPU, trainer.check() reports on the GPU without "
                f"it.\n{exc}") from None
    return module, x, y, prepare, inputs, loss_fn, loss_name


def _report_of(meas: dict[str, Any], module: torch.nn.Module, loss_name: str, tpu: Any,
               chip: TPUChip, steps: int, inputs: str | None, seconds: float) -> ReadinessReport:
    """The report of the child's measurements ``meas`` against ``chip``."""
    meas["loss"] = loss_name
    meas["param_shapes"] = [tuple(p.shape) for p in module.parameters() if p.requires_grad]
    meas["tpu_devices"] = tpu_devices(tpu) if isinstance(tpu, str) else None  # "v5e-8" -> 8
    return ReadinessReport(findings_from(meas, chip), tpu=chip.name,
                           batch_size=meas["batch_rows"], steps=steps, per_step=meas["per_step"],
                           losses=meas["losses"], seconds=seconds, measurements=meas,
                           inputs=inputs or "", step=meas["step"])


# ---------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------
def _as_tensor(v: Any) -> Any:
    try:
        import numpy as np

        if isinstance(v, np.ndarray):
            return torch.from_numpy(v)
    except ImportError:  # pragma: no cover - numpy is a dependency
        pass
    return v


def _default_prepare(batch: Any) -> tuple[Callable | None, str]:
    """The trainer's treatment of ``batch``'s inputs (decided from its first row) and
    its description: uint8 images normalised with ImageNet mean/std, else unchanged."""
    from ..data import IMAGENET_MEAN, IMAGENET_STD
    from ..step.inputs import inspect_inputs

    x = batch[0] if isinstance(batch, (tuple, list)) and batch else batch
    if not (isinstance(x, torch.Tensor) or hasattr(x, "__array__")) or not len(getattr(x, "shape", ())):
        return None, ""
    spec = inspect_inputs([x[0]], "batch", need_target=False)
    return functools.partial(spec.prepare, mean=IMAGENET_MEAN, std=IMAGENET_STD,
                             flip=False), spec.describe(flip=False)


def _split_batch(batch: Any) -> tuple[Any, Any]:
    if isinstance(batch, (tuple, list)):
        if len(batch) == 1:
            return _as_tensor(batch[0]), None
        if len(batch) in (2, 3):  # (x, y) or the trainer's (x, y, valid)
            return _as_tensor(batch[0]), _as_tensor(batch[1])
        raise ValueError(f"batch must be (x, y) or x, got a {type(batch).__name__} of {len(batch)}")
    return _as_tensor(batch), None




def _sum_outputs(out: Any) -> torch.Tensor:
    """Sum of every floating-point tensor in ``out`` (a tensor, tuple, list or dict)."""
    if isinstance(out, torch.Tensor):
        return out.float().sum() if out.is_floating_point() else out.sum() * 0.0
    if isinstance(out, dict):
        out = list(out.values())
    if isinstance(out, (tuple, list)):
        parts = [_sum_outputs(o) for o in out if isinstance(o, (torch.Tensor, tuple, list, dict))]
        if parts:
            return sum(parts[1:], parts[0])
    raise TypeError(f"cannot make a loss from a model output of type {type(out).__name__}; pass loss=")


class _AutoLoss:
    """The documented ``loss=None`` default; picklable and decided once per target kind."""

    def __init__(self, kind: str):
        self.kind = kind

    def __call__(self, out: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        F = torch.nn.functional
        if self.kind == "sum":
            return _sum_outputs(out)
        if self.kind == "ce":
            return F.cross_entropy(out, y)
        if self.kind == "binary" and out.shape == y.shape:
            return F.binary_cross_entropy_with_logits(out, y.to(out.dtype))
        return F.mse_loss(out, y.to(out.dtype))


def _auto_loss(y: Any) -> tuple[Callable, str]:
    if y is None:
        return _AutoLoss("sum"), "sum of the outputs (no target)"
    if not isinstance(y, torch.Tensor):
        raise TypeError(f"targets must be a tensor for the default loss, got {type(y).__name__}; pass loss=")
    if not (y.is_floating_point() or y.is_complex()):
        return _AutoLoss("ce"), "cross-entropy (class-index targets)"
    if bool(((y == 0) | (y == 1)).all()):
        return _AutoLoss("binary"), "binary cross-entropy with logits (0/1 targets)"
    return _AutoLoss("mse"), "mean squared error (float targets)"
