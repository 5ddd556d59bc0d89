"""xla_utils.utils.atomic: a file appears whole or not at all (real files, no mocks)."""
from __future__ import annotations

import os
import stat

import numpy as np
import pytest
import torch

from xla_utils.utils.atomic import atomic_write, atomic_writer


def test_writes_bytes_and_text_and_creates_the_folder(tmp_path):
    atomic_write(tmp_path / "a" / "b.bin", b"\x00\x01")
    atomic_write(tmp_path / "a" / "c.txt", "héllo\n")
    assert (tmp_path / "a" / "b.bin").read_bytes() == b"\x00\x01"
    assert (tmp_path / "a" / "c.txt").read_bytes() == "héllo\n".encode()
    assert sorted(os.listdir(tmp_path / "a")) == ["b.bin", "c.txt"]


def test_a_writer_that_raises_leaves_the_old_file_and_no_partial_one(tmp_path):
    path = tmp_path / "model.pt"
    torch.save({"w": torch.ones(3)}, path)
    with pytest.raises(RuntimeError, match="disk gone"):
        with atomic_writer(path) as f:
            torch.save({"w": torch.zeros(1000)}, f)  # half of the new file is written
            raise RuntimeError("disk gone")
    assert torch.load(path)["w"].tolist() == [1.0, 1.0, 1.0]
    assert os.listdir(tmp_path) == ["model.pt"]
    with pytest.raises(ValueError):
        with atomic_writer(tmp_path / "new.npz") as f:
            np.savez(f, x=np.arange(3))
            raise ValueError
    assert os.listdir(tmp_path) == ["model.pt"]  # no new file, no temporary one


def test_the_file_gets_the_usual_permissions(tmp_path):
    atomic_write(tmp_path / "sub.csv", "id,label\n", durable=False)
    plain = tmp_path / "plain.csv"
    plain.write_text("x")
    assert stat.S_IMODE((tmp_path / "sub.csv").stat().st_mode) == stat.S_IMODE(plain.stat().st_mode)


def test_a_missing_folder_is_an_error_when_asked(tmp_path):
    with pytest.raises(FileNotFoundError):
        atomic_write(tmp_path / "gone" / "payload", b"x", parents=False)
    assert not (tmp_path / "gone").exists()
