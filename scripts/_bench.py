"""Helpers shared by scripts/bench_trainer.py and scripts/bench_predict.py.

Each benchmark runs every variant in a fresh interpreter (``script --child
VARIANT ...``), which prints its measurements as one JSON line last; pairs run
back to back, alternating which goes first, and are compared by the ratio of
medians and the median of per-pair ratios. Every figure is printed with the
host's load average, because the machine may be shared.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys


def child(script: str, variant: str, *args: str) -> dict:
    """Run ``python script --child variant *args`` on XLA:CPU; its last stdout line, parsed."""
    env = dict(os.environ, PJRT_DEVICE="CPU")
    p = subprocess.run([sys.executable, script, "--child", variant, *args], capture_output=True,
                       text=True, env=env)
    if p.returncode != 0:
        raise RuntimeError(f"{variant} failed:\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def load() -> str:
    """The 1/5/15-minute load averages, as ``uptime`` shows them."""
    return "load %.2f %.2f %.2f" % os.getloadavg()


def compare(name: str, base: list[float], ours: list[float], unit: str,
            base_name: str = "hand-written") -> dict:
    """Print and return medians and overheads of ``ours`` against ``base`` (rates:
    higher is better; overhead > 0 means ours is slower)."""
    mb, mo = statistics.median(base), statistics.median(ours)
    overhead = mb / mo - 1
    paired = statistics.median(b / o - 1 for b, o in zip(base, ours))
    print(f"{name}: median {unit}: {base_name} {mb:.2f}, xla_utils {mo:.2f}; overhead "
          f"{overhead:+.1%} (ratio of medians), {paired:+.1%} (median of per-pair ratios); "
          f"{len(ours)} pairs", flush=True)
    return {"base": base, "ours": ours, "median_base": mb, "median_ours": mo,
            "overhead": overhead, "paired_overhead": paired}
