"""Device buffers: :func:`to_device` and the prefetching :func:`device_prefetch`.

On CUDA the copies of host batches run on a side stream, ahead of the step that uses
them (:func:`overlapped`, :class:`CudaCopier`); on XLA a thread moves them ahead.
"""
from __future__ import annotations

import collections
import contextlib
import queue as queue_mod
import threading
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

from .state import STATE
from .world import device
from .xla import load_xla

__all__ = ["to_device", "host_copy", "device_prefetch", "overlapped", "CudaCopier"]


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


def host_copy(state: dict) -> dict:
    """A CPU copy of a state dict that later in-place updates of ``state`` cannot reach."""
    return {k: v.detach().to("cpu", copy=True) for k, v in state.items()}


def device_prefetch(batches: Iterable, depth: int = 2) -> Iterator:
    """Yield ``batches`` already on the device, transferring ahead.

    Unlike torch_xla's ``MpDeviceLoader`` it never ends the step itself: the
    training loop owns its step boundary (:func:`~xla_utils.runtime.sync`), which
    is what makes the simulated-core recipe and exact compile accounting
    possible. On XLA a thread transfers ahead; on CUDA the copies run on a side
    stream, ``depth`` batches ahead of the step (:func:`overlapped`; pinned host
    batches make them asynchronous), and a source that refills its buffers says
    after how many further batches in its ``valid_for`` attribute (a cache's
    :func:`~xla_utils.data.iterate_batches`: 2; absent: 0, the next one; None:
    never); on the CPU batches are used where they are.

    Args:
        batches: Host batches (anything :func:`to_device` accepts).
        depth: Batches in flight at most (default 2; 0 transfers inline).
    """
    dev = device()
    if depth > 0 and dev.type == "cuda":
        yield from overlapped(batches, CudaCopier(dev), depth, getattr(batches, "valid_for", 0))
        return
    if depth <= 0 or dev.type != "xla":
        # A CPU batch handed over early could be a loader's reused buffer by the time
        # it is used (and prefetching on the host's own cores gains nothing).
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


def overlapped(batches: Iterable, copier: Any, depth: int, valid_for: int | None) -> Iterator:
    """Yield ``batches`` moved by ``copier``, each copy issued ``depth`` batches before
    the batch is handed out (so it overlaps the steps before), never letting the source
    refill a host buffer that a copy still reads.

    A source that reuses its buffers keeps a yielded batch valid while ``valid_for``
    further batches are requested (None: forever): before asking for the next batch, the
    copy of the batch ``valid_for + 1`` requests back is waited for (on the host; it was
    issued ``valid_for + 1`` batches ago, so it is normally long done). At the end, or
    when the consumer stops early, every copy still reading host memory is waited for,
    so the source's next pass may refill any buffer.

    Args:
        batches: Host batches.
        copier: ``copy(batch) -> token`` issues an asynchronous copy, ``ready(token) ->
            device batch`` orders its use after the copy (without waiting on the host),
            ``finish(token)`` waits on the host until the copy has read the host buffers
            (:class:`CudaCopier`; tests use a copier that copies only when finished).
        depth: Copies issued ahead of the batch handed out (>= 1).
        valid_for: As above.
    """
    it = iter(batches)
    reading: collections.deque = collections.deque()  # copies the source may refill under
    ahead: collections.deque = collections.deque()  # issued, not yet handed out
    try:
        while True:
            if valid_for is not None and len(reading) > valid_for:
                copier.finish(reading.popleft())  # the next request may refill its buffers
            try:
                b = next(it)
            except StopIteration:
                break
            token = copier.copy(b)
            ahead.append(token)
            if valid_for is not None:
                reading.append(token)
            if len(ahead) > depth:
                yield copier.ready(ahead.popleft())
        while ahead:
            yield copier.ready(ahead.popleft())
    finally:
        for token in reading:
            copier.finish(token)
        if hasattr(it, "close"):
            it.close()


class CudaCopier:
    """Host -> CUDA copies on a side stream (see :func:`overlapped`): pinned host batches
    are copied asynchronously while the default stream computes.

    Args:
        dev: The CUDA device.
    """

    def __init__(self, dev: Any):
        import torch

        self.torch, self.dev = torch, dev
        self.stream = torch.cuda.Stream(dev)

    def copy(self, batch: Any) -> tuple[Any, Any]:
        """Issue ``batch``'s copy on the side stream; ``(device batch, event after it)``."""
        torch = self.torch
        with torch.cuda.stream(self.stream):
            moved = to_device(batch, self.dev)  # non_blocking: asynchronous from pinned memory
            done = torch.cuda.Event()
            done.record(self.stream)
        return moved, done

    def ready(self, token: tuple[Any, Any]) -> Any:
        """The device batch, its use on the current stream ordered after its copy; its
        memory is not reused before that stream is done with it."""
        moved, done = token
        main = self.torch.cuda.current_stream(self.dev)
        main.wait_event(done)
        for t in _tensors(moved):
            t.record_stream(main)
        return moved

    def finish(self, token: tuple[Any, Any]) -> None:
        """Wait (host) until the copy has read its host buffers."""
        token[1].synchronize()


def _tensors(batch: Any) -> Iterator:
    """The tensors of a (nested) tuple/list/dict batch."""
    if isinstance(batch, dict):
        batch = list(batch.values())
    if isinstance(batch, (list, tuple)):
        for b in batch:
            yield from _tensors(b)
    elif hasattr(batch, "record_stream"):
        yield batch
