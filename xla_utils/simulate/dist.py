"""torch.distributed inside a simulated replica: the ``xla`` backend on host collectives.

torch_xla's own ``ProcessGroupXla`` (the ``xla`` backend) implements every
torch.distributed collective with ``xm.all_reduce`` / ``xm.all_gather`` /
``xm.reduce_scatter`` / ``xm.collective_broadcast``, which :mod:`.collectives`
replaces in the replica by host collectives; so ``all_reduce``, ``all_gather``,
``reduce_scatter``, ``broadcast`` and ``DistributedDataParallel``'s gradient
buckets already carry the same guarantees (a rank-dependent collective is a
named ``CollectiveError``). What breaks is the rendezvous: torch_xla's ``xla://``
handler and torch's ``env://`` make replica 0 host a ``TCPStore`` on
``MASTER_PORT`` (12355 by default), which collides between simulated runs and,
without the world patched, in every replica, and listens on every network
interface. :func:`patch_distributed` makes both handlers hand out the job's own
store instead (the caller's, listening on the loopback address only), and
:func:`patch_distributed_spmd` an in-process store in an SPMD process.
"""
from __future__ import annotations

import os
from typing import Iterator

# Every simulated replica lives on the caller's host: gloo's and tensorpipe's sockets
# (a gloo process group, torch.distributed.rpc) bind the loopback interface, not the
# address the host name resolves to. Set in every replica's and SPMD process's
# environment.
LOOPBACK_ENV = {"GLOO_SOCKET_IFNAME": "lo", "TP_SOCKET_IFNAME": "lo"}

# torch.distributed frames count as library frames when a collective's call site is named
DIST_DIRS = (os.path.join("torch", "distributed", ""), os.path.join("torch", "nn", "parallel", ""))


def patch_distributed(rank: int, n: int, store) -> None:
    """Route ``init_process_group``'s ``xla://`` and ``env://`` rendezvous of this
    replica to ``store`` (under a prefix), with the simulated rank and world size."""
    import torch.distributed as dist
    import importlib

    rdzv = importlib.import_module("torch.distributed.rendezvous")
    import torch_xla.distributed.xla_backend  # noqa: F401  (registers 'xla' and xla://)

    def xla_handler(url: str, timeout=None, **kwargs) -> Iterator[tuple]:
        yield dist.PrefixStore("xla_utils_dist/", store), rank, n

    def env_handler(url: str, timeout=None, **kwargs) -> Iterator[tuple]:
        _check_env(url, rank, n)
        yield dist.PrefixStore("xla_utils_dist/", store), rank, n

    rdzv._rendezvous_handlers["xla"] = xla_handler
    rdzv._rendezvous_handlers["env"] = env_handler


def patch_distributed_spmd() -> None:
    """In an SPMD process (one process owning every device, world of one process),
    route the ``xla://`` and ``env://`` rendezvous to an in-process ``HashStore``:
    torch_xla's handler would otherwise host a ``TCPStore`` on ``MASTER_PORT``,
    listening on every network interface."""
    import torch.distributed as dist

    patch_distributed(0, 1, dist.HashStore())


def _check_env(url: str, rank: int, n: int) -> None:
    """``env://`` reads MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE (the URL's
    query may give rank/world_size): missing ones fail as on a TPU, and values
    other than the simulated world's are named."""
    from urllib.parse import parse_qs, urlparse

    query = {k: v[0] for k, v in parse_qs(urlparse(url).query).items()}
    for var in ("MASTER_ADDR", "MASTER_PORT"):
        if not os.environ.get(var):
            raise ValueError(f"Error initializing torch.distributed using env:// rendezvous: "
                             f"environment variable {var} expected, but not set")
    for var, key, want in (("RANK", "rank", rank), ("WORLD_SIZE", "world_size", n)):
        got = query.get(key, os.environ.get(var))
        if got is None:
            raise ValueError(f"Error initializing torch.distributed using env:// rendezvous: "
                             f"environment variable {var} expected, but not set")
        if int(got) != want and int(got) != -1:
            raise ValueError(
                f"init_process_group(init_method='env://'): {var}={got} in simulated replica "
                f"{rank} of {n}; set {var} from xr.global_ordinal() / xr.world_size() "
                f"(here {want})")
