"""Will this model run well on a TPU? Answered on a CPU, before any TPU quota is spent.

``report = xla_utils.check(model, batch)`` runs a few real training steps
(forward, backward, optimizer step, one ``sync`` per step) on one XLA:CPU device
in a forked child process and turns what XLA did into findings a user can act
on: recompilations, host syncs, CPU fallbacks, data-dependent shapes, float64 /
float16 math, matrix-unit padding, memory against the target TPU's HBM and,
with ``data=``, whether the input pipeline can feed the chip.

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

Why one module of about 1,200 lines: the child's measurement (counters, the
dispatch recorder) and the findings read and write one measurement dict whose
keys are private to this check; split apart, that format would be spread over
several files with no other reader.
"""
from __future__ import annotations

import contextlib
import copy
import functools
import math
import os
import re
import textwrap
import time
import traceback
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from . import runtime
from .memory import strategy_advice, tpu_devices
from .progress import progress_bar

__all__ = ["check", "ReadinessReport", "Finding", "ReadinessError", "TPU_CHIPS", "TPUChip",
           "CODES", "UTILIZATION"]

CODES = ("recompile", "host_sync", "cpu_fallback", "dynamic_shape", "f64", "f16", "padding",
         "memory", "input_bound", "strategy")
SEVERITIES = ("error", "warning", "info")

# Fraction of the chip's bf16 peak a well-fed training step reaches; the TPU step
# rate behind ``input_bound`` assumes it (typical for convnets / small transformers).
UTILIZATION = 0.4
# Share of HBM a step may use; XLA keeps the rest for its own temporaries.
HBM_USABLE = 0.9
# Padding waste (FLOP-weighted over all matmuls/convolutions) that makes a
# warning, and the smaller share that makes an info note.
PADDING_WARN = 0.25
PADDING_INFO = 0.10


@dataclass(frozen=True)
class TPUChip:
    """Public spec-sheet figures of one TPU generation (per chip).

    Attributes:
        name: generation, e.g. ``"v5e"``.
        bf16_tflops: peak bfloat16 TFLOP/s of one chip.
        hbm_gib: HBM of one chip in GiB.
        mxu: side of the matrix unit (128 -> 128x128); matmul/conv widths are padded to it.
        devices_per_chip: XLA devices (replicas) per chip in torch_xla (2 on v2/v3).
    """

    name: str
    bf16_tflops: float
    hbm_gib: float
    mxu: int
    devices_per_chip: int

    @property
    def hbm_per_device(self) -> float:
        """HBM of one XLA device, in bytes."""
        return self.hbm_gib * 2**30 / self.devices_per_chip

    @property
    def flops_per_device(self) -> float:
        """Peak bf16 FLOP/s of one XLA device."""
        return self.bf16_tflops * 1e12 / self.devices_per_chip


TPU_CHIPS: dict[str, TPUChip] = {c.name: c for c in (
    TPUChip("v2", 45, 16, 128, 2),
    TPUChip("v3", 123, 32, 128, 2),
    TPUChip("v4", 275, 32, 128, 1),
    TPUChip("v5e", 197, 16, 128, 1),
    TPUChip("v5p", 459, 95, 128, 1),
    TPUChip("v6e", 918, 32, 256, 1),
)}


@dataclass(frozen=True)
class Finding:
    """One problem (or note) found by :func:`check`.

    Attributes:
        code: one of :data:`CODES` (``"recompile"``, ``"host_sync"``, ...).
        severity: ``"error"`` (the run would fail or be many times slower),
            ``"warning"`` (TPU time wasted) or ``"info"`` (a measurement, no action needed).
        message: what was measured and where, in words.
        fix: what to change.
    """

    code: str
    severity: str
    message: str
    fix: str

    def __post_init__(self) -> None:
        if self.severity not in SEVERITIES:
            raise ValueError(f"severity must be one of {SEVERITIES}, got {self.severity!r}")

    def __str__(self) -> str:
        head = f"[{self.severity}] {self.code}: "
        body = textwrap.fill(self.message, 100, initial_indent=head, subsequent_indent="    ")
        if self.fix:
            body += "\n" + textwrap.fill(self.fix, 100, initial_indent="    fix: ",
                                         subsequent_indent="         ")
        return body


@dataclass
class ReadinessReport:
    """What :func:`check` returns.

    Attributes:
        findings: the :class:`Finding` list, errors first.
        tpu: the TPU generation the estimates are for (``"v5e"``, ...).
        batch_size: per-core batch (rows of the checked batch).
        steps: training steps run on XLA:CPU.
        per_step: XLA counter deltas of every step (``compiles``, ``executions``,
            ``to_device``, ``to_host``, ``fallback_ops``).
        losses: the loss of every step (read after the last step).
        seconds: wall time of the whole check.
        measurements: the raw numbers behind the findings (FLOPs per sample,
            bytes of parameters / gradients / optimizer state / activations,
            loader samples/s, ...).
        inputs: the input layout seen and what is done with it, in words
            (``"inputs: uint8 [B,3,32,32] channels-first images (torch.Tensor),
            normalised and flipped on the device"``); empty when ``prepare`` was given
            without a description.
    """

    findings: list[Finding]
    tpu: str = "v5e"
    batch_size: int = 0
    steps: int = 0
    per_step: list[dict[str, Any]] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    seconds: float = 0.0
    measurements: dict[str, Any] = field(default_factory=dict, repr=False)
    inputs: str = ""

    @property
    def ok(self) -> bool:
        """True when no finding is an error or a warning."""
        return not any(f.severity in ("error", "warning") for f in self.findings)

    @property
    def codes(self) -> list[str]:
        """Codes of all findings, in report order (info notes included)."""
        return [f.code for f in self.findings]

    @property
    def errors(self) -> list[Finding]:
        """Findings of severity ``"error"``."""
        return [f for f in self.findings if f.severity == "error"]

    def __str__(self) -> str:
        n = Counter(f.severity for f in self.findings)
        if self.ok:
            verdict = "READY"
        else:
            parts = [f"{n[s]} {s}{'s' if n[s] > 1 else ''}" for s in ("error", "warning") if n[s]]
            verdict = "NOT READY (" + ", ".join(parts) + ")"
        losses = ""
        if self.losses:
            losses = f"; loss {self.losses[0]:.4g} -> {self.losses[-1]:.4g}"
        lines = [f"xla_utils.check for TPU {self.tpu}: {verdict}",
                 f"  per-core batch {self.batch_size}, {self.steps} training steps on one XLA:CPU "
                 f"device in {self.seconds:.0f} s{losses}"]
        if self.inputs:
            lines.append(f"  {self.inputs}")
        lines += [textwrap.indent(str(f), "  ") for f in self.findings]
        return "\n".join(lines)


class ReadinessError(RuntimeError):
    """Raised by ``OneCycleTrainer.fit(check=True)`` when :func:`check` found errors.

    ``report`` is the :class:`ReadinessReport`.
    """

    def __init__(self, report: ReadinessReport):
        self.report = report
        codes = ", ".join(sorted({f.code for f in report.errors}))
        super().__init__(
            f"xla_utils.check found errors that would waste TPU time ({codes}):\n{report}\n"
            "Fix them, or call fit(check=False) to train anyway.")


# ---------------------------------------------------------------------------
# Public entry point
# ---------------------------------------------------------------------------
def check(model: torch.nn.Module | Callable[[], torch.nn.Module], batch: Any,
          loss: Callable | None = None, optimizer: Any = "sgd", steps: int = 4, data: Any = None,
          tpu: str | TPUChip | None = None, *, prepare: Callable | None = None,
          train_step: Callable | None = None, bf16: bool = False, verbose: bool = True,
          timeout: float | None = None, inputs: str | None = None,
          compile_cache: runtime.CompileCacheOption = "auto") -> ReadinessReport:
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
            callable ``f(params, lr=...)`` (see :func:`xla_utils.optim.make_optimizer`;
            lr 1e-3) or an optimizer instance over ``model``'s parameters (rebuilt
            on the device with its hyper-parameters and state; the original is
            not touched).
        steps: training steps to run, at least 3 (default 4). The optimizer state
            is created before step 1, so every step from 2 on must reuse step 1's
            compiled graph.
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
            :class:`~xla_utils.trainer.OneCycleTrainer`.
        bf16: run forward/backward under ``torch.autocast(dtype=bfloat16)`` (the
            trainer's ``bf16=True``). Default False.
        verbose: show a progress bar of the steps. Default True.
        timeout: seconds after which the child is killed (default: none).
        inputs: the report's input layout line; default: described from ``batch``.
        compile_cache: torch_xla's persistent compilation cache, as
            ``TrainerConfig.compile_cache``; ``"auto"`` (default) leaves it off
            here, since the check always runs on XLA:CPU.

    Returns:
        A :class:`ReadinessReport`: ``print(report)`` for the verdict,
        ``report.ok`` (no error or warning), ``report.findings``.

    Raises:
        XLAUnavailableError: torch_xla is missing or does not match torch.
        ReplicaError: the training step itself raised (its traceback included).
    """
    runtime.check_compile_cache_option(compile_cache)
    if not isinstance(steps, int) or steps < 3:
        raise ValueError(f"steps must be an int >= 3 (1 to compile, 2.. to check for recompiles), "
                         f"got {steps!r}")
    chip = resolve_tpu(tpu)
    prepare, inputs = (prepare, inputs) if prepare is not None else _default_prepare(batch)
    x, y = _split_batch(batch)
    module = model if isinstance(model, torch.nn.Module) else model()
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"model must be an nn.Module or a factory returning one, got {type(module).__name__}")
    if isinstance(optimizer, torch.optim.Optimizer):
        _param_positions(module, optimizer)  # fail here, not in the child
    loss_fn, loss_name = (loss, "your loss") if loss is not None else _auto_loss(y)
    if not runtime.xla_installed():  # without importing it here: the zygote does
        runtime.load_xla()  # raises XLAUnavailableError with the fix
    t0 = time.perf_counter()
    job = _Job(module, x, y, loss_fn, optimizer, steps, data, prepare, train_step, bf16, verbose)
    job.compile_cache = compile_cache
    with _fast_xla_cpu_compile():
        meas = runtime.launch_job(job, (), cores=1, simulate=1, timeout=timeout, sim_threads=True)
    meas["loss"] = loss_name
    meas["param_shapes"] = [tuple(p.shape) for p in module.parameters() if p.requires_grad]
    meas["tpu_devices"] = tpu_devices(tpu) if isinstance(tpu, str) else None  # "v5e-8" -> 8
    seconds = time.perf_counter() - t0
    return ReadinessReport(findings=_findings(meas, chip), tpu=chip.name,
                           batch_size=meas["batch_rows"], steps=steps, per_step=meas["per_step"],
                           losses=meas["losses"], seconds=seconds, measurements=meas,
                           inputs=inputs or "")


def resolve_tpu(tpu: str | TPUChip | None) -> TPUChip:
    """The :class:`TPUChip` for ``tpu`` (None: this machine's TPU, else v5e; a
    :class:`TPUChip` is used as given, e.g. for a generation not listed here)."""
    if isinstance(tpu, TPUChip):
        return tpu
    if tpu is None:
        try:
            from . import env

            info = env.detect()
            gen = info.tpu_generation if info.accelerator == "tpu" else None
        except Exception:  # detection must never block a check
            gen = None
        if gen == "v2/v3":
            gen = "v2"  # the smaller HBM: the memory verdict stays safe
        return TPU_CHIPS.get(gen or "v5e", TPU_CHIPS["v5e"])
    m = re.fullmatch(r"\s*(v\d+[a-z]*)(?:-\d+)?\s*", str(tpu).lower())
    if not m or m.group(1) not in TPU_CHIPS:
        raise ValueError(f"unknown TPU {tpu!r}; known generations: {', '.join(TPU_CHIPS)} "
                         "(a slice name such as 'v5e-8' also works)")
    return TPU_CHIPS[m.group(1)]


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
    from .data import IMAGENET_MEAN, IMAGENET_STD
    from .inputs import inspect_inputs

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


def _rows(x: Any) -> int:
    if isinstance(x, torch.Tensor):
        return int(x.shape[0]) if x.dim() else 1
    if isinstance(x, dict):
        return _rows(next(iter(x.values())))
    if isinstance(x, (tuple, list)) and x:
        return _rows(x[0])
    return 0


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


def _param_positions(module: torch.nn.Module, opt: torch.optim.Optimizer) -> list[list[int]]:
    index = {id(p): i for i, p in enumerate(module.parameters())}
    try:
        return [[index[id(p)] for p in g["params"]] for g in opt.param_groups]
    except KeyError:
        raise ValueError("the optimizer holds parameters that are not the model's; build it "
                         "over model.parameters() or pass a name such as 'sgd'") from None


def _rebuild_optimizer(opt: torch.optim.Optimizer, module: torch.nn.Module,
                       net: torch.nn.Module) -> torch.optim.Optimizer:
    """``opt``'s class, hyper-parameters and state over ``net`` (a copy of ``module``)."""
    params = list(net.parameters())
    groups = []
    for g, pos in zip(opt.param_groups, _param_positions(module, opt)):
        ng = {k: v for k, v in g.items() if k != "params"}
        ng["params"] = [params[i] for i in pos]
        groups.append(ng)
    try:
        new = type(opt)(groups, **opt.defaults)
    except TypeError:
        new = type(opt)(groups)
    new.load_state_dict(opt.state_dict())  # moves the state to the params' device
    return new


@contextlib.contextmanager
def _fast_xla_cpu_compile():
    """XLA_FLAGS for the forked child only: the caller's value is restored at once
    (the caller never starts the XLA runtime, so the flag has no effect there)."""
    old = os.environ.get("XLA_FLAGS")
    os.environ["XLA_FLAGS"] = runtime.fast_cpu_compile_flags(old)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("XLA_FLAGS", None)
        else:
            os.environ["XLA_FLAGS"] = old


# ---------------------------------------------------------------------------
# The child: CPU analysis pass + XLA steps
# ---------------------------------------------------------------------------
_TORCH_DIR = os.path.dirname(torch.__file__)
_PKG_DIR = os.path.dirname(os.path.abspath(__file__))
_DYNAMIC_OPS = {"nonzero": "nonzero", "argwhere": "nonzero", "masked_select": "masked_select",
                "_unique": "unique", "_unique2": "unique", "unique_dim": "unique",
                "unique_consecutive": "unique_consecutive", "nonzero_static": None}
_HOST_READ_OPS = {"_local_scalar_dense"}


def _where() -> str:
    """``file.py:line in function`` of the innermost user code that called the
    current op, or "" when torch's own modules did (then the module name says where)."""
    frames = traceback.extract_stack()[:-1]
    while frames and frames[-1].filename == __file__:
        frames.pop()  # the recorder itself
    for fr in reversed(frames):
        f = fr.filename
        if f.startswith(_TORCH_DIR) or "/torch_xla/" in f or "/torchvision/" in f:
            continue
        if f.startswith(_PKG_DIR):
            return ""  # reached xla_utils' own step: no user code in between
        return f"{os.path.basename(f)}:{fr.lineno} in {fr.name}"
    return ""


def _place(where: str, module: str) -> str:
    """``"at file.py:12 in forward (in `layer`)"``, or the parts of it that are known."""
    parts = ([f"at {where}"] if where else []) + ([f"(in `{module}`)"] if module else [])
    return " ".join(parts)


def _storage_key(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage().data_ptr()
    except Exception:
        return id(t)


def _tiled_bytes(t: torch.Tensor) -> int:
    """Bytes of ``t`` if the TPU lays it out in (8, 128) tiles: the feature dimension
    (last; dim 1 of a 4-D/5-D conv activation) padded to 128, the next one to 8."""
    shape = list(t.shape)
    if not shape:
        return t.element_size()
    if len(shape) >= 4:
        shape[1] = _pad(shape[1], 128)
        shape[0] = _pad(shape[0], 8)
    else:
        shape[-1] = _pad(shape[-1], 128)
        if len(shape) >= 2:
            shape[-2] = _pad(shape[-2], 8)
    return math.prod(shape) * t.element_size()


def _feature_sizes(t: torch.Tensor) -> set[int]:
    """Sizes a layer width could be tied to: the last dim, and dim 1 of a 3-D+ (channels-first) tensor."""
    if t.dim() < 2:
        return set()
    return {int(t.shape[-1])} | ({int(t.shape[1])} if t.dim() >= 3 else set())


def _pad(n: int, m: int) -> int:
    return -(-int(n) // m) * m


class _Recorder:
    """A dispatch recorder of the forward pass (see the module docstring)."""

    def __init__(self) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        rec = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                if rec.recording:
                    rec.record(func, args, out)
                return out

        self.mode = Mode()
        self.recording = False
        self.module_stack: list[tuple[str, str]] = []  # (name, class name), innermost last
        self.first_where: dict[str, str] = {}  # op name -> place of its first call
        self.low_precision: dict[str, dict[str, Any]] = {}
        self.dynamic: dict[str, dict[str, Any]] = {}
        self.host_reads: dict[str, int] = {}
        self.matmuls: list[dict[str, Any]] = []
        self.input_keys: set[int] = set()  # storages of the model's inputs
        self.input_widths: set[int] = set()  # their feature sizes (last dim; dim 1 of images)

    def module(self) -> str:
        return self.module_stack[-1][0] if self.module_stack else ""

    def module_kind(self) -> str:
        return self.module_stack[-1][1] if self.module_stack else ""

    def record(self, func, args, out) -> None:
        name = func.overloadpacket.__name__
        if name not in self.first_where:
            self.first_where[name] = _place(_where(), self.module())
        outs = [o for o in (out if isinstance(out, (tuple, list)) else (out,))
                if isinstance(o, torch.Tensor)]
        for o in outs:
            if o.dtype in (torch.float64, torch.float16) and o.dim() > 0:
                d = self.low_precision.setdefault(str(o.dtype).replace("torch.", ""),
                                                  {"count": 0, "examples": []})
                d["count"] += 1
                if len(d["examples"]) < 3:
                    d["examples"].append(f"{_op_label(func)} {_place(_where(), self.module())}".strip())
        label = _DYNAMIC_OPS.get(name)
        if name == "index" and any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
                                   for i in (args[1] if len(args) > 1 else []) or []):
            label = "boolean-mask indexing x[mask]"
        elif name == "repeat_interleave" and args and isinstance(args[0], torch.Tensor) \
                and len(args) > 1 and isinstance(args[1], torch.Tensor):
            label = "repeat_interleave with tensor repeats"
        if label:
            d = self.dynamic.setdefault(label, {"count": 0, "place": _place(_where(), self.module())})
            d["count"] += 1
        if name in _HOST_READ_OPS:
            w = _place(_where(), self.module())
            self.host_reads[w] = self.host_reads.get(w, 0) + 1
        if name in ("mm", "addmm", "bmm", "baddbmm", "convolution"):
            self._matmul(name, args, outs[0] if outs else None)

    def _matmul(self, name: str, args, out) -> None:
        groups, depthwise = 1, False
        if name == "convolution":
            inp, w = args[0], args[1]
            transposed = bool(args[6]) if len(args) > 6 else False
            groups = int(args[8]) if len(args) > 8 else 1
            cin = int(inp.shape[1])
            cout = int(w.shape[1]) * groups if transposed else int(w.shape[0])
            # As a matmul (im2col): rows = output pixels, contraction = input channels x
            # kernel taps, columns = output channels.
            taps = math.prod(int(s) for s in w.shape[2:])
            k, n, width_in = cin // groups * taps, cout // groups, cin
            m = int(out.shape[0]) * math.prod(int(s) for s in out.shape[2:]) if out is not None else 0
            depthwise = groups > 1 and cin // groups == 1
            kind = self.module_kind() or f"Conv{len(w.shape) - 2}d"
            k_fixed = _storage_key(inp) in self.input_keys or cin // groups <= 4
        else:
            a, b = (args[1], args[2]) if name in ("addmm", "baddbmm") else (args[0], args[1])
            m, k, n = int(a.shape[-2]), int(a.shape[-1]), int(b.shape[-1])
            width_in = k
            if a.dim() == 3:
                groups = int(a.shape[0])
            kind = self.module_kind() if self.module_kind() in ("Linear", "Bilinear") else f"aten::{name}"
            k_fixed = _storage_key(a) in self.input_keys or k in self.input_widths
        self.matmuls.append({"module": self.module(), "kind": kind, "op": name, "m": m, "k": k,
                             "n": n, "width_in": width_in, "groups": groups, "depthwise": depthwise,
                             "k_fixed": k_fixed, "n_fixed": False,
                             "out_key": _storage_key(out) if out is not None else None,
                             "where": _where()})


def _op_label(func) -> str:
    name = func.overloadpacket.__name__
    return "a dtype conversion" if name in ("_to_copy", "to", "copy_") else f"aten::{name}"


def _flat_tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        obj = list(obj.values())
    if isinstance(obj, (tuple, list)):
        return [t for o in obj for t in _flat_tensors(o)]
    return []


def _dtype_names(obj: Any) -> list[str]:
    return sorted({str(t.dtype).replace("torch.", "") for t in _flat_tensors(obj)
                   if t.is_floating_point()})


def _default_step(model: torch.nn.Module, batch: tuple, loss_fn: Callable) -> torch.Tensor:
    x, y = batch
    out = model(x)
    return loss_fn(out) if y is None else loss_fn(out, y)


class _Job:
    """The function run in the forked child; returns plain-Python measurements."""

    def __init__(self, module, x, y, loss_fn, optimizer, steps, data, prepare, train_step, bf16,
                 verbose):
        self.module, self.x, self.y, self.loss_fn = module, x, y, loss_fn
        self.optimizer, self.steps, self.data = optimizer, steps, data
        self.prepare, self.train_step, self.bf16, self.verbose = prepare, train_step, bf16, verbose
        self.compile_cache: runtime.CompileCacheOption = "auto"

    def _prep(self, x):
        return self.prepare(x) if self.prepare is not None else x

    def __call__(self) -> dict[str, Any]:
        cache = runtime.enable_compile_cache(self.compile_cache)  # before anything compiles
        meas: dict[str, Any] = {"batch_rows": _rows(self.x), "compile_cache": cache.state}
        meas["input_dtypes"] = _dtype_names(self.x)
        meas["param_dtypes"] = {}
        for n, p in self.module.named_parameters():
            meas["param_dtypes"].setdefault(str(p.dtype).replace("torch.", ""), []).append(n)
        meas["param_bytes"] = sum(p.numel() * p.element_size() for p in self.module.parameters())
        meas["grad_bytes"] = sum(p.numel() * p.element_size() for p in self.module.parameters()
                                 if p.requires_grad)
        if self.data is not None:
            meas["loader"] = _measure_loader(self.data, max(meas["batch_rows"], 1))
        meas.update(self._cpu_pass())
        meas.update(self._xla_steps())
        return meas

    # -- one forward/backward on the CPU under the recorder -------------------
    def _cpu_pass(self) -> dict[str, Any]:
        from torch.utils.flop_counter import FlopCounterMode

        res: dict[str, Any] = {"cpu_error": None}
        rec = _Recorder()
        net = copy.deepcopy(self.module).cpu().train()
        handles = []

        def enter(label: str):
            def hook(module, args) -> None:
                rec.module_stack.append((label, type(module).__name__))
            return hook

        def leave(module, args, out) -> None:
            if rec.module_stack:
                rec.module_stack.pop()

        def model_inputs(module, args, kwargs) -> None:
            for t in _flat_tensors((args, kwargs)):
                rec.input_keys.add(_storage_key(t))
                rec.input_widths.update(_feature_sizes(t))

        for name, mod in net.named_modules():
            handles.append(mod.register_forward_pre_hook(enter(name or "model")))
            handles.append(mod.register_forward_hook(leave))
        handles.append(net.register_forward_pre_hook(model_inputs, with_kwargs=True))
        param_keys = {_storage_key(p) for p in net.parameters()}
        saved: dict[int, tuple[int, int]] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            key = _storage_key(t)
            if key not in param_keys and key not in saved:
                try:
                    nbytes = t.untyped_storage().nbytes()
                except Exception:
                    nbytes = t.numel() * t.element_size()
                saved[key] = (nbytes, _tiled_bytes(t))
            return t

        step = self.train_step or _default_step
        autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.bf16)
        try:
            x = self._prep(self.x)
            with FlopCounterMode(display=False) as flops:
                with rec.mode, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast:
                    rec.recording = True
                    out_keys: set[int] = set()
                    out_widths: set[int] = set()

                    def model_outputs(module, args, out) -> None:
                        for t in _flat_tensors(out):
                            out_keys.add(_storage_key(t))
                            out_widths.update(_feature_sizes(t))

                    hook = net.register_forward_hook(model_outputs)
                    try:
                        loss = step(net, (x, self.y), self.loss_fn)
                    finally:
                        hook.remove()
                        rec.recording = False
                loss.backward()
            for mm in rec.matmuls:
                # the model's output width (classes, targets) is set by the task
                mm["n_fixed"] = mm.pop("out_key") in out_keys or mm["n"] in out_widths
            res.update(flops=int(flops.get_total_flops()),
                       activation_bytes=sum(v[0] for v in saved.values()),
                       activation_bytes_tiled=sum(v[1] for v in saved.values()),
                       low_precision=rec.low_precision, dynamic=rec.dynamic,
                       host_read_places=rec.host_reads, matmuls=rec.matmuls,
                       op_places=rec.first_where)
        except Exception as exc:  # the XLA steps still give the counters
            res["cpu_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        finally:
            for h in handles:
                h.remove()
        return res

    # -- the measured XLA steps ------------------------------------------------
    def _xla_steps(self) -> dict[str, Any]:
        dev = runtime.device()
        runtime.set_seed(0)
        net = copy.deepcopy(self.module).to(dev).train()
        if isinstance(self.optimizer, torch.optim.Optimizer):
            opt = _rebuild_optimizer(self.optimizer, self.module, net)
        else:
            from .optim import make_optimizer

            opt = make_optimizer(self.optimizer, net.parameters(), lr=1e-3)
        params = [p for g in opt.param_groups for p in g["params"]]
        _init_optimizer_state(opt, params)
        shapes: list[dict[str, list]] = []  # per step: "name (Kind)" -> input shapes per call

        def input_shapes(label: str):
            def hook(module, args) -> None:
                shapes[-1].setdefault(label, []).append([tuple(t.shape) for t in _flat_tensors(args)])
            return hook

        for name, mod in net.named_modules():
            mod.register_forward_pre_hook(input_shapes(f"{name or 'model'} ({type(mod).__name__})"))
        x = runtime.to_device(self.x, dev)
        y = runtime.to_device(self.y, dev) if self.y is not None else None
        step = self.train_step or _default_step
        autocast = torch.autocast(dev.type, dtype=torch.bfloat16, enabled=self.bf16)
        per_step, texts, losses = [], [], []
        bar = range(self.steps)
        if self.verbose and runtime.is_master():
            bar = progress_bar(self.steps, console=runtime.backend() == "xla")
        prev = runtime.xla_counters()
        for i in bar:
            shapes.append({})
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            with autocast:
                loss = step(net, (self._prep(x), y), self.loss_fn)
            loss.backward()
            runtime.optimizer_step(opt)
            state = [t for s in opt.state.values() for t in s.values()
                     if isinstance(t, torch.Tensor) and t.device.type == dev.type]
            texts.append(runtime.graph_text([loss] + params + state))
            runtime.sync()
            losses.append(loss.detach())
            now = runtime.xla_counters()
            d = {k: now[k] - prev[k] for k in ("compiles", "executions", "to_device", "to_host")}
            d["fallback_ops"] = {k: v - prev["fallback_ops"].get(k, 0)
                                 for k, v in now["fallback_ops"].items()
                                 if v - prev["fallback_ops"].get(k, 0) > 0}
            d["seconds"] = time.perf_counter() - t0
            per_step.append(d)
            prev = now
            if hasattr(bar, "comment"):
                bar.comment = f"step {i + 1}: {d['compiles']} compiles"
        opt_bytes = sum(t.numel() * t.element_size() for s in opt.state.values()
                        for t in s.values() if isinstance(t, torch.Tensor))
        changes = []
        for i in range(1, self.steps):
            if per_step[i]["compiles"]:
                changes.append({"step": i + 1, "shapes": _shape_changes(shapes[i - 1], shapes[i]),
                                "graph": _graph_changes(texts[i - 1], texts[i])})
        lowp = Counter()
        for t in texts:
            for m in re.finditer(r"= (f64|f16)\[\d", t):  # not scalars: Python numbers are f64
                lowp[m.group(1)] += 1
        return {"per_step": per_step, "losses": [float(v.cpu()) for v in losses],
                "optimizer_state_bytes": opt_bytes, "recompile_changes": changes,
                "ir_low_precision": {"float64" if k == "f64" else "float16": v // len(texts)
                                     for k, v in lowp.items()}}


def _init_optimizer_state(opt: torch.optim.Optimizer, params: list[torch.Tensor]) -> None:
    """Create the optimizer's state (momentum buffers, moments) before step 1 with
    one zero-gradient step whose parameter changes are undone, so that step 1's
    graph is the steady one and step 2 already shows any recompile. (A real run
    compiles one more graph at step 2 for that state.)"""
    with torch.no_grad():
        backup = [p.detach().clone() for p in params]
        for p in params:
            p.grad = torch.zeros_like(p)
        opt.step()
        for p, b in zip(params, backup):
            p.copy_(b)
            p.grad = None
    runtime.sync()


def _shape_changes(before: dict[str, list], after: dict[str, list], limit: int = 2) -> list[str]:
    out = []
    for name, shapes in after.items():
        if name in before and before[name] != shapes:
            a, b = before[name][0], shapes[0]
            out.append(f"{name} input {_fmt_shapes(a)} -> {_fmt_shapes(b)}")
        elif name not in before:
            out.append(f"{name} ran in this step only")
        if len(out) >= limit:
            break
    if len(out) < limit:
        out += [f"{n} did not run in this step" for n in before if n not in after][: limit - len(out)]
    return out


def _fmt_shapes(shapes: list[tuple]) -> str:
    s = ", ".join("[" + ",".join(str(d) for d in sh) + "]" for sh in shapes)
    return s or "[]"


_IR_LINE = re.compile(r"^\s*%\d+\s*=\s*(.*?)(?:, xla_shape=[^,]*)?(?:, ROOT=\d+)?\s*$")


def _graph_lines(text: str) -> Counter:
    lines = Counter()
    for line in text.splitlines():
        m = _IR_LINE.match(line)
        if m:
            lines[re.sub(r"%\d+", "%", m.group(1))] += 1
    return lines


def _graph_changes(before: str, after: str, limit: int = 3) -> dict[str, list[str]]:
    """IR nodes (ids stripped) only in ``before`` / only in ``after``."""
    a, b = _graph_lines(before), _graph_lines(after)
    return {"removed": list((a - b).elements())[:limit], "added": list((b - a).elements())[:limit]}


def _batch_len(b: Any) -> int:
    return _rows(b[0] if isinstance(b, (tuple, list)) else b)


def _measure_loader(data: Any, batch_size: int, seconds: float = 3.0,
                    max_batches: int = 64) -> dict[str, Any]:
    """Samples/s of ``data``'s loader (the trainer's :func:`~xla_utils.data.iterate_batches`
    for a dataset, or the iterable itself) over up to ``seconds`` after one warm-up batch."""
    from .data import CachedImageDataset, iterate_batches

    if isinstance(data, (str, os.PathLike)):
        data = CachedImageDataset(data)
    if hasattr(data, "__len__") and hasattr(data, "__getitem__"):
        if len(data) == 0:
            raise ValueError("data= is empty")
        batches = iterate_batches(data, min(batch_size, len(data)), shuffle=True, drop_last=True)
        source = f"{type(data).__name__} of {len(data)} samples through iterate_batches"
    else:
        batches, source = data, type(data).__name__
    it = iter(batches)
    try:
        t0 = time.perf_counter()
        try:
            first = next(it)
        except StopIteration:
            raise ValueError("data= yielded no batch") from None
        t1 = time.perf_counter()
        n = k = 0
        for b in it:
            n += _batch_len(b)
            k += 1
            if k >= max_batches or time.perf_counter() - t1 > seconds:
                break
        if k == 0:  # a single batch: time it, warm-up included
            n, t1 = _batch_len(first), t0
        elapsed = max(time.perf_counter() - t1, 1e-9)
    finally:
        close = getattr(it, "close", None)
        if close is not None:
            close()
    return {"samples_per_s": n / elapsed, "samples": n, "seconds": elapsed, "source": source,
            "host_cpus": os.cpu_count()}


# ---------------------------------------------------------------------------
# Findings from measurements (pure Python, runs in the caller)
# ---------------------------------------------------------------------------
def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**28 else f"{n / 2**20:.1f} MiB"


def _findings(meas: dict[str, Any], chip: TPUChip) -> list[Finding]:
    """Every finding the measurements of one check support, errors first."""
    found: list[Finding] = []
    found += _recompile_findings(meas)
    found += _op_findings(meas)
    found += _dtype_findings(meas)

    # padding ----------------------------------------------------------------
    if meas.get("matmuls"):
        f = _padding_finding(meas["matmuls"], meas["batch_rows"], chip)
        if f is not None:
            found.append(f)

    # memory -----------------------------------------------------------------
    if meas.get("activation_bytes") is not None:
        found.append(_memory_finding(meas, chip))

    # input_bound --------------------------------------------------------------
    if meas.get("loader") is not None:
        found.append(_input_finding(meas, chip))

    if meas.get("cpu_error"):
        found.append(Finding(
            "memory", "info",
            f"the CPU analysis pass failed ({meas['cpu_error']}), so activation memory, FLOPs, "
            "padding and intermediate dtypes were not measured; the XLA counters above still were.",
            "make the model run on the CPU too (it must for this check), or read the other findings."))
    order = {s: i for i, s in enumerate(SEVERITIES)}
    found.sort(key=lambda f: order[f.severity])
    return found


def _recompile_findings(meas: dict[str, Any]) -> list[Finding]:
    """Steps after the first that compiled a new graph, and what changed."""
    found: list[Finding] = []
    per_step = meas["per_step"]
    steady = per_step[1:]
    bad = [i + 2 for i, s in enumerate(steady) if s["compiles"]]
    if bad:
        why = []
        for ch in meas["recompile_changes"][:2]:
            g = ch["graph"]
            if ch["shapes"]:
                why.append(f"step {ch['step']}: " + "; ".join(ch["shapes"]))
            elif g["added"] or g["removed"]:
                why.append(f"step {ch['step']}: graph nodes changed, e.g. "
                           + "; ".join([f"now {l}" for l in g["added"][:2]]
                                       + [f"was {l}" for l in g["removed"][:1]]))
            else:
                why.append(f"step {ch['step']}: same ops and shapes, so a compiled-in constant "
                           "changed: a Python number in the step (XLA bakes 0, 1 and -1 into the "
                           "graph; other values only when they reach it as constants)")
        every = len(bad) == len(steady)
        n_after = sum(per_step[i - 1]["compiles"] for i in bad)
        found.append(Finding(
            "recompile", "error" if every else "warning",
            (f"every step from 2 on compiled a new XLA graph ({n_after} compilations after step 1): "
             "the step's graph changes every step, and on a TPU each compilation of a real model "
             "takes tens of seconds, so every step would."
             if every else
             f"step{'s' if len(bad) > 1 else ''} {', '.join(map(str, bad))} compiled a new XLA graph "
             f"after step 1 ({n_after} compilation{'s' if n_after > 1 else ''}; later steps reused them): the step has several "
             "graph variants, each compiled once on the TPU (tens of seconds each).")
            + (" What changed: " + " | ".join(why) + "." if why else ""),
            "keep every shape and Python value in the step fixed: pad or drop ragged batches, use "
            "fixed crop/resize sizes (or a few buckets), no step counters or random sizes inside "
            "forward, never let a scalar hit exactly 0 or 1, no Python branches on tensor values."))
    return found


def _op_findings(meas: dict[str, Any]) -> list[Finding]:
    """Dynamic shapes, CPU-fallback ops and host syncs inside the step."""
    found: list[Finding] = []
    steady = meas["per_step"][1:]
    n_steady = max(len(steady), 1)
    places = meas.get("op_places") or {}
    fb_total: Counter = Counter()
    for s in steady:
        fb_total.update(s["fallback_ops"])
    dynamic_fb = {k: v for k, v in fb_total.items() if _fallback_base(k) in _DYNAMIC_OPS}
    item_reads = fb_total.get("aten::_local_scalar_dense", 0)
    other_fb = {k: v for k, v in fb_total.items()
                if k not in dynamic_fb and k != "aten::_local_scalar_dense"}
    dyn = meas.get("dynamic") or {}
    if dyn or dynamic_fb:
        parts = [f"{label} {d['place']}".strip() for label, d in dyn.items()]
        parts += [f"{k} fell back to the CPU {v / n_steady:.0f}x per step" for k, v in dynamic_fb.items()]
        found.append(Finding(
            "dynamic_shape", "warning",
            "ops whose output shape depends on the values: " + "; ".join(parts) + ". XLA needs static "
            "shapes: each one stops the step, copies the data to the host and continues with a shape "
            "that may differ (and recompile) next step.",
            "keep the shape fixed: multiply by the mask or use torch.where(mask, x, 0) instead of "
            "x[mask]; masked sums/means (mask.sum()) instead of selecting; for unique/nonzero use a "
            "fixed-size alternative (one-hot, bincount with minlength, topk) or move it out of the step."))
    if other_fb:
        names = ", ".join(f"{k} ({v / n_steady:.0f}x per step"
                          + (f", {places[_fallback_base(k)]}" if places.get(_fallback_base(k)) else "")
                          + ")" for k, v in sorted(other_fb.items(), key=lambda kv: -kv[1]))
        found.append(Finding(
            "cpu_fallback", "warning",
            f"ops with no XLA lowering ran on the host CPU: {names}. Each one copies its inputs to "
            "the host, computes there and copies back, in the middle of the step.",
            "replace the op with one XLA lowers (e.g. lgamma/digamma via a series, median via "
            "sort/kthvalue, histc/bincount via one-hot sums), or compute it outside the training step."))
    transfers = sum(s["to_host"] for s in steady)
    explained = sum(v for k, v in fb_total.items() if k != "aten::_local_scalar_dense")
    syncs = max(transfers - explained, item_reads)
    if syncs:
        reads = meas.get("host_read_places") or {}
        where = (" Host reads (.item(), float(), `if tensor:`): "
                 + ", ".join(w for w in list(reads)[:3] if w) + ".") if any(reads) else \
            " No .item() was seen: look for print(tensor), .cpu(), .tolist() or .numpy() in the step."
        found.append(Finding(
            "host_sync", "warning",
            f"{syncs / n_steady:.0f} device-to-host transfer(s) per step inside the step: the host "
            "waits for the device, then traces the rest of the step as a separate graph, so the TPU "
            f"idles every step.{where}",
            "keep values on the device inside the step: no .item(), float(t), print(t), or Python "
            "`if`/`while` on tensors; accumulate metrics as tensors and read them every N steps "
            "(the trainer's log_every), check for NaN after the epoch."))
    return found


def _dtype_findings(meas: dict[str, Any]) -> list[Finding]:
    """float64 and float16 in parameters, inputs or intermediate results."""
    found: list[Finding] = []
    lowp = meas.get("low_precision") or {}
    ir_lowp = meas.get("ir_low_precision") or {}
    for dtype, code, fix in (
        ("float64", "f64", "use float32 (and bfloat16 for speed on the TPU): model.float(), "
                           "x.float() / torch.from_numpy(a).float() for NumPy data (NumPy's default "
                           "is float64), dtype=torch.float32 in torch.tensor/arange/zeros; train in "
                           "bfloat16 with torch.autocast('xla', dtype=torch.bfloat16) or bf16=True."),
        ("float16", "f16", "TPUs have no float16 units: use bfloat16 (model.to(torch.bfloat16) or "
                           "torch.autocast('xla', dtype=torch.bfloat16), the trainer's bf16=True) "
                           "and drop .half(), torch.cuda.amp and GradScaler (bfloat16 needs no loss "
                           "scaling)."),
    ):
        parts = []
        pnames = (meas.get("param_dtypes") or {}).get(dtype, [])
        if pnames:
            parts.append(f"{len(pnames)} parameter tensor(s) ({', '.join(pnames[:3])}"
                         f"{', ...' if len(pnames) > 3 else ''})")
        if dtype in meas.get("input_dtypes", []):
            parts.append("the input batch")
        d = lowp.get(dtype)
        if d:
            ex = "; ".join(d["examples"])
            parts.append(f"{d['count']} intermediate result(s) in the forward pass, e.g. {ex}")
        elif ir_lowp.get(dtype):
            parts.append(f"{ir_lowp[dtype]} node(s) of the XLA graph")
        if parts:
            slow = "TPUs emulate float64 in software, many times slower" if code == "f64" else \
                "TPUs have no native float16: XLA converts around every op"
            found.append(Finding(code, "warning", f"{dtype} in " + "; ".join(parts) + f". {slow}.",
                                 fix))
    return found


def _fallback_base(counter: str) -> str:
    return counter.split("::", 1)[-1].split(".", 1)[0]


def _nearest_efficient(n: int, unit: int) -> str:
    lo, hi = (n // unit) * unit, _pad(n, unit)
    if lo and n - lo <= hi - n:
        return f"{lo}"
    return f"{hi}" if not lo else f"{lo} or {hi}"


def _padding_finding(matmuls: list[dict[str, Any]], batch_rows: int, chip: TPUChip) -> Finding | None:
    lanes = chip.mxu
    actual_total = padded_total = 0.0
    layers: dict[str, dict[str, Any]] = {}
    for mm in matmuls:
        if mm["depthwise"]:
            continue  # depthwise convolutions run on the vector unit, not the MXU
        m, k, n = mm["m"], mm["k"], mm["n"]
        pk = k if mm["k_fixed"] else _pad(k, lanes)
        pn = n if mm["n_fixed"] else _pad(n, lanes)
        scale = 2.0 * mm["groups"]
        actual = scale * m * k * n
        padded = scale * _pad(m, 8) * pk * pn
        actual_total += actual
        padded_total += padded
        key = mm["module"] or mm["where"]
        lay = layers.setdefault(key, {"actual": 0.0, "padded": 0.0, "mm": mm})
        lay["actual"] += actual
        lay["padded"] += padded
    if padded_total <= 0:
        return None
    waste = 1.0 - actual_total / padded_total
    if waste < PADDING_INFO:
        return None
    # Layers of one shape and waste are reported together, worst wasted FLOPs first.
    groups: dict[tuple, dict[str, Any]] = {}
    for name, lay in layers.items():
        w = 1.0 - lay["actual"] / lay["padded"]
        mm = lay["mm"]
        g = groups.setdefault((mm["kind"], mm["width_in"], mm["n"], round(w, 2)),
                              {"names": [], "wasted": 0.0, "waste": w, "mm": mm})
        g["names"].append(name)
        g["wasted"] += lay["padded"] - lay["actual"]
    parts = []
    for g in sorted(groups.values(), key=lambda g: -g["wasted"]):
        if g["waste"] < 0.2 or len(parts) >= 3:
            continue
        mm = g["mm"]
        dims = []
        if not mm["n_fixed"] and mm["n"] % lanes:
            dims.append(f"{mm['n']} output features fill {mm['n']} of {_pad(mm['n'], lanes)} lanes "
                        f"(nearest efficient: {_nearest_efficient(mm['n'], lanes)})")
        if not mm["k_fixed"] and mm["k"] % lanes:
            what = "input features" if mm["k"] == mm["width_in"] else \
                f"inputs per output ({mm['width_in']} channels x {mm['k'] // max(mm['width_in'] // mm['groups'], 1)} taps)"
            dims.append(f"{mm['k']} {what} fill {mm['k']} of {_pad(mm['k'], lanes)}"
                        + (f" (nearest efficient: {_nearest_efficient(mm['k'], lanes)})"
                           if mm["k"] == mm["width_in"] else ""))
        if mm["m"] % 8:
            dims.append(f"{mm['m']} rows pad to {_pad(mm['m'], 8)}")
        names = f"`{g['names'][0]}`" + (f" and {len(g['names']) - 1} more like it"
                                        if len(g["names"]) > 1 else "")
        parts.append(f"{names} ({mm['kind']} {mm['width_in']}->{mm['n']}): {g['waste']:.0%} "
                     "padding; " + ", ".join(dims))
    batch_note = ""
    if batch_rows % 8:
        batch_note = (f" The per-core batch {batch_rows} is not a multiple of 8 (rows are padded to "
                      f"{_pad(batch_rows, 8)}).")
    sev = "warning" if waste >= PADDING_WARN else "info"
    return Finding(
        "padding", sev,
        f"about {waste:.0%} of the matrix-unit work ({lanes}x{lanes} on {chip.name}) would be padding "
        "(FLOP-weighted over all matmuls and convolutions; dimensions set by the data or the number "
        f"of classes not counted). Worst layers: " + ("; ".join(parts) or "spread over many layers")
        + "." + batch_note,
        f"make layer widths (features, channels, attention head dims x heads) multiples of {lanes} "
        f"and the per-core batch a multiple of 8 (ideally {lanes}); widths below {lanes} waste the "
        "rest of the unit.")


def _memory_finding(meas: dict[str, Any], chip: TPUChip) -> Finding:
    rows = max(meas["batch_rows"], 1)
    fixed = meas["param_bytes"] + meas["grad_bytes"] + meas["optimizer_state_bytes"]
    act, act_tiled = meas["activation_bytes"], meas["activation_bytes_tiled"]
    hbm = chip.hbm_per_device
    usable = hbm * HBM_USABLE
    total, total_tiled = fixed + act, fixed + act_tiled

    def largest(per_sample: float) -> int:
        if per_sample <= 0:
            return 0
        b = int((usable - fixed) // per_sample)
        return b - b % 8 if b >= 8 else max(b, 0)

    fit, fit_tiled = largest(act / rows), largest(act_tiled / rows)
    msg = (f"one step at per-core batch {rows} needs about {_gib(total)} (parameters "
           f"{_gib(meas['param_bytes'])} + gradients {_gib(meas['grad_bytes'])} + optimizer state "
           f"{_gib(meas['optimizer_state_bytes'])} + activations saved for backward {_gib(act)}; "
           f"{_gib(total_tiled)} if every activation is padded to TPU (8, 128) tiles) of "
           f"{_gib(hbm)} HBM per {chip.name} core. ")
    sharded_fix = None
    if (meas.get("tpu_devices") or 0) > 1 and meas.get("param_shapes"):  # per strategy (memory.py)
        states = round(meas["optimizer_state_bytes"] / max(meas["param_bytes"], 1))
        line, sharded_fix = strategy_advice(meas["param_shapes"], meas["param_bytes"], act, states,
                                            meas["tpu_devices"], usable, chip.name)
        msg += line + " "
    if fixed > usable:
        msg += "Parameters, gradients and optimizer state alone do not fit one core."
        return Finding("memory", "error", msg, sharded_fix or
                       "shrink the model, train in bfloat16 (model.to(torch.bfloat16)), use SGD "
                       "(one state tensor per parameter) instead of Adam (two), or pick a TPU with "
                       "more HBM per core (v5p: 95 GiB).")
    def show(b: int) -> str:
        return "more than 65,536" if b > 65536 else f"about {b:,}"

    msg += f"Largest per-core batch that fits: {show(fit)}" + (
        f" ({show(fit_tiled)} with tile padding)." if show(fit_tiled) != show(fit) else ".")
    fix = ("lower the per-core batch (and raise the LR less), train in bfloat16 (halves "
           "activations: the trainer's bf16=True), or use activation checkpointing "
           "(torch.utils.checkpoint).")
    if total > usable:
        return Finding("memory", "error", msg + " The run would stop with an out-of-memory error.",
                       sharded_fix or fix)
    if total_tiled > usable:
        return Finding("memory", "warning", msg + " It may not fit once XLA pads the activations.", fix)
    return Finding("memory", "info", msg, "")


def _fmt_flops(n: float) -> str:
    for unit, scale in (("GFLOPs", 1e9), ("MFLOPs", 1e6), ("kFLOPs", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} FLOPs"


def _input_finding(meas: dict[str, Any], chip: TPUChip) -> Finding:
    ld = meas["loader"]
    rate = ld["samples_per_s"]
    flops = meas.get("flops") or 0
    rows = max(meas["batch_rows"], 1)
    if not flops:
        return Finding("input_bound", "info",
                       f"the loader gives {rate:,.0f} samples/s here; the model's FLOPs could not be "
                       "counted (no matmul or convolution ran on the CPU), so no TPU rate to compare.",
                       "")
    per_sample = flops / rows
    tpu_rate = chip.flops_per_device * UTILIZATION / per_sample
    head = (f"the loader ({ld['source']}) gives {rate:,.0f} samples/s in one process on this "
            f"host ({ld['host_cpus']} vCPUs); one {chip.name} core would train about "
            f"{tpu_rate:,.0f} samples/s ({_fmt_flops(per_sample)} per sample forward+backward "
            f"at {UTILIZATION:.0%} of its {chip.flops_per_device / 1e12:.0f} bf16 TFLOP/s).")
    if rate < tpu_rate:
        return Finding(
            "input_bound", "warning",
            head + f" The TPU would wait for the host about {1 - rate / tpu_rate:.0%} of the time.",
            "decode and resize once: build a uint8 cache with tpu_cache_ds / build_cache and train "
            "from CachedImageDataset; move normalisation, flips and casts onto the device "
            "(images_to_float); use more loader workers (num_workers) or smaller images.")
    return Finding("input_bound", "info", head + " The host keeps up.", "")
