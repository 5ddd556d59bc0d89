"""Runs that outlive the session (:mod:`xla_utils.train.session`): per-step records, in-epoch
checkpoints, ``fit(time_limit=...)``, SIGTERM/SIGINT, each resumed with ``resume="last"`` to
the weights of the uninterrupted run (torch CPU path; one CPU-replica and one simulated
variant)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from helpers import digit_images, digits_split, tiny_cnn, tiny_mlp

from xla_utils import CachedImageDataset, OneCycleTrainer, build_cache
from xla_utils.step.plain import default_train_step
from xla_utils.train import session

SIZE, CLASSES = 12, 5
# 48 images, 8 a batch: 6 optimizer steps an epoch, a loss read every 2
_OPTS = dict(batch_size=8, epochs=2, max_lr=0.05, mixup=0.4, ema=0.9, log_every=2,
             checkpoint_every=None, mean=(0.5,) * 3, std=(0.25,) * 3)


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    """A cache of 48 digits with 3 variants each (each epoch shows another)."""
    root = tmp_path_factory.mktemp("session") / "c"
    build_cache(digit_images(48, classes=CLASSES), root, size=SIZE, variants=3,
                scale=(0.6, 1.0), verbose=False)
    return root


def _trainer(cache: Path, folder: Path | None, **kw) -> OneCycleTrainer:
    opts = {**_OPTS, **kw}
    return OneCycleTrainer(tiny_cnn(CLASSES, size=SIZE, seed=0), nn.CrossEntropyLoss(),
                           CachedImageDataset(cache), None,
                           checkpoint_dir=None if folder is None else str(folder), **opts)


@pytest.fixture(scope="module")
def uninterrupted(cache, tmp_path_factory):
    """The run that the interrupted ones must end equal to."""
    return _trainer(cache, tmp_path_factory.mktemp("whole")).fit()


def _same_run(a, b, atol: float = 0.0) -> None:
    for name in ("state_dict", "ema_state_dict"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.keys() == y.keys() and x
        assert max((x[k].float() - y[k].float()).abs().max().item() for k in x) <= atol, name
    np.testing.assert_allclose([e["train_loss"] for e in a], [e["train_loss"] for e in b],
                               rtol=1e-6)
    assert [(r["epoch"], r["step"]) for r in a.steps] == [(r["epoch"], r["step"]) for r in b.steps]


def test_durations_and_intervals_are_read_or_refused():
    assert session.parse_duration("30min", "x") == 1800
    assert session.parse_duration("8h30min", "x") == 8.5 * 3600
    assert session.parse_duration(90, "x") == 90
    for bad in ("30 parsecs", "", 0, -5, True, "min"):
        with pytest.raises(ValueError, match="x="):
            session.parse_duration(bad, "x")
    assert session.checkpoint_interval("auto", "kaggle") == (None, session.AUTO_CHECKPOINT_S)
    assert session.checkpoint_interval("auto", None) == (None, None)
    assert session.checkpoint_interval(500, None) == (500, None)
    assert session.checkpoint_interval("2h", None) == (None, 7200)
    with pytest.raises(ValueError, match="checkpoint_every="):
        OneCycleTrainer(tiny_mlp(), nn.CrossEntropyLoss(), digits_split()[0],
                        checkpoint_every="often")
    left, words = session.resolve_time_limit("auto", "kaggle", age_s=3600)
    assert left == 8 * 3600 - session.AUTO_MARGIN_S and "kaggle" in words
    with pytest.raises(ValueError, match="Kaggle, Colab"):
        session.resolve_time_limit("auto", None)
    with pytest.raises(ValueError, match="no time is left"):
        session.resolve_time_limit("auto", "colab", age_s=12 * 3600)
    age = session.session_age_s()
    assert age is None or age >= 0


def test_step_rows_in_the_history_and_steps_csv(uninterrupted, tmp_path):
    h = uninterrupted
    # reads at steps 2, 4, 6 of each of the 2 epochs
    assert [(r["epoch"], r["step"]) for r in h.steps] == [(1, 2), (1, 4), (1, 6), (2, 8),
                                                         (2, 10), (2, 12)]
    assert all(set(r) == {"epoch", "step", "train_loss", "lr"} for r in h.steps)
    assert h.steps[2]["train_loss"] == pytest.approx(h.epochs[0]["train_loss"])  # the epoch's mean
    assert h.steps[-1]["lr"] == pytest.approx(h.epochs[-1]["lr_last"])
    h.steps_to_csv(tmp_path / "steps.csv")
    rows = (tmp_path / "steps.csv").read_text().splitlines()
    assert rows[0] == "epoch,step,train_loss,lr" and rows[1].startswith("1,2,")


def test_time_limit_stops_inside_the_epoch_and_resume_ends_as_one_run(cache, uninterrupted,
                                                                     tmp_path):
    """A limit that ends the run at its first loss read, twice, then the rest: the same
    weights, EMA weights, losses and step rows as the uninterrupted run (mixup, EMA, a cache
    of 3 variants)."""
    h = _trainer(cache, tmp_path).fit(time_limit=1e-3)
    assert h.stop_reason == session.TIME_LIMIT_REASON and not h.epochs
    assert [r["step"] for r in h.steps] == [2]
    names = sorted(p.name for p in tmp_path.glob("epoch_*.pt"))
    assert len(names) == 1 and names[0].startswith("epoch_001_step000002-")
    assert not (tmp_path / "final.pt").exists()  # a paused run is not finished
    h = _trainer(cache, tmp_path).fit(resume="last", time_limit=1e-3)
    assert h.stop_reason == session.TIME_LIMIT_REASON and [r["step"] for r in h.steps] == [2, 4]
    h = _trainer(cache, tmp_path).fit(resume="last")
    assert h.stop_reason is None and (tmp_path / "final.pt").exists()
    _same_run(uninterrupted, h)
    rows = (tmp_path / "steps.csv").read_text().splitlines()
    assert rows[0] == "epoch,step,train_loss,lr" and len(rows) == 1 + len(h.steps)
    # keep_checkpoints=2: the in-epoch files rotate with the epoch files
    assert sorted(p.name[:9] for p in tmp_path.glob("epoch_*.pt")) == ["epoch_001", "epoch_002"]


def test_checkpoint_every_steps_writes_resumable_files(cache, uninterrupted, tmp_path, capsys):
    t = _trainer(cache, tmp_path, checkpoint_every=3, epochs=2, keep_checkpoints=10)
    t.fit()
    names = sorted(p.name.split("-")[0] for p in tmp_path.glob("epoch_*.pt"))
    # a read every 2 steps, a checkpoint at the first read 3 steps past the last one
    assert names == ["epoch_001", "epoch_001_step000004", "epoch_002", "epoch_002_step000004"]
    for p in tmp_path.glob("epoch_00*_step*.pt"):
        if p.name.startswith("epoch_002"):
            p.unlink()  # the newest mid-epoch one stays: epoch 1, step 4
    for p in tmp_path.glob("epoch_002-*.pt"):
        p.unlink()
    capsys.readouterr()
    h = _trainer(cache, tmp_path).fit(resume=str(next(tmp_path.glob("epoch_001_step*.pt"))))
    assert "resumed at epoch 1, step 4 of 6" in capsys.readouterr().out
    _same_run(uninterrupted, h)


_KILLED = """
import os, signal, sys
sys.path[:0] = [{tests!r}, {root!r}]
from test_session import _trainer
from xla_utils.step.plain import default_train_step
calls = []

def train_step(model, batch, loss_fn):
    calls.append(1)
    if len(calls) == 7:  # inside step 7 of 12: the signal arrives mid-epoch 2
        os.kill(os.getpid(), signal.SIGTERM)
    return default_train_step(model, batch, loss_fn)

t = _trainer({cache!r}, {folder!r})
t.train_step = train_step
try:
    t.fit()
except KeyboardInterrupt as e:
    print("INTERRUPTED:", e, flush=True)
    sys.exit(3)
"""


@pytest.mark.timeout(240)
def test_sigterm_mid_epoch_then_resume_in_a_new_process(cache, uninterrupted, tmp_path):
    """A process running fit gets SIGTERM in step 7: it writes a checkpoint at step 8 (the
    next read), fit raises KeyboardInterrupt; a new process resumes to the same weights."""
    script = tmp_path / "killed.py"
    tests = str(Path(__file__).parent)
    script.write_text(_KILLED.format(tests=tests, root=str(Path(tests).parent.parent),
                                     cache=str(cache), folder=str(tmp_path / "ck")))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=200, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert out.returncode == 3, out.stdout[-2000:] + out.stderr[-3000:]
    assert 'INTERRUPTED: stopped by SIGTERM; fit(resume="last") continues' in out.stdout
    names = [p.name for p in (tmp_path / "ck").glob("epoch_*.pt")]
    assert any(n.startswith("epoch_002_step000002-") for n in names), names
    h = _trainer(cache, tmp_path / "ck").fit(resume="last")
    _same_run(uninterrupted, h)


def test_sigint_in_the_notebook_process_checkpoints_and_the_process_goes_on(
        cache, uninterrupted, tmp_path):
    """The notebook's interrupt (SIGINT to this process) during step 3: KeyboardInterrupt
    after the checkpoint at step 4; the handler is restored; the same process resumes."""
    before = signal.getsignal(signal.SIGINT)
    calls = []

    def train_step(model, batch, loss_fn):
        calls.append(1)
        if len(calls) == 3:
            os.kill(os.getpid(), signal.SIGINT)
        return default_train_step(model, batch, loss_fn)

    t = _trainer(cache, tmp_path)
    t.train_step = train_step
    with pytest.raises(KeyboardInterrupt, match="stopped by SIGINT"):
        t.fit()
    assert signal.getsignal(signal.SIGINT) is before
    assert len(calls) == 4 and [p.name[:20] for p in tmp_path.glob("epoch_*.pt")] == \
        ["epoch_001_step000004"]
    h = _trainer(cache, tmp_path).fit(resume="last")
    _same_run(uninterrupted, h)


def _steps_of(h) -> list[tuple[int, int]]:
    return [(r["epoch"], r["step"]) for r in h.steps]


@pytest.fixture(scope="module")
def two_replicas(cache, tmp_path_factory):
    """The uninterrupted run on 2 CPU replicas (XLA_UTILS_CPU_REPLICAS=2, 4 per replica)."""
    with pytest.MonkeyPatch.context() as mp:  # only for this run: later tests run on one
        mp.setenv("XLA_UTILS_CPU_REPLICAS", "2")
        return _trainer(cache, tmp_path_factory.mktemp("two"), batch_size=4).fit()


@pytest.mark.slow  # about 25 s in CI: two replica processes, stopped, then resumed
@pytest.mark.multicore
@pytest.mark.timeout(300)
def test_sigterm_to_one_of_two_cpu_replicas_stops_both_and_resumes_exactly(
        cache, uninterrupted, two_replicas, tmp_path, monkeypatch):
    """XLA_UTILS_CPU_REPLICAS=2: in step 7 SIGTERM reaches replica 1 alone: both replicas stop
    at step 8 (they agree at the read) with one checkpoint, fit raises KeyboardInterrupt, no
    process of the job is left; the resumed run ends with the uninterrupted 2-replica run's
    weights, and both record the one-process run's step rows. (A SIGTERM to the whole job:
    the job process keeps the caller's handler, forked with it, and each replica its own.)"""
    import multiprocessing

    from xla_utils import runtime

    monkeypatch.setenv("XLA_UTILS_CPU_REPLICAS", "2")
    assert two_replicas.world_size == 2 and _steps_of(two_replicas) == _steps_of(uninterrupted)
    calls = []

    def train_step(model, batch, loss_fn):
        calls.append(1)
        if len(calls) == 7 and runtime.rank() == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        return default_train_step(model, batch, loss_fn)

    t = _trainer(cache, tmp_path, batch_size=4)
    t.train_step = train_step
    with pytest.raises(KeyboardInterrupt, match="stopped by SIGTERM"):
        t.fit()
    assert not multiprocessing.active_children()
    names = sorted(p.name.split("-")[0] for p in tmp_path.glob("epoch_*.pt"))
    assert names == ["epoch_001", "epoch_002_step000002"]
    h = _trainer(cache, tmp_path, batch_size=4).fit(resume="last")
    _same_run(two_replicas, h, atol=1e-6)


@pytest.mark.multicore
@pytest.mark.timeout(400)
def test_time_limit_on_two_simulated_cores_resumes_exactly(cache, uninterrupted, tmp_path):
    """simulate=2 (XLA:CPU): stopped at the first read by the time limit, resumed in another
    job: the uninterrupted run's weights and EMA weights, its step rows (those of the
    one-process run), and nothing compiles after the first epoch."""
    whole = _trainer(cache, tmp_path / "whole", batch_size=4).fit(simulate=2)
    assert _steps_of(whole) == _steps_of(uninterrupted)
    assert whole[0]["compiles"] == whole[1]["compiles"]  # the reads' seeding compiles nothing
    h = _trainer(cache, tmp_path / "ck", batch_size=4).fit(simulate=2, time_limit=1e-3)
    assert h.stop_reason == session.TIME_LIMIT_REASON and _steps_of(h) == [(1, 2)]
    h = _trainer(cache, tmp_path / "ck", batch_size=4).fit(simulate=2, resume="last")
    _same_run(whole, h, atol=1e-5)


def test_fine_tune_under_a_time_limit_resumes_its_phase_at_the_step(tmp_path):
    """fine_tune(time_limit=...) stops in the frozen phase's first epoch with a checkpoint
    that records its phase; fine_tune(resume="last") continues it there and ends both
    phases with the uninterrupted fine_tune's weights and step rows (numbered on)."""
    train, val = digits_split(n_val=32, n_train=128)
    kw = dict(batch_size=16, epochs=1, max_lr=1e-2, seed=0, log_every=2, checkpoint_every=None)

    def trainer(folder: Path) -> OneCycleTrainer:
        return OneCycleTrainer(tiny_mlp(hidden=(16, 16), seed=0), nn.CrossEntropyLoss(), train,
                               val, checkpoint_dir=str(folder), **kw)

    whole = trainer(tmp_path / "whole").fine_tune(1, freeze_epochs=1)
    assert [(r["epoch"], r["step"]) for r in whole.steps] == \
        [(1, 2), (1, 4), (1, 6), (1, 8), (2, 10), (2, 12), (2, 14), (2, 16)]
    h = trainer(tmp_path / "ck").fine_tune(1, freeze_epochs=1, time_limit=1e-3)
    assert h.stop_reason == session.TIME_LIMIT_REASON and [r["step"] for r in h.steps] == [2]
    ckpt = torch.load(next((tmp_path / "ck").glob("epoch_001_step000002-*.pt")),
                      weights_only=False)
    assert ckpt["fine_tune"]["phase"] == "frozen"
    h = trainer(tmp_path / "ck").fine_tune(1, freeze_epochs=1, resume="last")
    assert [e["phase"] for e in h.epochs] == ["frozen", "unfrozen"]
    for k, v in whole.state_dict.items():
        torch.testing.assert_close(h.state_dict[k], v, rtol=0, atol=1e-6)


def test_cross_validate_stops_at_a_paused_fold_and_keeps_it_unfinished(tmp_path):
    from xla_utils import cross_validate

    data, _ = digits_split(n_val=0, n_train=96)

    def make(train, val, fold):
        return OneCycleTrainer(tiny_mlp(seed=0), nn.CrossEntropyLoss(), train, val,
                               batch_size=16, epochs=1, max_lr=1e-2, log_every=1,
                               checkpoint_dir=str(tmp_path / f"fold{fold}"))

    with pytest.raises(RuntimeError, match="fold 0's fit stopped at the time limit, so the fold "
                                           "is not finished; the finished folds are kept in"):
        cross_validate(make, data, folds=2, folder=tmp_path / "cv",
                       train=lambda t: t.fit(time_limit=1e-3))
    assert not list((tmp_path / "cv").glob("fold_*.npz"))
    assert list((tmp_path / "fold0").glob("epoch_001_step000001-*.pt"))
