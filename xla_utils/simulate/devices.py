"""Run a function in a fresh process that owns N real XLA devices (SPMD form).

:func:`run_on_devices` runs ``fn(*args)`` through
:func:`xla_utils.runtime.fresh.run_fresh` (cloudpickled: notebook functions and models
work) in a process with ``PJRT_DEVICE=CPU CPU_NUM_DEVICES=N`` (or ``PJRT_DEVICE=TPU``
for the host's chips), as the one replica (no host collectives: SPMD's collectives are
XLA's own), and returns its result, device tensors turned into CPU tensors. The
child's output is relayed as it comes, so progress shows in a notebook too. An
exception in the child is raised here as ``ReplicaError`` with its traceback.
"""
from __future__ import annotations

from typing import Any, Callable

from ..runtime.fresh import child_env, run_fresh

__all__ = ["run_on_devices"]


def run_on_devices(fn: Callable[..., Any], args: tuple, devices: int | None, *,
                   timeout: float | None = None) -> Any:
    """``fn(*args)`` in a fresh process with ``devices`` XLA:CPU devices (None: the TPU).

    Args:
        fn: Called as ``fn(*args)`` in the child (cloudpickled).
        args: Its arguments.
        devices: Number of simulated XLA:CPU devices; None runs on this host's TPU
            chips (``PJRT_DEVICE=TPU``).
        timeout: Seconds after which the child is killed (default none).

    Returns:
        What ``fn`` returned (CPU tensors).

    Raises:
        ReplicaError: ``fn`` raised in the child, or the child died.
        TimeoutError: ``timeout`` passed; the child was killed.
    """
    where = "this host's TPU" if devices is None else f"{devices} XLA:CPU devices"
    return run_fresh(device_child, (fn, tuple(args)),
                     env=child_env("tpu" if devices is None else devices),
                     what=f"the device process ({where})", timeout=timeout)


def device_child(fn: Callable[..., Any], args: tuple) -> Any:
    """In the device process: run ``fn(*args)`` as the one XLA replica."""
    import torch

    from ..runtime.state import STATE

    STATE.local.backend, STATE.local.in_replica = "xla", True
    with torch.autograd.set_multithreading_enabled(False):
        return fn(*args)
