"""The torch_xla import, with one clear message when it is missing or mismatched.

Nothing here imports torch_xla at module import time: :func:`load_xla` does, on
first use, and remembers the modules (or the error) in
:data:`~xla_utils.runtime.state.STATE`.
"""
from __future__ import annotations

import os
import sys
from typing import Any

from .state import STATE

__all__ = ["XLAUnavailableError", "RuntimeAlreadyInitializedError", "xla_available",
           "xla_installed",
           "load_xla", "tpu_present", "xla_runtime_initialized", "fast_cpu_compile_flags"]

# XLA:CPU without LLVM's optimisation passes: compiles a ResNet-18 step ~5x faster;
# compile counts, transfers, fallbacks and shardings do not depend on it, and results
# change by float rounding only.
FAST_CPU_COMPILE = "--xla_backend_optimization_level=0"


def fast_cpu_compile_flags(flags: str | None) -> str:
    """An ``XLA_FLAGS`` value: ``flags`` plus :data:`FAST_CPU_COMPILE`, unless ``flags``
    already sets an optimisation level (the caller's choice wins)."""
    flags = (flags or "").strip()
    if "xla_backend_optimization_level" in flags:
        return flags
    return f"{flags} {FAST_CPU_COMPILE}".strip()


class XLAUnavailableError(ImportError):
    """torch_xla is missing, or does not match the installed torch."""


class RuntimeAlreadyInitializedError(RuntimeError):
    """The calling process already initialised the XLA runtime."""


def _fix_message(cause: str) -> str:
    try:
        from .. import env

        return f"{cause}\n{env.xla_fix_message()}"
    except Exception:  # env must never mask the real cause
        return cause


def load_xla() -> dict[str, Any]:
    """Import torch_xla lazily.

    Returns:
        ``{"torch_xla", "xm", "xr", "xmp", "met"}``: the modules.

    Raises:
        XLAUnavailableError: torch_xla is missing or fails to import; the message
            carries the fix.
    """
    if STATE.xla is not None:
        return STATE.xla
    if STATE.xla_error is not None:
        raise XLAUnavailableError(STATE.xla_error)
    if "PJRT_DEVICE" not in os.environ and "torch_xla" not in sys.modules and not tpu_present():
        os.environ["PJRT_DEVICE"] = "CPU"  # torch_xla's own default here, minus its warning
    try:
        import torch_xla
        import torch_xla.core.xla_model as xm
        import torch_xla.debug.metrics as met
        import torch_xla.distributed.xla_multiprocessing as xmp
        import torch_xla.runtime as xr
    except ModuleNotFoundError as exc:
        STATE.xla_error = _fix_message(f"torch_xla is not installed ({exc}).")
        raise XLAUnavailableError(STATE.xla_error) from None
    except (ImportError, OSError) as exc:
        # The classic symptom of a torch / torch_xla version mismatch is an
        # "undefined symbol" from _XLAC.so; never show that raw.
        STATE.xla_error = _fix_message(
            f"torch_xla failed to import ({type(exc).__name__}: {str(exc)[:200]}). "
            "This almost always means torch and torch_xla are different versions."
        )
        raise XLAUnavailableError(STATE.xla_error) from None
    STATE.xla = {"torch_xla": torch_xla, "xm": xm, "xr": xr, "xmp": xmp, "met": met}
    return STATE.xla


def xla_available() -> bool:
    """True when torch_xla imports cleanly (imports it on first call)."""
    try:
        load_xla()
        return True
    except XLAUnavailableError:
        return False


def xla_installed() -> bool:
    """Whether torch_xla is installed, without importing it (unless it already was).

    Simulated launches use this instead of :func:`xla_available`: their replicas
    import torch_xla in the simulation's own clean interpreter (the zygote), so
    the calling process need not pay the import (1.5-6 s on a 2-core host).
    """
    if STATE.xla is not None:
        return True
    if STATE.xla_error is not None:
        return False
    import importlib.util

    try:
        return importlib.util.find_spec("torch_xla") is not None
    except (ImportError, ValueError):  # e.g. sys.modules["torch_xla"] is None
        return False


def xla_runtime_initialized() -> bool:
    """Whether *this process* already initialised the XLA runtime (no side effects)."""
    if "torch_xla" not in sys.modules:
        return False
    xla = load_xla()
    xr = xla["xr"]
    for probe in (
        lambda: xr.is_runtime_initialized(),  # not in every release
        lambda: xla["torch_xla"]._XLAC._xla_runtime_is_initialized(),
    ):
        try:
            return bool(probe())
        except AttributeError:
            continue
    return False


def tpu_present() -> bool:
    """Whether this host has a TPU (asks :func:`xla_utils.env.detect` once)."""
    if STATE.tpu_present is None:
        try:
            from .. import env

            STATE.tpu_present = env.detect().accelerator == "tpu"
        except Exception:
            STATE.tpu_present = False
    return STATE.tpu_present
