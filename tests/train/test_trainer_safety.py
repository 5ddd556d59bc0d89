"""No silent wrong results in OneCycleTrainer (issue 10): labels, divergence,
checkpoint rotation, resume with a changed configuration, corrupt checkpoints,
optimizer names, a second fit, tiny datasets."""
from __future__ import annotations

import copy
import math
import re
import warnings

import numpy as np
import pytest
import torch
from torch import nn

from helpers import digits_split, tiny_mlp

from xla_utils import OneCycleTrainer, debug_run, lr_find
from xla_utils.step.optim import Adam, make_optimizer, resolve_optimizer
from xla_utils.train.trainer import CheckpointError, ResumeError, TrainerConfig


def _cache(tmp_path, n: int = 12, classes: int = 3, name: str = "cache"):
    """A real cache of rendered images: class c has a bright channel c."""
    from xla_utils import CachedImageDataset, build_cache

    rng = np.random.default_rng(0)
    items = []
    for i in range(n):
        img = rng.integers(0, 120, (20, 20, 3), dtype=np.uint8)
        img[..., i % 3] = 255
        items.append((img, i % classes))
    build_cache(items, tmp_path / name, size=16, variants=1, verbose=False)
    return CachedImageDataset(tmp_path / name)


def _conv(out: int):
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                         nn.Flatten(), nn.Linear(4, out))


class _Pairs(torch.utils.data.Dataset):
    """A map-style dataset with no label array: targets only via __getitem__."""

    def __init__(self, x, y):
        self.x, self.y = x, y

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], int(self.y[i])


def _ckpts(d, run_id=None):
    pat = "epoch_*.pt" if run_id is None else f"epoch_*-{run_id}.pt"
    return sorted(p.name for p in d.glob(pat))


# ----------------------------------------------------------------------------- 1: labels
def test_out_of_range_label_in_tensor_dataset_is_named_before_training():
    train, _ = digits_split()
    t = OneCycleTrainer(tiny_mlp(3), nn.CrossEntropyLoss(), train, batch_size=32)
    before = copy.deepcopy(t.model.state_dict())
    with pytest.raises(ValueError) as info:
        t.fit()
    msg = str(info.value)
    first_bad = int(np.argmax(train.tensors[1].numpy() >= 3))
    label = int(train.tensors[1][first_bad])
    assert f"label {label} at sample {first_bad}" in msg
    assert "3 outputs" in msg and "train_data" in msg and "num_classes=10" in msg
    for k, v in before.items():
        assert torch.equal(t.model.state_dict()[k], v)


def test_out_of_range_label_found_by_scanning_a_dataset_without_label_array():
    train, _ = digits_split(n_train=200)
    x, y = train.tensors
    y = y.clone() % 4
    y[150] = 7  # beyond the model's 4 outputs
    ds = _Pairs(x, y)
    with pytest.raises(ValueError, match=r"label 7 at sample 150 is outside the model's 4 outputs"):
        OneCycleTrainer(tiny_mlp(4), nn.CrossEntropyLoss(), ds, batch_size=16).fit()
    # ignore_index of the loss is a legal target
    y[150] = -100
    h = OneCycleTrainer(tiny_mlp(4), nn.CrossEntropyLoss(), _Pairs(x, y), batch_size=64).fit()
    assert len(h) == 1


@pytest.mark.timeout(300)
def test_cached_labels_beyond_the_model_refused_under_simulate_and_debug(tmp_path):
    ds = _cache(tmp_path, classes=3)
    t = OneCycleTrainer(_conv(2), nn.CrossEntropyLoss(), ds, batch_size=2)
    for kwargs in ({"simulate": 2}, {"debug": True}):
        with pytest.raises(ValueError, match=r"label 2 at sample 2 is outside the model's 2 outputs"
                                             r".*train_data has 3 classes.*num_classes=3"):
            t.fit(**kwargs)
    with pytest.raises(ValueError, match="label 2 at sample 2"):
        debug_run(_conv(2), nn.CrossEntropyLoss(), ds, batch_size=2, print_report=False)
    # validation data is checked too
    t = OneCycleTrainer(_conv(3), nn.CrossEntropyLoss(), ds, _cache(tmp_path, 6, 5, "v5"),
                        batch_size=2)
    with pytest.raises(ValueError, match=r"val_data: label [34] at sample [34]"):
        t.fit(simulate=2)


def test_multilabel_width_and_model_wider_than_classes():
    x = torch.rand(64, 8)
    y = (torch.rand(64, 5) > 0.5).float()
    ds = torch.utils.data.TensorDataset(x, y)
    with pytest.raises(ValueError, match="multi-label targets of width 5 but the model outputs 4"):
        OneCycleTrainer(nn.Linear(8, 4), nn.BCEWithLogitsLoss(), ds, batch_size=16).fit()


# ----------------------------------------------------------------------------- 2: divergence
def _nan_after(n_calls: int):
    calls = {"n": 0}

    def step(model, batch, loss_fn):
        calls["n"] += 1
        x, y = batch
        loss = loss_fn(model(x), y)
        return loss * float("nan") if calls["n"] > n_calls else loss

    return step


def test_nan_loss_stops_and_keeps_last_finite_epoch(tmp_path):
    train, val = digits_split(n_train=640)  # 10 steps of 64
    ck = tmp_path / "ck"
    t = OneCycleTrainer(tiny_mlp, nn.CrossEntropyLoss(), train, val, batch_size=64, epochs=4,
                        max_lr=1e-2, checkpoint_dir=str(ck), keep_checkpoints=1, log_every=3,
                        train_step=_nan_after(14))  # NaN from epoch 2, step 5
    with pytest.warns(RuntimeWarning, match=r"train_loss became nan in epoch 2 by step 6/10"):
        h = t.fit()
    assert [e["epoch"] for e in h.epochs] == [1]
    assert h.stop_reason and "on_nan='stop'" in h.stop_reason and "epoch 1" in h.stop_reason
    assert "lower max_lr" in h.stop_reason and "STOPPED" in str(h)
    weights = t.model.state_dict()
    assert all(torch.isfinite(v).all() for v in weights.values())
    # the caller's model holds epoch 1's weights, as does the only checkpoint
    assert _ckpts(ck) == [f"epoch_001-{h.run_id}.pt"] and not (ck / "final.pt").exists()
    saved = torch.load(ck / f"epoch_001-{h.run_id}.pt", weights_only=False)["model"]
    for k, v in saved.items():
        assert torch.equal(weights[k], v)


def test_nan_in_first_epoch_leaves_model_untouched_and_continue_mode_keeps_good_ckpt(tmp_path):
    train, _ = digits_split(n_train=640)
    t = OneCycleTrainer(tiny_mlp, nn.CrossEntropyLoss(), train, batch_size=64, epochs=2,
                        train_step=_nan_after(2), log_every=100)
    before = copy.deepcopy(t.model.state_dict())
    with pytest.warns(RuntimeWarning, match=r"epoch 1 by step 10/10.*is unchanged"):
        h = t.fit()
    assert h.epochs == [] and h.state_dict == {} and h.stop_reason
    for k, v in before.items():
        assert torch.equal(t.model.state_dict()[k], v)

    ck = tmp_path / "ck"
    t = OneCycleTrainer(tiny_mlp, nn.CrossEntropyLoss(), train, batch_size=64, epochs=3,
                        checkpoint_dir=str(ck), keep_checkpoints=1, on_nan="continue",
                        train_step=_nan_after(12))
    with pytest.warns(RuntimeWarning, match="on_nan='continue'"):
        h = t.fit()
    assert len(h) == 3 and h.stop_reason is None
    assert math.isfinite(h[0]["train_loss"]) and math.isnan(h[2]["train_loss"])
    # the non-finite epochs 2 and 3 never rotated out the good epoch 1
    assert _ckpts(ck) == [f"epoch_001-{h.run_id}.pt"]


def _runtime_warnings(record) -> list[str]:
    return [str(w.message) for w in record if issubclass(w.category, RuntimeWarning)]


def test_exploding_validation_loss_stops_and_keeps_the_last_good_epoch(tmp_path, capsys):
    """Epoch 2's validation loss blows up (not NaN): the run stops there as on a NaN,
    trainer.model keeps epoch 1's weights (as its checkpoint does), no checkpoint is
    written for epoch 2, and it is said once."""
    train, val = digits_split(n_train=640)
    calls = {"n": 0}

    def eval_step(model, batch):
        calls["n"] += len(batch[0]) > 2  # not the 2-sample forward of the label check
        out = model(batch[0])
        return out * 1e4 if calls["n"] > 6 else out  # epoch 2's validation blows up

    ck = tmp_path / "ck"
    t = OneCycleTrainer(tiny_mlp, nn.CrossEntropyLoss(), train, val, batch_size=64, epochs=3,
                        eval_step=eval_step, checkpoint_dir=str(ck))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        h = t.fit()
    msgs = _runtime_warnings(record)
    assert len(msgs) == 1 and msgs[0] == h.stop_reason, msgs
    assert re.match(r"val_loss \S+ at epoch 2 is [\d,.]+x the untrained model's loss at the first "
                    r"step \(\S+\): training is diverging\. Training stopped \(on_nan='stop'",
                    msgs[0]), msgs[0]
    assert "keeps the weights of epoch 1" in msgs[0] and "no checkpoint was written for epoch 2" in msgs[0]
    assert msgs[0] not in capsys.readouterr().out  # said once: the warning, no print as well
    assert [e["epoch"] for e in h.epochs] == [1, 2] and "STOPPED" in str(h)
    assert _ckpts(ck) == [f"epoch_001-{h.run_id}.pt"] and not (ck / "final.pt").exists()
    saved = torch.load(ck / f"epoch_001-{h.run_id}.pt", weights_only=False)["model"]
    assert all(torch.equal(t.model.state_dict()[k], v) for k, v in saved.items())


@pytest.mark.parametrize("simulate", [None, pytest.param(2, marks=pytest.mark.multicore)])
@pytest.mark.timeout(300)
def test_exploding_run_stops_or_goes_on_as_asked(simulate, capsys):
    """A tiny model at a huge max_lr: its epoch-1 losses end far above the untrained
    model's (finite, no NaN). on_nan="stop" ends the run there with the model untouched;
    on_nan="continue" trains every epoch and says so once."""
    train, val = digits_split(n_train=640)
    kw = dict(batch_size=64 if simulate is None else 32, epochs=3, max_lr=100.0, optimizer="sgd")
    t = OneCycleTrainer(tiny_mlp, nn.CrossEntropyLoss(), train, val, **kw)
    before = copy.deepcopy(t.model.state_dict())
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        h = t.fit(simulate=simulate, timeout=240)
    msgs = _runtime_warnings(record)
    assert len(msgs) == 1 and "x the untrained model's loss" in msgs[0], msgs
    assert "at epoch 1" in msgs[0] and "is unchanged (no epoch ended good)" in msgs[0]
    assert [e["epoch"] for e in h.epochs] == [1] and h.stop_reason == msgs[0]
    assert h.state_dict == {} and all(torch.equal(t.model.state_dict()[k], v)
                                      for k, v in before.items())
    capsys.readouterr()

    t = OneCycleTrainer(tiny_mlp, nn.CrossEntropyLoss(), train, val, on_nan="continue", **kw)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        h = t.fit(simulate=simulate, timeout=240)
    msgs = _runtime_warnings(record)
    assert len(msgs) == 1 and "Training goes on (on_nan='continue')" in msgs[0], msgs
    assert len(h) == 3 and h.stop_reason is None
    assert capsys.readouterr().out.count("training is diverging") == 1  # printed when it happened


@pytest.mark.multicore
@pytest.mark.timeout(300)
def test_simulated_cores_all_stop_at_the_same_nan_step():
    train, _ = digits_split(n_train=512)
    t = OneCycleTrainer(tiny_mlp, nn.CrossEntropyLoss(), train, batch_size=32, epochs=3,
                        max_lr=1e-2, log_every=2, train_step=_nan_after(0))
    with pytest.warns(RuntimeWarning, match=r"epoch 1 by step 2/8"):
        h = t.fit(simulate=2, timeout=240)
    assert h.world_size == 2 and h.epochs == [] and "on_nan='stop'" in h.stop_reason


# ----------------------------------------------------------------------------- 4: rotation
def test_rerun_into_same_dir_keeps_both_runs_newest_files(tmp_path):
    train, _ = digits_split(n_train=256)
    ck = tmp_path / "ck"
    kw = dict(batch_size=64, checkpoint_dir=str(ck), seed=1)
    first = OneCycleTrainer(tiny_mlp, nn.CrossEntropyLoss(), train, epochs=5, **kw).fit()
    second = OneCycleTrainer(tiny_mlp, nn.CrossEntropyLoss(), train, epochs=2, **kw).fit()
    assert first.run_id != second.run_id
    assert _ckpts(ck, first.run_id) == [f"epoch_004-{first.run_id}.pt", f"epoch_005-{first.run_id}.pt"]
    assert _ckpts(ck, second.run_id) == [f"epoch_001-{second.run_id}.pt",
                                         f"epoch_002-{second.run_id}.pt"]
    # a legacy file of no run is never touched
    (ck / "epoch_009.pt").write_bytes(b"legacy")
    third = OneCycleTrainer(tiny_mlp, nn.CrossEntropyLoss(), train, epochs=3, keep_checkpoints=1,
                            **kw).fit()
    assert _ckpts(ck, third.run_id) == [f"epoch_003-{third.run_id}.pt"]
    assert (ck / "epoch_009.pt").exists() and len(_ckpts(ck)) == 6


def test_keep_checkpoints_and_on_nan_validated():
    with pytest.raises(ValueError, match="keep_checkpoints"):
        TrainerConfig(keep_checkpoints=0)
    with pytest.raises(ValueError, match="on_nan"):
        TrainerConfig(on_nan="ignore")


# ----------------------------------------------------------------------------- 5: resume
def test_resume_refuses_changed_schedule_listing_every_difference(tmp_path, capsys):
    train, _ = digits_split(n_train=256)
    ck = tmp_path / "ck"
    base = dict(batch_size=64, epochs=3, max_lr=1e-2, optimizer="sgd", checkpoint_dir=str(ck))
    h = OneCycleTrainer(tiny_mlp, nn.CrossEntropyLoss(), train, **base).fit()
    path = ck / f"epoch_002-{h.run_id}.pt"

    t = OneCycleTrainer(tiny_mlp, nn.CrossEntropyLoss(), train,
                        **{**base, "epochs": 5, "optimizer": "adamw"})
    before = copy.deepcopy(t.model.state_dict())
    with pytest.raises(ResumeError) as info:
        t.fit(resume=path, max_lr=0.5)
    msg = str(info.value)
    for piece in ("epochs: 3 in the checkpoint, 5 now", "optimizer: 'sgd' in the checkpoint, 'adamw' now",
                  "max_lr: 0.01 in the checkpoint, 0.5 now", "load_state_dict(torch.load(path)['model'])"):
        assert piece in msg, msg
    for k, v in before.items():  # nothing was loaded into the caller's model
        assert torch.equal(t.model.state_dict()[k], v)

    other = nn.Sequential(nn.Linear(64, 16), nn.ReLU(), nn.Linear(16, 10))
    with pytest.raises(ResumeError, match=r"model: .*shapes"):
        OneCycleTrainer(other, nn.CrossEntropyLoss(), train, **base).fit(resume=path)

    # allowed changes are named; the schedule continues exactly
    capsys.readouterr()
    t = OneCycleTrainer(tiny_mlp, nn.CrossEntropyLoss(), train, **{**base, "log_every": 3})
    r = t.fit(resume=path)
    out = capsys.readouterr().out
    assert re.search(r"resuming run \S+ from epoch_002-\S+ after epoch 2 of 3: kept max_lr 0.01", out)
    assert ", optimizer SGD, batch 64 x 1 process, " in out  # the first line's words (CPU, torch)
    assert "changed: log_every 20 -> 3" in out
    assert [e["epoch"] for e in r.epochs] == [1, 2, 3] and r.epochs[:2] == h.epochs[:2]
    for k, v in h.state_dict.items():
        torch.testing.assert_close(r.state_dict[k], v)


@pytest.mark.filterwarnings("ignore:LR finder:RuntimeWarning")  # an 8-step run: not trustworthy
def test_resume_keeps_the_lr_given_to_or_found_by_the_interrupted_fit(tmp_path, capsys):
    """fit(max_lr=X) stopped after epoch 1 of 2; a new trainer (configured max_lr left
    at its default) continues with fit(resume="last") at X, exactly; a different
    fit(max_lr=) is refused naming both. The same for a run whose LR lr_find found."""
    train, _ = digits_split(n_train=256)
    for given in (2e-2, "find"):
        ck = tmp_path / str(given)
        kw = dict(batch_size=64, epochs=2, optimizer="sgd", checkpoint_dir=str(ck), seed=3)
        full = OneCycleTrainer(tiny_mlp, nn.CrossEntropyLoss(), train, **kw).fit(max_lr=given)
        lr = full.base_lr
        # what a crash during epoch 2 leaves behind: epoch 1's checkpoint only
        (ck / f"epoch_002-{full.run_id}.pt").unlink()
        (ck / "final.pt").unlink()
        capsys.readouterr()
        r = OneCycleTrainer(tiny_mlp, nn.CrossEntropyLoss(), train, **kw).fit(resume="last")
        out = capsys.readouterr().out
        assert f"after epoch 1 of 2: kept max_lr {lr:.3g} from the checkpoint (this " \
               "trainer's max_lr=0.001 applies to new runs only)" in out, out
        assert r.base_lr == lr and r.max_lr == full.max_lr
        assert [e["epoch"] for e in r.epochs] == [1, 2] and r.epochs[:1] == full.epochs[:1]
        assert r.epochs[1]["lr_last"] == pytest.approx(full.epochs[1]["lr_last"], rel=1e-12)
        for k, v in full.state_dict.items():
            torch.testing.assert_close(r.state_dict[k], v)
        t = OneCycleTrainer(tiny_mlp, nn.CrossEntropyLoss(), train, **kw)
        with pytest.raises(ResumeError) as info:
            t.fit(resume=ck / f"epoch_001-{full.run_id}.pt", max_lr=lr * 3)
        assert f"max_lr: {lr:.6g} in the checkpoint, {lr * 3!r} now (given to fit(); leave " \
               "max_lr out to keep the checkpoint's)" in str(info.value)
    capsys.readouterr()
    OneCycleTrainer(tiny_mlp, nn.CrossEntropyLoss(), train, **kw).fit(
        resume=ck / f"epoch_001-{full.run_id}.pt", max_lr="find")
    assert "a resumed run does not sweep again" in capsys.readouterr().out


def test_resume_last_and_directory_pick_newest_good_checkpoint(tmp_path, capsys):
    train, _ = digits_split(n_train=256)
    ck = tmp_path / "ck"
    kw = dict(batch_size=64, epochs=3, checkpoint_dir=str(ck), keep_checkpoints=3)
    h = OneCycleTrainer(tiny_mlp, nn.CrossEntropyLoss(), train, **kw).fit()
    newest = ck / f"epoch_003-{h.run_id}.pt"
    newest.write_bytes(newest.read_bytes()[:100])  # truncated: skipped
    t = OneCycleTrainer(tiny_mlp, nn.CrossEntropyLoss(), train, **kw)
    r = t.fit(resume="last")
    assert f"resuming from {ck / f'epoch_002-{h.run_id}.pt'}" in capsys.readouterr().out
    assert [e["epoch"] for e in r.epochs] == [1, 2, 3]
    # the plain epoch name still finds this run's file
    r2 = OneCycleTrainer(tiny_mlp, nn.CrossEntropyLoss(), train, **kw).fit(resume=ck / "epoch_001.pt")
    assert [e["epoch"] for e in r2.epochs] == [1, 2, 3] and r2.epochs[:1] == h.epochs[:1]
    with pytest.raises(ValueError, match="resume='last' needs checkpoint_dir"):
        OneCycleTrainer(tiny_mlp, nn.CrossEntropyLoss(), train, batch_size=64).fit(resume="last")


def test_fit_overrides_the_schedule_for_one_run_and_resume_passes_them_again(tmp_path):
    """fit(epochs=, pct_start=, div_factor=, final_div_factor=) runs that one-cycle without
    changing the trainer's configuration; the epoch checkpoints record the run's schedule and
    checkpoint_extra, so resuming needs the same overrides (and is refused without them)."""
    from xla_utils.train.schedule import OneCycleSchedule

    train, _ = digits_split(n_train=256)
    ck = tmp_path / "ck"
    base = dict(batch_size=64, epochs=1, max_lr=1e-2, optimizer="sgd", checkpoint_dir=str(ck),
                keep_checkpoints=3)
    over = dict(epochs=3, pct_start=0.5, div_factor=10.0, final_div_factor=100.0)
    t = OneCycleTrainer(tiny_mlp, nn.CrossEntropyLoss(), train, **base)
    h = t.fit(**over, checkpoint_extra={"note": "run A"})
    assert [e["epoch"] for e in h.epochs] == [1, 2, 3]
    assert (t.config.epochs, t.config.pct_start, t.config.div_factor) == (1, 0.3, 25.0)
    sched = OneCycleSchedule(total_steps=12, max_lr=1e-2, pct_start=0.5, div_factor=10.0,
                             final_div_factor=100.0)  # 4 steps per epoch on one core
    assert [e["lr_last"] for e in h.epochs] == pytest.approx([sched.lr(s) for s in (3, 7, 11)])
    path = ck / f"epoch_002-{h.run_id}.pt"
    ckpt = torch.load(path, weights_only=False)
    assert {k: ckpt["config"][k] for k in over} == over and ckpt["note"] == "run A"

    with pytest.raises(ResumeError, match="epochs: 3 in the checkpoint, 1 now"):
        OneCycleTrainer(tiny_mlp, nn.CrossEntropyLoss(), train, **base).fit(resume=path)
    r = OneCycleTrainer(tiny_mlp, nn.CrossEntropyLoss(), train, **base).fit(resume=path, **over)
    assert [e["epoch"] for e in r.epochs] == [1, 2, 3] and r.epochs[:2] == h.epochs[:2]
    for k, v in h.state_dict.items():
        torch.testing.assert_close(r.state_dict[k], v)


def test_fit_lr_groups_reach_the_optimizer_and_bad_overrides_are_refused():
    from xla_utils.train.finetune import layer_group_lrs

    train, _ = digits_split(n_train=256)
    t = OneCycleTrainer(tiny_mlp, nn.CrossEntropyLoss(), train, batch_size=64, max_lr=1e-2)
    first, last = t.model[0].weight.clone(), t.model[2].weight.clone()
    t.fit(lr_groups=layer_group_lrs([["2.weight", "2.bias"]], [1.0]))  # the last layer only
    assert torch.equal(t.model[0].weight, first) and not torch.equal(t.model[2].weight, last)
    for kw, err, match in [
            (dict(pct_start=1.5), ValueError, r"fit\(pct_start=1.5\): pct_start must be in \[0, 1\]"),
            (dict(epochs=0), ValueError, r"fit\(epochs=0\): epochs must be a positive int"),
            (dict(div_factor=-1.0), ValueError, "div_factor and final_div_factor must be positive"),
            (dict(checkpoint_extra={"model": 1}), ValueError, r"checkpoint_extra uses \['model'\]"),
            (dict(checkpoint_extra=["x"]), TypeError, "checkpoint_extra must be a dict"),
            (dict(lr_groups=[1.0]), TypeError, "lr_groups must be a callable")]:
        with pytest.raises(err, match=match):
            t.fit(**kw, warn_if_trained=False)


# ----------------------------------------------------------------------------- 6: corrupt
def test_corrupt_checkpoints_name_the_file_and_the_newest_good_one(tmp_path):
    train, _ = digits_split(n_train=256)
    ck = tmp_path / "ck"
    h = OneCycleTrainer(tiny_mlp, nn.CrossEntropyLoss(), train, batch_size=64, epochs=2,
                        checkpoint_dir=str(ck)).fit()
    good = ck / f"epoch_002-{h.run_id}.pt"
    truncated = ck / "epoch_003-copy.pt"
    truncated.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    empty = ck / "epoch_004-copy.pt"
    empty.write_bytes(b"")
    t = OneCycleTrainer(tiny_mlp, nn.CrossEntropyLoss(), train, batch_size=64, epochs=2)
    for bad in (truncated, empty):
        with pytest.raises(CheckpointError) as info:
            t.fit(resume=bad)
        msg = str(info.value)
        assert str(bad) in msg and "corrupt or truncated" in msg
        assert f"newest good checkpoint beside it is {good}" in msg
    # nothing good beside it
    lonely = tmp_path / "alone" / "epoch_001.pt"
    lonely.parent.mkdir()
    lonely.write_bytes(b"\0" * 10)
    with pytest.raises(CheckpointError, match="No good epoch checkpoint is beside it"):
        t.fit(resume=lonely)


# ----------------------------------------------------------------------------- 10: optimizer names
def test_optimizer_names_are_case_insensitive_and_validated_early():
    assert resolve_optimizer("SGD") == "sgd" and resolve_optimizer(" AdamW ") == "adamw"
    assert TrainerConfig(optimizer="SGD").scaling_rule == "linear"
    assert TrainerConfig(optimizer="Adam").scaling_rule == "sqrt"
    opt = make_optimizer("AdamW", [nn.Parameter(torch.zeros(2))], lr=1e-3)
    assert isinstance(opt, Adam) and opt.param_groups[0]["decoupled"]
    train, _ = digits_split(n_train=64)
    with pytest.raises(ValueError, match=r"unknown optimizer 'sgdd' \(did you mean 'sgd'\?\); "
                                         r"valid names .*'sgd', 'adam', 'adamw'"):
        OneCycleTrainer(tiny_mlp(), nn.CrossEntropyLoss(), train, optimizer="sgdd")
    with pytest.raises(ValueError, match="unknown optimizer"):
        debug_run(tiny_mlp(), nn.CrossEntropyLoss(), train, optimizer="rmsprop", print_report=False)
    with pytest.raises(TypeError, match="not an optimizer instance"):
        resolve_optimizer(torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1))


@pytest.mark.filterwarnings("ignore:LR finder:RuntimeWarning")
def test_uppercase_sgd_gets_linear_scaling_in_a_run(capsys):
    train, _ = digits_split(n_train=256)
    h = OneCycleTrainer(tiny_mlp, nn.CrossEntropyLoss(), train, batch_size=64, optimizer="SGD",
                        max_lr=1e-2).fit()
    assert h.lr_scaling == "linear" and "(linear scaling)" in capsys.readouterr().out
    res = lr_find(tiny_mlp(), nn.CrossEntropyLoss(), train, batch_size=32, optimizer="SGD", num_it=5)
    assert res.optimizer == "SGD"


# ----------------------------------------------------------------------------- 12: smaller ones
def test_second_fit_says_it_continues_from_trained_weights():
    train, _ = digits_split(n_train=256)
    t = OneCycleTrainer(tiny_mlp, nn.CrossEntropyLoss(), train, batch_size=64, epochs=1)
    with warnings.catch_warnings(record=True) as first:
        warnings.simplefilter("always")
        t.fit()
    assert not [w for w in first if "already trained" in str(w.message)]
    with pytest.warns(UserWarning, match=r"already trained by an earlier fit\(\) \(1 epoch.*"
                                         r"factory is called once"):
        t.fit()
    with warnings.catch_warnings(record=True) as planned:  # a deliberate continuation
        warnings.simplefilter("always")
        t.fit(warn_if_trained=False)
    assert not [w for w in planned if "already trained" in str(w.message)]


def test_tiny_dataset_error_names_trainer_fix_not_drop_last():
    train, _ = digits_split(n_train=20)
    with pytest.raises(ValueError) as info:
        OneCycleTrainer(tiny_mlp, nn.CrossEntropyLoss(), train, batch_size=32).fit()
    msg = str(info.value)
    assert "train_data has 20 samples" in msg and "batch_size=20 or lower" in msg
    assert "drop_last" not in msg
    with pytest.raises(ValueError, match=r"32 per core x 2 cores = 64.*batch_size=10 or lower"):
        OneCycleTrainer(tiny_mlp, nn.CrossEntropyLoss(), train, batch_size=32).fit(simulate=2)


def test_fit_debug_is_deprecated_in_favour_of_trainer_debug(monkeypatch):
    train, _ = digits_split(n_train=64)
    t = OneCycleTrainer(tiny_mlp(), nn.CrossEntropyLoss(), train, batch_size=16)
    monkeypatch.setattr(OneCycleTrainer, "_debug",
                        lambda self, spec, steps=5, simulate=None: ("report", steps))
    with pytest.warns(DeprecationWarning, match=r"trainer\.debug\(\)"):
        assert t.fit(debug=True) == ("report", 5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert t.debug(steps=3) == ("report", 3)
    # debug() checks the inputs as fit() does, before any device time
    t = OneCycleTrainer(tiny_mlp(2), nn.CrossEntropyLoss(), train, batch_size=16)
    with pytest.raises(ValueError, match="outside the model's 2 outputs"):
        t.debug()
