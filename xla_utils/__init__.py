"""xla_utils: fast, painless PyTorch/XLA training on Kaggle and Colab TPUs.

Importing the package is cheap: it imports neither torch nor torch_xla. Each
public name is loaded from its module on first use. The one thing wired at import:
:mod:`xla_utils.simulate` registers the simulated launcher with :mod:`xla_utils.runtime`
(which sits below it and never imports it), so ``runtime.launch(fn, simulate=N)``
works however ``runtime`` was imported. And ``PYTORCH_NVML_BASED_CUDA_CHECK=1`` is set
unless the user set it: a ``torch.cuda.is_available()`` in the notebook then asks NVML instead
of starting the CUDA driver, which would make the notebook unable to fork GPU replicas
(``fit`` on every GPU; Accelerate's ``notebook_launcher`` sets the same).
"""
from __future__ import annotations

import importlib
import os
from typing import TYPE_CHECKING, Any

from .version import __version__

os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")

if TYPE_CHECKING:  # what editors and type checkers see; at run time __getattr__ loads these lazily
    from . import runtime
    from .cache import CacheConfig, build_cache
    from .data import CachedImageDataset
    from .env import EnvInfo, detect, setup
    from .lr_finder import LRFinderResult, lr_find
    from .memory import MemoryReport, measure_memory, paper_memory
    from .readiness import Finding, ReadinessReport, check
    from .runtime import launch
    from .schedule import OneCycleSchedule
    from .submission import write_submission
    from .debug import debug_run
    from .trainer import OneCycleTrainer
    from .crossval import CVResult, cross_validate, split
    from .config import TrainerConfig
    from .history import History
    from .runtime import ReplicaError
    from .simulate import run_script, simulated_spawn

# public name -> module that defines it (keep in step with the TYPE_CHECKING imports above;
# tests/test_import.py checks that they agree)
_EXPORTS = {
    "detect": "env",
    "setup": "env",
    "EnvInfo": "env",
    "build_cache": "cache",
    "CacheConfig": "cache",
    "CachedImageDataset": "data",
    "OneCycleSchedule": "schedule",
    "OneCycleTrainer": "trainer",
    "debug_run": "debug",
    "lr_find": "lr_finder",
    "LRFinderResult": "lr_finder",
    "measure_memory": "memory",
    "paper_memory": "memory",
    "MemoryReport": "memory",
    "launch": "runtime",
    "write_submission": "submission",
    "check": "readiness",
    "ReadinessReport": "readiness",
    "Finding": "readiness",
    "cross_validate": "crossval",
    "CVResult": "crossval",
    "split": "crossval",
    "TrainerConfig": "config",
    "History": "history",
    "ReplicaError": "runtime",
    "run_script": "simulate",
    "simulated_spawn": "simulate",
}

__all__ = sorted(_EXPORTS) + ["runtime", "__version__"]


def __getattr__(name: str) -> Any:
    """Load public name ``name`` from its module on first use (PEP 562)."""
    if name in _EXPORTS:
        module = importlib.import_module(f".{_EXPORTS[name]}", __name__)
        value = getattr(module, name)
        globals()[name] = value
        return value
    if name == "runtime":
        return importlib.import_module(".runtime", __name__)
    raise AttributeError(f"module 'xla_utils' has no attribute {name!r}")


def __dir__() -> list[str]:
    return __all__


# Last, once the names above exist: registers simulated launches with runtime's launcher.
from . import simulate as _simulate  # noqa: E402,F401
