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

import os
from typing import TYPE_CHECKING

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
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals(), modules=("runtime",))


# Last, once the names above exist: registers simulated launches with runtime's launcher.
from . import simulate as _simulate  # noqa: E402,F401
