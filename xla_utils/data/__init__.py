"""Reading an image cache built by :mod:`xla_utils.cache`.

The face of the package: it re-exports the names below from the modules that define them
(as timm's ``timm/data``). torch_xla is never imported here.

* ``dataset``: :class:`CachedImageDataset`, map-style ``(uint8 HxWx3 image, label)`` over
  the memory-mapped shards; epoch ``e`` shows variant ``e % num_variants`` of every image.
* ``samplers``: :class:`DistributedBatchSampler`, one exact global shuffle per epoch cut into
  the same number of full batches on every rank; :class:`ShardWindowSampler`, the
  shard-aware shuffle of a remote cache larger than its local budget.
* ``loader``: :func:`iterate_batches`, uint8 NHWC batches filled by background threads into
  a ring of preallocated (optionally pinned) buffers, no collate (also for a user's dataset
  around a cache, :func:`caches_inside`), with an optional per-sample ``transform``
  (:func:`check_transform`); :func:`plan_loading` says which way a dataset goes.
* ``transforms``: :func:`images_to_float`, :func:`image_layout`, :func:`apply_batch_transform`,
  the device transforms.

Everything here is safe to share between threads: the dataset is read-only after
construction and all per-pass state lives in the iterator. (The one exception is
:meth:`CachedImageDataset.set_epoch`, which only affects ``ds[i]``; :func:`iterate_batches`
takes ``epoch`` explicitly.)
"""
from __future__ import annotations

from .dataset import CachedImageDataset
from .loader import (RING_VALID_FOR, BatchIterable, LoadPlan, caches_inside, check_transform,
                     default_loader_threads, describe_value, iterate_batches, plan_loading,
                     type_name)
from .samplers import DistributedBatchSampler, ShardWindowSampler
from .transforms import (IMAGE_CHANNELS, IMAGENET_MEAN, IMAGENET_STD, apply_batch_transform, image_layout,
                         images_to_float)

__all__ = [
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "CachedImageDataset",
    "DistributedBatchSampler",
    "ShardWindowSampler",
    "BatchIterable",
    "iterate_batches",
    "default_loader_threads",
    "RING_VALID_FOR",
    "LoadPlan",
    "plan_loading",
    "caches_inside",
    "check_transform",
    "images_to_float",
    "image_layout",
    "IMAGE_CHANNELS",
    "apply_batch_transform",
    "describe_value",  # a value in words (type, shape, dtype): the loader's and step.inputs' errors
    "type_name",
]
