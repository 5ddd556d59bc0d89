"""CI's own time budget, printed at the end of `.ci/run` (issue 42).

Usage: python3 .ci/budget.py TOTAL_S INSTALL_S STACK=SECONDS=JUNIT_XML [STACK=SECONDS=JUNIT_XML ...]

Prints the machine (CPU model, cores, memory: the same tree's suites took 0.65x the time on
one 2-core machine that they took on another, so a figure is read with its machine), the
whole run's wall time (builds and tests), each stack's test wall time, the 15
slowest tests of all stacks (pytest's junit XML), the tests over 20 s without the ``slow``
marker (tests/conftest.py records the marker in the XML), and a warning line when the run passed
40 minutes: the budget is 30 minutes from a fresh clone, 20 warm, and CI's hard limit 90.
Standard library only: it runs on the machine's own python3, outside the stacks.
"""
from __future__ import annotations

import os
import sys
import xml.etree.ElementTree as ET

WARN_S = 40 * 60
SLOW_S = 20  # seconds: a test over this is marked slow
SLOWEST = 15


def _mmss(s: float) -> str:
    return f"{int(s) // 60} min {int(s) % 60:02d} s"


def machine() -> str:
    """``CPU model (family F model M), N cores, G GiB``: /proc's CPU model and memory, and
    the cores this process may run on ("unknown" parts where /proc is missing)."""
    info: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                info.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    cpu = info.get("model name", "unknown CPU")
    if "cpu family" in info:
        cpu += f" (family {info['cpu family']} model {info.get('model', '?')})"
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    mem = "unknown memory"
    try:
        with open("/proc/meminfo") as f:
            kib = next(int(ln.split()[1]) for ln in f if ln.startswith("MemTotal:"))
        mem = f"{kib / 2**20:.1f} GiB"
    except (OSError, StopIteration, ValueError):
        pass
    return f"{cpu}, {cores} cores, {mem}"


def _cases(path: str):
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return []
    out = []
    for case in root.iter("testcase"):
        mod, _, cls = case.get("classname", "").partition(".Test")
        where = mod.replace(".", "/") + ".py" + (f"::Test{cls}" if cls else "")
        slow = any(prop.get("name") == "slow" for prop in case.iter("property"))
        out.append((float(case.get("time", 0)), f"{where}::{case.get('name')}", slow))
    return out


def main(argv: list[str]) -> int:
    total, install = float(argv[0]), float(argv[1])
    print("=== CI time budget ===")
    print(f"machine: {machine()}")
    print(f"whole run: {_mmss(total)} (installs and builds {_mmss(install)}, "
          f"tests {_mmss(total - install)})")
    slow = []
    for spec in argv[2:]:
        stack, took, xml = spec.split("=", 2)
        cases = _cases(xml)
        print(f"stack {stack}: tests {_mmss(float(took))} wall, {len(cases)} tests, "
              f"{_mmss(sum(c[0] for c in cases))} in tests")
        slow += [(t, stack, name, marked) for t, name, marked in cases]
    print(f"the {SLOWEST} slowest tests:")
    for t, stack, name, _ in sorted(slow, reverse=True)[:SLOWEST]:
        print(f"  {t:7.1f} s  {stack:6}  {name}")
    unmarked = sorted({name for t, _, name, marked in slow if t > SLOW_S and not marked})
    if unmarked:
        print(f"WARNING: {len(unmarked)} test(s) took over {SLOW_S} s without @pytest.mark.slow "
              "(the fast lane runs them; docs/CONTRIBUTING.md 'CI time'):")
        for name in unmarked:
            print(f"  {name}")
    if total > WARN_S:
        print(f"WARNING: CI took {_mmss(total)}, past the 40-minute line (budget: 30 min from a fresh "
              "clone, 20 warm; nothing lands past 90): share work through fixtures, mark and move "
              "tests (docs/CONTRIBUTING.md 'CI time').")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
