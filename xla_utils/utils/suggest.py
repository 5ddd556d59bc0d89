"""Suggestions for typos: the one helper behind every "did you mean ...?" of xla_utils.

Option names (``build_cache(varients=2)``, ``OneCycleTrainer(batchsize=4)``,
``--varients``), optimizer names (``"sgdd"``) and cache folders
(``CachedImageDataset("cache/trian")``) are matched with :mod:`difflib`'s ratio, so
the closest candidates come first. Pure Python: imports neither torch nor numpy.
"""
from __future__ import annotations

import difflib
from typing import Iterable

__all__ = ["closest", "did_you_mean", "by_similarity", "unknown_keywords"]

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
