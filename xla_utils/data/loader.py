"""Batches for one rank and one epoch: :func:`iterate_batches`.

For a :class:`~.dataset.CachedImageDataset`, uint8 NHWC batches assembled by background
threads into a ring of preallocated (optionally pinned) buffers, no collate (the fast path);
a user's dataset around a cache (:func:`caches_inside`) whose samples are uint8 images and
class targets goes the same way, sample by sample, its caches told each epoch; for any other
map-style dataset, a torch ``DataLoader`` over the same sampler's batches. An optional
per-sample ``transform`` runs in the fast path's threads (:func:`check_transform`). All
per-pass state lives in the iterator, and :func:`iterate_batches` takes ``epoch`` explicitly.
"""
from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import numpy as np
import torch

from .dataset import CachedImageDataset
from .samplers import DistributedBatchSampler, ShardWindowSampler
from .transforms import image_layout

__all__ = ["iterate_batches", "BatchIterable", "default_loader_threads", "RING_VALID_FOR",
           "LoadPlan", "plan_loading", "caches_inside", "check_transform", "describe_value",
           "type_name"]

# A batch of a cache's ring stays valid while this many further batches are requested.
RING_VALID_FOR = 2


# A wrapper's containers (lists, tuples, dicts) longer than this are not searched for caches.
_SEARCH_ITEMS = 16


def caches_inside(data: Any, depth: int = 4) -> list[CachedImageDataset]:
    """The :class:`CachedImageDataset` objects a user's dataset wraps: found through its
    attributes (any name: ``.dataset``, ``.ds``, ``.base`` ...), lists and dicts of up to 16
    items (``ConcatDataset.datasets``), up to ``depth`` levels down; ``[data]`` for a cache
    itself, ``[]`` when there is none. Only dataset-like objects (``__getitem__`` and
    ``__len__``) are searched, never arrays or tensors."""
    found: list[CachedImageDataset] = []
    seen: set[int] = set()

    def walk(obj: Any, level: int) -> None:
        if id(obj) in seen or level > depth:
            return
        seen.add(id(obj))
        if isinstance(obj, CachedImageDataset):
            found.append(obj)
            return
        if isinstance(obj, (list, tuple, dict)):
            items = list(obj.values()) if isinstance(obj, dict) else obj
            children = items if len(items) <= _SEARCH_ITEMS else []
        elif isinstance(obj, (np.ndarray, torch.Tensor, str, bytes)) or not (
                hasattr(type(obj), "__getitem__") and hasattr(type(obj), "__len__")):
            return
        else:
            children = list(getattr(obj, "__dict__", {}).values())
        for child in children:
            walk(child, level + 1)

    walk(data, 0)
    return found


@dataclass(frozen=True)
class LoadPlan:
    """How :func:`iterate_batches` loads a dataset (:func:`plan_loading`).

    Attributes:
        kind: ``"cache"`` (a :class:`CachedImageDataset`: the ring, whole batches),
            ``"wrapper"`` (a dataset around a cache: the ring, filled sample by sample by
            the loader threads) or ``"dataloader"`` (a torch ``DataLoader``).
        caches: The caches inside a wrapper: each pass sets their epoch (``set_epoch``)
            before reading, so their variants rotate whether or not the wrapper forwards it.
        name: The wrapper's class name ("" for a cache or a dataset without caches).
        why: Why a wrapper around a cache is not on the ring ("" otherwise).
        x_shape: One sample's uint8 image shape in the ring (``[H, W, C]`` or ``[C, H, W]``).
        channels_first: The ring holds ``[C, H, W]`` images (a wrapper's torch tensors).
        y_shape, y_dtype: One target's shape and numpy dtype in the ring.
    """

    kind: str
    caches: tuple[CachedImageDataset, ...] = ()
    name: str = ""
    why: str = ""
    x_shape: tuple[int, ...] = ()
    channels_first: bool = False
    y_shape: tuple[int, ...] = ()
    y_dtype: Any = np.int64

    @property
    def fast(self) -> bool:
        """Batches come from the ring of the loader threads."""
        return self.kind != "dataloader"

    def words(self, num_workers: int | None, transform: Callable | None = None) -> str:
        """How the batches are loaded, for a run's first line: ``"4 loader threads"``, with
        the wrapper and ``transform=`` when there are, or ``"DataLoader with 0 worker
        processes"`` (and, for a wrapper around a cache, why and what to do instead)."""
        if self.fast:
            n = num_workers if num_workers is not None else default_loader_threads()
            out = f"{n} loader thread{'s' if n != 1 else ''}"
            if self.kind == "wrapper":
                out += f" reading {self.name} per sample (around a cache: its variants rotate)"
            return out + (f", transform={_callable_name(transform)} per sample" if transform else "")
        n = num_workers or 0
        out = f"DataLoader with {n} worker process{'es' if n != 1 else ''}"
        if self.caches:
            out += (f" ({self.name} around a cache: its variants rotate; not on the loader threads, "
                    f"which take uint8 images and class targets: {self.why}; for them, return the "
                    "cache's uint8 images and pass the augmentation as transform=)")
        return out


def plan_loading(data: Any) -> LoadPlan:
    """How :func:`iterate_batches` loads ``data``: a cache on the ring; a dataset around one
    (:func:`caches_inside`) on the ring too when its sample 0 is ``(uint8 image, target)``
    with a class index or a float32 multi-hot target (read once here), else through a
    ``DataLoader``; anything else through a ``DataLoader``."""
    if isinstance(data, CachedImageDataset):
        # each batch's labels as the dataset's (class indices, multi-hot rows, float targets)
        return LoadPlan("cache", (data,), "", "", (*data.image_size, 3), False,
                        tuple(data.labels.shape[1:]), data.labels.dtype)
    caches = tuple(caches_inside(data))
    if not caches:
        return LoadPlan("dataloader")
    name = type(data).__name__
    sample = data[0] if len(data) else None
    if not isinstance(sample, (tuple, list)) or len(sample) != 2:
        return LoadPlan("dataloader", caches, name, "its samples are not (input, target) pairs")
    x, y = sample
    a = _host_array(x)
    layout = None if a is None or a.dtype != np.uint8 else image_layout(
        a.shape, channels_first_on_tie=isinstance(x, torch.Tensor))
    if type(x).__module__.startswith("torchvision.tv_tensors") and a is not None and a.ndim == 3:
        layout = "channels_first"
    if layout is None:
        return LoadPlan("dataloader", caches, name,
                        f"its inputs are {describe_value(x)}")
    target = _target_kind(y)
    if target is None:
        return LoadPlan("dataloader", caches, name, f"its targets are {describe_value(y)}")
    return LoadPlan("wrapper", caches, name, "", tuple(a.shape), layout == "channels_first", *target)


def _host_array(x: Any) -> np.ndarray | None:
    """``x`` as a numpy array (a view of a CPU tensor), or None."""
    if isinstance(x, torch.Tensor):
        return x.detach().as_subclass(torch.Tensor).numpy() if x.device.type == "cpu" else None
    return x if isinstance(x, np.ndarray) else None


def _target_kind(y: Any) -> tuple[tuple[int, ...], Any] | None:
    """``(shape, numpy dtype)`` of a target the ring holds: a class index, or a float32
    multi-hot vector; None for anything else."""
    if isinstance(y, (bool, np.bool_)):
        return None
    if isinstance(y, (int, np.integer)):
        return (), np.int64
    a = _host_array(y)
    if a is None:
        return None
    if a.ndim == 0 and a.dtype.kind in "iu":
        return (), np.int64
    if a.ndim == 1 and a.dtype == np.float32:
        return tuple(a.shape), np.float32
    return None


def type_name(x: Any) -> str:
    """``x``'s type in words: ``tv_tensors.Image``, ``numpy.ndarray``, ``torch.Tensor``, ``int``."""
    t = type(x)
    if t.__module__.startswith("torchvision.tv_tensors"):
        return f"tv_tensors.{t.__name__}"
    if t.__module__ in ("builtins",):
        return t.__name__
    mod = t.__module__.split(".")[0]
    return f"{'numpy' if mod == 'numpy' else mod}.{t.__name__}"


def describe_value(v: Any) -> str:
    """A value named with its type, shape and dtype where it has them."""
    shape, dtype = getattr(v, "shape", None), getattr(v, "dtype", None)
    what = f"a {type_name(v)}"
    if shape is not None:
        what += f" of shape {tuple(int(d) for d in shape)}"
    if dtype is not None:
        what += f" and dtype {str(dtype).replace('torch.', '')}"
    if isinstance(v, (str, bytes)):
        what += f" ({v[:40]!r})"
    return what


def _callable_name(fn: Any) -> str:
    return getattr(fn, "__qualname__", None) or type(fn).__name__


def _set_epoch(data: Any, plan: LoadPlan, epoch: int) -> None:
    """Select ``epoch``'s variant: in every cache inside a wrapper first, then through the
    dataset's own ``set_epoch`` when it has one (a wrapper's own forwarding wins)."""
    if plan.kind != "cache":
        for cache in plan.caches:
            cache.set_epoch(epoch)
    if hasattr(data, "set_epoch"):
        data.set_epoch(epoch)


def _apply_transform(transform: Callable, img: np.ndarray, channels_first: bool) -> None:
    """``img`` (one ring slot's uint8 image, ``[H, W, C]`` or ``[C, H, W]``) replaced by
    ``transform``'s output for it, given as a contiguous uint8 ``[C, H, W]`` tensor (a copy)."""
    chw = img if channels_first else img.transpose(2, 0, 1)
    out = transform(torch.from_numpy(chw.copy()))
    problem = _transform_problem(out, chw.shape)
    if problem:
        raise ValueError(problem)
    a = out.detach().as_subclass(torch.Tensor).numpy()
    img[...] = a if channels_first else a.transpose(1, 2, 0)


def _transform_problem(out: Any, shape: tuple[int, ...]) -> str:
    """Why ``transform=``'s output ``out`` cannot replace a uint8 ``[C, H, W]`` image of
    ``shape``, with the fix; "" when it can."""
    c, h, w = shape
    if isinstance(out, torch.Tensor) and out.dtype == torch.uint8 and tuple(out.shape) == shape \
            and out.device.type == "cpu":
        return ""
    msg = (f"transform= must return a uint8 [C, H, W] tensor of the shape it is given, {shape} (the "
           f"loader writes it into the batch's preallocated slot, and every batch has one shape), "
           f"but it returned {describe_value(out)}")
    if not isinstance(out, torch.Tensor):
        fix = ("return a tensor: torchvision v2 transforms do when given one (leave out ToPILImage); "
               "numpy code's [H, W, C] result is torch.from_numpy(a).permute(2, 0, 1)")
    elif out.dtype != torch.uint8:
        fix = ("keep uint8: leave out ToDtype/Normalize/ToTensor, the trainer normalises uint8 images "
               "on the device with mean= and std=")
    elif out.dim() == 3 and out.shape[0] == c:
        fix = (f"a crop or resize must come back to {h}x{w} (e.g. v2.RandomResizedCrop(size=({h}, {w})) "
               f"instead of v2.RandomCrop(...) to a smaller size, or v2.Resize(({h}, {w})) after it); to "
               f"train at another size rebuild the cache at it (build_cache(..., size=...))")
    elif out.device.type != "cpu":
        fix = "run it on the CPU (it runs in the host's loader threads); device work goes in batch_transform="
    else:
        fix = f"keep the image's {c} channels and its [C, H, W] layout"
    return f"{msg}. Fix: {fix}"


def check_transform(data: Any, transform: Callable | None, name: str = "train_data") -> None:
    """Refuse a ``transform=`` that the loader cannot run on ``data``, on the host before any
    device time: ``data`` is not on the fast path, ``transform`` is not callable, it fails on
    sample 0 (variant 0), or its output is not a uint8 tensor of the input's shape.

    Raises:
        TypeError: ``transform`` is not callable.
        ValueError: any other case; the message names ``transform=`` and the fix.
    """
    if transform is None:
        return
    if not callable(transform):
        raise TypeError(f"transform= must be a callable (uint8 [C, H, W] tensor -> the same), e.g. "
                        f"torchvision.transforms.v2.Compose([...]), or None; got {transform!r}")
    plan = plan_loading(data)
    if not plan.fast:
        where = (f"{plan.name} wraps a cache, but {plan.why}" if plan.caches else
                 f"{name} is a {type(data).__name__}, loaded by a torch DataLoader")
        raise ValueError(f"transform= runs per sample in the loader threads of a CachedImageDataset "
                         f"(or of a dataset around one whose samples are uint8 images and class "
                         f"targets); {where}. Fix: apply it in the dataset's __getitem__, or train on "
                         f"a cache (build_cache)")
    if plan.kind == "cache":
        img = data.image(0, variant=0)
    else:
        img = np.array(_host_array(data[0][0]))
    try:
        _apply_transform(transform, img, plan.channels_first)
    except ValueError as e:
        if str(e).startswith("transform= must return"):
            raise ValueError(f"{name} sample 0: {e}") from None
        raise ValueError(f"transform= failed on {name} sample 0 (given a uint8 [C, H, W] tensor): "
                         f"{type(e).__name__}: {e}") from e
    except Exception as e:
        raise ValueError(f"transform= failed on {name} sample 0 (given a uint8 [C, H, W] tensor): "
                         f"{type(e).__name__}: {e}") from e


class BatchIterable:
    """One pass over ``(x, y, valid)`` batches; see :func:`iterate_batches`.

    Iterating again starts a new pass over the same epoch; :meth:`set_epoch` changes it.
    A pass yields the epoch's batches from batch ``start`` on (``len()`` counts those).
    """

    def __init__(self, dataset: Any, sampler: DistributedBatchSampler, epoch: int, num_workers: int | None,
                 pin_memory: bool = False, transform: Callable | None = None, plan: LoadPlan | None = None,
                 start: int = 0):
        self.dataset, self.sampler, self.epoch = dataset, sampler, int(epoch)
        self.num_workers, self.pin_memory, self.transform = num_workers, pin_memory, transform
        self.plan = plan if plan is not None else plan_loading(dataset)
        self.start = int(start)

    @property
    def valid_for(self) -> int | None:
        """Further batches a yielded batch stays valid for before its buffers are refilled:
        2 for a cache's ring, None (never reused: fresh tensors) for a ``DataLoader``'s."""
        return RING_VALID_FOR if self.plan.fast else None

    def __len__(self) -> int:
        return max(0, len(self.sampler) - self.start)

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch of the next pass."""
        self.epoch = int(epoch)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        if self.plan.kind == "wrapper":
            _set_epoch(self.dataset, self.plan, self.epoch)
        if self.plan.fast:
            workers = self.num_workers if self.num_workers is not None else default_loader_threads()
            return _ring_batches(self.dataset, self.plan, self.sampler, self.epoch, workers,
                                 self.pin_memory, self.transform, self.start)
        return self._loader_batches()

    def _loader_batches(self) -> Iterator[tuple[Any, Any, torch.Tensor]]:
        from torch.utils.data import DataLoader

        _set_epoch(self.dataset, self.plan, self.epoch)
        batches = [idx for idx, _ in self.sampler.batches(self.epoch, self.start)]
        loader = DataLoader(self.dataset, batch_sampler=batches, num_workers=self.num_workers or 0,
                            pin_memory=self.pin_memory)
        for k, batch in enumerate(loader, self.start):
            if not isinstance(batch, (list, tuple)) or len(batch) != 2:
                raise TypeError("iterate_batches needs a dataset of (input, target) pairs; its collated "
                                f"batch is a {type(batch).__name__}")
            yield batch[0], batch[1], torch.from_numpy(self.sampler.valid_mask(k))


class _Ring:
    """``R`` preallocated batch slots (tensors, pinned when asked, and numpy views of them).

    Consecutive passes of one rank reuse the ring (allocating and first-touching
    ~200 MB per epoch costs more than loading it), continuing the slot sequence
    at ``base`` so that the previous pass's last batches keep their guarantee.
    """

    def __init__(self, plan: LoadPlan, batch_size: int, size: int, pin: bool = False):
        self.size, self.base, self.in_use = size, 0, False
        y_dtype = torch.from_numpy(np.empty(0, plan.y_dtype)).dtype  # the dataset's own
        t = [torch.empty(shape, dtype=dtype, pin_memory=pin) for shape, dtype in (
            ((size, batch_size, *plan.x_shape), torch.uint8),
            ((size, batch_size, *plan.y_shape), y_dtype), ((size, batch_size), torch.bool))]
        self.xs, self.ys, self.vs = (a.numpy() for a in t)
        self.slots = [tuple(a[r] for a in t) for r in range(size)]


class _Prefetch:
    """Downloads ahead for one pass over a remote cache: called with each requested batch ``m``,
    it starts the downloads of the shards this rank needs next, in order of first use, as far
    as the local budget allows without evicting a shard needed by batches ``m .. m + R``."""

    def __init__(self, ds: CachedImageDataset, batches: list[tuple[np.ndarray, np.ndarray]], R: int):
        self.cache, self.R = ds._remote, R
        first: dict[int, int] = {}
        last: dict[int, int] = {}
        for k, (idx, _) in enumerate(batches):
            for sh in np.unique(ds._shard_of[idx]).tolist():
                first.setdefault(sh, k)
                last[sh] = k
        self.uses = sorted((f, last[sh], sh) for sh, f in first.items())

    def __call__(self, m: int) -> None:
        live = [(f, last, sh) for f, last, sh in self.uses if last >= m]
        protect = {sh for f, _, sh in live if f <= m + self.R}
        self.cache.prefetch([sh for _, _, sh in live], protect)


def _take_ring(plan: LoadPlan, sampler: DistributedBatchSampler, size: int, pin: bool) -> _Ring:
    """A free ring of the plan's shapes, kept by its (first) cache for the next passes."""
    ds = plan.caches[0]
    key = (sampler.rank, sampler.world_size, sampler.batch_size, size, pin, plan.x_shape,
           plan.y_shape, np.dtype(plan.y_dtype).str)
    with ds._rings_lock:
        ring = ds._rings.get(key)
        if ring is None or ring.in_use:  # a concurrent pass of the same rank gets its own buffers
            ring = _Ring(plan, sampler.batch_size, size, pin)
            ds._rings.setdefault(key, ring)
        ring.in_use = True
        return ring


def _fill_samples(data: Any, plan: LoadPlan, idx: np.ndarray, xs: np.ndarray, ys: np.ndarray) -> None:
    """A wrapper's samples ``idx`` into one ring slot (``xs``, ``ys``), each checked against
    the shape of sample 0."""
    for j, i in enumerate(idx.tolist()):
        sample = data[i]
        x, y = sample if isinstance(sample, (tuple, list)) and len(sample) == 2 else (sample, None)
        a = _host_array(x)
        if a is None or a.dtype != np.uint8 or a.shape != plan.x_shape or _target_kind(y) is None:
            raise ValueError(f"{plan.name} sample {i} is ({describe_value(x)}, {describe_value(y)}) but its sample "
                             f"0 was a uint8 image of shape {plan.x_shape} and a target: the loader's "
                             "batches have one shape (resize in the dataset, or use transform=)")
        xs[j] = a
        ys[j] = _host_array(y) if isinstance(y, torch.Tensor) else y


def _fill_slot(data: Any, plan: LoadPlan, epoch: int, batch: tuple[np.ndarray, np.ndarray],
               slot: tuple[np.ndarray, np.ndarray, np.ndarray], transform: Callable | None) -> None:
    """Batch ``batch`` (indices, valid mask) of ``epoch`` into a ring ``slot`` (x, y, valid):
    a cache's whole, a wrapper's sample by sample; then ``transform`` on every image."""
    (idx, valid), (xs, ys, vs) = batch, slot
    if plan.kind == "cache":
        data.load_batch(idx, epoch, xs)
        np.take(data.labels, idx, axis=0, out=ys)
    else:
        _fill_samples(data, plan, idx, xs, ys)
    if transform is not None:
        for img in xs:
            _apply_transform(transform, img, plan.channels_first)
    vs[...] = valid


def _ring_batches(data: Any, plan: LoadPlan, sampler: DistributedBatchSampler, epoch: int,
                  workers: int, pin: bool = False, transform: Callable | None = None,
                  start: int = 0
                  ) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Fill batches into a ring of ``R = workers + 3`` preallocated slots (pinned: ``pin``).

    Batch ``j`` (counted across the passes that share the ring) lives in slot
    ``j % R`` and is only overwritten by batch ``j + R``, which a thread may start
    once the consumer has asked for batch ``j + 3``: a yielded batch survives
    :data:`RING_VALID_FOR` (two) further requests. A cache's batches are read whole
    (:meth:`CachedImageDataset.load_batch`), a wrapper's sample by sample; ``transform``
    then replaces each image in the slot.
    """
    batches = list(sampler.batches(epoch, start))
    nb, R = len(batches), workers + RING_VALID_FOR + 1
    ring = _take_ring(plan, sampler, R, pin)
    base = ring.base
    remote = plan.kind == "cache" and data._remote is not None
    prefetch = _Prefetch(data, batches, R) if remote else None

    def fill(k: int) -> None:
        r = (base + k) % R
        _fill_slot(data, plan, epoch, batches[k], (ring.xs[r], ring.ys[r], ring.vs[r]), transform)
    cond = threading.Condition()
    st = {"next": 0, "requested": 0, "stop": False, "error": None}
    ready: set[int] = set()

    def worker() -> None:
        while True:
            with cond:
                k = st["next"]
                if st["stop"] or k >= nb:
                    return
                st["next"] = k + 1
                cond.wait_for(lambda: st["stop"] or st["requested"] >= k - R + RING_VALID_FOR + 2)
                if st["stop"]:
                    return
            try:
                fill(k)
            except BaseException as e:  # handed to the consumer
                with cond:
                    st["error"] = e
                    cond.notify_all()
                return
            with cond:
                ready.add(k)
                cond.notify_all()

    threads = [threading.Thread(target=worker, daemon=True, name=f"xla_utils-batches-{n}")
               for n in range(min(workers, nb))]
    for t in threads:
        t.start()
    try:
        for m in range(nb):
            if prefetch is not None:
                prefetch(m)
            with cond:
                st["requested"] = m + 1
                cond.notify_all()
                if threads:
                    cond.wait_for(lambda: m in ready or st["error"] is not None)
                    if st["error"] is not None:
                        raise st["error"]
                    ready.discard(m)
            if not threads:
                fill(m)
            yield ring.slots[(base + m) % R]
    finally:
        with cond:
            st["stop"] = True
            cond.notify_all()
        for t in threads:  # a thread may still be writing a slot; the next pass must not start before
            t.join()
        with plan.caches[0]._rings_lock:
            ring.base = base + max(st["next"], st["requested"])
            ring.in_use = False


def iterate_batches(dataset: Any, batch_size: int, *, world_size: int = 1, rank: int = 0, shuffle: bool = True,
                    seed: int = 0, epoch: int = 0, drop_last: bool = True,
                    num_workers: int | None = None, pin_memory: bool = False,
                    transform: Callable | None = None, start: int = 0) -> BatchIterable:
    """Batches ``(x, y, valid)`` of host tensors for one rank and one epoch.

    The sampler is :class:`DistributedBatchSampler` (equal full batches on every
    rank; ``valid`` is ``bool[B]``, all True when ``drop_last=True``), or
    :class:`ShardWindowSampler` for a remote cache larger than its ``max_local_bytes``.

    * :class:`CachedImageDataset`: ``x`` is ``uint8[B, H, W, 3]``, ``y`` is
      ``int64[B]`` or ``float32[B, C]`` (multi-label, regression: ``dataset.labels``'
      rows), filled by ``num_workers`` background
      threads (default ``min(4, cores)``; 0 = in the caller) into a ring of
      preallocated buffers. A yielded batch stays valid until two further
      batches have been requested (``.valid_for``): copy it (or move it to the
      device, and wait for an asynchronous copy to finish) first.
    * a user's dataset around a cache (a wrapper: :func:`caches_inside` finds the cache
      in its attributes) whose samples are uint8 images (``[H, W, C]`` arrays or
      ``[C, H, W]`` tensors) and class indices or float32 multi-hot targets: the same
      ring, filled sample by sample (``dataset[i]``) by the threads; ``x`` has the shape
      of its sample 0. Each pass first sets the epoch of the caches inside, then calls
      the wrapper's own ``set_epoch`` if it has one, so the variants rotate.
    * any other map-style dataset of ``(input, target)``: a torch ``DataLoader``
      with the same batches, default collate and ``num_workers`` processes
      (default 0); a wrapper around a cache that is not on the ring (other samples) has
      its caches' epoch set too.

    Args:
        dataset: a :class:`CachedImageDataset` or any map-style dataset.
        batch_size: samples per batch on this rank.
        world_size, rank, shuffle, seed, drop_last: as :class:`DistributedBatchSampler`.
        epoch: the epoch (variant and permutation). Default 0.
        num_workers: loader threads (cache) or processes (other datasets); see above.
        pin_memory: batches in pinned (page-locked) host memory, for asynchronous copies
            to a GPU (needs CUDA). Default False.
        transform: on the ring only: called in the loader threads on every image after
            its variant is read, with a uint8 ``[C, H, W]`` tensor (a copy; torchvision v2
            transforms take it), and must return a uint8 tensor of the same shape, written
            back into the batch (see :func:`check_transform`). Default None.
        start: the epoch's first batch to yield (a run resumed inside an epoch: the batches
            before it are neither read nor decoded; the order and the variants are those of
            the whole epoch). Default 0.

    Returns:
        A :class:`BatchIterable`: each iteration is one pass; ``len()`` is its batch count.
    """
    if isinstance(dataset, CachedImageDataset) and dataset.shard_aware:
        sampler = ShardWindowSampler(dataset.shard_ids, dataset.shards_per_window, batch_size, world_size, rank,
                                     shuffle, seed, drop_last)
    else:
        sampler = DistributedBatchSampler(len(dataset), batch_size, world_size, rank, shuffle, seed, drop_last)
    plan = plan_loading(dataset)
    if transform is not None and not plan.fast:
        check_transform(dataset, transform, "dataset")  # raises: names the fix
    return BatchIterable(dataset, sampler, epoch, num_workers, pin_memory, transform, plan, start)


def default_loader_threads() -> int:
    """Loader threads of a cache when ``num_workers`` is None: ``min(4, cores)``."""
    return min(4, os.cpu_count() or 1)
