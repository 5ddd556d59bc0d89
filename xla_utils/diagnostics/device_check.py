"""``trainer.check()`` for the device a notebook trains on without a TPU: a GPU, or the CPU.

The TPU readiness report (:mod:`xla_utils.diagnostics.readiness`) answers for a TPU, on
XLA:CPU. A notebook on Kaggle's "GPU T4 x2" (or a CPU) trains through the torch backend
instead, and what slows that run down is different: the loader against the step, the
precision and memory layout chosen, host reads that stall the GPU, and memory. So this
check runs the trainer's own step (:class:`~xla_utils.train.steps.TrainerStepPlan`, the
function ``fit`` runs, on ``fit``'s own feed: its loader, pinned buffers and copies) on one
replica of that backend and measures:

* the step as ``fit`` feeds it against the same step on one batch already on the device
  (the no-loader ceiling);
* the loader alone (host batches per second) against the step;
* the precision, layout and host buffers the run's
  :class:`~xla_utils.step.device_plan.DevicePlan` chose;
* host reads per step (``.item()``, a copy to the host: each one waits for the device);
* on CUDA, the peak memory against the GPU's.

It runs where ``fit(cores=1)`` would (:func:`xla_utils.runtime.launch`: a forked process
on a machine with several GPUs, so the notebook stays free of CUDA), and the caller's
model, optimizer and RNG states are left as they were.
"""
from __future__ import annotations

import copy
import itertools
import os
import time
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

from .. import runtime
from ..env.gpu import CPU_REPLICAS_ENV
from ..utils.units import format_bytes

__all__ = ["DeviceCheckReport", "check_device", "SLOW_FEED", "MEMORY_FULL"]

# A fed step this much slower than the ceiling is held back by its input.
SLOW_FEED = 1.15
# Peak memory above this share of the GPU's leaves no room for a larger batch.
MEMORY_FULL = 0.90


@dataclass
class DeviceCheckReport:
    """What :func:`check_device` measured (``trainer.check()`` prints :attr:`report`).

    Attributes:
        device: The device in words (``"Tesla T4 (cuda:0) x2"``, ``"the CPU (2 processes)"``).
        verdict: ``"GOOD"`` or ``"could be faster (n suggestions)"``.
        findings: One line per finding, each with its fix.
        batch_size: Per-replica batch of the step.
        step_s: Seconds per step as ``fit`` feeds it.
        ceiling_s: Seconds per step on one batch already on the device (no loader).
        loader_samples_per_s: The loader alone, host batches only.
        plan: Precision, layout and host buffers chosen, in words.
        host_reads_per_step: Device->host reads inside one step.
        peak_memory, total_memory: CUDA bytes (None on the CPU).
        report: The whole report as text.
    """

    device: str
    verdict: str
    findings: list[str]
    batch_size: int
    step_s: float
    ceiling_s: float
    loader_samples_per_s: float
    plan: str
    host_reads_per_step: float
    peak_memory: int | None = None
    total_memory: int | None = None
    report: str = field(default="", repr=False)

    @property
    def errors(self) -> list[str]:
        """Findings that stop ``fit(check=True)``: none (the device's findings are suggestions)."""
        return []

    def __str__(self) -> str:
        return f"xla_utils.check for {self.device}: {self.verdict}"


def check_device(model: torch.nn.Module, make_step: Any, data: Any, *, batch_size: int,
                 replicas: int, steps: int = 4, timeout: float | None = None) -> DeviceCheckReport:
    """Measure the trainer's step on this machine's torch device (a GPU, else the CPU).

    Args:
        model: The trainer's model on the CPU (copied; never changed).
        make_step: The trainer's step factory (:class:`~xla_utils.train.steps.TrainerStepPlan`),
            which sets the run up as ``fit`` does (device plan, optimizer, schedule, loader).
        data: The training data as the loader collates it.
        batch_size: Per-replica batch.
        replicas: How many replicas ``fit`` runs here (named in the report).
        steps: Steps per timing (default 4, after 2 warm-up steps).
        timeout: Seconds after which the measuring process is killed (default none).

    Returns:
        The :class:`DeviceCheckReport` (not printed).
    """
    meas = runtime.launch_job(_measure, (model, make_step, data, steps),
                              placement=runtime.resolve(cores=1), timeout=timeout,
                              sim_threads=False)
    return _report(meas, batch_size, replicas)


def _measure(model: torch.nn.Module, make_step: Any, data: Any, steps: int) -> dict[str, Any]:
    """The replica: warm up, time the fed step, the resident step and the loader; count
    host reads in one more step."""
    stepper = make_step(copy.deepcopy(model), None)
    s, cfg, dev = stepper.s, make_step.cfg, runtime.device()
    feed = _fed(s, data, cfg.data)
    first = tuple(t.clone() if isinstance(t, torch.Tensor) else t for t in next(feed))
    fed = _timed(stepper, feed, steps, dev)
    feed.close()  # the loader's threads end here
    ceiling = _timed(stepper, itertools.repeat(first), steps, dev)
    reads = _host_reads(stepper, first)
    loader_sps = _loader_speed(s, data, cfg.data, steps)
    meas = {"step_s": fed, "ceiling_s": ceiling, "loader_samples_per_s": loader_sps,
            "plan": s.plan.words, "host_reads": reads, "device": _device_words(dev),
            "device_type": dev.type, "peak_memory": None, "total_memory": None}
    if dev.type == "cuda":
        meas["peak_memory"] = int(torch.cuda.max_memory_allocated(dev))
        meas["total_memory"] = int(torch.cuda.get_device_properties(dev).total_memory)
    return meas


def _fed(s: Any, data: Any, cfg: Any) -> Iterator[tuple]:
    """Device batches as ``fit`` feeds them (its loader, buffers and copies), epoch after
    epoch (a small data set still gives every step)."""
    for epoch in itertools.count():
        yield from s.feed(s.batches(data, cfg, epoch, train=True))


def _wait_for(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _timed(stepper: Any, batches: Any, steps: int, dev: torch.device) -> float:
    """Seconds per optimizer step over ``steps`` steps of ``batches``, after 2 warm-up steps."""
    for i in range(steps + 2):
        if i == 2:
            _wait_for(dev)
            t0 = time.perf_counter()
        for _ in range(stepper.accum_steps):
            x, y, *_ = next(batches)
            stepper.micro_batch(x, y)
            runtime.sync()
    _wait_for(dev)
    return (time.perf_counter() - t0) / steps


def _host_reads(stepper: Any, batch: tuple) -> float:
    """Device->host reads (``.item()``, copies to the host) in one optimizer step."""
    from torch.utils._python_dispatch import TorchDispatchMode

    count = [0]

    class Reads(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if _reads_host(func.__name__.split(".")[0], args, kwargs):
                count[0] += 1
            return func(*args, **kwargs)

    x, y, *_ = batch
    with Reads():
        for _ in range(stepper.accum_steps):
            stepper.micro_batch(x, y)
    runtime.sync()
    return float(count[0])


def _reads_host(op: str, args: tuple, kwargs: dict) -> bool:
    """Whether the aten op ``op`` reads device data on the host: ``.item()``, ``float(t)`` and
    a Python ``if`` on a tensor (``_local_scalar_dense``), or a copy from the device to the CPU."""
    if op == "_local_scalar_dense":
        return True
    tensors = [a for a in args[:2] if isinstance(a, torch.Tensor)]
    if op == "_to_copy" and tensors:  # t.cpu(), t.to("cpu")
        return tensors[0].device.type != "cpu" and str(kwargs.get("device", "")).startswith("cpu")
    if op == "copy_" and len(tensors) == 2:  # dst.copy_(src)
        return tensors[0].device.type == "cpu" and tensors[1].device.type != "cpu"
    return False


def _loader_speed(s: Any, data: Any, cfg: Any, steps: int) -> float:
    """Samples per second of ``fit``'s host loader alone (no device), after one batch."""
    it = iter(s.batches(data, cfg, 1, train=True))
    n, t0 = 0, None
    for k, (x, *_rest) in enumerate(it):
        if k == 0:
            t0 = time.perf_counter()
            continue
        n += len(x)
        if k >= 2 * steps + 2:
            break
    if hasattr(it, "close"):
        it.close()
    return n / max(time.perf_counter() - t0, 1e-9) if t0 is not None and n else float("nan")


def _rate(v: float) -> str:
    return f"{v:,.0f}" if v >= 10 else f"{v:.2g}"


def _device_words(dev: torch.device) -> str:
    if dev.type == "cuda":
        return f"{torch.cuda.get_device_name(dev)} ({dev})"
    return "the CPU (torch)"


def _report(m: dict[str, Any], batch_size: int, replicas: int) -> DeviceCheckReport:
    """The findings and the text of the replica's measurements ``m``."""
    kind = m["device_type"]
    device = m["device"] + (f" x{replicas}" if kind == "cuda" and replicas > 1 else "")
    if kind != "cuda":
        device += (f", {runtime.replicas_word(replicas, kind)}"
                   + (f" ({CPU_REPLICAS_ENV}={os.environ[CPU_REPLICAS_ENV]})"
                      if os.environ.get(CPU_REPLICAS_ENV) else ""))
    step, ceiling, loader = m["step_s"], m["ceiling_s"], m["loader_samples_per_s"]
    wants = batch_size / max(ceiling, 1e-9)  # samples/s the step could take
    findings = []
    if step > SLOW_FEED * ceiling and loader < wants:
        findings.append(
            f"input-bound: the step as fit feeds it takes {step * 1e3:.1f} ms, {step / ceiling:.2f}x "
            f"the {ceiling * 1e3:.1f} ms it takes on a batch already on the device; the loader "
            f"gives {_rate(loader)} samples/s where the step takes {_rate(wants)}. Fix: a cache at the "
            "training size (build_cache(size=...)), num_workers= up to the host's cores, or a "
            "larger batch_size")
    reads = m["host_reads"]
    if kind == "cuda" and reads > (1 if "GradScaler" in m["plan"] else 0):
        findings.append(
            f"host reads: {reads:.0f} per step (.item(), .cpu(), a Python `if` on a tensor); "
            "each waits for the GPU to finish. Fix: keep values on the device in the step "
            "(fit reads the loss every log_every steps itself)")
    peak, total = m["peak_memory"], m["total_memory"]
    if peak is not None and total and peak > MEMORY_FULL * total:
        findings.append(f"memory: the step peaks at {format_bytes(peak)} of {format_bytes(total)} "
                        f"({peak / total:.0%}): a larger batch or model will not fit. Fix: "
                        "precision='auto' (bf16/fp16), a smaller batch_size with accum_steps=")
    verdict = (f"could be faster ({len(findings)} suggestion{'s' if len(findings) > 1 else ''})"
               if findings else "GOOD")
    lines = [f"xla_utils.check for {device}: {verdict}",
             f"  step: {step * 1e3:.1f} ms as fit feeds it, {ceiling * 1e3:.1f} ms on a batch "
             f"already on the device (the no-loader ceiling; fed/ceiling {step / ceiling:.2f}x), "
             f"batch {batch_size} per {runtime.replica_noun(kind)}",
             f"  loader: {_rate(loader)} samples/s alone; the step takes {_rate(wants)}",
             f"  plan: {m['plan']}",
             f"  host reads: {reads:.0f} per step"]
    if peak is not None:
        lines.append(f"  memory: peak {format_bytes(peak)} of {format_bytes(total)} "
                     f"({1 - peak / total:.0%} headroom)")
    lines += [f"- {f}" for f in findings]
    return DeviceCheckReport(device=device, verdict=verdict, findings=findings,
                             batch_size=batch_size, step_s=step, ceiling_s=ceiling,
                             loader_samples_per_s=loader, plan=m["plan"],
                             host_reads_per_step=reads, peak_memory=peak, total_memory=total,
                             report="\n".join(lines))
