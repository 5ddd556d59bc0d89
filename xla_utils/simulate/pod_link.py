"""The rehearsed pod slice's interconnect, as one host's launches use it.

Every host of a slice rehearsed by :mod:`.pod` runs the same script, so its launches come
in the same order on every host: launch ``k`` of each host is one job of the slice's world.
Its keys live under ``launch/<k>/`` in the slice's store (on ``127.0.0.1``), its payload files
(collective inputs, global ordinal 0's result, error reports) in the slice's folder
``launch<k>/``; each host's job leaves its exit status in ``launch<k>/host<h>/``.
"""
from __future__ import annotations

import os

from ..runtime.hosts import PodWorld, pod_store

__all__ = ["pod_launch", "launch_key", "started_key", "UP"]

# Store key (under a launch's prefix) the replicas count themselves up in before they run.
UP = "up"

_LAUNCHES = [0]  # launches this process started on its slice


def _prefix(k: int) -> str:
    """The store prefix of the slice's launch ``k`` (1, 2, ...); c10d's ``PrefixStore``
    joins it to a key with a ``/``."""
    return f"launch/{k}"


def launch_key(k: int, key: str) -> str:
    """``key`` of launch ``k`` as a client without its prefix names it."""
    return f"{_prefix(k)}/{key}"


def started_key(k: int, host: int) -> str:
    """Set when ``host`` starts its share of launch ``k`` (unprefixed)."""
    return launch_key(k, f"started/{host}")


def pod_launch(pod: PodWorld) -> tuple[str, object, str, str]:
    """This host's next launch on the slice: ``(folder, store, prefix, status folder)``:
    the launch's shared payload folder, a client of the slice's store under the launch's
    prefix, that prefix, and this host's folder for its job's exit status."""
    import torch.distributed as dist

    _LAUNCHES[0] += 1
    k = _LAUNCHES[0]
    base = pod_store(pod)
    folder = os.path.join(pod.folder, f"launch{k}")
    status = os.path.join(folder, f"host{pod.host}")
    os.makedirs(status, exist_ok=True)
    base.set(started_key(k, pod.host), "1")
    return folder, dist.PrefixStore(_prefix(k), base), _prefix(k), status
