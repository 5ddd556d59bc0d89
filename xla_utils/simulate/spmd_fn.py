"""SPMD functions on simulated cores: ``launch(fn, simulate=N)`` and ``simulated_spawn()``.

A function (a notebook cell's training function) that uses SPMD (``use_spmd``,
``Mesh``, ``mark_sharding``, FSDPv2, ``input_sharding``) is one program that owns
every device, so its faithful simulation is one fresh process with
``PJRT_DEVICE=CPU CPU_NUM_DEVICES=N`` (as for a script, see :mod:`.spmd`), not N
replica processes. :func:`.forms.fn_uses_spmd` reads the function's code (and the code
of the user functions and classes it names, not library code) for SPMD names;
:func:`run_spmd_fn` runs it once in that process
(:func:`xla_utils.runtime.fresh.run_fresh`) and returns its result (device tensors as
CPU tensors) or raises ``ReplicaError`` with its traceback.
"""
from __future__ import annotations

import sys
from typing import Any, Callable

from ..runtime.fresh import child_env, run_fresh
from .dist import LOOPBACK_ENV, patch_distributed_spmd


def run_spmd_fn(fn: Callable[..., Any], args: tuple, devices: int, why: str,
                timeout: float | None = None, pass_index: bool = False) -> Any:
    """Run ``fn(*args)`` (``fn(0, *args)`` with ``pass_index``) once in a fresh process
    with ``devices`` XLA:CPU devices and return its result.

    Raises:
        ReplicaError: ``fn`` raised (its traceback), or the process died.
        TimeoutError: ``timeout`` seconds passed; the process was killed.
    """
    name = getattr(fn, "__qualname__", repr(fn))
    print(f"xla_utils.simulate: running {name} as SPMD (one process with {devices} XLA:CPU "
          f"devices) because {why}", file=sys.stderr, flush=True)
    return run_fresh(spmd_fn_child, (fn, tuple(args), devices, pass_index),
                     env=child_env(devices, LOOPBACK_ENV),
                     what=f"the SPMD process running {name}", timeout=timeout)


def spmd_fn_child(fn: Callable[..., Any], args: tuple, devices: int, pass_index: bool) -> Any:
    """In the SPMD process of :func:`run_spmd_fn`: refuse the multi-process entry points,
    route torch.distributed's rendezvous in-process, run ``fn`` once."""
    from .spmd import refuse_multiprocess

    refuse_multiprocess(f"the function sent by launch(fn, simulate={devices})", devices)
    patch_distributed_spmd()
    return fn(0, *args) if pass_index else fn(*args)
