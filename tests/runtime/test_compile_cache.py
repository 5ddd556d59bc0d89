"""xla_utils.runtime.compile_cache: torch_xla's persistent compilation cache, on real XLA:CPU.

XLA:CPU writes cache entries but cannot load them (each found entry counts as a
PersistentCacheDeserializeFailure and is compiled again), so what is tested here
is everything up to the load: the folder is set up per replica before the first
computation, entries are written, a second run finds them, and an unusable
folder or disk is a warning, never a failure.
"""
from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
import torch
from torch import nn

from xla_utils import OneCycleTrainer, runtime
from xla_utils.train.trainer import TrainerConfig


def _data(n: int = 64):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 8, generator=g)
    return torch.utils.data.TensorDataset(x, (x.sum(1) > 0).long())


def _fit(cache, simulate: int = 2, **kw):
    t = OneCycleTrainer(lambda: nn.Sequential(nn.Linear(8, 2)), nn.CrossEntropyLoss(), _data(),
                        batch_size=8, epochs=1, max_lr=1e-2, optimizer="sgd",
                        compile_cache=cache, **kw)
    return t.fit(simulate=simulate)


def _files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file())


def test_option_validation_and_default_root(tmp_path, monkeypatch):
    for bad in (3, "", 1.5):
        with pytest.raises(ValueError, match="compile_cache must be"):
            TrainerConfig(compile_cache=bad)
    assert TrainerConfig().compile_cache == "auto"
    monkeypatch.setenv("XLA_UTILS_COMPILE_CACHE", str(tmp_path / "mine"))
    assert runtime.default_compile_cache_root() == tmp_path / "mine"
    monkeypatch.delenv("XLA_UTILS_COMPILE_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path))
    if not (os.path.isdir("/kaggle/working") or os.path.isdir("/content")):
        assert runtime.default_compile_cache_root() == tmp_path / ".cache/xla_utils/compile_cache"


@pytest.mark.slow
def test_auto_is_off_on_xla_cpu_and_says_why():
    h = _fit("auto")
    assert h.compile_cache.startswith("compile cache off: XLA:CPU cannot load"), h.compile_cache
    assert "compile cache" not in str(h)  # a deliberate off is not worth a line
    h = _fit(None)
    assert h.compile_cache == "compile cache off: compile_cache=None"


@pytest.mark.multicore
def test_threads_write_once_and_a_second_run_finds_the_entries(tmp_path):
    root = tmp_path / "cc"
    h1 = _fit(root)
    folders = sorted(p for p in root.rglob("replicas-*") if p.is_dir())
    assert [f.name for f in folders] == ["replicas-0-1"], list(root.rglob("*"))
    assert folders[0].parent.name == "cpu" and folders[0].parent.parent.name.startswith("torch_xla-")
    written = _files(folders[0])
    assert written, "the first run wrote no cache entries"
    assert "compile cache (read-write" in h1.compile_cache and "0 graph(s) loaded" in h1.compile_cache
    assert h1.compile_cache in str(h1)
    assert "not loadable" not in h1.compile_cache
    h2 = _fit(root)
    # the second run looked its graphs up and found the first run's entries (XLA:CPU then
    # fails to deserialise them and compiles again: on a TPU these are cache hits)
    assert "not loadable here" in h2.compile_cache, h2.compile_cache
    assert _files(folders[0]) == written


def _probe_replica(folder: str):
    """A launch(simulate=N) replica: set the cache up, compute, report what it saw."""
    import torch_xla.runtime as xr

    status = runtime.enable_compile_cache(folder)
    x = torch.ones(4, device=runtime.device()) * (runtime.rank() + 1)
    runtime.sync()
    total = float(runtime.all_reduce(x).sum().cpu())
    return {"state": status.state, "folder": status.folder, "rank": runtime.rank(),
            "env": os.environ.get("XLA_PERSISTENT_CACHE_PATH"), "total": total,
            "ordinal": xr.global_ordinal()}


@pytest.mark.multicore
def test_simulated_processes_get_one_folder_each(tmp_path):
    root = tmp_path / "cc"
    out = runtime.launch(_probe_replica, str(root), simulate=2)
    assert out["state"] == "read-write" and out["rank"] == 0, out
    assert out["env"] == out["folder"] and out["folder"].endswith("replica-0"), out
    assert out["total"] == 12.0  # 4 x (1 + 2): the collective ran with the cache on
    folders = sorted(p.name for p in root.rglob("replica-*") if p.is_dir())
    assert folders == ["replica-0", "replica-1"], folders
    for f in root.rglob("replica-*"):
        assert _files(f), f"{f}: no entries written"


def test_an_unusable_folder_is_a_warning_not_a_failure(tmp_path, capfd):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    h = _fit(blocker / "cc", simulate=1)
    assert len(h) == 1 and h[-1]["train_loss"] > 0
    assert h.compile_cache.startswith("compile cache off (warning): cannot create"), h.compile_cache
    assert h.compile_cache in str(h)
    assert "compile cache warning: cannot create" in capfd.readouterr().out


@pytest.fixture
def tmpfs(tmp_path):
    """A small tmpfs (needs root and mount rights; skipped elsewhere)."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()

    def mount(*opts: str) -> Path:
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", ",".join(opts), "tmpfs", str(mnt)],
                           capture_output=True, text=True)
        if r.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
        return mnt

    yield mount
    subprocess.run(["umount", str(mnt)], capture_output=True)


def test_full_disk_and_read_only_disk(tmpfs):
    mnt = tmpfs("size=64k")  # a full disk: too little free space, the cache stays off
    h = _fit(mnt / "cc", simulate=1)
    assert len(h) == 1
    assert re.match(r"compile cache off \(warning\): only 0\.\d\d MiB free", h.compile_cache), \
        h.compile_cache
    subprocess.run(["umount", str(mnt)], check=True)
    mnt = tmpfs("size=1g")  # room to write (tmpfs takes memory only as it fills)
    h = _fit(mnt / "cc", simulate=1)
    assert "compile cache (read-write" in h.compile_cache, h.compile_cache
    r = subprocess.run(["mount", "-o", "remount,ro", str(mnt)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    h = _fit(mnt / "cc", simulate=1)  # a read-only disk with entries: used read-only
    assert len(h) == 1
    assert "compile cache (read-only" in h.compile_cache and "not writable" in h.compile_cache, \
        h.compile_cache


def test_predict_lr_find_and_check_set_it_up_too(tmp_path):
    import xla_utils

    t = OneCycleTrainer(lambda: nn.Sequential(nn.Linear(8, 2)), nn.CrossEntropyLoss(), _data(),
                        batch_size=8, epochs=1, max_lr=1e-2, optimizer="sgd",
                        compile_cache=tmp_path / "predict")
    assert t.predict(_data(16), simulate=1).shape == (16, 2)
    assert _files(tmp_path / "predict"), "predict wrote no cache entries"
    with pytest.warns(RuntimeWarning, match="too early for a suggestion"):  # 5 steps
        res = xla_utils.lr_find(t.model, nn.CrossEntropyLoss(), _data(), 8, num_it=5,
                                simulate=1, show_progress=False,
                                compile_cache=tmp_path / "lr_find")
    assert len(res.lrs) == 5 and _files(tmp_path / "lr_find")
    x, y = _data(8).tensors
    rep = xla_utils.check(t.model, (x, y), steps=3, verbose=False,
                          compile_cache=tmp_path / "check")
    assert rep.measurements["compile_cache"] == "read-write" and _files(tmp_path / "check")
    with pytest.raises(ValueError, match="compile_cache must be"):
        xla_utils.lr_find(t.model, nn.CrossEntropyLoss(), _data(), 8, compile_cache=7)
