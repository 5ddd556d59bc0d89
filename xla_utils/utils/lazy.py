"""A package face's public names, each loaded from its module on first use (PEP 562).

A face (``xla_utils``, ``xla_utils.train``, ``xla_utils.diagnostics``) names what users
import without importing it: ``import xla_utils.train`` runs no torch and no trainer
module; ``xla_utils.train.OneCycleTrainer`` imports ``xla_utils.train.trainer`` then.
"""
from __future__ import annotations

import importlib
from typing import Any, Callable, Collection, Mapping

__all__ = ["lazy_exports"]


def lazy_exports(package: str, exports: Mapping[str, str], namespace: dict[str, Any],
                 modules: Collection[str] = ()
                 ) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for the face of ``package``.

    Args:
        package: The face's dotted name (its ``__name__``).
        exports: Public name -> the module defining it, relative to ``package``
            (``{"OneCycleTrainer": "trainer"}``).
        namespace: The face's ``globals()``: a name, once loaded, is kept there, so the
            next lookup does not come back here.
        modules: Submodules of ``package`` that are public names themselves
            (``xla_utils.runtime``), imported whole on first use.

    Returns:
        The module-level ``__getattr__`` (``AttributeError`` for any other name) and
        ``__dir__`` (the face's ``__all__``, the exports and the modules) of the face.
    """
    def __getattr__(name: str) -> Any:
        if name in modules:
            value = importlib.import_module(f".{name}", package)
        elif name in exports:
            value = getattr(importlib.import_module(f".{exports[name]}", package), name)
        else:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace.get("__all__", ())) | set(exports) | set(modules))

    return __getattr__, __dir__
