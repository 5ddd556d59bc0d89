"""xla_utils.progress: the one place that makes fastprogress bars."""
from __future__ import annotations

from xla_utils import progress, runtime


def test_bars_can_be_switched_off_and_forced_to_console():
    assert progress.progress_bar(3, show=False) == range(3)
    _, console_bar = progress.progress_bars(console=True)
    assert list(console_bar(range(3), leave=False)) == [0, 1, 2]
    assert list(progress.progress_bar(2, console=True, leave=False)) == [0, 1]
    # outside a replica on a CPU machine the backend is torch: fastprogress' own bars
    assert runtime.backend() == "torch"
    assert runtime.progress_bars() == progress.progress_bars()
