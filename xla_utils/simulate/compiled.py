"""``torch.compile`` inside a simulated replica.

Dynamo cannot trace a host collective (it reads files and waits in a store), so
in the replicas the simulated collectives are ``torch._dynamo.disable``d (dynamo
runs them outside the graph, between two graphs) and ``torch.compile(...,
fullgraph=True)`` is compiled with ``fullgraph=False``; one warning says that
the single-graph check is not made. The numbers are those of the uncompiled
program (the graphs around the collective are the same computation).
"""
from __future__ import annotations

import sys
from typing import Any, Callable

_WARNED: list = []


def patch_torch_compile(rank: int, collectives: dict[str, Callable[..., Any]]) -> None:
    """Make ``torch.compile`` in this replica tolerate the simulated collectives.

    Args:
        rank: This replica's rank (rank 0 prints the warning).
        collectives: ``{name: function}`` of the ``xm`` attributes to run
            outside dynamo's graphs.
    """
    import torch
    import torch._dynamo
    import torch_xla.core.xla_model as xm

    for name, fn in collectives.items():
        setattr(xm, name, torch._dynamo.disable(fn))
    orig = torch.compile

    def compile(model=None, *, fullgraph: bool = False, **kwargs):
        if fullgraph:
            if not _WARNED and rank == 0:
                print("xla_utils.simulate: warning: torch.compile(fullgraph=True) is not "
                      "checked on simulated cores: collectives are host exchanges that "
                      "dynamo runs between graphs (fullgraph=False); on a TPU the function "
                      "must trace to one graph. The numbers are unchanged.",
                      file=sys.stderr, flush=True)
            _WARNED.append(1)
        if model is None:
            return lambda m: orig(m, fullgraph=False, **kwargs)
        return orig(model, fullgraph=False, **kwargs)

    torch.compile = compile
