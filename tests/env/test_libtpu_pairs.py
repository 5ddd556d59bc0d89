"""Tests for xla_utils.env.libtpu_pairs: the known torch_xla / libtpu pairs and the warning's text."""
from __future__ import annotations

import pytest

from xla_utils.env.libtpu_pairs import libtpu_warning


@pytest.mark.parametrize("line, libtpu", [((2, 8), "0.0.17"), ((2, 9), "0.0.21.1"), ((2, 9), "0.0.21")])
def test_known_pairs_give_no_warning(line, libtpu):
    assert libtpu_warning(f"{line[0]}.{line[1]}.0", libtpu) is None
    assert libtpu_warning(f"{line[0]}.{line[1]}.0+cpu", libtpu) is None  # a local version suffix


def test_other_libtpu_names_both_pairs_and_the_command():
    msg = libtpu_warning("2.8.0", "0.0.21.1")
    assert msg.startswith("libtpu 0.0.21.1 is installed with torch_xla 2.8.0, which is known to work "
                          "with libtpu 0.0.17 (Kaggle's TPU image forces libtpu 0.0.17")
    assert msg.endswith(": pip install libtpu==0.0.17")
    assert libtpu_warning("2.9.0", "0.0.17").endswith(": pip install libtpu==0.0.21.1")
    # a nightly is removed first: pip would otherwise keep both and torch_xla could load either
    assert libtpu_warning("2.8.0", "0.1.dev20250101", "libtpu-nightly").endswith(
        ": pip uninstall -y libtpu-nightly && pip install libtpu==0.0.17")


@pytest.mark.parametrize("torch_xla, libtpu", [
    ("2.7.0", "0.0.11"),  # a line with no known pair: nothing to say
    (None, "0.0.17"), ("2.8.0", None), ("nightly", "0.0.17"),
])
def test_nothing_known_gives_no_warning(torch_xla, libtpu):
    assert libtpu_warning(torch_xla, libtpu) is None

