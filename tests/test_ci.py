""".ci/budget.py, the time account that ends `.ci/run` (issue 42): the machine, the whole run
split into builds and tests, each stack's wall time, the slowest tests of both stacks, the tests over
20 s without the ``slow`` marker, and the warning past 40 minutes."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# pytest's junit XML (junit_family xunit2), as tests/conftest.py marks a slow test
JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" tests="3">
<testcase classname="tests.train.test_trainer" name="test_fit" time="31.5">
<properties><property name="slow" value="1" /></properties></testcase>
<testcase classname="tests.test_docs" name="test_links" time="{docs}" />
<testcase classname="tests.cache.test_cache.TestShards" name="test_one[x]" time="0.25" />
</testsuite></testsuites>"""


def _budget(tmp_path, total_s: int, docs_s: float) -> str:
    colab, kaggle = tmp_path / "colab.xml", tmp_path / "kaggle.xml"
    colab.write_text(JUNIT.format(docs=docs_s))
    kaggle.write_text(JUNIT.format(docs=1.0).replace("test_fit", "test_resume"))
    p = subprocess.run([sys.executable, str(ROOT / ".ci" / "budget.py"), str(total_s), "300",
                        f"colab=700={colab}", f"kaggle=650={kaggle}", f"broken=1={tmp_path / 'none.xml'}"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    return p.stdout


def test_the_account_names_times_and_the_slowest_tests(tmp_path):
    out = _budget(tmp_path, 1500, 2.0)
    assert "whole run: 25 min 00 s (installs and builds 5 min 00 s, tests 20 min 00 s)" in out
    assert "stack colab: tests 11 min 40 s wall, 3 tests" in out
    assert "stack broken: tests 0 min 01 s wall, 0 tests" in out  # a stack that wrote no XML
    lines = out.splitlines()
    first = lines.index("the 15 slowest tests:")
    top = " ".join(lines[first + 1:first + 3])  # both stacks' 31.5 s tests come first
    assert "colab   tests/train/test_trainer.py::test_fit" in top
    assert "kaggle  tests/train/test_trainer.py::test_resume" in top
    assert "tests/cache/test_cache.py::TestShards::test_one[x]" in out
    assert "WARNING" not in out
    machine = lines[1]  # right under the heading: the figures below are this machine's
    assert lines[0] == "=== CI time budget ===" and machine.startswith("machine: ")
    assert machine.endswith(" GiB") and f", {len(os.sched_getaffinity(0))} cores, " in machine


def test_a_slow_test_without_the_marker_and_a_long_run_are_warned(tmp_path):
    out = _budget(tmp_path, 41 * 60, 25.0)
    assert "WARNING: 1 test(s) took over 20 s without @pytest.mark.slow" in out
    assert "  tests/test_docs.py::test_links" in out
    assert "test_fit" not in out.split("without @pytest.mark.slow")[1]  # marked: not named
    assert "WARNING: CI took 41 min 00 s, past the 40-minute line" in out
