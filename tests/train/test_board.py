"""tensorboard= (xla_utils.train.board): a fit run's event files on the torch backend, read
back with TensorBoard's own reader; per-step rows when the history has them; the option's
checks before any device time."""
from __future__ import annotations

import importlib.util

import pytest
from torch import nn

from helpers import digits_split, tiny_mlp

from xla_utils import OneCycleTrainer
from xla_utils.train.board import EpochBoard
from xla_utils.train.config import TrainerConfig

pytest.importorskip("tensorboard")


def _scalars(folder):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_fit_writes_each_epoch_grouped_as_the_plot(tmp_path):
    train, val = digits_split(n_val=64, n_train=256)
    t = OneCycleTrainer(tiny_mlp(seed=0), nn.CrossEntropyLoss(), train, val, batch_size=64,
                        epochs=2, max_lr=1e-2, checkpoint_dir=tmp_path / "ck", tensorboard=True,
                        grad_clip=1.0)
    h = t.fit()
    runs = list((tmp_path / "ck" / "tensorboard").iterdir())
    assert [p.name for p in runs] == [h.run_id]  # one folder per run
    got = _scalars(runs[0])
    for tag, key in (("loss/train_loss", "train_loss"), ("loss/val_loss", "val_loss"),
                     ("metrics/accuracy", "accuracy"), ("lr/lr_last", "lr_last"),
                     ("counts/samples", "samples"), ("counts/grad_norm", "grad_norm")):
        assert [s for s, _ in got[tag]] == [1, 2], tag
        assert [v for _, v in got[tag]] == pytest.approx([e[key] for e in h.epochs], rel=1e-6)
    # the run's per-step rows (History.steps), each at its optimizer step
    assert [s for s, _ in got["step/train_loss"]] == [r["step"] for r in h.steps]
    assert [v for _, v in got["step/train_loss"]] == pytest.approx([r["train_loss"] for r in h.steps],
                                                                   rel=1e-6)
    assert [s for s, _ in got["step/lr"]] == [r["step"] for r in h.steps] and h.steps


def test_step_rows_are_written_when_the_history_has_them(tmp_path):
    board = EpochBoard.open(tmp_path, None, "run", master=True)
    assert EpochBoard.open(tmp_path, None, "run", master=False) is None
    assert EpochBoard.open(None, tmp_path, "run", master=True) is None
    board.epoch({"epoch": 1, "train_loss": 0.5, "phase": "frozen", "accuracy": 0.75})

    class Steps:
        steps = [{"epoch": 1, "step": 1, "train_loss": 2.0, "lr": 1e-3},
                 {"epoch": 1, "step": 2, "train_loss": 1.5, "lr": 2e-3}]

    board.close(Steps())
    got = _scalars(tmp_path / "run")
    assert got["step/train_loss"] == [(1, 2.0), (2, 1.5)]
    assert [s for s, _ in got["step/lr"]] == [1, 2]
    assert got["metrics/accuracy"] == [(1, 0.75)] and "phase" not in str(got)


def test_tensorboard_option_is_checked_before_any_device_time(monkeypatch, tmp_path):
    with pytest.raises(ValueError, match="tensorboard=True writes beside the checkpoints"):
        TrainerConfig(tensorboard=True)
    with pytest.raises(ValueError, match="tensorboard must be a folder"):
        TrainerConfig(tensorboard=3)
    assert TrainerConfig(tensorboard=False).tensorboard is False
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "tensorboard" else real(name, *a))
    with pytest.raises(ImportError, match="pip install tensorboard"):
        TrainerConfig(tensorboard=tmp_path)
