"""torch_xla's SPMD calls, in one place: mesh, shardings, FSDPv2, sharded inputs.

An SPMD program is one process that owns every device of the host; tensors carry
shardings (``xs.mark_sharding``) and XLA's partitioner inserts the collectives.
:mod:`xla_utils.step.strategy` asks this module for everything SPMD; nothing here is
imported at ``import xla_utils`` time, and torch_xla is imported inside the
functions only.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, Iterator, Sequence

__all__ = ["SPMD_MODULES", "spmd_support", "enable_spmd", "device_count", "make_mesh",
           "sharded_batches", "shard_to_device", "fsdp_wrap_model", "shard_output",
           "shard_grads_like_params", "sharding_spec", "local_shard_bytes", "save_sharded",
           "load_sharded", "zeros_like_param", "SHARDED_META", "FSDP_WRAPPER_PARTS"]

# The modules "fsdp" needs (SPMD itself, FSDPv2, the wrap policies, checkpoint_module).
SPMD_MODULES = ("torch_xla.distributed.spmd",
                "torch_xla.experimental.spmd_fully_sharded_data_parallel",
                "torch_xla.distributed.fsdp.wrap")

# The file inside a ``.dcp`` folder holding what a resume needs beside the tensors.
SHARDED_META = "xla_utils_meta.pt"

# Names FSDPv2 and activation checkpointing insert into parameter paths.
FSDP_WRAPPER_PARTS = ("_orig_module", "_xla_checkpointed_module", "_checkpoint_wrapped_module")


def spmd_support(modules: Sequence[str] = SPMD_MODULES) -> str | None:
    """None when this torch_xla can run SPMD and FSDPv2, else why not (with the fix).

    Imports the modules (not the XLA runtime): safe in the calling process.
    """
    import importlib

    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as exc:  # ImportError, or a broken install
            return (f"this torch_xla cannot run SPMD/FSDPv2: importing {name} failed "
                    f"({type(exc).__name__}: {exc}). Fix: use torch_xla >= 2.5 (Kaggle's 2.8 "
                    "and Colab's 2.9 have it), or strategy='spawn'")
    return None


def enable_spmd() -> None:
    """``xr.use_spmd()``: call first thing in the SPMD process, before any XLA tensor."""
    import torch_xla.runtime as xr

    xr.use_spmd()


def device_count() -> int:
    """Devices this SPMD process owns (all of them: ``xr.global_runtime_device_count()``)."""
    import torch_xla.runtime as xr

    return int(xr.global_runtime_device_count())


def make_mesh(devices: int, axis: str) -> Any:
    """A 1-D ``xs.Mesh`` of ``devices`` devices whose one axis is named ``axis``."""
    import numpy as np
    import torch_xla.distributed.spmd as xs

    return xs.Mesh(np.arange(devices), (devices,), (axis,))


def _spec(mesh: Any, axis: str, t: Any) -> Any:
    import torch_xla.distributed.spmd as xs

    return xs.ShardingSpec(mesh, (axis,) + (None,) * (t.dim() - 1))


def sharded_batches(batches: Iterable, mesh: Any, axis: str) -> Iterator:
    """Host batches ``(x, y, valid)`` (or any tuple of tensors) moved to the devices,
    every tensor split along its first (batch) axis over ``axis`` of ``mesh``.

    Transfers go straight to the shards (``send_cpu_data_to_device(input_sharding=)``);
    no step boundary is taken (the loop owns it).
    """
    import torch
    import torch_xla
    import torch_xla.core.xla_model as xm

    dev = torch_xla.device()
    for batch in batches:
        out = []
        for t in batch:
            if isinstance(t, torch.Tensor) and t.dim() >= 1:
                t = xm.send_cpu_data_to_device([t], dev, input_sharding=_spec(mesh, axis, t))[0]
            elif isinstance(t, torch.Tensor):
                t = xm.send_cpu_data_to_device([t], dev)[0]
            out.append(t)
        yield type(batch)(out) if isinstance(batch, tuple) else out


def _wrap_policy(model: Any, wrap: Any) -> Callable | None:
    """torch_xla's auto-wrap policy for ``wrap``: module classes or class names (resolved
    against ``model``'s modules), a minimum parameter count, or None (no policy)."""
    import functools

    from torch_xla.distributed.fsdp.wrap import (size_based_auto_wrap_policy,
                                                 transformer_auto_wrap_policy)

    if wrap is None:
        return None
    if isinstance(wrap, int) and not isinstance(wrap, bool):
        return functools.partial(size_based_auto_wrap_policy, min_num_params=wrap)
    wrap = [wrap] if isinstance(wrap, (str, type)) else list(wrap)
    names = {w for w in wrap if isinstance(w, str)}
    classes = {w for w in wrap if isinstance(w, type)}
    classes |= {type(m) for m in model.modules() if type(m).__name__ in names}
    if not classes:
        raise ValueError(f"fsdp_wrap={wrap!r} matches no module of the model")
    return functools.partial(transformer_auto_wrap_policy, transformer_layer_cls=classes)


def shard_output(output: Any, mesh: Any) -> None:
    """FSDPv2's output hook: shard a batch-first output (or a tuple's first) on ``fsdp``;
    scalars (a loss) and other outputs (a dict) are left to XLA's propagation."""
    import torch_xla.distributed.spmd as xs

    t = output[0] if isinstance(output, (tuple, list)) and output else output
    if hasattr(t, "dim") and t.dim() >= 1:
        xs.mark_sharding(t, mesh, ("fsdp",) + (None,) * (t.dim() - 1))


def shard_to_device(model: Any, mesh: Any, on_place: Callable[[], None] | None = None) -> Any:
    """Move ``model``'s parameters from the host to the devices one at a time, each one
    straight into its FSDPv2 shards (largest dimension over ``mesh``'s ``fsdp`` axis).

    No device ever holds a parameter, let alone the model, unsharded: each host tensor
    is split on the host and every device receives only its shard
    (``send_cpu_data_to_device(input_sharding=)``). FSDPv2 then finds the parameters
    sharded already and leaves them as they are (its own ``module.to('xla')`` would
    copy a unit whole to every device first). Buffers (e.g. BatchNorm statistics) are
    small and go replicated. Tied parameters stay tied; parameters already on the
    device are kept. In place; returns ``model``.

    Args:
        model: A host (CPU) module.
        mesh: A mesh with an axis named ``"fsdp"``.
        on_place: Called after each parameter is placed (a memory probe); None: nothing.
    """
    import torch
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.distributed.spmd as xs

    dev = torch_xla.device()
    placed: dict[int, Any] = {}
    for mod in model.modules():
        for name, p in list(mod._parameters.items()):
            if p is None:
                continue
            if id(p) in placed or p.device.type == "xla":
                mod._parameters[name] = placed.setdefault(id(p), p)
                continue
            spec = xs.ShardingSpec(mesh, _fsdp_spec(p.shape)) if p.dim() else None
            data = xm.send_cpu_data_to_device([p.detach()], dev, input_sharding=spec)[0]
            mod._parameters[name] = placed[id(p)] = torch.nn.Parameter(
                data, requires_grad=p.requires_grad)
            if on_place is not None:
                on_place()
        for name, b in list(mod._buffers.items()):
            if b is not None and b.device.type != "xla":
                mod._buffers[name] = b.to(dev)
    return model


def fsdp_wrap_model(model: Any, mesh: Any, wrap: Any, checkpointing: bool) -> Any:
    """``model`` as FSDPv2 (``SpmdFullyShardedDataParallel``) over ``mesh``'s ``fsdp`` axis.

    Args:
        model: The module (on the CPU or the XLA device; from the CPU each parameter
            goes straight into its shards: :func:`shard_to_device`).
        mesh: A mesh with an axis named ``"fsdp"``.
        wrap: Module classes or class names to wrap as their own units, a minimum
            parameter count per unit (an int), or None (the whole model as one unit).
        checkpointing: Recompute each wrapped unit's activations in the backward pass
            (``checkpoint_module``); with ``wrap=None`` the whole model.
    """
    from torch_xla.distributed.fsdp import checkpoint_module
    from torch_xla.experimental.spmd_fully_sharded_data_parallel import \
        SpmdFullyShardedDataParallel as FSDPv2

    def unit(m, *args, **kwargs):
        return FSDPv2(checkpoint_module(m) if checkpointing else m, *args, **kwargs)

    shard_to_device(model, mesh)
    policy = _wrap_policy(model, wrap)
    if policy is None:
        wrapped = unit(model, mesh=mesh, shard_output=shard_output)
    else:
        wrapped = FSDPv2(model, mesh=mesh, shard_output=shard_output, auto_wrap_policy=policy,
                         auto_wrapper_callable=unit)
    shard_grads_like_params(wrapped, mesh)
    return wrapped


def _fsdp_spec(shape: Sequence[int]) -> tuple:
    """FSDPv2's rule: shard the largest dimension over ``fsdp`` (scalars replicated)."""
    spec: list = [None] * len(shape)
    if spec:
        spec[list(shape).index(max(shape))] = "fsdp"
    return tuple(spec)


def shard_grads_like_params(model: Any, mesh: Any) -> None:
    """Give every gradient its parameter's sharding as it is accumulated.

    Left alone, XLA's propagation all-reduces a gradient into a replicated tensor
    (full size on every device); annotated, it becomes a reduce-scatter and the
    optimizer state that follows it stays sharded too.
    """
    import torch_xla.distributed.spmd as xs

    def hook(p):
        if p.grad is not None and p.dim() > 0:
            xs.mark_sharding(p.grad, mesh, _fsdp_spec(p.shape))

    for p in model.parameters():
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(hook)


def sharding_spec(t: Any) -> str:
    """The XLA sharding of a device tensor as text, e.g. ``{devices=[8,1]0,1,...}``;
    ``""`` for an unsharded (replicated by default) tensor."""
    import torch_xla

    return torch_xla._XLAC._get_xla_sharding_spec(t)


def local_shard_bytes(t: Any) -> list[int]:
    """Bytes of ``t`` held by each device, read from its actual shards."""
    import torch_xla

    if sharding_spec(t) == "":
        n = device_count()
        return [t.numel() * t.element_size()] * n
    import torch_xla.core.xla_model as xm

    xm.wait_device_ops()  # the shards of a tensor still being computed cannot be read
    shards = torch_xla._XLAC._get_local_shards([t])[0]  # [(cpu tensor, "CPU:0"), ...]
    return [s.numel() * s.element_size() for s, _ in shards]


def save_sharded(state: dict, folder: Any, meta: dict | None = None) -> None:
    """Write ``state`` (nested dicts of sharded device tensors) as a torch.distributed
    checkpoint folder with torch_xla's ``SPMDSavePlanner``: each device's shards, no
    host-side consolidation; ``meta`` (host objects) goes beside them as
    :data:`SHARDED_META`. Written to ``<folder>.tmp`` and renamed."""
    import shutil
    from pathlib import Path

    import torch.distributed.checkpoint as dist_cp
    from torch_xla.experimental.distributed_checkpoint import SPMDSavePlanner

    import torch_xla.core.xla_model as xm

    xm.wait_device_ops()  # the planner reads shards: none may still be computing
    folder = Path(folder)
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    dist_cp.save(state_dict=state, storage_writer=dist_cp.FileSystemWriter(str(tmp)),
                 planner=SPMDSavePlanner())
    if meta is not None:
        import torch

        torch.save(meta, tmp / SHARDED_META)
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)


def load_sharded(state: dict, folder: Any) -> None:
    """Fill ``state`` (the same structure :func:`save_sharded` wrote, its device tensors
    already sharded as wanted) in place from ``folder`` with ``SPMDLoadPlanner``."""
    import torch.distributed.checkpoint as dist_cp
    import torch_xla.core.xla_model as xm
    from torch_xla.experimental.distributed_checkpoint import SPMDLoadPlanner

    xm.wait_device_ops()  # the planner reads the targets' shards: none may still be computing
    dist_cp.load(state_dict=state, storage_reader=dist_cp.FileSystemReader(str(folder)),
                 planner=SPMDLoadPlanner())


def zeros_like_param(p: Any, mesh: Any, shape: Sequence[int], dtype: Any) -> Any:
    """Zeros of ``shape`` on the devices: sharded as FSDPv2 shards ``p`` when ``p`` is
    sharded and the shape is ``p``'s, else replicated (never whole on one device more
    than a replicated tensor is)."""
    import torch
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.distributed.spmd as xs

    z = torch.zeros(tuple(shape), dtype=dtype)
    sharded = sharding_spec(p) not in ("", "{replicated}") and tuple(shape) == tuple(p.shape)
    spec = xs.ShardingSpec(mesh, _fsdp_spec(shape)) if sharded and len(shape) else None
    return xm.send_cpu_data_to_device([z], torch_xla.device(), input_sharding=spec)[0]
