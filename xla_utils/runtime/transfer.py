"""Device buffers: :func:`to_device` and the prefetching :func:`device_prefetch`."""
from __future__ import annotations

import contextlib
import queue as queue_mod
import threading
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

from .state import STATE
from .world import device
from .xla import load_xla

__all__ = ["to_device", "device_prefetch"]


def to_device(batch: Any, dev=None) -> Any:
    """Move a tensor or a (nested) tuple/list/dict of tensors to the device.

    On XLA this is ``xm.send_cpu_data_to_device`` (what ``MpDeviceLoader``
    uses): it copies the host data before returning. A plain ``tensor.to(xla)``
    may still read the host buffer later, when a loader has already freed or
    reused it (seen on XLA:CPU as silently wrong batches).

    Args:
        batch: A tensor or a nested tuple/list/dict of tensors (other leaves are
            returned as they are).
        dev: The target device; default the calling replica's :func:`device`.
    """
    import torch

    dev = dev or device()
    if dev.type == "xla":
        moved = load_xla()["xm"].send_cpu_data_to_device(batch, dev)
        # it wraps a bare tensor in a list
        return moved[0] if isinstance(batch, torch.Tensor) else moved
    if isinstance(batch, torch.Tensor):
        return batch.to(dev, non_blocking=dev.type == "cuda")
    if isinstance(batch, dict):
        return {k: to_device(v, dev) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(v, dev) for v in batch)
    return batch


def device_prefetch(batches: Iterable, depth: int = 2) -> Iterator:
    """Yield ``batches`` already on the device, transferring ahead in a thread.

    Unlike torch_xla's ``MpDeviceLoader`` it never ends the step itself: the
    training loop owns its step boundary (:func:`~xla_utils.runtime.sync`), which
    is what makes the simulated-core recipe and exact compile accounting
    possible. On the torch backend batches are moved inline, one at a time.

    Args:
        batches: Host batches (anything :func:`to_device` accepts).
        depth: Batches in flight at most (default 2; 0 transfers inline).
    """
    dev = device()
    if depth <= 0 or dev.type != "xla":
        # Only XLA transfers copy; on CPU/CUDA a batch handed over early could be
        # a loader's reused buffer by the time it is used (and prefetching on
        # the host's own cores gains nothing).
        for b in batches:
            yield to_device(b, dev)
        return
    q: queue_mod.Queue = queue_mod.Queue(maxsize=depth)
    done = object()
    stop = threading.Event()
    xla_state = (STATE.local.backend, STATE.local.in_replica)

    def worker() -> None:
        STATE.local.backend, STATE.local.in_replica = xla_state
        try:
            for b in batches:
                if stop.is_set():
                    return
                q.put(to_device(b, dev))
            q.put(done)
        except BaseException as exc:  # re-raised in the consumer
            q.put(_Raise(exc))

    t = threading.Thread(target=worker, daemon=True, name="xla_utils-prefetch")
    t.start()
    try:
        while True:
            item = q.get()
            if item is done:
                return
            if isinstance(item, _Raise):
                raise item.exc
            yield item
    finally:
        stop.set()
        with contextlib.suppress(queue_mod.Empty):
            while True:
                q.get_nowait()


@dataclass
class _Raise:
    exc: BaseException
