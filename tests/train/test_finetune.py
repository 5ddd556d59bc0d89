"""fine_tune / freeze / unfreeze, heads, layer groups and pretrained weights (xla_utils.train.finetune),
on XLA:CPU: 1 core and simulated cores; torchvision and timm models built without downloads."""
from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from helpers import digits_split

from xla_utils import OneCycleTrainer
from xla_utils.train.finetune import (even_mults, find_head, freeze, layer_group_lrs, layer_groups,
                                load_pretrained, unfreeze)
from xla_utils.step.optim import make_optimizer, set_hparams


class Net(nn.Module):
    """A BatchNorm MLP on digits with a torchvision-style ``fc`` head."""

    def __init__(self, classes: int = 10):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(64, 32), nn.BatchNorm1d(32), nn.ReLU(),
                                  nn.Linear(32, 32), nn.ReLU())
        self.fc = nn.Linear(32, classes)

    def forward(self, x):
        return self.fc(self.body(x))


def test_heads_found_for_torchvision_timm_and_sequential():
    tv = pytest.importorskip("torchvision")
    assert find_head(tv.models.resnet18(weights=None)) == ["fc"]
    assert find_head(tv.models.mobilenet_v3_small(weights=None)) == ["classifier"]
    assert find_head(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2), nn.Softmax(1))) == ["2"]
    assert find_head(Net(), head="body.3") == ["body.3"]
    with pytest.raises(ValueError, match="head='nope' is not a submodule"):
        find_head(Net(), head="nope")

    class NoHead(nn.Module):
        def __init__(self):
            super().__init__()
            self.trunk = nn.Linear(3, 3)

    with pytest.raises(ValueError, match="name it with head="):
        find_head(NoHead())
    timm = pytest.importorskip("timm")
    m = timm.create_model("resnet10t", pretrained=False, num_classes=3)
    assert find_head(m) == ["fc"]
    vit = timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=3, img_size=32)
    assert find_head(vit) == ["head"]


def test_freeze_keeps_batchnorm_trainable_and_groups():
    tv = pytest.importorskip("torchvision")
    m = tv.models.resnet18(weights=None)
    assert freeze(m) == ["fc"]
    trainable = {n for n, p in m.named_parameters() if p.requires_grad}
    assert {"fc.weight", "fc.bias", "bn1.weight", "layer4.1.bn2.bias"} <= trainable
    assert "conv1.weight" not in trainable and "layer4.1.conv2.weight" not in trainable
    assert all(".bn" in n or n.startswith(("bn1", "fc")) or "downsample.1" in n for n in trainable)
    freeze(m, train_bn=False)
    assert {n for n, p in m.named_parameters() if p.requires_grad} == {"fc.weight", "fc.bias"}
    unfreeze(m)
    assert all(p.requires_grad for p in m.parameters())
    groups = layer_groups(m, n_groups=3)
    assert [len(g) for g in groups][-1] == 2 and groups[-1] == ["fc.weight", "fc.bias"]
    assert sum(map(len, groups)) == len(list(m.parameters())) and groups[0][0] == "conv1.weight"
    with pytest.raises(ValueError, match="n_groups must be an int >= 2"):
        layer_groups(m, n_groups=1)


def test_discriminative_lrs_reach_the_param_groups():
    assert even_mults(100, 3) == pytest.approx([0.01, 0.1, 1.0])
    m = Net()
    groups = layer_groups(m, n_groups=3)
    opt = make_optimizer("adamw", layer_group_lrs(groups, even_mults(100, 3))(m), lr=1e-3)
    set_hparams(opt, 2e-3, 0.9)
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([2e-5, 2e-4, 2e-3])
    assert all(g["betas"][0] == 0.9 for g in opt.param_groups)


def test_load_pretrained_skips_a_new_head_only(tmp_path):
    src = Net(10)
    torch.save(src.state_dict(), tmp_path / "final.pt")
    torch.save({"model": src.state_dict(), "epoch": 3}, tmp_path / "epoch_003.pt")
    for source in (tmp_path / "final.pt", tmp_path / "epoch_003.pt", lambda: src, src.state_dict()):
        dst = Net(3)
        skipped = load_pretrained(dst, source)
        assert skipped == ["fc.weight", "fc.bias"]
        torch.testing.assert_close(dst.body[0].weight, src.body[0].weight)
        torch.testing.assert_close(dst.body[1].running_mean, src.body[1].running_mean)
    with pytest.raises(FileNotFoundError, match="do not exist"):
        load_pretrained(Net(3), tmp_path / "missing.pt")
    bad = {k: v for k, v in src.state_dict().items() if k != "body.0.weight"}
    with pytest.raises(ValueError, match="do not fit the body"):
        load_pretrained(Net(3), bad)


def test_fine_tune_refuses_bad_values_before_device_time():
    train, val = digits_split()
    t = OneCycleTrainer(Net(), nn.CrossEntropyLoss(), train, val)
    with pytest.raises(ValueError, match="epochs must be an int >= 1"):
        t.fine_tune(0)
    with pytest.raises(ValueError, match="freeze_epochs must be an int >= 0"):
        t.fine_tune(1, freeze_epochs=-1)
    with pytest.raises(ValueError, match="lr_mult must be a number >= 1"):
        t.fine_tune(1, lr_mult=0.5)
    with pytest.raises(TypeError, match="unexpected argument"):
        t.fine_tune(1, max_lr=1e-3)
    with pytest.raises(ValueError, match="needs checkpoint_dir"):
        t.fine_tune(1, resume="last")


def test_fine_tune_without_a_frozen_phase_and_the_trainer_untouched(recwarn):
    """freeze_epochs=0 runs the unfrozen phase alone (on the torch backend, in-process), as
    one fit with its own schedule: the trainer's configuration stays as it was, and no
    "already trained" warning comes from the phases."""
    train, val = digits_split()
    t = OneCycleTrainer(Net, nn.CrossEntropyLoss(), train, val, batch_size=64, epochs=3,
                        max_lr=1e-2, seed=0)
    t.fit(epochs=1)
    h = t.fine_tune(1, freeze_epochs=0, pct_start=0.25)
    assert [e["phase"] for e in h.epochs] == ["unfrozen"] and h.epochs[0]["epoch"] == 1
    assert h.epochs[0]["lr_max"] == pytest.approx(1e-2 / 2)
    assert t.config.epochs == 3 and t.config.pct_start == 0.3 and t.config.div_factor == 25.0
    assert not [w for w in recwarn if "already trained" in str(w.message)]
    with pytest.warns(UserWarning, match="already trained"):  # a plain second fit still warns
        t.fit(epochs=1)


def test_fine_tune_phases_are_one_run_on_disk(tmp_path, capsys):
    """The frozen and unfrozen phases write ``<run>+frozen`` / ``<run>+unfrozen`` files: the
    unfrozen phase names the frozen files as its own run's (not "1 earlier run(s)"), and
    keep_runs=1 keeps them, while an earlier fit's files are pruned (torch backend)."""
    from xla_utils.train.checkpoint import run_files

    train, _ = digits_split(n_train=256)
    t = OneCycleTrainer(Net, nn.CrossEntropyLoss(), train, batch_size=64, epochs=1,
                        max_lr=1e-2, seed=0, checkpoint_dir=tmp_path)
    old = t.fit()
    capsys.readouterr()
    t.config.keep_runs = 1
    h = t.fine_tune(1, freeze_epochs=1)
    out = capsys.readouterr().out
    run = h.run_id.partition("+")[0]
    assert h.run_id == f"{run}+unfrozen"
    names = sorted(p.name for p in tmp_path.glob("epoch_*.pt"))
    assert names == [f"epoch_001-{run}+frozen.pt", f"epoch_001-{run}+unfrozen.pt"], names
    assert list(run_files(tmp_path)) == [run]  # one run; the earlier fit's files are gone
    notes = [ln for ln in out.splitlines() if ln.startswith("checkpoint_dir")]
    assert len(notes) == 2, out
    assert f"1 epoch checkpoint(s) of 1 earlier run(s)" in notes[0] and old.run_id in notes[0]
    assert notes[1].startswith(f"checkpoint_dir {tmp_path} holds 1 epoch checkpoint(s) of this "
                               f"run's earlier phase(s) (frozen; run {run}, "), notes[1]
    assert "earlier run(s)" not in notes[1]
    with pytest.raises(ValueError, match="a resumed run goes on under its checkpoint's run id"):
        t.fit(resume="last", run_id="mine")
    with pytest.raises(ValueError, match="run_id must be a str"):
        t.fit(run_id="a/b")


@pytest.mark.parametrize("simulate", [1, pytest.param(2, marks=pytest.mark.multicore)])
@pytest.mark.timeout(400)
def test_freeze_then_fine_tune_on_xla(simulate):
    """Frozen fit: body weights do not move, BatchNorm and head do, one graph. fine_tune:
    frozen then unfrozen phases, each with a constant compile count after its first epoch,
    and every parameter trainable again afterwards."""
    train, val = digits_split()
    torch.manual_seed(0)
    t = OneCycleTrainer(Net, nn.CrossEntropyLoss(), train, val, batch_size=32 // simulate,
                        epochs=2, max_lr=1e-2, seed=0)
    before = {k: v.clone() for k, v in t.model.state_dict().items()}
    t.freeze()
    h = t.fit(simulate=simulate)
    after = t.model.state_dict()
    assert torch.equal(after["body.0.weight"], before["body.0.weight"])
    assert torch.equal(after["body.3.weight"], before["body.3.weight"])
    assert not torch.equal(after["body.1.weight"], before["body.1.weight"])  # BN trains
    assert not torch.equal(after["fc.weight"], before["fc.weight"])
    assert len({e["compiles"] for e in h.epochs}) == 1, h
    t.unfreeze()
    ft = t.fine_tune(2, freeze_epochs=2, simulate=simulate)
    assert [e["phase"] for e in ft.epochs] == ["frozen"] * 2 + ["unfrozen"] * 2
    assert [e["epoch"] for e in ft.epochs] == [1, 2, 3, 4]
    for phase in ("frozen", "unfrozen"):
        counts = {e["compiles"] for e in ft.epochs if e["phase"] == phase}
        assert len(counts) == 1, ft  # nothing compiles after a phase's first epoch
    assert ft.epochs[2]["lr_max"] == pytest.approx(ft.epochs[0]["lr_max"] / 2)
    assert ft[-1]["accuracy"] > 0.8, ft
    assert all(p.requires_grad for p in t.model.parameters()) and t._lr_groups is None
    assert t.config.epochs == 2 and t.config.pct_start == 0.3  # the trainer's config is back


@pytest.mark.timeout(400)
def test_fine_tune_resumes_in_the_unfrozen_phase(tmp_path):
    """A run that crashed after unfrozen epoch 1 (its later files gone) resumes there with
    resume="last": the frozen phase is not rerun, the result equals the uninterrupted run's,
    and the history still holds the frozen epoch. A checkpoint of plain fit is refused."""
    import copy

    train, val = digits_split()
    torch.manual_seed(0)
    init = Net()
    kw = dict(batch_size=32, epochs=2, max_lr=1e-2, seed=0, keep_checkpoints=5)
    full_dir, crash_dir = tmp_path / "full", tmp_path / "crash"
    t = OneCycleTrainer(copy.deepcopy(init), nn.CrossEntropyLoss(), train, val,
                        checkpoint_dir=str(full_dir), **kw)
    full = t.fine_tune(2, freeze_epochs=1, simulate=1)
    files = sorted(full_dir.glob("epoch_*.pt"), key=lambda p: p.stat().st_mtime)
    phases = [torch.load(p, weights_only=False)["fine_tune"]["phase"] for p in files]
    assert phases == ["frozen", "unfrozen", "unfrozen"], phases
    crash_dir.mkdir()
    for p in files[:2]:  # the frozen epoch and unfrozen epoch 1 were written, then the crash
        (crash_dir / p.name).write_bytes(p.read_bytes())
        os.utime(crash_dir / p.name, (p.stat().st_atime, p.stat().st_mtime))
    r = OneCycleTrainer(copy.deepcopy(init), nn.CrossEntropyLoss(), train, val,
                        checkpoint_dir=str(crash_dir), **kw)
    resumed = r.fine_tune(2, freeze_epochs=1, resume="last", simulate=1)
    assert [e["phase"] for e in resumed.epochs] == ["frozen", "unfrozen", "unfrozen"]
    assert [e["epoch"] for e in resumed.epochs] == [1, 2, 3]
    assert resumed.epochs[0]["train_loss"] == full.epochs[0]["train_loss"]
    assert resumed[-1]["val_loss"] == pytest.approx(full[-1]["val_loss"], rel=1e-5)
    for k, v in full.state_dict.items():
        torch.testing.assert_close(resumed.state_dict[k], v, rtol=1e-5, atol=1e-6)
    assert all(p.requires_grad for p in r.model.parameters())
    torch.save({**torch.load(files[0], weights_only=False), "fine_tune": None},
               tmp_path / "plain.pt")
    with pytest.raises(ValueError, match="not by fine_tune"):
        r.fine_tune(2, resume=tmp_path / "plain.pt")


@pytest.mark.timeout(400)
def test_fine_tune_resumes_in_the_frozen_phase(tmp_path):
    """A run that crashed during frozen epoch 2 (only frozen epoch 1's checkpoint written)
    resumes there: the frozen body is still the initial weights in the resumed frozen
    epoch's checkpoint, which equals the uninterrupted run's, and the unfrozen phase then
    ends at the uninterrupted run's weights."""
    import copy

    train, val = digits_split()
    torch.manual_seed(0)
    init = Net()
    kw = dict(batch_size=32, epochs=2, max_lr=1e-2, seed=0, keep_checkpoints=5)
    full_dir, crash_dir = tmp_path / "full", tmp_path / "crash"
    t = OneCycleTrainer(copy.deepcopy(init), nn.CrossEntropyLoss(), train, val,
                        checkpoint_dir=str(full_dir), **kw)
    full = t.fine_tune(1, freeze_epochs=2, simulate=1)
    files = sorted(full_dir.glob("epoch_*.pt"), key=lambda p: p.stat().st_mtime)
    ckpts = [torch.load(p, weights_only=False) for p in files]
    assert [c["fine_tune"]["phase"] for c in ckpts] == ["frozen", "frozen", "unfrozen"]
    crash_dir.mkdir()
    (crash_dir / files[0].name).write_bytes(files[0].read_bytes())
    r = OneCycleTrainer(copy.deepcopy(init), nn.CrossEntropyLoss(), train, val,
                        checkpoint_dir=str(crash_dir), **kw)
    resumed = r.fine_tune(1, freeze_epochs=2, resume="last", simulate=1)
    assert [e["phase"] for e in resumed.epochs] == ["frozen", "frozen", "unfrozen"]
    assert [e["epoch"] for e in resumed.epochs] == [1, 2, 3]
    assert resumed.epochs[0]["train_loss"] == full.epochs[0]["train_loss"]
    again = [c for c in (torch.load(p, weights_only=False) for p in crash_dir.glob("epoch_*.pt"))
             if c["fine_tune"]["phase"] == "frozen" and c["epoch"] == 2]
    assert len(again) == 1, sorted(p.name for p in crash_dir.glob("*"))
    # the linear layers of the body; its BatchNorm (body.1) trains when frozen
    frozen = {k for k, _ in init.named_parameters() if k.startswith(("body.0.", "body.3."))}
    init_state = init.state_dict()
    for k, v in again[0]["model"].items():
        if k in frozen:
            assert torch.equal(v, init_state[k]), k
        torch.testing.assert_close(v, ckpts[1]["model"][k], rtol=1e-5, atol=1e-6)
    for k, v in full.state_dict.items():
        torch.testing.assert_close(resumed.state_dict[k], v, rtol=1e-5, atol=1e-6)
    assert resumed[-1]["val_loss"] == pytest.approx(full[-1]["val_loss"], rel=1e-5)
    assert all(p.requires_grad for p in r.model.parameters())


def _bench_finetune():
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "scripts" / "bench_finetune.py"
    spec = importlib.util.spec_from_file_location("bench_finetune", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    import cloudpickle  # the simulated cores' process cannot import scripts/: ship it by value

    cloudpickle.register_pickle_by_value(mod)
    return mod


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_transfer_fine_tune_beats_fit_from_pretrained_and_from_scratch():
    """The issue's transfer task, CI-sized (scripts/bench_finetune.py, its defaults): a CNN
    pretrained here on upright digits, then 3 labelled images per class of the other digits
    turned upside down, 10 epochs for everyone at the same peak LR. Medians over 3 seeds:
    fine_tune (library defaults: 1 frozen epoch, lr_mult 100) beats fit from the same weights
    and fit from scratch, each by 3 points (docs/BENCHMARKS.md has the figures: margins of 6-12
    points; fit from the same weights and from scratch are about even on this task).

    On plain torch (the script's ``--simulate 0``): what is tested is the method, and the ten
    runs took 9.7 s there against about 50 s on a simulated XLA:CPU core, where every run is a
    fresh launch that compiles its graphs. fine_tune's XLA path is tested above
    (test_freeze_then_fine_tune_on_xla, test_fine_tune_resumes_in_the_frozen_phase)."""
    bench = _bench_finetune()
    source, _, _ = bench.transfer_data(3, 0)
    pre = bench.pretrain(source, 8, simulate=None)
    rows = []
    for seed in range(3):
        _, target, val = bench.transfer_data(3, seed, n_val=300)
        rows.append(bench.run_all(pre, target, val, epochs=10, lr=5e-2, seed=seed, simulate=None))
    med = {k: sorted(r[k] for r in rows)[1] for k in rows[0]}
    assert med["fine_tune"] > med["fit_pretrained"] + 0.03, rows
    assert med["fine_tune"] > med["fit_scratch"] + 0.03, rows
