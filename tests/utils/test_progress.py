"""xla_utils.utils.progress: the one place that makes progress bars; readable in a terminal and a log."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from xla_utils.utils import progress
from xla_utils import runtime

ROOT = Path(__file__).resolve().parents[2]


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
    import io

    monkeypatch.delenv("XLA_UTILS_PROGRESS", raising=False)
    monkeypatch.setattr(sys, "stdout", io.StringIO())  # a log file: not a terminal
    assert progress.output_style() == "lines"
    monkeypatch.setenv("XLA_UTILS_OUTPUT", "redraw")  # what a launching terminal recorded
    assert progress.output_style(console=True) == "redraw"
    monkeypatch.setenv("XLA_UTILS_OUTPUT", "bogus")
    assert progress.output_style(console=True) == "lines"
    monkeypatch.setenv("XLA_UTILS_PROGRESS", "redraw")
    assert progress.output_style() == progress.output_style(console=True) == "redraw"
    monkeypatch.delenv("XLA_UTILS_PROGRESS")

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.setattr(sys, "stdout", Terminal())
    assert progress.output_style() == "redraw"
    monkeypatch.setenv("KAGGLE_KERNEL_RUN_TYPE", "Batch")  # a saved Kaggle version: its log
    assert progress.output_style() == "lines"


def test_lines_style_writes_whole_lines_only(monkeypatch, capsys):
    """In a log (stdout not a terminal): no carriage return, no stray character, every bar
    line is a complete bar line and every result is a line of its own."""
    monkeypatch.setenv("XLA_UTILS_PROGRESS", "lines")  # what a pipe or a file gets
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
    code = ("import os\nfrom xla_utils.utils import progress\n"
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

    return "from xla_utils.utils import progress\n" + textwrap.dedent(inspect.getsource(fn))


_RUN = '''
import numpy as np
import torch
from torch import nn

import xla_utils
from xla_utils import CachedImageDataset, OneCycleTrainer, build_cache

rng = np.random.default_rng(0)
items = []
for i in range(48):
    img = rng.integers(0, 100, (20, 24, 3), dtype=np.uint8)
    img[..., i % 3] = 250
    items.append((img, i % 3))
build_cache(items[:36], WORK + "/train", size=16, variants=1, workers=1)
build_cache(items[36:], WORK + "/val", size=16, variants=1, workers=1)
train, val = CachedImageDataset(WORK + "/train"), CachedImageDataset(WORK + "/val")


def net():
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                         nn.Flatten(), nn.Linear(8, 3))


trainer = OneCycleTrainer(net, nn.CrossEntropyLoss(), train, val, batch_size=4, epochs=2,
                          max_lr=1e-2)
history = trainer.fit(simulate=2)
print("RESULT history", {"loss": round(history[-1]["train_loss"], 3), "epochs": len(history)})
report = trainer.check(measure_loader=False)
preds = trainer.predict(val, simulate=2)
print("RESULT preds", preds.shape)
'''


@pytest.mark.multicore
@pytest.mark.timeout(600)
def test_a_run_logged_through_a_pipe_reads_line_by_line(tmp_path):
    """The issue-36 log: a script (cache build, fit on 2 simulated cores, check, predict) whose
    stdout is a pipe. Every line of the log is whole: a bar line (no stray fill character,
    no carriage return, its own line), or text that starts at the line's start; every bar
    ends at its total; the script's results are lines of their own."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), PJRT_DEVICE="CPU")
    env.pop("XLA_UTILS_PROGRESS", None)
    code = f"WORK = {str(tmp_path)!r}\n" + _RUN
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=540)
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = proc.stdout
    assert "\r" not in log and log.endswith("\n")
    lines = log.splitlines()
    import re

    bar = re.compile(r"(?P<title>[^|]*?) ?\|(?P<fill>[█-]{25})\| \d+% \[(?P<n>\d+)/(?P<total>\d+) "
                     r"\d\d:\d\d<(\d\d:\d\d|\?)( [^\]]*)?\]")
    bars: dict[str, list[tuple[int, int]]] = {}
    for ln in lines:
        m = bar.fullmatch(ln)
        if m:
            bars.setdefault(m["title"], []).append((int(m["n"]), int(m["total"])))
        else:  # no bar piece glued to other text
            assert "█" not in ln and "|-" not in ln and "-|" not in ln, ln
    titles = set(bars)
    assert {"Epoch 1/2", "Epoch 2/2", "check: 4 training steps on one XLA:CPU device",
            "predict: 12 samples x 1 view on 2 cores"} <= titles, titles
    assert any(t.startswith("build_cache: 12 images on ") for t in titles), titles  # the builder's
    for title, states in bars.items():
        assert states[-1][0] == states[-1][1], (title, states)  # each bar ends at its total
    results = [ln for ln in lines if ln.startswith("RESULT")]
    assert results == ["RESULT history {'loss': %s, 'epochs': 2}" % results[0].split("'loss': ")[1]
                       .split(",")[0], "RESULT preds (12, 3)"], results
    assert any(ln.startswith("xla_utils.check for TPU v5e: READY") for ln in lines), log
    assert any(ln.startswith("epoch 2  train_loss") for ln in lines), log
