"""Suggestions for typos: the one helper behind every "did you mean ...?" of xla_utils.

Option names (``build_cache(varients=2)``, ``OneCycleTrainer(batchsize=4)``,
``fit(epoch=2)``, ``--varients``), string options (``"sgdd"``, ``max_lr="fnd"``) and paths
(``build_cache("comp/Train")``, ``CachedImageDataset("cache/trian")``) are matched with
:mod:`difflib`'s ratio, so the closest candidates come first. String options are compared
after ``.strip().lower()`` everywhere (:func:`choice`): ``"AdamW "`` is ``"adamw"``. Pure
Python: imports neither torch nor numpy.
"""
from __future__ import annotations

import difflib
import functools
import inspect
import os
import sys
import warnings
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence, TypeVar

__all__ = ["closest", "did_you_mean", "by_similarity", "unknown_keywords", "keyword_help",
           "choice", "similar_path", "deprecated"]

F = TypeVar("F", bound=Callable[..., Any])

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep

CUTOFF = 0.6  # difflib's default: below this ratio a candidate is not suggested


def closest(word: str, options: Iterable[str], n: int = 3, cutoff: float = CUTOFF) -> list[str]:
    """Up to ``n`` of ``options`` similar to ``word``, the closest first (case-insensitive).

    Args:
        word: what the user typed.
        options: the valid names.
        n: most candidates returned. Default 3.
        cutoff: least similarity (0-1, :class:`difflib.SequenceMatcher` ratio). Default 0.6.

    Returns:
        The candidates as spelled in ``options``; empty when none is close.
    """
    opts = list(dict.fromkeys(str(o) for o in options))
    lower = {o.lower(): o for o in opts}
    found = difflib.get_close_matches(str(word).lower(), list(lower), n=n, cutoff=cutoff)
    return [lower[f] for f in found]


def did_you_mean(word: str, options: Iterable[str], quote: bool = True) -> str:
    """``" (did you mean 'x'?)"`` with the closest of ``options``, or ``""`` when none is close.

    Args:
        word: what the user typed.
        options: the valid names.
        quote: quote the name (``repr``); False for command-line options (``--variants``).
    """
    found = closest(word, options, n=1)
    if not found:
        return ""
    return f" (did you mean {found[0]!r}?)" if quote else f" (did you mean {found[0]}?)"


def by_similarity(word: str, options: Iterable[str]) -> list[str]:
    """Every one of ``options``, the most similar to ``word`` first (ties keep their order)."""
    opts = list(dict.fromkeys(str(o) for o in options))
    w = str(word).lower()
    score = {o: difflib.SequenceMatcher(None, w, o.lower()).ratio() for o in opts}
    return sorted(opts, key=lambda o: -score[o])


def unknown_keywords(where: str, unknown: Iterable[str], options: Iterable[str],
                     what: str = "options") -> TypeError:
    """The ``TypeError`` for unknown keyword arguments: each with its suggestion first,
    then every valid name (sorted).

    Args:
        where: the callable, e.g. ``"OneCycleTrainer()"``.
        unknown: the keywords that are not accepted.
        options: the keywords that are.
        what: how the message calls the valid names. Default ``"options"``.
    """
    opts = sorted(set(options))
    parts = [f"{k!r}{did_you_mean(k, opts)}" for k in unknown]
    s = "s" if len(parts) > 1 else ""
    return TypeError(f"{where} got unexpected keyword argument{s} {', '.join(parts)}; "
                     f"its {what} are: {', '.join(opts)}")


def keyword_help(fn: F) -> F:
    """``fn`` refusing an unknown keyword with :func:`unknown_keywords`' ``TypeError`` (its
    suggestion first: ``fit(epoch=2)`` -> did you mean 'epochs'?) instead of Python's bare one;
    its signature is unchanged (``inspect.signature``, help()). The check is one more frame:
    a warning ``fn`` aims at its caller needs ``stacklevel`` one higher."""
    params = inspect.signature(fn).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return fn  # takes any keyword: its own code judges them
    names = [n for n, p in params.items() if n != "self" and p.kind in (
        inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    where = fn.__qualname__.replace(".<locals>", "") + "()"

    @functools.wraps(fn)
    def checked(*args: Any, **kwargs: Any) -> Any:
        unknown = [k for k in kwargs if k not in params]
        if unknown:
            raise unknown_keywords(where, unknown, names, what="keywords")
        return fn(*args, **kwargs)

    return checked  # type: ignore[return-value]


def choice(value: Any, options: Sequence[str], setting: str, others: str = "") -> Any:
    """A string option as xla_utils reads every one: ``value.strip().lower()`` (case and
    surrounding spaces do not matter), refused with a suggestion when it is none of
    ``options``; a value that is not a string is returned unchanged (the caller judges it).

    Args:
        value: what the user passed.
        options: the valid strings, lower-case.
        setting: how the error names the option, e.g. ``"max_lr"``.
        others: what else the option takes, in words (``"a positive number"``), for the error.

    Raises:
        ValueError: a string none of ``options``: names the setting, the closest option and
            every valid value.
    """
    if not isinstance(value, str):
        return value
    norm = value.strip().lower()
    if norm in options:
        return norm
    valid = ", ".join(repr(o) for o in options) + (f" or {others}" if others else "")
    raise ValueError(f"{setting} must be one of {valid} (any case), got "
                     f"{value!r}{did_you_mean(norm, options)}")


def similar_path(path: str | os.PathLike, folders_only: bool = False) -> tuple[Path | None, Path]:
    """Where a path that does not exist goes wrong: ``(guess, parent)``, with ``parent`` the
    nearest existing folder above it and ``guess`` the path with the closest name at that
    level (a case slip or a near miss: ``comp/Train`` -> ``comp/train``), the rest of the
    path kept where it exists below it; ``guess`` is None when no name is close.

    Args:
        path: the missing path.
        folders_only: suggest folders only (else files too).
    """
    p = Path(path).expanduser().absolute()
    parent, missing, rest = p.parent, p.name, Path()
    while not parent.is_dir() and parent != parent.parent:
        parent, missing, rest = parent.parent, parent.name, Path(missing) / rest
    try:
        names = [e.name for e in parent.iterdir() if not e.name.startswith(".")
                 and (e.is_dir() or not folders_only)]
    except OSError:
        names = []
    close = closest(missing, names, n=1)
    if not close:
        return None, parent
    below = parent / close[0] / rest
    return (below if below.exists() else parent / close[0]), parent


def deprecated(old: str, new: str) -> None:
    """The one deprecation message of xla_utils: ``"<old> is deprecated: use <new>"``, a
    ``DeprecationWarning`` pointed at the first caller outside xla_utils (the user's line,
    however deep inside the package the old spelling was read).

    Args:
        old: what the user wrote, e.g. ``"bf16=True"``.
        new: what replaces it, e.g. ``"precision='bf16'"``.
    """
    level, frame = 1, sys._getframe(0)
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        frame, level = frame.f_back, level + 1
    warnings.warn(f"{old} is deprecated: use {new}", DeprecationWarning, stacklevel=level)
