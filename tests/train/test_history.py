"""History (moved to xla_utils.train.history): CSV, plot, history.csv beside the checkpoints,
and the best epoch (monitor=, patience=, best.pt) on XLA:CPU, 1 core and simulated cores."""
from __future__ import annotations

import csv
import math

import pytest
import torch
from torch import nn

from helpers import digits_split, tiny_mlp

from xla_utils import OneCycleTrainer
from xla_utils.train.history import BestTracker, History, write_csv_atomic
from xla_utils.train.trainer import TrainerConfig


def _history(records):
    return History(epochs=records, world_size=1, global_batch=8, base_lr=1e-3, max_lr=1e-3,
                   lr_scaling="sqrt", lr_note="sqrt scaling", backend="xla")


def test_history_still_importable_from_trainer():
    from xla_utils.train import trainer

    assert trainer.History is History


def test_history_as_a_cells_last_expression_shows_its_table():
    """A notebook shows ``history`` (the last expression of a cell) through IPython's display
    formatter: an HTML table, and as text the table ``print(history)`` gives, no field dump."""
    from IPython.core.formatters import DisplayFormatter

    h = _history([{"epoch": 1, "train_loss": 1.5, "val_loss": 1.2, "accuracy": 0.5},
                  {"epoch": 2, "train_loss": 0.5, "val_loss": 0.7, "accuracy": 0.9}])
    h.state_dict = {"w": torch.zeros(64, 64)}
    h.best_epoch, h.best_score, h.monitor = 2, 0.9, "accuracy"
    shown, _ = DisplayFormatter().format(h)
    assert shown["text/plain"] == str(h)
    assert "epoch  train_loss" in shown["text/plain"] and "tensor" not in shown["text/plain"]
    page = shown["text/html"]
    assert page.count("<tr>") == 3 and "<th>accuracy</th>" in page and "<td>0.9</td>" in page
    assert "best epoch 2 (accuracy 0.9)" in page and "tensor" not in page
    assert "(no epochs)" in _history([])._repr_html_()


def test_to_csv_union_of_keys_and_atomic(tmp_path):
    h = _history([{"epoch": 1, "train_loss": 1.5, "lr_last": 1e-3},
                  {"epoch": 2, "train_loss": 0.5, "val_loss": 0.7, "accuracy": 0.9}])
    path = h.to_csv(tmp_path / "sub" / "h.csv")
    rows = list(csv.DictReader(path.open()))
    assert list(rows[0]) == ["epoch", "train_loss", "lr_last", "val_loss", "accuracy"]
    assert rows[0]["val_loss"] == "" and float(rows[1]["accuracy"]) == 0.9
    assert [p.name for p in path.parent.iterdir()] == ["h.csv"]  # no temporary file left
    # a failed write leaves the old file whole
    class Bad:
        def __str__(self):
            raise RuntimeError("unprintable")

    with pytest.raises(RuntimeError):
        write_csv_atomic([{"epoch": 1, "x": Bad()}], path)
    assert list(csv.DictReader(path.open())) == rows
    assert [p.name for p in path.parent.iterdir()] == ["h.csv"]


def test_plot_draws_each_kind_of_value_on_its_own_axis(tmp_path):
    """Losses, metrics (0..1), LRs, and counts and timings (``samples`` 80, ``compiles``,
    ``seconds``, the gradient norms, ...) each on their own axis: no count on the metrics'."""
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    h = _history([{"epoch": e, "train_loss": 2.0 / e, "val_loss": 2.2 / e, "accuracy": 0.3 * e,
                   "top5": 0.9, "samples": 80, "lr_max": 1e-2, "lr_last": 1e-3 / e,
                   "images_per_s": 5000.0, "compiles": 7, "host_reads_per_step": 1.0,
                   "seconds": 0.5, "grad_norm": 0.4, "clipped_steps": 0, "phase": "frozen",
                   "auc": 0.7}
                  for e in (1, 2, 3)])
    h.monitor, h.best_epoch, h.best_score = "accuracy", 3, 0.9
    fig = h.plot(tmp_path / "h.png")
    assert (tmp_path / "h.png").stat().st_size > 1000
    labels = [[l.get_label() for l in ax.get_lines()] for ax in fig.axes]
    assert labels[0][:2] == ["train_loss", "val_loss"]
    assert labels[1] == ["accuracy", "top5", "auc", "best (accuracy)"]
    assert labels[2][:2] == ["lr_last", "lr_max"]
    assert labels[3] == ["samples", "images_per_s", "compiles", "host_reads_per_step", "seconds",
                         "grad_norm", "clipped_steps"]
    assert [ax.get_title() for ax in fig.axes] == ["loss", "validation metrics", "learning rate",
                                                   "counts and timings"]
    with pytest.raises(ValueError, match="no epochs"):
        _history([]).plot()


def test_plot_without_matplotlib_names_the_install(monkeypatch):
    import builtins

    real = builtins.__import__

    def no_mpl(name, *a, **k):
        if name.startswith("matplotlib"):
            raise ImportError(name)
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_mpl)
    with pytest.raises(ImportError, match="pip install matplotlib"):
        _history([{"epoch": 1, "train_loss": 1.0}]).plot()


def test_monitor_and_patience_refused_up_front():
    with pytest.raises(ValueError, match="monitor='acc'.*'accuracy'"):
        TrainerConfig(monitor="acc")
    with pytest.raises(ValueError, match="patience= needs monitor="):
        TrainerConfig(patience=2)
    with pytest.raises(ValueError, match="patience must be an int >= 1"):
        TrainerConfig(monitor="val_loss", patience=0)
    assert TrainerConfig(monitor="Top3").checkpoints.monitor == "top3"
    train, val = digits_split()
    with pytest.raises(ValueError, match="no val_data"):
        OneCycleTrainer(tiny_mlp(), nn.CrossEntropyLoss(), train, monitor="accuracy").fit()
    with pytest.raises(ValueError, match="not among this run's validation metrics"):
        OneCycleTrainer(tiny_mlp(), nn.CrossEntropyLoss(), train, val, monitor="f1").fit()
    with pytest.raises(ValueError, match="not among"):
        OneCycleTrainer(tiny_mlp(), nn.CrossEntropyLoss(), train, val, metrics=["accuracy"],
                        monitor="top5").fit()


def test_best_tracker_modes_and_patience():
    t = BestTracker("val_loss", patience=2)
    for e, v in enumerate([1.0, 0.8, 0.9, math.nan, 0.85], 1):
        t.improved({"epoch": e, "val_loss": v})
        stop = t.should_stop(e)
    assert (t.best_epoch, t.best_score) == (2, 0.8) and stop
    assert "did not improve for 3 epoch(s) (patience=2)" in t.stop_reason
    a = BestTracker("accuracy")
    for e, v in enumerate([0.5, 0.7, 0.6], 1):
        a.improved({"epoch": e, "accuracy": v})
        assert not a.should_stop(e)
    assert a.best_epoch == 2


@pytest.mark.parametrize("simulate", [1, pytest.param(2, marks=pytest.mark.multicore)])
@pytest.mark.timeout(300)
def test_best_epoch_kept_and_early_stop_on_xla(tmp_path, simulate):
    """A too-high LR late in the run: the best epoch's weights come back, best.pt holds
    them, history.csv has every epoch, the stop is recorded; no compile after epoch 1."""
    train, val = digits_split()
    ckpt = tmp_path / "ckpt"
    t = OneCycleTrainer(tiny_mlp, nn.CrossEntropyLoss(), train, val, batch_size=16 // simulate,
                        epochs=6, max_lr=0.3, optimizer="sgd", lr_scaling="none", seed=2,
                        pct_start=0.9, monitor="val_loss", patience=1, checkpoint_dir=ckpt)
    h = t.fit(simulate=simulate)
    losses = [e["val_loss"] for e in h.epochs]
    assert h.best_epoch == 1 + losses.index(min(losses)) and h.best_score == min(losses)
    assert h.world_size == simulate
    if len(h) < 6:
        assert h.stop_reason.startswith("early stop after epoch") and len(h) == h.best_epoch + 1
    else:
        assert h.stop_reason is None
    assert len({e["compiles"] for e in h.epochs}) == 1, h
    best = torch.load(ckpt / "best.pt")
    for k, v in h.state_dict.items():
        torch.testing.assert_close(best[k], v)
        torch.testing.assert_close(t.model.state_dict()[k], v)
    rows = list(csv.DictReader((ckpt / "history.csv").open()))
    assert [int(r["epoch"]) for r in rows] == [e["epoch"] for e in h.epochs]
    assert float(rows[0]["val_loss"]) == pytest.approx(losses[0])
    # the best epoch's weights: evaluating them gives the best val_loss again
    again = t.evaluate(val, simulate=simulate)
    assert again["loss"] == pytest.approx(h.best_score, rel=1e-4)
