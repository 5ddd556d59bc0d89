"""xla_utils: fast, painless PyTorch/XLA training on Kaggle and Colab TPUs.

Importing the package is cheap: it imports neither torch nor torch_xla. Each
public name is loaded from its module on first use.
"""
from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# public name -> module that defines it
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
    "launch": "runtime",
    "write_submission": "submission",
    "check": "readiness",
    "ReadinessReport": "readiness",
    "Finding": "readiness",
}

__all__ = sorted(_EXPORTS) + ["runtime", "__version__"]


def __getattr__(name: str) -> Any:
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
