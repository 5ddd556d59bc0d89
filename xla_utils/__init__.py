"""xla_utils: fast, painless PyTorch/XLA training on Kaggle and Colab TPUs.

Importing the package is cheap: it imports neither torch nor torch_xla. Each
public name is loaded from its module on first use. The one thing wired at import:
:mod:`xla_utils.simulate` registers the simulated launcher with :mod:`xla_utils.runtime`
(which sits below it and never imports it), so ``runtime.launch(fn, simulate=N)``
works however ``runtime`` was imported. And ``PYTORCH_NVML_BASED_CUDA_CHECK=1`` is set
unless the user set it: a ``torch.cuda.is_available()`` in the notebook then asks NVML instead
of starting the CUDA driver, after which GPU replicas could not be forked and would start as
fresh interpreters, a few seconds slower (``fit`` on every GPU; Accelerate's
``notebook_launcher`` sets the same).
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import os
import sys
from typing import TYPE_CHECKING, Any

from .utils.lazy import lazy_exports
from .utils.version import __version__

os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")

if TYPE_CHECKING:  # what editors and type checkers see; at run time __getattr__ loads these lazily
    from . import runtime
    from .cache import CacheConfig, build_cache
    from .data import CachedImageDataset
    from .env import EnvInfo, detect, setup
    from .train import (CVResult, History, LRFinderResult, OneCycleSchedule, OneCycleTrainer,
                        TrainerConfig, cross_validate, lr_find, split, write_submission)
    from .diagnostics import (Finding, MemoryReport, ReadinessReport, check, debug_run, measure_memory,
                              paper_memory)
    from .runtime import launch
    from .runtime import ReplicaError
    from .simulate import run_script, simulated_spawn

# public name -> the module, or the package face, that has it (keep in step with the TYPE_CHECKING
# imports above; tests/test_import.py checks that they agree; a face knows its defining modules)
_EXPORTS = {
    "detect": "env",
    "setup": "env",
    "EnvInfo": "env",
    "build_cache": "cache",
    "CacheConfig": "cache",
    "CachedImageDataset": "data",
    "OneCycleSchedule": "train",
    "OneCycleTrainer": "train",
    "debug_run": "diagnostics",
    "lr_find": "train",
    "LRFinderResult": "train",
    "measure_memory": "diagnostics",
    "paper_memory": "diagnostics",
    "MemoryReport": "diagnostics",
    "launch": "runtime",
    "write_submission": "train",
    "check": "diagnostics",
    "ReadinessReport": "diagnostics",
    "Finding": "diagnostics",
    "cross_validate": "train",
    "CVResult": "train",
    "split": "train",
    "TrainerConfig": "train",
    "History": "train",
    "ReplicaError": "runtime",
    "run_script": "simulate",
    "simulated_spawn": "simulate",
}

__all__ = sorted(_EXPORTS) + ["runtime", "__version__"]


# Old module paths: each module that was directly under xla_utils/ before the top level was
# grouped by domain (issue 35) -> the package it moved to. `xla_utils.<old>` (an import, a
# `from` import, a pickle naming it, an attribute of this package) is the moved module
# itself, the same object: patching one patches the other. See _MovedModules below.
_MOVED = {old: package for package, olds in {
    "data": ("transforms",),
    "diagnostics": ("debug", "findings", "memory", "readiness"),
    "env": ("libtpu_pairs", "tpus"),
    "step": ("device_plan", "inputs", "optim", "strategy"),
    "train": ("checkpoint", "config", "crossval", "ema", "finetune", "history", "loop",
        "lr_finder", "lr_rules", "mesh_tasks", "metrics", "mixup", "replica_loops", "schedule",
        "steps", "submission", "trainer"),
    "utils": ("atomic", "progress", "suggest", "units", "version"),
}.items() for old in olds}


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Import hook: ``xla_utils.<old>`` is the module ``xla_utils.<package>.<old>``."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        head, _, old = fullname.partition(".")
        if head != __name__ or old not in _MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: Any) -> Any:
        old = spec.name.partition(".")[2]
        module = importlib.import_module(f"{__name__}.{_MOVED[old]}.{old}")
        spec.loader_state = module.__spec__  # the import system sets the alias's spec next
        return module

    def exec_module(self, module: Any) -> None:
        module.__spec__ = module.__spec__.loader_state  # keep the module's own spec


# first: it answers only the old names, before any other finder (an editable install's finder
# of another checkout) could find a stale copy of an old module
sys.meta_path[:] = [_MovedModules()] + [f for f in sys.meta_path
                                        if type(f).__qualname__ != "_MovedModules"]


_load_export, _ = lazy_exports(__name__, _EXPORTS, globals())


def __getattr__(name: str) -> Any:
    """Load public name ``name`` from its module on first use (PEP 562)."""
    if name in _EXPORTS:
        return _load_export(name)
    if name == "runtime":
        return importlib.import_module(".runtime", __name__)
    if name in _MOVED:  # an old module path (see _MovedModules)
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'xla_utils' has no attribute {name!r}")


def __dir__() -> list[str]:
    return __all__


# Last, once the names above exist: registers simulated launches with runtime's launcher.
from . import simulate as _simulate  # noqa: E402,F401
