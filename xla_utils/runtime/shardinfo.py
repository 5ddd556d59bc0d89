"""Per-device memory read from real XLA shardings (the torch_xla side of :mod:`xla_utils.diagnostics.memory`).

:func:`run_measurement` starts a fresh interpreter with ``PJRT_DEVICE=CPU
CPU_NUM_DEVICES=N`` (N real XLA:CPU devices; SPMD cannot share a process with
``xmp.spawn`` or an initialised runtime), which runs :func:`measure` on the model:

* ``"spawn"``: no SPMD, one device, the per-core batch (what each ``xmp.spawn``
  replica holds: everything replicated);
* ``"spmd"``: ``xr.use_spmd()``, a 1-D mesh over the N devices, parameters
  replicated, the global batch (N x per-core) sharded on its first dimension;
* ``"fsdp"``: as ``"spmd"`` with the model wrapped by torch_xla's FSDPv2
  (``SpmdFullyShardedDataParallel``), optionally per module class or parameter count.

Then one real forward/backward and one AdamW step run, and every tensor's bytes on
one device are read from its XLA sharding (``_get_local_shard_replica_and_indices``:
the index ranges of each device's shard; XLA pads uneven shards to equal size, so
the largest shard is what every device holds). Activations are the tensors autograd
saves for backward (``saved_tensors_hooks``), materialised with one sync so that
XLA's sharding propagation has placed them, minus parameters and views of them.
"""
from __future__ import annotations

import os
from typing import Any, Callable

from .fresh import child_env, run_fresh
from .xla import fast_cpu_compile_flags

__all__ = ["run_measurement", "measure", "measure_job", "shard_bytes"]

STRATEGIES = ("spawn", "spmd", "fsdp")


def shard_bytes(t: Any) -> int:
    """Bytes of XLA tensor ``t`` on one device: its largest shard (the whole tensor if replicated)."""
    import torch_xla

    full = t.numel() * t.element_size()
    spec = torch_xla._XLAC._get_xla_sharding_spec(t)
    if not spec or spec == "{replicated}":
        return full
    shards = torch_xla._XLAC._get_local_shard_replica_and_indices([t])[0]
    best = 0
    for _replica, index in shards:
        if index is Ellipsis or (isinstance(index, (list, tuple)) and Ellipsis in index):
            return full  # this device holds the whole tensor
        n = 1
        for dim, sl in zip(t.shape, index if isinstance(index, (list, tuple)) else [index]):
            start, stop, _ = sl.indices(dim) if isinstance(sl, slice) else (0, dim, 1)
            n *= max(stop - start, 0)
        best = max(best, n * t.element_size())
    return best


def _setup(model: Any, strategy: str, n: int, wrap: Any, checkpointing: bool) -> tuple[Any, Any]:
    """``(model on the device (wrapped for fsdp), mesh or None)``: the trainer's own
    placement and FSDPv2 wrap (:func:`xla_utils.runtime.spmd.fsdp_wrap_model`)."""
    import torch_xla

    from . import spmd

    if strategy == "spawn":
        return model.to(torch_xla.device()), None
    spmd.enable_spmd()
    mesh = spmd.make_mesh(n, "fsdp")
    if strategy == "fsdp":
        return spmd.fsdp_wrap_model(model, mesh, wrap, checkpointing), mesh
    return model.to(torch_xla.device()), mesh


def _to_device(batch: Any, mesh: Any, n: int) -> Any:
    """The batch on the device: under SPMD repeated to the global batch (n x per-core)
    and sharded on its first dimension."""
    import torch
    import torch_xla
    import torch_xla.distributed.spmd as xs

    if isinstance(batch, (tuple, list)):
        return type(batch)(_to_device(b, mesh, n) for b in batch)
    if isinstance(batch, dict):
        return {k: _to_device(v, mesh, n) for k, v in batch.items()}
    if not isinstance(batch, torch.Tensor):
        return batch
    t = batch if mesh is None or batch.dim() == 0 else torch.cat([batch] * n)
    t = t.to(torch_xla.device())
    if mesh is not None and t.dim() >= 1:
        xs.mark_sharding(t, mesh, ("fsdp",) + (None,) * (t.dim() - 1))
    return t


def measure(model: Any, batch: Any, strategy: str, devices: int, *, train_step: Callable | None,
            loss: Callable | None, fsdp_wrap: Any = None, checkpointing: bool = False,
            lr: float = 1e-3) -> dict[str, Any]:
    """Per-device bytes of parameters, gradients, AdamW state and saved activations after one
    real forward/backward/AdamW step of ``model`` on ``batch`` under ``strategy`` (call in a
    process with ``devices`` XLA:CPU devices and an untouched runtime)."""
    import torch
    import torch_xla

    full = {"params": sum(p.numel() * p.element_size() for p in model.parameters()),
            "n_params": sum(p.numel() for p in model.parameters())}
    model, mesh = _setup(model, strategy, devices, fsdp_wrap, checkpointing)
    params = list(model.parameters())
    out: dict[str, Any] = {"strategy": strategy, "devices": devices if mesh is not None else 1,
                           "replicated_param_bytes": full["params"], "n_params": full["n_params"],
                           "shardings": sorted({torch_xla._XLAC._get_xla_sharding_spec(p) or "replicated"
                                                for p in params})}
    out["param_bytes"] = sum(shard_bytes(p) for p in params)
    x, y = _to_device(batch, mesh, devices)
    pids = {id(p) for p in params}
    saved: dict[int, Any] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        base = t._base if t._base is not None else t
        if t.device.type == "xla" and id(t) not in pids and id(base) not in pids:
            saved[id(t)] = t
        return t

    model.train()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        value = train_step(model, (x, y), loss) if train_step else loss(model(x), y)
    acts = list(saved.values())
    torch_xla._XLAC._xla_sync_multi(acts, [], True)  # XLA places (shards) each saved tensor
    out["activation_bytes"] = sum(shard_bytes(t) for t in acts)
    out["activation_tensors"] = len(acts)
    value.backward()
    opt = torch.optim.AdamW(params, lr=lr, foreach=False)
    opt.step()
    torch_xla.sync()
    torch_xla._XLAC._xla_wait_device_ops(devices=[])  # shard indices need the step's results
    out["loss"] = float(value.detach().cpu())
    out["grad_bytes"] = sum(shard_bytes(p.grad) for p in params if p.grad is not None)
    out["optimizer_state_bytes"] = sum(shard_bytes(v) for s in opt.state.values()
                                       for v in s.values()
                                       if isinstance(v, torch.Tensor) and v.device.type == "xla")
    return out


def run_measurement(job: dict[str, Any], devices: int, timeout: float | None = None) -> dict[str, Any]:
    """Run :func:`measure` with ``job``'s arguments in a fresh interpreter
    (:func:`xla_utils.runtime.fresh.run_fresh`) with ``devices`` XLA:CPU devices; its output
    is kept, not printed, and shown only in the error of a process that died.

    Raises:
        ReplicaError: the measurement raised (its traceback), or the process died.
        TimeoutError: ``timeout`` seconds passed; the process was killed.
    """
    env = child_env(devices, {"XLA_THREAD_POOL_SIZE": str(max(16, devices)),
                              "XLA_FLAGS": fast_cpu_compile_flags(os.environ.get("XLA_FLAGS"))})
    return run_fresh(measure_job, (job,), env=env, timeout=timeout, echo=False,
                     what=f"the {job['strategy']!r} memory measurement on {devices} XLA:CPU devices")


def measure_job(job: dict[str, Any]) -> dict[str, Any]:
    """In the measuring process: build the model (a factory is called after seeding 0),
    then :func:`measure`."""
    job = dict(job)
    model = job.pop("model")
    if not hasattr(model, "parameters"):
        import torch

        torch.manual_seed(0)
        model = model()
    return measure(model, job.pop("batch"), job.pop("strategy"), job.pop("devices"), **job)
