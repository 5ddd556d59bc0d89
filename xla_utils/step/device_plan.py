"""How a run uses its device: precision, memory layout and host buffers, decided once per run.

On XLA (TPU cores, simulated cores) nothing here changes what runs: bfloat16 autocast
when asked (``precision="bf16"``), float32 otherwise (``"auto"`` too),
XLA's own layouts, and batches moved by :func:`xla_utils.runtime.device_prefetch`'s
thread. On the torch backend (one CUDA GPU, or the CPU) a :class:`DevicePlan` feeds the
GPU like a careful hand-written loop
(docs/BENCHMARKS.md "GPU: the trainer against a hand-written loop"):

* precision: ``"auto"`` is bfloat16 autocast on GPUs with bf16 matrix units (compute
  capability 8.0 and up: A100, L4, H100), float16 autocast with a
  ``torch.amp.GradScaler`` on older ones (T4 sm_75, V100 sm_70, P100 sm_60: Accelerate's
  and Lightning's "16-mixed"), float32 on the CPU (:func:`resolve_precision`, a pure
  function of the device's type and compute capability);
* channels_last: convolution models with image inputs on CUDA (``"auto"``): the model's
  4-D weights, and each uint8 NHWC batch normalised on the device straight into that
  layout (an NHWC batch is channels_last once permuted: no copy), which cuDNN's fastest
  kernels want; a model whose forward fails on channels_last tensors (a ``.view()`` of a
  convolution's output) is left in NCHW, and the run's first line says why;
* pinned host buffers whose copies to the GPU run on a side stream, overlapping the
  previous step (:func:`xla_utils.runtime.transfer.overlapped`).

Skipped steps: the gradient scaler skips an optimizer step whose gradients hold an inf
or NaN (and halves its scale). Each one is counted on the device, read once per epoch
(``skipped_steps`` in the history) and warned about when it is most of an epoch. A
skipped step still advances the one-cycle schedule: the schedule is a function of the
step count, so a resumed run continues exactly and the run ends at the planned LR; the
few steps the scaler skips while it finds its scale (at the start) train at no LR. Host
reads: the loss every ``log_every`` steps, the skip count once per epoch; with fp16,
``GradScaler.step`` itself also reads one flag per step (to skip the step on the host),
unless the optimizer does the scaling itself (torch's fused optimizers).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from .. import runtime
from ..env.gpu import cuda_facts

__all__ = ["PRECISIONS", "PrecisionError", "resolve_precision",
           "check_before_launch", "DeviceRequest", "DevicePlan"]

PRECISIONS = ("auto", "bf16", "fp16", "fp32")
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
_NAMES = {"bf16": "bf16 autocast", "fp16": "fp16 autocast + GradScaler", "fp32": "fp32"}


class PrecisionError(ValueError):
    """A precision the device cannot run well; the message says why and the fix."""


def resolve_precision(requested: str, device_type: str, capability: tuple[int, int] | None = None,
                      gpu: str = "this GPU") -> str:
    """The precision a run uses: ``"bf16"``, ``"fp16"`` or ``"fp32"``.

    A pure function of the device: ``"auto"`` is bf16 on CUDA from compute capability
    8.0, fp16 (with a gradient scaler) below it, fp32 on XLA (bf16 there only when asked)
    and on the CPU. A forced ``"bf16"``, ``"fp16"`` or ``"fp32"`` is kept where it runs
    well.

    Args:
        requested: One of :data:`PRECISIONS`.
        device_type: ``"xla"`` (TPU or simulated cores), ``"cuda"``, or a torch device
            type such as ``"cpu"``.
        capability: ``(major, minor)`` of the CUDA device (needed for ``"cuda"``).
        gpu: The GPU's name, for the message.

    Raises:
        PrecisionError: ``"fp16"`` on XLA, or ``"bf16"`` on a GPU without bf16 matrix units.
    """
    if requested not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {requested!r}")
    if device_type == "xla":
        if requested == "fp16":
            raise PrecisionError(
                "precision='fp16' is for GPUs: TPUs (and simulated XLA cores) have no fast "
                "float16, bfloat16 is their fast type. Fix: precision='bf16', or "
                "'auto' (float32 on XLA)")
        return "bf16" if requested == "bf16" else "fp32"
    if device_type == "cuda":
        if capability is None:
            raise ValueError("resolve_precision on CUDA needs the compute capability")
        fast_bf16 = tuple(capability) >= (8, 0)
        if requested == "auto":
            return "bf16" if fast_bf16 else "fp16"
        if requested == "bf16" and not fast_bf16:
            raise PrecisionError(
                f"precision='bf16' on {gpu}, compute capability "
                f"{capability[0]}.{capability[1]}: GPUs below 8.0 (T4, V100, P100) have no "
                "bfloat16 matrix units, so bf16 runs emulated, slower than float32. Fix: "
                "precision='auto' (fp16 autocast with a gradient scaler here) or 'fp16'; "
                "keep 'bf16' for TPUs and GPUs from the A100 on")
        return requested
    return "fp32" if requested == "auto" else requested


def check_before_launch(precision: str, placement: runtime.Placement, *,
                        mesh: bool = False) -> None:
    """Refuse, in the calling process and before any device time, a precision the run's
    device (``placement``'s) cannot use (:func:`resolve_precision`). XLA: simulated
    devices, a mesh strategy or a TPU. A GPU is read with ``nvidia-smi`` (:func:`xla_utils.env.gpu.torch_devices`), so
    CUDA is not initialised here; without it the replica decides, first thing.

    Raises:
        PrecisionError: as :func:`resolve_precision`.
    """
    if placement.backend == "xla" or mesh:
        resolve_precision(precision, "xla")
    elif precision == "bf16":  # the one a GPU can refuse
        # Not torch.cuda.is_available(): without PYTORCH_NVML_BASED_CUDA_CHECK=1 it starts
        # the CUDA driver here, and forked GPU replicas could not use CUDA any more.
        gpus = runtime.torch_devices().gpus
        if gpus:
            worst = min(gpus, key=lambda g: g.compute_capability)
            resolve_precision(precision, "cuda", worst.compute_capability, worst.describe())
    else:
        resolve_precision(precision, "cpu")


@dataclass(frozen=True)
class DeviceRequest:
    """What a run asks for (the configuration's words; :class:`DevicePlan` decides).

    Attributes:
        precision: One of :data:`PRECISIONS`.
        channels_last: ``"auto"``, True or False (see ``TrainerConfig.channels_last``).
        inputs: The data's :class:`~xla_utils.step.inputs.InputSpec` (image inputs are what
            ``"auto"`` puts in channels_last), or None.
    """

    precision: str = "auto"
    channels_last: bool | str = "auto"
    inputs: Any = None


@dataclass
class DevicePlan:
    """What a run does on its device, decided once in the replica (:meth:`build`).

    Attributes:
        device: The replica's device.
        precision: ``"bf16"``, ``"fp16"`` or ``"fp32"``.
        channels_last: The model and image batches are in channels_last memory format.
        pinned: Host batches go to pinned buffers and are copied on a side stream (CUDA).
        words: What was chosen and why, for the run's first line (``""`` on XLA, where
            nothing is decided here).
        autocast: The forward's autocast context (disabled for fp32).
        scaler: The ``torch.amp.GradScaler`` of an fp16 training run, else None.
    """

    device: torch.device
    precision: str
    channels_last: bool
    pinned: bool
    words: str
    autocast: Any
    scaler: Any = None
    _one: Any = None
    _skipped: Any = None
    _reported: int = 0

    @classmethod
    def build(cls, request: DeviceRequest, dev: torch.device, model: torch.nn.Module,
              train: bool = True) -> "DevicePlan":
        """Decide for ``model`` (already on ``dev``) and put it in the chosen memory format.

        Args:
            request: What the configuration asks for.
            dev: The replica's device (CUDA facts are read from it: CUDA is in use here).
            model: The replica's own model (converted in place).
            train: A training run (fp16 gets a gradient scaler).

        Raises:
            PrecisionError: as :func:`resolve_precision`.
        """
        if dev.type == "xla":
            p = resolve_precision(request.precision, "xla")
            return cls(dev, p, False, False, "", torch.autocast(
                device_type=dev.type, dtype=torch.bfloat16, enabled=p == "bf16"))
        where = dev.type
        if dev.type == "cuda":
            facts = cuda_facts(dev)
            where = f"cuda {facts.describe()}"
            p = resolve_precision(request.precision, "cuda", facts.compute_capability,
                                  facts.describe())
            why = ("asked" if request.precision != "auto" else
                   "auto: bf16 matrix units" if p == "bf16" else "auto: no bf16 matrix units below sm_80")
        else:
            p = resolve_precision(request.precision, dev.type)
            why = "asked" if request.precision != "auto" else "auto"
        cl, layout = _layout(request, dev, model)
        scaler = torch.amp.GradScaler(dev.type) if p == "fp16" and train else None
        pinned = dev.type == "cuda"
        buffers = ("pinned host buffers, copied on a side stream" if pinned
                   else "pageable host buffers (no CUDA)")
        return cls(dev, p, cl, pinned, f"{where}: {_NAMES[p]} ({why}), {layout}, {buffers}",
                   torch.autocast(device_type=dev.type, dtype=_DTYPES.get(p, torch.bfloat16),
                                  enabled=p != "fp32"), scaler,
                   _one=None if scaler is None else torch.ones((), device=dev))

    @property
    def memory_format(self) -> torch.memory_format:
        """The memory format image batches are normalised into."""
        return torch.channels_last if self.channels_last else torch.contiguous_format

    def place(self, module: torch.nn.Module) -> torch.nn.Module:
        """``module`` (in place) in the plan's memory format (e.g. the EMA copy)."""
        return module.to(memory_format=torch.channels_last) if self.channels_last else module

    def release(self, module: torch.nn.Module) -> None:
        """Give a caller's module its contiguous format back (an in-process LR sweep)."""
        if self.channels_last:
            module.to(memory_format=torch.contiguous_format)

    def layout(self, x: Any) -> Any:
        """``x`` in the plan's memory format when it is a 4-D tensor (a no-op when it is)."""
        if self.channels_last and isinstance(x, torch.Tensor) and x.dim() == 4:
            return x.contiguous(memory_format=torch.channels_last)
        return x

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()``, scaled by the gradient scaler when there is one."""
        (loss if self.scaler is None else self.scaler.scale(loss)).backward()

    def step(self, opt: torch.optim.Optimizer, barrier: bool = False,
             averaged: bool = False, clip: Callable[[torch.optim.Optimizer], None] | None = None
             ) -> None:
        """The optimizer step: :func:`xla_utils.runtime.optimizer_step`, or through the
        gradient scaler (which skips a step with inf/NaN gradients and then lowers its
        scale: the skip is counted on the device, no host read). ``averaged``: the
        gradients were averaged over the replicas during backward (DistributedDataParallel).
        ``clip``: called with ``opt`` where the gradients are final, averaged over the
        replicas and unscaled (``scaler.unscale_``), before the step
        (:class:`xla_utils.step.clip.GradClip`); default None."""
        if self.scaler is None and clip is None:
            runtime.optimizer_step(opt, barrier=barrier, averaged=averaged)
            return
        if not averaged:
            runtime.reduce_gradients(opt)
        if self.scaler is None:
            clip(opt)
            runtime.optimizer_step(opt, barrier=barrier, averaged=True)
            return
        before = self.scaler.scale(self._one)
        if clip is not None:
            self.scaler.unscale_(opt)  # clip the true gradients; step() does not unscale again
            clip(opt)
        # averaged gradients: every replica sees the same inf/NaN and skips the same steps
        self.scaler.step(opt)
        self.scaler.update()
        skipped = (self.scaler.scale(self._one) < before).to(torch.int64)
        self._skipped = skipped if self._skipped is None else self._skipped + skipped

    def take_skipped(self) -> int | None:
        """Steps the gradient scaler skipped since the last call (one host read); None
        without a scaler."""
        if self.scaler is None:
            return None
        total = 0 if self._skipped is None else int(self._skipped.item())
        n, self._reported = total - self._reported, total
        return n

    def scaler_state(self) -> dict | None:
        """The gradient scaler's state for a checkpoint (None without one)."""
        return None if self.scaler is None else self.scaler.state_dict()

    def load_scaler_state(self, state: dict | None) -> None:
        """Resume the gradient scaler (a checkpoint of a run without one leaves it fresh)."""
        if self.scaler is not None and state:
            self.scaler.load_state_dict(state)


def _layout(request: DeviceRequest, dev: torch.device, model: torch.nn.Module) -> tuple[bool, str]:
    """``(channels_last, in words)`` for ``model`` on ``dev``; converts ``model`` when chosen."""
    setting, inputs = request.channels_last, request.inputs
    if setting is False:
        return False, "NCHW (channels_last=False)"
    if setting == "auto":
        if dev.type != "cuda":
            return False, "NCHW (channels_last='auto' is for CUDA)"
        if not any(isinstance(m, torch.nn.Conv2d) for m in model.modules()):
            return False, "NCHW (no Conv2d in the model)"
        if inputs is None or inputs.layout is None:
            return False, "NCHW (the inputs are not uint8 images)"
    model.to(memory_format=torch.channels_last)
    if setting is True:
        return True, "channels_last (asked)"
    failure = _forward_fails(model, inputs.image_chw, dev)
    if failure is not None:
        model.to(memory_format=torch.contiguous_format)
        return False, (f"NCHW: the model fails on channels_last tensors ({failure}); use "
                       ".reshape()/.flatten() there for the faster layout")
    return True, "channels_last (auto: convolutions on CUDA)"


def _forward_fails(model: torch.nn.Module, chw: tuple[int, ...], dev: torch.device) -> str | None:
    """Why a forward of two zero images in channels_last fails for a layout reason (a
    ``.view()`` across the permuted strides), else None (any other failure is left to the
    run, where it surfaces with its own message)."""
    modes = [m.training for m in model.modules()]
    x = torch.zeros(2, *chw, device=dev).contiguous(memory_format=torch.channels_last)
    try:
        model.eval()
        with torch.no_grad():
            model(x)
    except RuntimeError as exc:
        text = str(exc)
        return text.splitlines()[0][:160] if "view size is not compatible" in text else None
    except Exception:
        return None
    finally:
        for m, mode in zip(model.modules(), modes):
            m.training = mode
    return None
