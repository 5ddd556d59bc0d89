"""xla_utils.utils.units.format_bytes: the one byte formatter."""
from __future__ import annotations

import pytest

from xla_utils.utils.units import format_bytes


def test_the_largest_unit_reached_two_decimals():
    assert [format_bytes(n) for n in (0, 512, 1023)] == ["0 B", "512 B", "1023 B"]
    assert format_bytes(1536) == "1.50 KiB"
    assert format_bytes(534.21 * 2**20) == "534.21 MiB"
    assert format_bytes(16 * 2**30) == "16.00 GiB"
    assert format_bytes(3 * 2**40) == "3.00 TiB" and format_bytes(2**50) == "1024.00 TiB"


def test_a_fixed_unit_for_figures_compared_in_one_message():
    assert format_bytes(2**31, "GiB") == "2.00 GiB"
    assert format_bytes(2**29, "GiB") == "0.50 GiB"
    assert format_bytes(40 * 2**10, "MiB") == "0.04 MiB"
    with pytest.raises(ValueError, match="unit='GB'"):
        format_bytes(1, "GB")
