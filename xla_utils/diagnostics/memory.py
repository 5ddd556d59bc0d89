"""Per-device memory of a training step under each strategy: measured from real shardings, or on paper.

Three ways to train on N devices (``TrainerConfig.strategy``):

* ``"spawn"``: one process per core, everything replicated; each core runs the per-core batch.
* ``"spmd"``: one process, a 1-D mesh, parameters replicated, the global batch sharded.
* ``"fsdp"``: FSDPv2 over that mesh: parameters, gradients and optimizer state sharded.

:func:`measure_memory` builds the model under each strategy on N real XLA:CPU devices in
a fresh process, runs one forward/backward/AdamW step and reads every tensor's bytes on
one device from its XLA sharding (see :mod:`xla_utils.runtime.shardinfo`). Activations
are the tensors autograd saves for backward in that real forward, as XLA's sharding
propagation placed them. :func:`paper_memory` applies the same sharding rules (FSDPv2:
each parameter's largest dimension split over the devices, padded to equal shards) to a
list of parameter shapes without building the model, e.g. :func:`llama_shapes` for 1B
and 7B models. :func:`strategy_advice` is the ``check(tpu=...)`` memory line.

Nothing here imports torch_xla; the measurement runs in another process.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

from ..utils.units import format_bytes

__all__ = ["DeviceMemory", "MemoryReport", "measure_memory", "paper_memory", "llama_shapes",
           "strategy_advice", "optimizer_state_count", "state_bytes",
           "activation_bytes",
           "STRATEGIES"]

STRATEGIES = ("spawn", "spmd", "fsdp")


@dataclass(frozen=True)
class DeviceMemory:
    """Bytes held by ONE device during a training step under one strategy.

    Attributes:
        strategy: ``"spawn"``, ``"spmd"`` or ``"fsdp"``.
        devices: devices the run uses (the mesh size; 1 for one spawn replica's view).
        params, grads, optimizer: bytes of parameters, gradients and AdamW state on one device.
        activations: bytes of the tensors saved for backward on one device (None: not known,
            e.g. on paper).
        source: ``"measured"`` (read from XLA shardings) or ``"paper"`` (sharding rules).
    """

    strategy: str
    devices: int
    params: int
    grads: int
    optimizer: int
    activations: int | None
    source: str

    @property
    def states(self) -> int:
        """Parameters + gradients + optimizer state, in bytes."""
        return self.params + self.grads + self.optimizer

    @property
    def total(self) -> int:
        """States + activations (activations counted as 0 when unknown), in bytes."""
        return self.states + (self.activations or 0)

    def __str__(self) -> str:
        act = "n/a" if self.activations is None else format_bytes(self.activations)
        return (f"{self.strategy:>5}: params {format_bytes(self.params)} + grads {format_bytes(self.grads)} + AdamW "
                f"{format_bytes(self.optimizer)} + activations {act} = {format_bytes(self.total)} per device "
                f"({self.source})")


@dataclass
class MemoryReport:
    """Per-device memory under each strategy for one model and batch.

    Attributes:
        rows: one :class:`DeviceMemory` per strategy.
        n_params: parameters of the model.
        replicated_states: params + grads + AdamW state of the whole model, in bytes (what
            every device holds when nothing is sharded).
        devices: the mesh size N.
        details: raw measurements per strategy (shardings seen, saved tensors, loss).
    """

    rows: list[DeviceMemory]
    n_params: int
    replicated_states: int
    devices: int
    details: dict[str, Any] = field(default_factory=dict)

    def __getitem__(self, strategy: str) -> DeviceMemory:
        for r in self.rows:
            if r.strategy == strategy:
                return r
        raise KeyError(f"no {strategy!r} row; strategies here: {[r.strategy for r in self.rows]}")

    def table(self) -> str:
        """A markdown table, one row per strategy, in MiB per device."""
        def mib(v: int | None) -> str:
            return "n/a" if v is None else f"{v / 2**20:,.1f}"

        lines = ["| strategy | devices | params | grads | AdamW state | activations | total | source |",
                 "|---|---:|---:|---:|---:|---:|---:|---|"]
        for r in self.rows:
            lines.append(f"| {r.strategy} | {r.devices} | {mib(r.params)} | {mib(r.grads)} | "
                         f"{mib(r.optimizer)} | {mib(r.activations)} | {mib(r.total)} | {r.source} |")
        return "\n".join(lines)

    def __str__(self) -> str:
        head = (f"{self.n_params / 1e6:,.1f}M parameters; replicated params + grads + AdamW = "
                f"{format_bytes(self.replicated_states)}; per device on {self.devices} devices:")
        return "\n".join([head] + [f"  {r}" for r in self.rows])


def _check_strategies(strategies: Iterable[str]) -> list[str]:
    out = list(strategies)
    bad = [s for s in out if s not in STRATEGIES]
    if bad or not out:
        raise ValueError(f"strategies must be a non-empty subset of {STRATEGIES}, got {out!r}")
    return out


def _check_wrap(fsdp_wrap: Any) -> None:
    ok = fsdp_wrap is None or (isinstance(fsdp_wrap, int) and not isinstance(fsdp_wrap, bool)
                               and fsdp_wrap > 0) or (
        isinstance(fsdp_wrap, (list, tuple, set)) and fsdp_wrap
        and all(isinstance(w, (str, type)) for w in fsdp_wrap))
    if not ok:
        raise ValueError(f"fsdp_wrap must be None (whole model), a positive int (minimum "
                         f"parameters per unit) or a list of module classes / class names, "
                         f"got {fsdp_wrap!r}")


def _check_wrap_matches(model: Any, fsdp_wrap: Any) -> None:
    """Refuse module classes / names that match no module of an already built ``model``."""
    if not hasattr(model, "modules") or not isinstance(fsdp_wrap, (list, tuple, set)):
        return  # a factory: the measuring process refuses it, naming the same setting
    kinds = {type(m) for m in model.modules()}
    names = {k.__name__ for k in kinds}
    if not any(w in kinds or w in names for w in fsdp_wrap):
        raise ValueError(f"fsdp_wrap={list(fsdp_wrap)!r} matches no module of the model (its "
                         f"module classes: {sorted(names)}). Fix: name the repeated block class, "
                         "e.g. fsdp_wrap=['Block'], or pass None to wrap the whole model")


def measure_memory(model: Any, batch: Any, *, strategies: Sequence[str] = STRATEGIES,
                   devices: int = 8, train_step: Callable | None = None,
                   loss: Callable | None = None, fsdp_wrap: Any = None,
                   activation_checkpointing: bool = False,
                   timeout: float | None = 900.0) -> MemoryReport:
    """Measure per-device memory under each strategy on ``devices`` real XLA:CPU devices.

    Each strategy runs in its own fresh process (``PJRT_DEVICE=CPU CPU_NUM_DEVICES=devices``):
    the model is built (and for ``"fsdp"`` wrapped with FSDPv2), one forward/backward and one
    AdamW step run on ``batch``, and each tensor's bytes on one device are read from its XLA
    sharding. The calling process never touches the XLA runtime.

    Args:
        model: a zero-argument factory returning an ``nn.Module`` (cheapest: only the
            function is sent), or an ``nn.Module`` on the CPU (pickled with its weights).
        batch: ONE core's batch ``(x, y)`` of tensors (dicts/tuples of tensors allowed in
            ``x``); under ``"spmd"``/``"fsdp"`` it is repeated ``devices`` times to make the
            global batch, which is sharded on its first dimension.
        strategies: which of ``"spawn"``, ``"spmd"``, ``"fsdp"`` to measure (default all).
        devices: mesh size N (default 8, a v5e-8).
        train_step: ``train_step(model, (x, y), loss) -> loss tensor`` as in the trainer;
            default ``loss(model(x), y)``.
        loss: the loss for the default step.
        fsdp_wrap: FSDPv2 units: module classes or class names, a minimum parameter count,
            or None (default: the whole model as one unit).
        activation_checkpointing: checkpoint each wrapped unit under ``"fsdp"`` (default False).
        timeout: seconds per strategy's process (default 900).

    Returns:
        A :class:`MemoryReport` (``print`` it, or ``report["fsdp"].states``).

    Raises:
        ValueError: bad ``strategies``, ``devices``, ``fsdp_wrap`` or no step to run.
        ReplicaError: a measuring process raised (its traceback) or died (its output's tail).
        TimeoutError: a measuring process ran past ``timeout``.
    """
    from ..runtime import shardinfo

    names = _check_strategies(strategies)
    if not isinstance(devices, int) or devices < 1:
        raise ValueError(f"devices must be a positive int (the mesh size), got {devices!r}")
    _check_wrap(fsdp_wrap)
    _check_wrap_matches(model, fsdp_wrap)
    if train_step is None and loss is None:
        raise ValueError("measure_memory needs loss= (for loss(model(x), y)) or train_step=")
    if not isinstance(batch, (tuple, list)) or len(batch) != 2:
        raise ValueError("batch must be one core's (x, y); use (x, None) when there is no target")
    rows, details = [], {}
    for s in names:
        job = {"model": model, "batch": tuple(batch), "strategy": s, "devices": devices,
               "train_step": train_step, "loss": loss,
               "fsdp_wrap": fsdp_wrap if s == "fsdp" else None,
               "checkpointing": activation_checkpointing and s == "fsdp"}
        r = shardinfo.run_measurement(job, devices, timeout=timeout)
        details[s] = r
        rows.append(DeviceMemory(s, devices, r["param_bytes"], r["grad_bytes"],
                                 r["optimizer_state_bytes"], r["activation_bytes"], "measured"))
    first = details[names[0]]
    return MemoryReport(rows, first["n_params"], 4 * first["replicated_param_bytes"], devices,
                        details)


def _fsdp_shard_numel(shape: Sequence[int], n: int) -> int:
    """Elements of one device's shard under FSDPv2's rule: the largest dimension split over
    ``n`` (padded to equal shards); scalars are replicated."""
    if not shape:
        return 1
    dims = list(shape)
    i = dims.index(max(dims))
    dims[i] = math.ceil(dims[i] / n)
    return math.prod(dims)


def paper_memory(param_shapes: Iterable[Sequence[int]], devices: int = 8, *,
                 strategies: Sequence[str] = STRATEGIES, bytes_per_param: int = 4,
                 optimizer_states: int = 2, activations: int | None = None) -> MemoryReport:
    """Per-device memory from the sharding rules on paper (no model is built).

    ``"spawn"`` and ``"spmd"`` replicate parameters, gradients and optimizer state;
    ``"fsdp"`` shards each parameter, its gradient and its
    optimizer state on the parameter's largest dimension, as FSDPv2 does
    (``shard_maximal``), with XLA's padding to equal shards.

    Args:
        param_shapes: the shape of every parameter.
        devices: mesh size N (default 8).
        strategies: rows to compute (default all three).
        bytes_per_param: 4 (fp32, default) or 2 (bf16 weights).
        optimizer_states: state tensors per parameter (AdamW 2, default; SGD momentum 1).
        activations: per-device activation bytes to add to every row (None: unknown).

    Returns:
        A :class:`MemoryReport` with ``source="paper"`` rows.
    """
    names = _check_strategies(strategies)
    shapes = [tuple(int(d) for d in s) for s in param_shapes]
    full = sum(math.prod(s) for s in shapes)
    sharded = sum(_fsdp_shard_numel(s, devices) for s in shapes)
    rows = []
    for s in names:
        n = sharded if s == "fsdp" else full
        b = n * bytes_per_param
        rows.append(DeviceMemory(s, devices, b, b, optimizer_states * b, activations, "paper"))
    return MemoryReport(rows, full, (2 + optimizer_states) * full * bytes_per_param, devices)


# Public configurations (Hugging Face config.json of each model).
_LLAMA = {
    "1b": dict(layers=16, d=2048, ff=8192, heads=32, kv_heads=8, vocab=128256, tied=True),
    "7b": dict(layers=32, d=4096, ff=11008, heads=32, kv_heads=32, vocab=32000, tied=False),
}


def llama_shapes(size: str) -> list[tuple[int, ...]]:
    """Parameter shapes of a Llama-style decoder: ``"1b"`` (Llama-3.2-1B, 1.24B parameters,
    tied embeddings) or ``"7b"`` (Llama-2-7B, 6.74B)."""
    if size not in _LLAMA:
        raise ValueError(f"size must be one of {sorted(_LLAMA)}, got {size!r}")
    c = _LLAMA[size]
    d, kv = c["d"], c["d"] // c["heads"] * c["kv_heads"]
    block = [(d, d), (kv, d), (kv, d), (d, d), (c["ff"], d), (c["ff"], d), (d, c["ff"]), (d,), (d,)]
    shapes = [(c["vocab"], d)] + block * c["layers"] + [(d,)]
    if not c["tied"]:
        shapes.append((c["vocab"], d))
    return shapes


def strategy_advice(param_shapes: Iterable[Sequence[int]], param_bytes: int, activations: int,
                    optimizer_states: int, devices: int, usable_bytes: float, chip: str
                    ) -> tuple[str, str | None]:
    """``(sentence, fix or None)`` for ``check(tpu=...)``: per-device bytes under each strategy
    on ``devices`` devices, and ``strategy="fsdp"`` as the fix when the states do not fit one
    core but the sharded ones do."""
    shapes = list(param_shapes)
    n = max(sum(math.prod(s) for s in shapes), 1)
    per = max(round(param_bytes / n), 1)
    rep = paper_memory(shapes, devices, bytes_per_param=per, optimizer_states=optimizer_states,
                       activations=activations)
    parts = "; ".join(f'strategy="{r.strategy}" {format_bytes(r.total)}' for r in rep.rows)
    text = (f"Per device on {devices} {chip} devices (sharding rules on paper, activations as "
            f"measured at this per-core batch): {parts}.")
    fsdp = rep["fsdp"]
    if rep["spawn"].total > usable_bytes and fsdp.total <= usable_bytes:
        return text, (f'train with strategy="fsdp" (FSDPv2: parameters, gradients and optimizer '
                      f"state sharded over the {devices} devices): about {format_bytes(fsdp.total)} per "
                      f"device ({format_bytes(fsdp.states)} of states + {format_bytes(activations)} of activations)")
    return text, None


def optimizer_state_count(optimizer: Any) -> int:
    """State tensors per parameter of an optimizer spec: ``"sgd"`` 1 (momentum), ``"adam"`` /
    ``"adamw"`` 2 (moments); a callable is counted as 2 (Adam-like, the safe side)."""
    return 1 if isinstance(optimizer, str) and optimizer.lower() == "sgd" else 2


def state_bytes(model: Any, optimizer: Any) -> int:
    """Bytes of parameters + gradients (trainable ones) + optimizer state
    (:func:`optimizer_state_count` tensors per trainable parameter) of ``model`` whole,
    from its parameters' sizes and dtypes: what one core holds when nothing is sharded."""
    pbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    tbytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    return pbytes + tbytes * (1 + optimizer_state_count(optimizer))


def activation_bytes(model: Any, x: Any, y: Any, *, step: Callable, loss: Callable,
                     batch_size: int, bf16: bool = False) -> int:
    """Bytes of the tensors autograd saves for backward in one training forward of
    ``model`` at ``batch_size`` rows: measured in one forward pass on the host CPU of
    the small sample batch ``(x, y)`` (a few rows) and scaled linearly; no backward
    runs. The model's buffers (BatchNorm statistics), train/eval flags and the torch
    RNG are restored afterwards; its parameters and gradients are not touched.

    Args:
        model: An ``nn.Module`` on the CPU.
        x, y: A small host batch (model input as ``step`` expects it, targets).
        step: ``step(model, (x, y), loss) -> loss tensor`` (the trainer's ``train_step``).
        loss: The loss.
        batch_size: Rows of one core's batch.
        bf16: Run the forward under CPU ``autocast(bfloat16)`` (the trainer's ``bf16``).
    """
    import torch

    keys = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: Any) -> Any:
        key = t.untyped_storage().data_ptr()
        if key not in keys:
            saved[key] = t.untyped_storage().nbytes()
        return t

    first = next((t for t in (x.values() if isinstance(x, dict) else
                              x if isinstance(x, (tuple, list)) else [x])
                  if isinstance(t, torch.Tensor) and t.dim()), None)
    rows = max(int(first.shape[0]) if first is not None else 1, 1)  # dict/tuple inputs too
    buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
    flags = {n: m.training for n, m in model.named_modules()}
    try:
        with torch.random.fork_rng(devices=[]), torch.enable_grad(), \
                torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16), \
                torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model.train()
            step(model, (x, y), loss)
    finally:
        with torch.no_grad():
            for n, b in model.named_buffers():
                b.copy_(buffers[n])
        for n, m in model.named_modules():
            m.training = flags[n]
    return round(sum(saved.values()) * batch_size / rows)
