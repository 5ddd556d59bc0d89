"""A map-style dataset for the Ray tests, importable by Ray's worker processes (the test cluster puts
``tests/`` on their ``PYTHONPATH``): ``n`` small random images whose loading can be slowed down, so
that a test can act while a build is running."""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np


class SlowImages:
    """``n`` random 24x30 RGB images (label ``i % 2``), each taking ``delay`` seconds to load.

    With ``marks`` (a folder), a process that loads an image inside a Ray task touches
    ``marks/<its Ray node id>``: the test sees on which nodes tasks are running.
    """

    def __init__(self, n: int, delay: float = 0.0, marks: str | None = None):
        self.n, self.delay, self.marks = n, delay, marks

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[np.ndarray, int]:
        if self.marks:
            import ray

            if ray.is_initialized():
                Path(self.marks, ray.get_runtime_context().get_node_id()).touch()
        time.sleep(self.delay)
        return np.random.default_rng(i).integers(0, 256, (24, 30, 3), dtype=np.uint8), i % 2
