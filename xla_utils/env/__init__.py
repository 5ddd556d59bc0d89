"""Where am I, what do I have, what should I do next.

The face of the package: it re-exports the names below from the modules that define them.
None of them imports torch or torch_xla, so ``python -m xla_utils.env`` works on a machine
whose torch or torch_xla is broken.

* ``info``: :class:`EnvInfo` (what :func:`detect` found) and :class:`Advice` (the one next step)
* ``detection``: :func:`detect`: platform, accelerator, host and installed versions, without
  side effects (never the XLA runtime, no network); :func:`child_pythonpath`
* ``advice``: :func:`advise`: the exact, pinned ``pip install`` line, or "ready", from the
  torch_xla wheel and release tables
* ``actions``: :func:`setup` (the notebook helper: report, optional install, environment),
  :func:`prepare_spawn`, :func:`report`, :func:`xla_fix_message`
* ``cli``: :func:`main`, ``python -m xla_utils.env [--json] [--root DIR]``
* ``gpu``: the host's NVIDIA GPUs (``nvidia-smi``), CUDA facts, the torch backend's replicas
* ``tpus``: the one table of TPU chip facts
* ``libtpu_pairs``: the libtpu known to work with each torch_xla line
"""
from __future__ import annotations

from .actions import prepare_spawn, report, setup, xla_fix_message
from .advice import advise
from .cli import main
from .detection import child_pythonpath, detect
from .info import Advice, EnvInfo

__all__ = [
    "EnvInfo",
    "Advice",
    "detect",
    "advise",
    "xla_fix_message",
    "prepare_spawn",
    "setup",
    "report",
    "main",
    "child_pythonpath",
]
