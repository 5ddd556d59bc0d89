"""Progress bars (fastprogress), in one place for the whole package.

A forked XLA replica cannot draw notebook widgets, so there the console bars are
used (their text reaches the notebook through stdout): callers in a replica pass
``console=True``, which :func:`xla_utils.runtime.progress_bars` does for the
calling replica's backend. This module imports neither torch nor the runtime.
"""
from __future__ import annotations

from typing import Any, Callable

__all__ = ["progress_bars", "progress_bar", "update_bar"]


def progress_bars(console: bool = False) -> tuple[Callable, Callable]:
    """``(master_bar, progress_bar)`` from fastprogress.

    Args:
        console: Force console (text) bars, as an XLA replica needs; default
            False: fastprogress' own choice (widgets in a notebook).
    """
    from fastprogress import fastprogress as fp

    if console:
        return fp.force_console_behavior()
    return fp.master_bar, fp.progress_bar


def progress_bar(total: int, *, show: bool = True, console: bool = False,
                 leave: bool = True) -> Any:
    """A bar over ``range(total)``; a plain ``range(total)`` when ``show`` is False.

    Args:
        total: Number of items.
        show: Draw a bar (default True).
        console: As in :func:`progress_bars` (default False).
        leave: Keep the bar on screen when it ends (default True).
    """
    if not show:
        return range(total)
    _, bar = progress_bars(console)
    return bar(range(total), leave=leave)


def update_bar(total: int, *, console: bool = False) -> Any:
    """A bar the caller advances itself (``bar.update(n)``, ``bar.comment = ...``),
    shown at 0 at once; None when fastprogress is not installed (the cache
    builder runs without it).

    Args:
        total: Number of items.
        console: As in :func:`progress_bars` (default False).
    """
    try:
        _, bar_cls = progress_bars(console)
    except ImportError:
        return None
    bar = bar_cls(range(total), total=total)
    bar.update(0)
    return bar
