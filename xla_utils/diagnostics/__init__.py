"""xla_utils.diagnostics: is a model ready for a TPU: check(), findings, memory, debug_run

Importing this package runs nothing else: the names below load from their modules on first
use (``from xla_utils.diagnostics import Finding``), the same objects :mod:`xla_utils` exports.

* ``readiness``: Will this model run well on a TPU? Answered on a CPU, before any TPU quota
  is spent
* ``measure``: The measurement job of :func:`xla_utils.check`: what runs in the forked child
* ``findings``: What :func:`xla_utils.check` found, in words a user can act on
* ``memory``: Per-device memory of a training step under each strategy
* ``debug``: Single-core debug mode
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from ..utils.lazy import lazy_exports

if TYPE_CHECKING:  # what editors see; at run time __getattr__ loads these on first use
    from .readiness import Finding, ReadinessReport, check
    from .debug import debug_run
    from .memory import MemoryReport, measure_memory, paper_memory

# public name -> the module of this package that defines it (tests/test_import.py checks
# that the TYPE_CHECKING imports agree and that xla_utils exports the same objects)
_EXPORTS = {
    "check": "readiness",
    "ReadinessReport": "readiness",
    "Finding": "readiness",
    "debug_run": "debug",
    "measure_memory": "memory",
    "paper_memory": "memory",
    "MemoryReport": "memory",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
