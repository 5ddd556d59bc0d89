"""Objects a live simulated job keeps between calls, sent again only when they changed.

A later ``predict``/``evaluate(simulate=N)`` call used to cloudpickle the whole
trainer (its model's weights) and the plan to the live job, which unpickled them
and reopened every image cache they name (its ``manifest.json`` parsed again,
every shard mapped again). :class:`CallPickler` replaces *resident* objects by a
key (pickle's ``persistent_id``); the job keeps, per replica, the objects of its
last call by key (:func:`load_call`) and receives only the ones it does not hold.

Resident objects and their keys (a changed object gets a new key, so a stale
object is never used):

* a CPU tensor or ``nn.Parameter`` of at least :data:`MIN_BYTES` (plain, contiguous,
  no autograd history): ``id()``, type, dtype, shape, ``requires_grad`` and the
  SHA-256 of its bytes. The content hash, not torch's version counter, because an
  in-place change through ``.data`` (``p.data.copy_(...)``) does not bump the
  counter. Hashing reads the weights once (~0.1 s per 100 MB); pickling,
  sending and unpickling them copied them several times.
* a local :class:`~xla_utils.data.CachedImageDataset` (exactly that class): ``id()``,
  its pickled state (path, epoch) and the ``(inode, size, mtime)`` of its
  ``manifest.json`` and ``labels.npy`` (a rebuilt cache rewrites both).

Everything else (the model's structure, the trainer's settings, the plan) is
pickled with every call as before.

In the job, :func:`replica_model` also keeps each replica's device copy of a
resident tensor: a later call whose model holds the same resident tensor gets
the device tensor already there (no host-to-device copy) unless the device
tensor was changed in place since (its version counter).
"""
from __future__ import annotations

import copy
import hashlib
import io
import os
import pickle
from typing import Any

import cloudpickle

__all__ = ["MIN_BYTES", "CallPickler", "resident_key", "load_call", "mark_live_job",
           "in_live_job", "replica_model"]

MIN_BYTES = 4096  # smaller tensors are pickled with the call (hashing costs about as much)


def resident_key(obj: Any) -> tuple | None:
    """The key ``obj`` is kept under in the live job, or None (pickled with the call)."""
    import torch

    if isinstance(obj, torch.Tensor):
        return _tensor_key(obj, torch)
    from ..data import CachedImageDataset

    if type(obj) is CachedImageDataset:
        return _dataset_key(obj)
    return None


def _tensor_key(t: Any, torch: Any) -> tuple | None:
    if type(t) not in (torch.Tensor, torch.nn.Parameter) or t.device.type != "cpu":
        return None
    if (t.layout != torch.strided or not t.is_contiguous() or t.grad_fn is not None
            or t.is_quantized or t.is_conj() or t.is_neg() or t.__dict__):
        return None
    nbytes = t.numel() * t.element_size()
    if nbytes < MIN_BYTES:
        return None
    raw = t.detach().reshape(-1).view(torch.uint8).numpy()
    digest = hashlib.sha256(raw).hexdigest()
    return ("tensor", id(t), type(t).__name__, str(t.dtype), tuple(t.shape),
            bool(t.requires_grad), digest)


def _dataset_key(ds: Any) -> tuple | None:
    from ..cache.format import LABELS, MANIFEST

    if ds.is_remote:
        return None
    try:
        stats = [os.stat(ds.path / name) for name in (MANIFEST, LABELS)]
    except OSError:  # gone: pickled with the call, whose job then names the problem
        return None
    return ("cache", id(ds), repr(ds.__getstate__()),
            tuple((s.st_ino, s.st_size, s.st_mtime_ns) for s in stats))


class CallPickler(cloudpickle.Pickler):
    """Pickles one call with every resident object replaced by its key.

    Attributes:
        used: ``{key: object}`` of the resident objects met, in the order met.
    """

    def __init__(self, file: io.BytesIO) -> None:
        import torch

        from ..data import CachedImageDataset

        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self._types = {torch.Tensor, torch.nn.Parameter, CachedImageDataset}  # exact types only
        self.used: dict[tuple, Any] = {}
        # each object looked at once per call; kept alive so that its id is not reused
        # by a temporary of a __reduce__ while this call is pickled
        self._by_id: dict[int, tuple[Any, tuple | None]] = {}

    def persistent_id(self, obj: Any) -> tuple | None:  # noqa: D102 (pickle's hook)
        if type(obj) not in self._types:  # called for every object pickled: keep it cheap
            return None
        seen = self._by_id.get(id(obj))
        if seen is not None:
            return seen[1]
        key = resident_key(obj)
        self._by_id[id(obj)] = (obj, key)
        if key is not None:
            self.used[key] = obj
        return key

    @classmethod
    def dumps(cls, obj: Any) -> tuple[bytes, dict[tuple, Any]]:
        """``(pickle of obj, {key: resident object})``."""
        buf = io.BytesIO()
        p = cls(buf)
        p.dump(obj)
        return buf.getvalue(), p.used


class _CallUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes, store: dict[tuple, Any]) -> None:
        super().__init__(io.BytesIO(data))
        self._store = store

    def persistent_load(self, pid: Any) -> Any:  # noqa: D102 (pickle's hook)
        try:
            return self._store[tuple(pid)]
        except KeyError:
            raise RuntimeError(f"the live job does not hold the resident object {pid[:2]}; "
                               "this is a bug in xla_utils.simulate.resident") from None


def load_call(store: dict[tuple, Any], payload: bytes, new: bytes | None,
              keep: tuple) -> Any:
    """In the job: the call's ``(fn, args)``, after adding the new resident objects
    (``new``: a pickled ``{key: object}``) to this replica's ``store`` and dropping
    those this call does not use (``keep``: its keys)."""
    if new:
        store.update(cloudpickle.loads(new))
    obj = _CallUnpickler(payload, store).load()
    keep_set = set(keep)
    for k in [k for k in store if k not in keep_set]:
        del store[k]
    return obj


# Set by a live job's replicas (:func:`mark_live_job`). Only there are the host tensors
# of a call snapshots that nobody changes in place (a changed one arrives as a new
# object), so only there may replica_model reuse device copies by host identity.
_IN_JOB = False


def mark_live_job() -> None:
    """Mark this process as a live job (called by its replicas before serving)."""
    global _IN_JOB
    _IN_JOB = True


def in_live_job() -> bool:
    """Whether this process is a live job, where :func:`replica_model` can reuse device
    copies."""
    return _IN_JOB


# In the job, per rank: id(host tensor) -> (host tensor, its device copy, the copy's version)
_DEVICE: dict[int, dict[int, tuple[Any, Any, int]]] = {}


def replica_model(model: Any, dev: Any, rank: int) -> Any:
    """This replica's model on ``dev`` in a live job (:func:`in_live_job`): a copy of
    ``model`` on ``dev`` (``model`` itself is left on the host), whose tensors of at least
    :data:`MIN_BYTES` reuse this rank's device copies from the last call when they are the
    same host tensor objects (resident: unchanged) and their device copy was not changed
    in place. Only the last call's copies are kept."""
    cache = _DEVICE.get(rank, {})
    host = {**dict(model.named_parameters(remove_duplicate=False)),
            **{f"buffer:{n}": b for n, b in model.named_buffers(remove_duplicate=False)}}
    memo: dict[int, Any] = {}
    for t in host.values():
        hit = cache.get(id(t))
        if hit is not None and hit[0] is t and hit[1]._version == hit[2]:
            memo[id(t)] = hit[1]
    net = copy.deepcopy(model, memo).to(dev)
    moved = {**dict(net.named_parameters(remove_duplicate=False)),
             **{f"buffer:{n}": b for n, b in net.named_buffers(remove_duplicate=False)}}
    kept: dict[int, tuple[Any, Any, int]] = {}
    for name, t in host.items():
        d = moved.get(name)
        if d is not None and t.numel() * t.element_size() >= MIN_BYTES and d.device == dev:
            kept[id(t)] = (t, d, d._version)
    _DEVICE[rank] = kept
    return net
