"""checkpoint_dir in a bucket (xla_utils.train.mirror), against the GCS emulator: a fit run's
checkpoints uploaded as it writes them, listed and resumed on a machine that has none of its
files, and an upload cut short leaving the previous checkpoint good."""
from __future__ import annotations

import shutil

import pytest
import torch
from torch import nn

from helpers import digits_split, tiny_mlp

from xla_utils import OneCycleTrainer
from xla_utils.cache.storage import Store
from xla_utils.train import mirror as _mirror


def _trainer(url: str, epochs: int) -> OneCycleTrainer:
    train, val = digits_split(n_val=64, n_train=256)
    return OneCycleTrainer(tiny_mlp(seed=0), nn.CrossEntropyLoss(), train, val, batch_size=32,
                           epochs=epochs, max_lr=1e-2, checkpoint_dir=url, log_every=2,
                           checkpoint_every=4)


@pytest.fixture
def home(tmp_path, monkeypatch):
    """A machine of its own: the staging folders live under this HOME."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def test_checkpoints_in_a_bucket_resume_on_a_machine_without_them(gcs_emulator, home, capsys):
    """A run paused by its time limit early in epoch 1 (an in-epoch checkpoint), resumed by
    another session whose machine has none of its files: it lists the bucket, continues at that
    step and ends with the weights of the same run never stopped."""
    full = _trainer(gcs_emulator(), epochs=2)
    full.fit()
    url = gcs_emulator()
    t = _trainer(url, epochs=2)
    h = t.fit(time_limit=1e-6)  # past at the first read: a pause on any machine
    assert h.stop_reason.startswith("stopped at the time limit")
    names = Store(url).listdir()
    assert any(n.startswith("epoch_001_step") and n.endswith(f"-{h.run_id}.pt") for n in names)
    assert not any(".tmp-" in n for n in names)
    shutil.rmtree(home)  # another session: no local file of the run
    again = _trainer(url, epochs=2)
    h2 = again.fit(resume="last")
    out = capsys.readouterr().out
    assert f"checkpoint_dir {url}: written through" in out and "resumed at epoch 1, step" in out
    assert [e["epoch"] for e in h2.epochs] == [1, 2] and h2.run_id == h.run_id
    names = Store(url).listdir()
    assert {f"epoch_002-{h.run_id}.pt", "final.pt", "history.csv", "steps.csv"} <= set(names)
    ref = full.model.state_dict()
    assert max(float((again.model.state_dict()[k] - ref[k]).abs().max()) for k in ref) <= 1e-6


def test_an_upload_cut_short_leaves_the_previous_checkpoint_good(gcs_emulator, home, monkeypatch):
    url = gcs_emulator()
    real = Store.write

    def cut(self, name, chunks):  # the session ends while epoch 2's first file is uploaded
        if name.startswith("epoch_002"):
            next(iter(chunks))
            raise ConnectionError("the session ended during the upload")
        return real(self, name, chunks)

    monkeypatch.setattr(Store, "write", cut)
    with pytest.raises(ConnectionError):
        _trainer(url, epochs=2).fit()
    monkeypatch.setattr(Store, "write", real)
    names = Store(url).listdir()
    run = next(n for n in names if n.startswith("epoch_001-")).split("-", 1)[1][:-3]
    assert not any(n.startswith("epoch_002") or ".tmp-" in n for n in names)
    shutil.rmtree(home)
    resumed = _trainer(url, epochs=2)
    h2 = resumed.fit(resume="last")  # from epoch 1's checkpoint, good
    assert [e["epoch"] for e in h2.epochs] == [1, 2] and h2.run_id == run
    assert torch.isfinite(torch.tensor(h2.epochs[-1]["train_loss"]))


def test_a_local_checkpoint_dir_is_not_mirrored(tmp_path):
    assert _mirror.CheckpointMirror.of(tmp_path) is None and _mirror.CheckpointMirror.of(None) is None
    m = _mirror.CheckpointMirror.of("gs://b/run/")
    assert m.url == "gs://b/run" and m.folder.name.startswith("b_run-")


def test_resume_from_another_folder_writes_only_its_own(tmp_path):
    """A Kaggle notebook's previous version attached as input: the run resumes from that
    folder and writes every new checkpoint into its own checkpoint_dir, nothing into the input."""
    done = tmp_path / "input" / "ckpt"
    first = _trainer(str(done), epochs=2)
    h = first.fit(time_limit=1e-6)  # past at the first read: an in-epoch pause
    assert h.stop_reason.startswith("stopped at the time limit")
    before = {p.name: p.stat().st_mtime_ns for p in done.iterdir()}
    t = _trainer(str(tmp_path / "working" / "ckpt"), epochs=2)
    h2 = t.fit(resume=str(done))
    assert [e["epoch"] for e in h2.epochs] == [1, 2] and h2.run_id == h.run_id
    assert {p.name: p.stat().st_mtime_ns for p in done.iterdir()} == before
    written = {p.name for p in (tmp_path / "working" / "ckpt").iterdir()}
    assert {f"epoch_002-{h.run_id}.pt", "final.pt", "history.csv"} <= written
