"""The torch backend's world when a ``torch.distributed`` process group is initialised.

A multi-replica launch on the torch backend (every GPU, NCCL; or
``XLA_UTILS_CPU_REPLICAS=N`` CPU processes, gloo: :mod:`.torch_launch`) initialises one
process group per replica; so does ``torchrun``. Then :mod:`.world` asks this module for
the rank, world size and collectives; without a process group the torch world is one
replica and every function here answers as such. This is the only module of xla_utils
that calls ``torch.distributed`` collectives.

The trainer's gradients go through torch's ``DistributedDataParallel``
(:func:`data_parallel`): each bucket is all-reduced as soon as backward has produced its
gradients, overlapping the rest of backward, into the gradients themselves
(``gradient_as_bucket_view``); accumulation steps run under ``no_sync()``. A loop written
against :func:`xla_utils.runtime.optimizer_step` averages them after backward instead
(:func:`reduce_gradients`).
"""
from __future__ import annotations

import contextlib
import math
import os
import sys
import threading
from typing import Any, Iterator

__all__ = ["active", "world_size", "rank", "local_rank", "all_reduce_sum", "host_sum",
           "barrier", "solo", "broadcast_object", "reduce_gradients", "data_parallel", "gradient_reductions", "BUCKET_BYTES"]

# Gradients are all-reduced flattened into buckets of about this many bytes (torch's DDP
# uses 25 MiB): few collectives, and no copy of the whole model's gradients at once.
BUCKET_BYTES = 25 * 2**20


def _dist():
    import torch.distributed as dist

    return dist


_SOLO = threading.local()  # .on: this thread runs a one-replica job inside a joined world


def active() -> bool:
    """Whether this process belongs to an initialised process group of more than one rank
    (and is not running a one-replica job inside it: :func:`solo`)."""
    dist = _dist()
    return (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
            and not getattr(_SOLO, "on", False))


@contextlib.contextmanager
def solo() -> Iterator[None]:
    """Inside the block this thread's world is one replica (rank 0 of 1, no collective),
    though the process belongs to a larger group (a one-core job of a joined world)."""
    before = getattr(_SOLO, "on", False)
    _SOLO.on = True
    try:
        yield
    finally:
        _SOLO.on = before


def broadcast_object(payload: bytes | None) -> bytes:
    """Global rank 0's ``payload`` on every rank of the whole process group (the others
    pass None); every rank must call it."""
    dist = _dist()
    box = [payload]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def world_size() -> int:
    """Ranks of the process group (1 without one)."""
    return _dist().get_world_size() if active() else 1


def rank() -> int:
    """This process's rank in the process group (0 without one)."""
    return _dist().get_rank() if active() else 0


def local_rank() -> int:
    """This process's rank on its host: ``LOCAL_RANK`` (set by xla_utils' launch and by
    torchrun), else the global rank."""
    return int(os.environ.get("LOCAL_RANK", rank())) if active() else 0


def all_reduce_sum(value):
    """The sum of tensor ``value`` over the ranks (a new tensor; ``value`` is unchanged)."""
    out = value.clone()
    _dist().all_reduce(out)
    return out


def host_sum(v: float, dev) -> float:
    """The sum of Python number ``v`` over the ranks, the same on every rank (every value
    gathered, then summed exactly with ``math.fsum`` in rank order).

    Args:
        v: This rank's number.
        dev: The replica's device (NCCL moves CUDA tensors only).
    """
    import torch

    dist = _dist()
    mine = torch.tensor([float(v)], dtype=torch.float64, device=dev)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    return math.fsum(float(t.item()) for t in every)


def barrier() -> None:
    """All ranks meet here."""
    _dist().barrier()


def reduce_gradients(optimizer) -> None:
    """Replace every gradient of ``optimizer``'s parameters by its mean over the ranks.

    Gradients are flattened into buckets of at most :data:`BUCKET_BYTES` per dtype and
    device, one ``all_reduce`` each. Which parameters have a gradient is agreed first (one
    small collective): a parameter with a gradient on some rank only (a branch of the
    forward skipped elsewhere) gets zeros on the others, so every rank reduces the same
    buckets; one without a gradient anywhere is left out everywhere.
    """
    import torch

    dist = _dist()
    n = dist.get_world_size()
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if not params:
        return
    have = torch.tensor([p.grad is not None for p in params], dtype=torch.int32,
                        device=params[0].device)
    dist.all_reduce(have, op=dist.ReduceOp.MAX)
    for p, anywhere in zip(params, have.tolist()):
        if anywhere and p.grad is None:
            p.grad = torch.zeros_like(p)
    grads = [p.grad for p in params if p.grad is not None]
    buckets: dict[tuple, list[list]] = {}
    filled: dict[tuple, int] = {}  # bytes in each key's last bucket
    for g in grads:
        key, size = (g.dtype, g.device), g.numel() * g.element_size()
        runs = buckets.setdefault(key, [[]])
        if runs[-1] and filled[key] + size > BUCKET_BYTES:
            runs.append([])
            filled[key] = 0
        runs[-1].append(g)
        filled[key] = filled.get(key, 0) + size
    for runs in buckets.values():
        for run in runs:
            flat = torch.cat([g.reshape(-1) for g in run])
            dist.all_reduce(flat)
            flat.div_(n)
            offset = 0
            for g in run:
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()



_REDUCTIONS = [0]  # gradient buckets all-reduced by data_parallel's hook in this process


def gradient_reductions() -> int:
    """Gradient buckets this process has all-reduced through :func:`data_parallel` so far."""
    return _REDUCTIONS[0]


# torch's advice, printed by DDP's C++ reducer on stderr once per process, when a forward
# used every parameter: a trainer cannot know whether a later one will skip some.
_DDP_ADVICE = b"find_unused_parameters=True was specified in DDP constructor"


def data_parallel(model, device):
    """``model`` in torch's ``DistributedDataParallel`` over the process group, behind a
    forward that runs any step function of it: ``ddp(fn, *args)`` is ``fn(model, *args)``
    with DDP's bookkeeping around it, so ``fn`` (a user's ``train_step``) gets the plain
    model while every gradient is averaged over the ranks during backward.

    Buffers are not broadcast (each rank keeps its own batch-norm statistics, rank 0's are
    saved); parameters that one rank's forward skipped are reduced with zeros there
    (``find_unused_parameters``: a search of the step's graph, without torch's advice
    against it on stderr); each reduced bucket is counted (:func:`gradient_reductions`).
    """
    import torch
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel

    class _Step(torch.nn.Module):
        def __init__(self, module: torch.nn.Module) -> None:
            super().__init__()
            self.module = module

        def forward(self, fn, *args):
            return fn(self.module, *args)

    class _DDP(DistributedDataParallel):
        advised = False

        def forward(self, *args, **kwargs):
            if self.advised or not (torch.is_grad_enabled() and self.require_backward_grad_sync):
                return super().forward(*args, **kwargs)
            self.advised = True  # the reducer's search (and advice) follows the first synced forward
            with _stderr_without(_DDP_ADVICE):
                return super().forward(*args, **kwargs)

    def counted(state, bucket):
        _REDUCTIONS[0] += 1
        return default_hooks.allreduce_hook(state, bucket)

    ddp = _DDP(_Step(model), device_ids=[device.index] if device.type == "cuda" else None,
               broadcast_buffers=False, find_unused_parameters=True, gradient_as_bucket_view=True)
    ddp.register_comm_hook(None, counted)
    return ddp


@contextlib.contextmanager
def _stderr_without(text: bytes):
    """File descriptor 2 goes to a temporary file inside the block; afterwards every line
    of it that does not contain ``text`` is written to the real one (nothing else lost)."""
    import tempfile

    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            kept = b"".join(line for line in tmp.read().splitlines(keepends=True)
                            if text not in line)
            if kept:
                os.write(2, kept)
