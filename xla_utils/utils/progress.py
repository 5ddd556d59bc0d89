"""Progress bars, in one place for the whole package, readable in a terminal and in a log.

Where a bar draws:

* In a Jupyter notebook (the calling process, ``console=False``): fastprogress' widgets.
* Everywhere else a text bar of this module (:class:`ConsoleBar`), in one of two styles:

  - ``"redraw"`` when the output is a terminal or a notebook: one line redrawn in place
    (``\\r``), ended with a newline when the bar ends, so what is printed next starts on a
    line of its own;
  - ``"lines"`` when the output is a pipe or a file (``python train.py > log``, ``| tee``),
    or a Kaggle notebook run as a saved version (its log): no ``\\r`` at all, one whole line
    when the bar starts, at every quarter (or minute) and when it ends.

  Neither style prints anything else (fastprogress' console bars print a stray fill
  character when made and never end their line: ``...302 img/s]{'loss': 1.07}``).

A forked XLA replica writes into a pipe that the notebook process re-prints, so its
style is the one of the process that launched it: each process that imports this
module records its own style in the environment variable ``XLA_UTILS_OUTPUT``, which
replicas inherit (:func:`output_style`). ``XLA_UTILS_PROGRESS=lines`` or ``=redraw``
forces a style everywhere. This module imports neither torch nor the runtime.
"""
from __future__ import annotations

import os
import sys
import time
from typing import Any, Callable, Iterable, Iterator

__all__ = ["progress_bars", "progress_bar", "update_bar", "output_style", "ConsoleBar",
           "ConsoleMasterBar", "STYLES"]

STYLES = ("redraw", "lines")
_CALLER = "XLA_UTILS_OUTPUT"  # the style of the process whose output this one's reaches
_FORCE = "XLA_UTILS_PROGRESS"
_WIDTH = 25  # characters of the bar itself
_REDRAW_S = 0.2  # at most this often a redrawn bar is written
_LINE_S = 60.0  # a "lines" bar writes a line at least this often while it advances


def _own_style(stream: Any = None) -> str:
    """``"redraw"`` when ``stream`` (default ``sys.stdout``) is a terminal or a Jupyter
    output stream (the notebook renders ``\\r``), else ``"lines"``; also "lines" in a
    Kaggle notebook run as a saved version (``KAGGLE_KERNEL_RUN_TYPE=Batch``: nobody
    watches it, its output is the log)."""
    stream = sys.stdout if stream is None else stream
    if os.environ.get("KAGGLE_KERNEL_RUN_TYPE") == "Batch":
        return "lines"
    if type(stream).__module__.startswith("ipykernel"):
        return "redraw"
    try:
        return "redraw" if stream.isatty() else "lines"
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return "lines"


def output_style(console: bool = False) -> str:
    """How a text bar draws here: ``"redraw"`` or ``"lines"`` (see the module docstring).

    Args:
        console: The caller is a replica whose output the launching process re-prints
            (the style then is that process's, from ``XLA_UTILS_OUTPUT``); default False:
            this process's own standard output decides.
    """
    forced = os.environ.get(_FORCE, "").strip().lower()
    if forced in STYLES:
        return forced
    if console:
        inherited = os.environ.get(_CALLER, "")
        return inherited if inherited in STYLES else "lines"
    return _own_style()


# Replicas forked from this process (or started with its environment) learn its style.
os.environ[_CALLER] = _own_style()


def _in_notebook() -> bool:
    """A Jupyter kernel (Kaggle, Colab, JupyterLab) runs this process."""
    if "google.colab" in sys.modules:
        return True
    shell = getattr(sys.modules.get("IPython"), "get_ipython", lambda: None)()
    return shell is not None and "ZMQ" in type(shell).__name__


def _clock(seconds: float) -> str:
    s = int(seconds)
    if s >= 3600:
        return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"
    return f"{s // 60:02d}:{s % 60:02d}"


class ConsoleBar:
    """A text progress bar over ``gen`` (or advanced by :meth:`update`) that always ends its
    line: ``title |█████-----| 50% [5/10 00:06<00:06 comment]``.

    Args:
        gen: What to iterate (its length is the total unless ``total`` is given).
        total: Number of items; default ``len(gen)``.
        leave: Keep the last state on screen (default True); False clears a redrawn
            line at the end ("lines" logs keep it anyway).
        parent: A :class:`ConsoleMasterBar`: the title becomes ``Epoch i/n``.
        title: Words before the bar, e.g. ``"lr_find: 100 steps on one core"``.
        style: ``"redraw"`` or ``"lines"``; default :func:`output_style` of this process.

    ``bar.comment`` (text after the counts) may be set at any time. The remaining time is
    estimated from the items after the first (which often includes a compilation).
    """

    def __init__(self, gen: Iterable, total: int | None = None, *, leave: bool = True,
                 parent: "ConsoleMasterBar | None" = None, title: str = "",
                 style: str | None = None) -> None:
        self.gen = gen
        self.total = len(gen) if total is None else int(total)  # type: ignore[arg-type]
        self.leave, self.comment = leave, ""
        self.title = title if parent is None else parent.child_title()
        self.style = style or output_style()
        if parent is not None:
            parent.child = self
        self.n, self.t0, self.t1 = 0, None, None  # t1: when the first item ended
        self.open = False  # a redrawn line is on screen without its newline
        self.done = False
        self._drawn_at, self._line_at, self._quarter, self._len = 0.0, 0.0, 0, 0
        self._last = ""  # the last line written ("lines": the final one is not repeated)

    def __len__(self) -> int:
        return self.total

    def __iter__(self) -> Iterator:
        self.update(0)
        try:
            for i, item in enumerate(self.gen):
                if i >= self.total:
                    break
                yield item
                self.update(i + 1)
        finally:  # also when the caller stops early or raises: the line still ends
            self.finish()

    def update(self, n: int) -> None:
        """Show ``n`` items done (the bar ends itself at ``total``)."""
        now = time.perf_counter()
        if self.t0 is None:
            self.t0 = self._drawn_at = now
            self._write(self._text(0, now), force=True)
        if n <= 0 or self.done:
            return
        if self.t1 is None:
            self.t1 = now
        self.n = min(int(n), self.total)
        if self.n >= self.total:
            self.finish()
            return
        quarter = 4 * self.n // max(self.total, 1)
        if self.style == "redraw":
            if now - self._drawn_at >= _REDRAW_S:
                self._write(self._text(self.n, now))
        elif quarter > self._quarter or now - self._line_at >= _LINE_S:
            self._quarter = quarter
            self._write(self._text(self.n, now))

    def on_iter_end(self) -> None:
        """fastprogress' name for :meth:`finish`."""
        self.finish()

    def finish(self) -> None:
        """Write the final state and end the line (once; nothing if never started)."""
        if self.done or self.t0 is None:
            return
        self.done = True
        now = time.perf_counter()
        if self.style == "redraw" and not self.leave:
            if self.open:
                sys.stdout.write("\r" + " " * self._len + "\r")
                sys.stdout.flush()
            self.open = False
            return
        self._write(self._text(self.n, now), force=True, end=True)

    def _text(self, n: int, now: float) -> str:
        frac = n / self.total if self.total else 1.0
        filled = int(_WIDTH * frac)
        elapsed = now - (self.t0 or now)
        left = "?"
        if n >= self.total:
            left = "00:00"
        elif n >= 2 and self.t1 is not None:
            left = _clock((now - self.t1) / (n - 1) * (self.total - n))
        elif n == 1:
            left = _clock(elapsed * (self.total - 1))
        head = f"{self.title} " if self.title else ""
        tail = f" {self.comment}" if self.comment else ""
        return (f"{head}|{'█' * filled}{'-' * (_WIDTH - filled)}| {100 * frac:.0f}% "
                f"[{n}/{self.total} {_clock(elapsed)}<{left}{tail}]")

    def _write(self, text: str, force: bool = False, end: bool = False) -> None:
        if self.style == "lines":
            self._line_at = time.perf_counter()
            if text != self._last:
                print(text, flush=True)
            self._last = text
            return
        pad = " " * max(self._len - len(text), 0)
        self._len = len(text)
        sys.stdout.write("\r" + text + pad + ("\n" if end else ""))
        sys.stdout.flush()
        self.open = not end
        self._drawn_at = time.perf_counter()

    def close_line(self) -> None:
        """End a redrawn line now (before other output); the next draw starts a new one."""
        if self.open:
            sys.stdout.write("\n")
            sys.stdout.flush()
            self.open = False


class ConsoleMasterBar:
    """The epochs of a run: iterate it, make each epoch's :class:`ConsoleBar` with
    ``parent=`` it (titled ``Epoch i/n``) and :meth:`write` result lines between them."""

    def __init__(self, gen: Iterable, total: int | None = None) -> None:
        self.gen = gen
        self.total = len(gen) if total is None else int(total)  # type: ignore[arg-type]
        self.index = 0
        self.child: ConsoleBar | None = None

    def __iter__(self) -> Iterator:
        for i, item in enumerate(self.gen):
            self.index = i
            yield item

    def child_title(self) -> str:
        return f"Epoch {self.index + 1}/{self.total}"

    def write(self, line: str) -> None:
        """Print ``line`` on a line of its own."""
        if self.child is not None:
            self.child.close_line()
        print(line, flush=True)


def _notebook_bars() -> tuple[Callable, Callable]:
    """fastprogress' widget bars, the progress bar taking a ``title`` too."""
    from fastprogress import fastprogress as fp

    class TitledBar(fp.NBProgressBar):
        def __init__(self, gen, total=None, *, title: str = "", **kwargs: Any) -> None:
            self.title = title
            super().__init__(gen, total=total, **kwargs)

        def on_update(self, val, text, interrupted=False):
            super().on_update(val, f"{self.title} {text}".strip(), interrupted)

    return fp.NBMasterBar, TitledBar


def progress_bars(console: bool = False) -> tuple[Callable, Callable]:
    """``(master_bar, progress_bar)``: widgets in a notebook, else :class:`ConsoleMasterBar`
    and :class:`ConsoleBar` (progress bars take ``title=``).

    Args:
        console: Text bars whatever the process, as an XLA replica needs (its output is
            re-printed by the process that launched it, whose style it takes); default
            False: widgets in a notebook, text bars elsewhere.
    """
    if not console and _in_notebook():
        try:
            return _notebook_bars()
        except ImportError:
            pass
    style = output_style(console)

    def bar(gen: Iterable, total: int | None = None, **kwargs: Any) -> ConsoleBar:
        kwargs.setdefault("style", style)
        return ConsoleBar(gen, total, **kwargs)

    return ConsoleMasterBar, bar


def progress_bar(total: int, *, show: bool = True, console: bool = False,
                 leave: bool = True, title: str = "") -> Any:
    """A bar over ``range(total)``; a plain ``range(total)`` when ``show`` is False.

    Args:
        total: Number of items.
        show: Draw a bar (default True).
        console: As in :func:`progress_bars` (default False).
        leave: Keep the bar on screen when it ends (default True).
        title: Words before the bar (default none).
    """
    if not show:
        return range(total)
    _, bar = progress_bars(console)
    return bar(range(total), leave=leave, title=title)


def update_bar(total: int, *, console: bool = False, title: str = "") -> Any:
    """A bar the caller advances itself (``bar.update(n)``, ``bar.comment = ...``), shown at
    0 at once and ended (its line finished) when ``n`` reaches ``total``. Needs fastprogress
    only for a notebook's widget (the cache builder runs without it: text bars then).

    Args:
        total: Number of items.
        console: As in :func:`progress_bars` (default False).
        title: Words before the bar (default none).
    """
    _, bar_cls = progress_bars(console)
    bar = bar_cls(range(total), total=total, title=title)
    bar.update(0)
    return bar
