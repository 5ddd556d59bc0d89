"""Checkpoint files of OneCycleTrainer.fit: the disk earlier runs hold, keep_runs, and
missing paths named with what is there (plain torch on the CPU: the files are the point)."""
from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from xla_utils import OneCycleTrainer
from xla_utils.train.checkpoint import earlier_runs_note, prune_runs, run_files
from xla_utils.train.trainer import TrainerConfig


def _data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 8, generator=g)
    y = (x[:, 0] > 0).long()
    return torch.utils.data.TensorDataset(x, y)


def _fit(ckdir, capsys, resume=None, **kw):
    kw = {"epochs": 3, **kw}
    t = OneCycleTrainer(lambda: nn.Linear(8, 2), nn.CrossEntropyLoss(), _data(), batch_size=16,
                        max_lr=1e-2, checkpoint_dir=ckdir, **kw)
    h = t.fit(resume=resume)
    return t, h, capsys.readouterr().out


def _names(folder):
    return sorted(p.name for p in folder.iterdir())


def test_earlier_runs_are_reported_and_keep_runs_prunes_them(tmp_path, capsys):
    ck = tmp_path / "ck"
    _, a, out = _fit(ck, capsys)
    assert "earlier run" not in out  # a fresh folder: nothing to say
    assert _names(ck) == sorted([f"epoch_002-{a.run_id}.pt", f"epoch_003-{a.run_id}.pt", "final.pt",
                                 "history.csv", "steps.csv"])
    _, b, out = _fit(ck, capsys)
    m = re.search(r"checkpoint_dir \S+ holds 2 epoch checkpoint\(s\) of 1 earlier run\(s\), [\d.]+ KiB "
                  rf"\(newest run {a.run_id}\); they are kept \(keep_runs=None\)", out)
    assert m, out
    assert f"xla_utils.train.checkpoint.prune_runs({str(ck)!r}, keep=0)" in out
    assert list(run_files(ck)) == [a.run_id, b.run_id]  # oldest first

    _, c, out = _fit(ck, capsys, keep_runs=2, monitor="train_loss")
    assert "holds 4 epoch checkpoint(s) of 2 earlier run(s)" in out
    assert "keep_runs=2: the files of the 1 oldest run(s)" in out
    assert "keep_runs=2: deleted 2 epoch checkpoint(s) of earlier runs" in out
    assert list(run_files(ck)) == [b.run_id, c.run_id]
    assert {"final.pt", "best.pt", "history.csv"} <= set(_names(ck))

    _, d, out = _fit(ck, capsys, keep_runs=1)
    assert list(run_files(ck)) == [d.run_id]  # only this run's epoch files
    assert _names(ck) == sorted([f"epoch_002-{d.run_id}.pt", f"epoch_003-{d.run_id}.pt", "best.pt",
                                 "final.pt", "history.csv", "steps.csv"])  # best.pt of the
    # earlier run kept
    # the helper the note names, by hand: keep=0 empties the folder of epoch files only
    assert prune_runs(ck, keep=0, current=d.run_id) == []  # never the current run's
    gone = prune_runs(ck, keep=0)
    assert sorted(p.name for p in gone) == [f"epoch_002-{d.run_id}.pt", f"epoch_003-{d.run_id}.pt"]
    assert _names(ck) == ["best.pt", "final.pt", "history.csv", "steps.csv"] \
        and earlier_runs_note(ck, None) is None


def test_keep_runs_is_validated():
    assert TrainerConfig().keep_runs is None  # default: keep every run's files (and say so)
    for bad in (0, -1, True, 1.5, "2"):
        with pytest.raises(ValueError, match="keep_runs must be None .* or an int >= 1"):
            TrainerConfig(keep_runs=bad)
    with pytest.raises(ValueError, match="keep_checkpoints must be an int >= 1"):
        TrainerConfig(keep_checkpoints=0)


def test_a_missing_checkpoint_path_lists_what_is_there(tmp_path, capsys):
    ck = tmp_path / "ck"
    t, h, _ = _fit(ck, capsys)
    with pytest.raises(FileNotFoundError) as err:
        t.fit(resume=ck / "epoch_007.pt")
    msg = str(err.value)
    assert f"checkpoint {ck / 'epoch_007.pt'} does not exist; {ck} holds (newest first): " in msg
    assert f"epoch_003-{h.run_id}.pt" in msg and "final.pt" in msg and 'resume="last"' in msg
    with pytest.raises(FileNotFoundError, match=r"weights=.*nope.pt.* does not exist; .*final\.pt"):
        t.predict(_data(), weights=ck / "nope.pt")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="no readable epoch checkpoint .* holds no checkpoint"):
        t.fit(resume=empty)
    # the pre-run-id name of an existing epoch still finds the newest run's file
    t2 = OneCycleTrainer(lambda: nn.Linear(8, 2), nn.CrossEntropyLoss(), _data(), batch_size=16,
                         epochs=3, max_lr=1e-2, checkpoint_dir=ck)
    t2.fit(resume=ck / "epoch_002.pt")
    assert f"resuming from epoch_002-{h.run_id}.pt" in capsys.readouterr().out


def test_resume_goes_on_as_its_run_and_a_complete_run_trains_nothing(tmp_path, capsys):
    """A run stopped after epoch 3 of 6, resumed with resume="last": its bar counts the run's
    epochs and the note names it; resumed once more when complete, nothing runs or is written."""
    ck = tmp_path / "ck"
    _, first, _ = _fit(ck, capsys, epochs=6, keep_checkpoints=6)
    for e in (4, 5, 6):  # the run stopped during epoch 4
        (ck / f"epoch_{e:03d}-{first.run_id}.pt").unlink()
    t, resumed, out = _fit(ck, capsys, epochs=6, keep_checkpoints=6, resume="last")
    assert "Epoch 4/6 |" in out and "Epoch 6/6 |" in out and "Epoch 1/" not in out, out
    assert re.search(rf"holds 3 epoch checkpoint\(s\) of run {first.run_id}, resumed here "
                     r"\([\d.]+ KiB\)\n", out), out
    assert "earlier run" not in out
    assert resumed.run_id == first.run_id and [e["epoch"] for e in resumed.epochs] == [1, 2, 3, 4, 5, 6]
    assert resumed.epochs[:3] == first.epochs[:3]

    before = {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in ck.iterdir()}
    again = t.fit(resume="last")
    out = capsys.readouterr().out
    assert (f"run {first.run_id} is already complete: epoch_006-{first.run_id}.pt holds epoch 6 "
            "of 6. Nothing was trained and no file written") in out, out
    assert "Epoch" not in out and "global batch" not in out and "resuming run" not in out, out
    assert {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in ck.iterdir()} == before
    assert again.epochs == resumed.epochs and again.run_id == first.run_id
    assert torch.equal(t.model.weight, torch.load(ck / f"epoch_006-{first.run_id}.pt",
                                                  weights_only=False)["model"]["weight"])


def test_a_checkpoint_of_the_flat_settings_resumes(tmp_path, capsys):
    """Checkpoints store the options flat, as before the settings were grouped (37 fields,
    ``bf16`` among them): such a file resumes, and its values are still compared."""
    ck = tmp_path / "ck"
    _, first, _ = _fit(ck, capsys, epochs=2)
    path = ck / f"epoch_001-{first.run_id}.pt"
    state = torch.load(path, weights_only=False)
    old = {"batch_size": 16, "eval_batch_size": None, "epochs": 2, "max_lr": 1e-2,
           "weight_decay": 0.0, "pct_start": 0.3, "div_factor": 25.0, "final_div_factor": 1e4,
           "moms": (0.95, 0.85, 0.95), "lr_scaling": None, "bf16": False, "precision": "auto",
           "channels_last": "auto", "metrics": None, "checkpoint_dir": ck, "keep_checkpoints": 2,
           "keep_runs": None, "seed": 0, "flip": True, "mean": (0.485, 0.456, 0.406),
           "std": (0.229, 0.224, 0.225), "log_every": 20, "num_workers": None, "on_nan": "stop",
           "compile_cache": "auto", "accum_steps": 1, "ema": None, "mixup": 0.0, "cutmix": 0.0,
           "label_smoothing": 0.0, "monitor": None, "patience": None, "strategy": "spawn",
           "fsdp_wrap": None, "activation_checkpointing": False, "lr_find_on_mesh": None}
    # the same layout, less the alias, plus compile= (issue 45), the augmentation hooks,
    # grad_clip= and tensorboard= (issue 53) and checkpoint_every (issue 54; a file without
    # them resumes)
    assert set(state["config"]) == set(old) - {"bf16"} | {
        "compile", "transform", "batch_transform", "grad_clip", "tensorboard", "checkpoint_every"}
    (ck / f"epoch_002-{first.run_id}.pt").unlink()
    for batch, ok in ((32, False), (16, True)):
        state["config"] = {**old, "batch_size": batch}
        torch.save(state, path)
        if not ok:
            with pytest.raises(ValueError, match="batch_size: 32 in the checkpoint, 16 now"):
                _fit(ck, capsys, epochs=2, resume=path)
            continue
        _, resumed, out = _fit(ck, capsys, epochs=2, resume=path)
        assert f"resuming run {first.run_id} from {path.name} after epoch 1 of 2" in out, out
        assert "changed:" not in out, out
        assert [e["epoch"] for e in resumed.epochs] == [1, 2]
        assert resumed.epochs[:1] == first.epochs[:1]
