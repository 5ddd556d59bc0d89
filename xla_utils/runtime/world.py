"""The calling replica's world: backend, device, ranks, the step boundary, collectives, save.

Every function asks :data:`~xla_utils.runtime.state.STATE` which backend the
calling thread's replica has (see :mod:`xla_utils.runtime`). On the torch backend the
world is the ``torch.distributed`` process group when one is initialised (a replica of a
multi-GPU or ``XLA_UTILS_CPU_REPLICAS`` launch, or torchrun: :mod:`.torch_world`);
without one it has one replica and collectives are no-ops.
"""
from __future__ import annotations

import math
import os
import threading
from pathlib import Path
from typing import Any, Callable, Iterable

from . import torch_world
from ..env.gpu import CPU_REPLICAS_ENV, cuda_available
from ..utils import progress as _progress
from .state import STATE, SimGroup
from .xla import load_xla, tpu_present, xla_available

__all__ = ["backend", "text_progress", "is_simulated", "device", "world_size", "rank", "local_rank", "is_master",
           "sync", "optimizer_step", "reduce_gradients", "data_parallel", "no_sync", "all_reduce",
           "master_print", "rendezvous", "save", "set_seed", "graph_text", "replica_noun",
           "replicas_word", "progress_bars", "BARRIER_TIMEOUT_S"]

# Seconds a thread-simulated replica waits at a step boundary for the others. A
# replica that is still compiling a large graph can legitimately lag, so this is
# long; it only exists so that a dead replica can never hang the rest forever.
BARRIER_TIMEOUT_S = float(os.environ.get("XLA_UTILS_BARRIER_TIMEOUT", "600"))


def backend() -> str:
    """``"xla"`` or ``"torch"`` for the calling replica (see :mod:`xla_utils.runtime`)."""
    if STATE.local.backend is not None:
        return STATE.local.backend
    if STATE.simulated_process:
        return "xla"
    return "xla" if tpu_present() and xla_available() else "torch"


def text_progress() -> bool:
    """Whether progress must be drawn as text lines: in an XLA replica and in a forked
    torch replica, whose output reaches the notebook through another process (widgets
    cannot)."""
    return backend() == "xla" or STATE.torch_device is not None


def progress_bars() -> tuple[Callable, Callable]:
    """``(master_bar, progress_bar)`` that can draw in the calling replica: console
    bars in an XLA replica or a forked torch replica (see :mod:`xla_utils.utils.progress`)."""
    return _progress.progress_bars(console=text_progress())


def is_simulated() -> bool:
    """True inside a ``launch(..., simulate=N)`` replica."""
    return STATE.simulated_process or (STATE.sim is not None and backend() == "xla")


def device():
    """The calling replica's device (``torch.device``)."""
    import torch

    if backend() == "xla":
        x = load_xla()
        tx = x["torch_xla"]
        return tx.device() if hasattr(tx, "device") else x["xm"].xla_device()
    if STATE.torch_device is not None:  # a replica of a torch-backend launch
        return STATE.torch_device
    if os.environ.get(CPU_REPLICAS_ENV):
        return torch.device("cpu")
    return torch.device("cuda" if cuda_available() else "cpu")


def replica_noun(device_type: str) -> str:
    """What one replica is called on a device of ``device_type``: ``"core"`` (XLA: TPU or
    simulated cores), ``"GPU"`` (CUDA), ``"process"`` (the CPU on the torch backend)."""
    return {"xla": "core", "cuda": "GPU"}.get(device_type, "process")


def replicas_word(count: int, device_type: str) -> str:
    """``count`` replicas in the words of their device: ``"8 cores"``, ``"2 GPUs"``,
    ``"1 process"`` (:func:`replica_noun`)."""
    noun = replica_noun(device_type)
    return f"{count} {noun}" + ("" if count == 1 else "es" if noun == "process" else "s")


def world_size() -> int:
    """Number of replicas over all hosts (on the torch backend: the process group's ranks,
    1 without one)."""
    if backend() != "xla":
        return torch_world.world_size()
    return int(load_xla()["xr"].world_size())


def rank() -> int:
    """Global rank of the calling replica, 0 .. world_size()-1."""
    if backend() != "xla":
        return torch_world.rank()
    return int(load_xla()["xr"].global_ordinal())


def local_rank() -> int:
    """Rank of the calling replica on this host."""
    if backend() != "xla":
        return torch_world.local_rank()
    return int(load_xla()["xr"].local_ordinal())


def is_master() -> bool:
    """True on global rank 0."""
    return rank() == 0


def sync() -> None:
    """End the step: compile (if new) and launch the pending XLA graph.

    Every replica must call it the same number of times. In thread simulation
    it also meets the other replicas first (see :mod:`xla_utils.runtime`). No-op
    on the torch backend.
    """
    if backend() != "xla":
        return
    x = load_xla()
    tx = x["torch_xla"]
    do_sync = tx.sync if hasattr(tx, "sync") else x["xm"].mark_step
    sim = STATE.sim
    if sim is None:
        do_sync()
        return
    sim_wait(sim)
    with sim.lock:
        do_sync()


def sim_wait(sim: SimGroup) -> None:
    """Meet the other replica threads of a thread-simulated job.

    Raises:
        RuntimeError: another replica failed, or ``BARRIER_TIMEOUT_S`` passed.
    """
    try:
        sim.barrier.wait(timeout=BARRIER_TIMEOUT_S)
    except threading.BrokenBarrierError:
        raise RuntimeError(
            "another simulated replica failed or timed out at a step boundary; "
            "this replica stops too"
        ) from None


def optimizer_step(optimizer, barrier: bool = False, averaged: bool = False) -> None:
    """Average gradients over replicas, then ``optimizer.step()``.

    Args:
        optimizer: A ``torch.optim.Optimizer``.
        barrier: Also end the step (the single-core debug idiom
            ``xm.optimizer_step(opt, barrier=True)``); default False: call
            :func:`sync` yourself.
        averaged: The gradients were averaged already (a model in
            :func:`data_parallel`, or :func:`reduce_gradients` called first): step only.
    """
    if backend() != "xla":
        if torch_world.active() and not averaged:
            torch_world.reduce_gradients(optimizer)
        optimizer.step()
        return
    xm = load_xla()["xm"]
    if averaged:  # e.g. reduce_gradients, then clipping: the step alone
        optimizer.step()
        if barrier:
            sync()
    elif STATE.sim is not None and barrier:
        xm.optimizer_step(optimizer)
        sync()
    else:
        xm.optimizer_step(optimizer, barrier=barrier)


def data_parallel(model):
    """``model`` (on this replica's device) in torch's ``DistributedDataParallel`` when this
    is a replica of a multi-replica torch launch, else None. Call it as ``ddp(fn, *args)``
    for ``fn(model, *args)`` (a training step): gradients are averaged over the replicas as
    backward produces them; pass ``averaged=True`` to :func:`optimizer_step`. See
    :func:`xla_utils.runtime.torch_world.data_parallel`."""
    if backend() == "xla" or not torch_world.active():
        return None
    return torch_world.data_parallel(model, device())


def no_sync(ddp):
    """The context in which a backward through ``ddp`` (from :func:`data_parallel`, or
    None) accumulates gradients without averaging them (an accumulation step)."""
    import contextlib

    return contextlib.nullcontext() if ddp is None else ddp.no_sync()


def reduce_gradients(optimizer) -> None:
    """Average the gradients of ``optimizer``'s parameters over replicas without stepping
    (what :func:`optimizer_step` does first; a gradient scaler steps itself after it)."""
    if backend() != "xla":
        if torch_world.active():
            torch_world.reduce_gradients(optimizer)
        return
    if world_size() > 1:
        load_xla()["xm"].reduce_gradients(optimizer)


def all_reduce(value, op: str = "sum"):
    """Sum or mean of a tensor or a Python number over all replicas.

    Tensors are reduced lazily on the device (no host sync; the result is
    materialised at the next :func:`sync`). Python numbers are reduced on the
    host and returned as a float; call it from every replica, outside hot loops.

    Args:
        value: A tensor or a Python number.
        op: ``"sum"`` (default) or ``"mean"``.
    """
    import torch

    if op not in ("sum", "mean"):
        raise ValueError(f"all_reduce op must be 'sum' or 'mean', got {op!r}")
    n = world_size()
    if not isinstance(value, torch.Tensor):
        total = _host_sum(float(value)) if n > 1 else float(value)
        return total / n if op == "mean" else total
    if n > 1 and backend() != "xla":
        value = torch_world.all_reduce_sum(value)
    elif n > 1:
        value = load_xla()["xm"].all_reduce(load_xla()["xm"].REDUCE_SUM, value)
    return value / n if op == "mean" else value


def _host_sum(v: float) -> float:
    if backend() != "xla":
        return torch_world.host_sum(v, device())
    sim = STATE.sim
    if sim is not None and backend() == "xla":
        # Threads of one process: exchange through memory, no XLA graph (a
        # rank-dependent scalar would give each replica a different graph).
        r = rank()
        sim.values[r] = v
        sim_wait(sim)
        total = math.fsum(sim.values[i] for i in range(sim.n))
        sim_wait(sim)  # nobody overwrites values before all have read them
        return total
    STATE.host_sum_calls += 1
    return float(load_xla()["xm"].mesh_reduce(f"xla_utils.sum.{STATE.host_sum_calls}", v,
                                              math.fsum))


def master_print(*args, **kwargs) -> None:
    """``print`` on global rank 0 only (flushes)."""
    if is_master():
        kwargs.setdefault("flush", True)
        print(*args, **kwargs)


def rendezvous(tag: str) -> None:
    """All replicas meet here before any goes on."""
    if world_size() == 1:
        return
    if backend() != "xla":
        torch_world.barrier()
        return
    if STATE.sim is not None:
        sim_wait(STATE.sim)
        return
    load_xla()["xm"].rendezvous(tag)


def save(obj: Any, path: str | os.PathLike) -> None:
    """Checkpoint from every replica: all sync, the master writes, all meet.

    Call it on every rank (never inside ``if is_master()``). Tensors are moved to
    the CPU; the file is written to ``path + '.tmp'`` and renamed, so a crash
    never leaves a half-written checkpoint under ``path``.
    """
    import torch

    path = Path(path)
    sync()
    if is_master():
        cpu_obj = _to_cpu(obj)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "wb") as f:
            torch.save(cpu_obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    rendezvous(f"xla_utils.save:{path}")


def _to_cpu(obj: Any) -> Any:
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


def set_seed(seed: int) -> None:
    """Seed Python, NumPy, torch and (on XLA) the device RNG of this replica."""
    import random

    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed % 2**32)
    if STATE.sim is None:  # the host RNG is shared by simulated threads
        torch.manual_seed(seed)
    if backend() == "xla":
        load_xla()["xm"].set_rng_state(int(seed), device=device())


def graph_text(tensors: Iterable[Any]) -> str:
    """The pending XLA IR of ``tensors`` as text ("" on the torch backend).

    Call it before :func:`sync`; it neither compiles nor executes anything.
    Comparing it between steps names what changed when a step compiles again.
    """
    if backend() != "xla":
        return ""
    return load_xla()["torch_xla"]._XLAC._get_xla_tensors_text(list(tensors))
