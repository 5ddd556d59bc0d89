"""One byte formatter: every size xla_utils prints (cache, checkpoints, memory, findings).

Imports nothing of xla_utils. (Parsing sizes such as ``"256MiB"`` is
:func:`xla_utils.cache.config.parse_bytes`.)
"""
from __future__ import annotations

__all__ = ["format_bytes"]

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


def format_bytes(n: float, unit: str | None = None) -> str:
    """``n`` bytes as text in binary units, two decimals: ``"512 B"``, ``"1.50 MiB"``,
    ``"16.00 GiB"``.

    Args:
        n: a number of bytes.
        unit: one of ``B KiB MiB GiB TiB`` to always use (two figures compared in one
            message); default None: the largest unit that ``n`` reaches (up to TiB).
    """
    if unit is None:
        unit = "B"
        for u in _UNITS[1:]:
            if abs(n) < 1024 ** _UNITS.index(u):
                break
            unit = u
    elif unit not in _UNITS:
        raise ValueError(f"unit={unit!r}: use one of {_UNITS}")
    value = n / 1024 ** _UNITS.index(unit)
    return f"{value:.0f} B" if unit == "B" else f"{value:.2f} {unit}"
