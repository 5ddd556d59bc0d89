"""DistributedDataParallel inside a simulated replica: fresh gradient views before a
mid-step sync.

DDP writes each parameter's gradient into a view of its bucket's flat buffer (with
``gradient_as_bucket_view=True`` the view *is* ``param.grad``). Under torch_xla's
functionalization each such write leaves the view holding its own version of the whole
flat buffer until the view is read again. On a TPU the step is one graph and those
versions stay inside it; on simulated cores a bucket's all-reduce is a host exchange
that first runs the pending graph (``collectives._materialize``), whose outputs are then
every live version: one full copy of the bucket per parameter (ResNet-18's first step:
63 copies of 44.6 MiB, 2.8 GiB per replica). :func:`refresh_grad_views` brings the
views of every DDP module of the replica up to date first (``torch._sync``, the same
values), so the graph outputs each bucket once.
"""
from __future__ import annotations

import functools
import weakref

_MODULES: "weakref.WeakSet" = weakref.WeakSet()


def track_ddp() -> None:
    """Record every ``DistributedDataParallel`` module this replica builds."""
    from torch.nn.parallel import DistributedDataParallel

    init = DistributedDataParallel.__init__
    if getattr(init, "_xla_utils_tracked", False):
        return

    @functools.wraps(init)
    def tracked(self, *args, **kwargs):
        init(self, *args, **kwargs)
        _MODULES.add(self)

    tracked._xla_utils_tracked = True
    DistributedDataParallel.__init__ = tracked


def refresh_grad_views() -> None:
    """Bring the gradients of this replica's DDP modules up to date with their buckets."""
    if not _MODULES:
        return
    import torch

    for module in list(_MODULES):
        for p in module.parameters():
            g = p.grad
            if g is not None and g.device.type == "xla":
                torch._sync(g)
