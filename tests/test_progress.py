"""xla_utils.progress: the one place that makes progress bars; readable in a terminal and a log."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from xla_utils import progress, runtime

ROOT = Path(__file__).resolve().parents[1]


def _bars() -> None:
    """What the package's bars do in a run: epochs with results between them, a titled
    bar, a bar the caller advances, one left early."""
    master_bar, progress_bar = progress.progress_bars()
    mb = master_bar(range(2))
    for epoch in mb:
        pb = progress_bar(range(5), parent=mb)
        for i in pb:
            pb.comment = f"loss {i}"
        mb.write(f"epoch {epoch + 1}  train_loss 0.5")
    for _ in progress.progress_bar(3, title="lr_find: 3 steps x 8 micro-batches on one core"):
        pass
    bar = progress.update_bar(10)
    bar.update(4)
    bar.update(10)
    print({"loss": 1.07})
    for i in progress.progress_bar(4, title="early"):
        if i == 1:
            break
    print("after break")


def test_bars_can_be_switched_off_and_forced_to_console():
    assert progress.progress_bar(3, show=False) == range(3)
    _, console_bar = progress.progress_bars(console=True)
    assert list(console_bar(range(3), leave=False)) == [0, 1, 2]
    assert list(progress.progress_bar(2, console=True, leave=False)) == [0, 1]
    # outside a replica on a CPU machine the backend is torch: this process's own bars
    assert runtime.backend() == "torch"
    assert isinstance(runtime.progress_bars()[1](range(1)), progress.ConsoleBar)


def test_style_follows_the_output_and_can_be_forced(monkeypatch):
    monkeypatch.delenv("XLA_UTILS_PROGRESS", raising=False)
    assert progress.output_style() == "lines"  # pytest captures stdout: not a terminal
    monkeypatch.setenv("XLA_UTILS_OUTPUT", "redraw")  # what a launching terminal recorded
    assert progress.output_style(console=True) == "redraw"
    monkeypatch.setenv("XLA_UTILS_OUTPUT", "bogus")
    assert progress.output_style(console=True) == "lines"
    monkeypatch.setenv("XLA_UTILS_PROGRESS", "redraw")
    assert progress.output_style() == progress.output_style(console=True) == "redraw"


def test_lines_style_writes_whole_lines_only(capsys):
    """In a log (stdout not a terminal): no carriage return, no stray character, every bar
    line is a complete bar line and every result is a line of its own."""
    _bars()
    out = capsys.readouterr().out
    assert "\r" not in out and out.endswith("after break\n")
    lines = out.splitlines()
    results = ["epoch 1  train_loss 0.5", "epoch 2  train_loss 0.5", "{'loss': 1.07}", "after break"]
    assert [ln for ln in lines if "|" not in ln] == results
    bar = r"(.* )?\|[█-]{25}\| \d+% \[\d+/\d+ \d\d:\d\d<(\d\d:\d\d|\?)( .*)?\]"
    import re

    assert all(re.fullmatch(bar, ln) for ln in lines if "|" in ln), lines
    # each bar starts at 0 and ends at its total (or where it was left), once
    assert lines[0].startswith("Epoch 1/2 |") and "[0/5 " in lines[0]
    assert lines[lines.index(results[0]) - 1].startswith("Epoch 1/2 |█") and "[5/5 " in \
        lines[lines.index(results[0]) - 1]
    assert sum("[3/3 " in ln and ln.startswith("lr_find: 3 steps") for ln in lines) == 1
    assert lines[-2].startswith("early |") and "[1/4 " in lines[-2]


def test_redraw_style_ends_every_bar_with_a_newline(monkeypatch, capsys):
    monkeypatch.setenv("XLA_UTILS_PROGRESS", "redraw")
    _bars()
    out = capsys.readouterr().out
    # the results never share a line with a bar: each follows a newline
    for result in ("epoch 1  train_loss 0.5\n", "{'loss': 1.07}\n", "after break\n"):
        at = out.index(result)
        assert out[at - 1] == "\n", repr(out[at - 40:at + len(result)])
    # what is on screen at the end: every line a bar's final state or a result
    screen = [ln.rsplit("\r", 1)[-1].rstrip() for ln in out.split("\n")]
    assert "█" not in "".join(ln for ln in screen if "|" not in ln)  # no stray fill character
    assert any(ln.startswith("Epoch 2/2 |█") and "[5/5 " in ln for ln in screen)


@pytest.mark.timeout(120)
def test_a_piped_script_logs_whole_lines():
    """A script whose stdout is a pipe (a log file, `| tee`, a Kaggle log) gets "lines"
    bars, also from a replica it launches (the style travels in XLA_UTILS_OUTPUT)."""
    code = ("import os\nfrom xla_utils import progress\n"
            "print('own:', progress.output_style(), 'replica:', progress.output_style(console=True))\n"
            f"exec(compile({_source(_bars)!r}, 'bars', 'exec'))\n_bars()\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("XLA_UTILS_PROGRESS", None)
    env["XLA_UTILS_OUTPUT"] = "redraw"  # inherited from a terminal parent: overridden at import
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=100, check=True).stdout
    assert out.splitlines()[0] == "own: lines replica: lines" and "\r" not in out


def _source(fn) -> str:
    import inspect
    import textwrap

    return "from xla_utils import progress\n" + textwrap.dedent(inspect.getsource(fn))
