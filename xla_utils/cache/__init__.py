"""Sharded uint8 image cache: build once on any CPU machine, then train from memory maps.

No TPU, no torch and no torch_xla are needed to build::

    from xla_utils import build_cache
    build_cache("train_images/", "cache/train", size=224, variants=4)   # or the
    # ``tpu_cache_ds build train_images/ cache/train --size 224 --variants 4`` command

One module per concern; dependencies run one way (config <- images <- sources <-
worker <- builder; everything may use format, errors and storage; nothing here imports the
reader :mod:`xla_utils.data` or the command line :mod:`xla_utils.cli`):

* :mod:`~xla_utils.cache.format` - the on-disk format: file names, manifest,
  shard layouts, the JPEG index (the reader imports only this module).
* :mod:`~xla_utils.cache.config` - :class:`CacheConfig`, :func:`parse_size`.
* :mod:`~xla_utils.cache.errors` - :class:`BuildError`, :class:`BadImageError`.
* :mod:`~xla_utils.cache.storage` - local folders and URLs (``gs://``) alike: atomic
  publish, listing, the build lock, checked downloads (the reader uses it too).
* :mod:`~xla_utils.cache.images` - decoding and the stored variants.
* :mod:`~xla_utils.cache.sources` - folder, CSV and dataset sources.
* :mod:`~xla_utils.cache.worker` - the shard tasks (one shard each).
* :mod:`~xla_utils.cache.runners` - who runs the tasks: the local process pool or Ray.
* :mod:`~xla_utils.cache.space` - free space: refuse before writing, one line when the disk fills.
* :mod:`~xla_utils.cache.fetch` - the reader's bounded local copy of a cache in a bucket.
* :mod:`~xla_utils.cache.builder` - :func:`build_cache`: resume, lock, pool, manifest.
* :mod:`~xla_utils.cache.verify` - :func:`cache_info`, :func:`verify_cache`.

``python -m xla_utils.cache`` runs the ``tpu_cache_ds`` command (:mod:`xla_utils.cli`).
"""
from __future__ import annotations

from .builder import BuildReport, DryRunEstimate, build_cache
from .config import (JPEG_RATIO_GUESS, MIN_SHARD_BYTES, MIN_SHARDS, CacheConfig, parse_bytes,
                     parse_size)
from .errors import BadImageError, BuildError
from .format import FORMAT, FORMAT_VERSION, JPEG_MAGIC, LABELS, MANIFEST, read_manifest
from .images import decode_source, make_variants
from .sources import IMAGE_EXTENSIONS
from .verify import VerifyReport, cache_info, verify_cache

__all__ = [
    "CacheConfig",
    "BuildReport",
    "DryRunEstimate",
    "VerifyReport",
    "BuildError",
    "BadImageError",
    "build_cache",
    "read_manifest",
    "cache_info",
    "verify_cache",
    "decode_source",
    "make_variants",
    "parse_size",
    "parse_bytes",
    "IMAGE_EXTENSIONS",
    "FORMAT",
    "FORMAT_VERSION",
    "MANIFEST",
    "LABELS",
    "JPEG_MAGIC",
    "MIN_SHARDS",
    "MIN_SHARD_BYTES",
    "JPEG_RATIO_GUESS",
]
