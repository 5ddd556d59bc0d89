"""Progress bars (fastprogress), in one place for the whole package.

A forked XLA replica cannot draw notebook widgets, so there the console bars are
used (their text reaches the notebook through stdout). This module imports
neither torch nor torch_xla; it asks :mod:`xla_utils.runtime` for the backend only
when the caller does not say.
"""
from __future__ import annotations

from typing import Any, Callable

__all__ = ["progress_bars", "progress_bar"]


def progress_bars(console: bool | None = None) -> tuple[Callable, Callable]:
    """``(master_bar, progress_bar)`` from fastprogress that can draw here.

    Args:
        console: Force console (text) bars; default ``None``: console bars in an
            XLA replica, fastprogress' own choice elsewhere.
    """
    from fastprogress import fastprogress as fp

    if console is None:
        from . import runtime

        console = runtime.backend() == "xla"
    if console:
        return fp.force_console_behavior()
    return fp.master_bar, fp.progress_bar


def progress_bar(total: int, *, show: bool = True, console: bool | None = None,
                 leave: bool = True) -> Any:
    """A bar over ``range(total)``; a plain ``range(total)`` when ``show`` is False.

    Args:
        total: Number of items.
        show: Draw a bar (default True).
        console: As in :func:`progress_bars`.
        leave: Keep the bar on screen when it ends (default True).
    """
    if not show:
        return range(total)
    _, bar = progress_bars(console)
    return bar(range(total), leave=leave)
