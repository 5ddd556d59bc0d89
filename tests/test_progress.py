"""xla_utils.progress: the one place that makes fastprogress bars."""
from __future__ import annotations

from xla_utils import progress, runtime


def test_bars_follow_the_backend_and_can_be_switched_off():
    assert progress.progress_bar(3, show=False) == range(3)
    master_bar, progress_bar = progress.progress_bars(console=True)
    assert list(progress_bar(range(3), leave=False)) == [0, 1, 2]
    # runtime's public name is the same function
    assert runtime.progress_bars is progress.progress_bars
    # outside a replica on a CPU machine the backend is torch: fastprogress' own choice
    assert runtime.backend() == "torch"
    assert list(progress.progress_bar(2, leave=False)) == [0, 1]
