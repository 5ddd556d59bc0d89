"""Disk space (xla_utils.cache.space): a build into a small tmpfs is refused before writing, with the
numbers; a disk filled mid-build by another writer stops with one line, no temporary file, and resumes
to a byte-identical cache once space is freed. The tmpfs is mounted by the test (root); skipped elsewhere."""
from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from pathlib import Path

import numpy as np
import pytest

from xla_utils.cache import BuildError, build_cache, read_manifest, verify_cache
from xla_utils.cache.space import DiskFullError, check_space, estimate_bytes
from xla_utils.cache.config import CacheConfig


@pytest.fixture
def tmpfs(tmp_path):
    """A 1 MiB tmpfs mounted at ``tmp_path / "disk"`` (skipped where mounting is not allowed)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if shutil.which("mount") is None:
        pytest.skip("no mount command")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(disk)], capture_output=True)
    if r.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode().strip()}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", str(disk)], check=False)


class Pictures:
    """64 images; item ``fill_at`` fills the disk at ``ballast`` (another writer) while the flag file exists."""

    def __init__(self, ballast: Path | None = None, fill_at: int = -1):
        self.ballast, self.fill_at = ballast, fill_at

    def __len__(self):
        return 64

    def __getitem__(self, i):
        if i == self.fill_at and self.ballast is not None and self.ballast.with_suffix(".flag").exists():
            free = shutil.disk_usage(self.ballast.parent).free
            with open(self.ballast, "wb") as f:
                f.write(b"\0" * max(0, free - 8192))
        return np.random.default_rng(i).integers(0, 256, (40, 40, 3), dtype=np.uint8), i % 3


def test_estimate_and_refusal_name_both_numbers_and_the_options_that_fit():
    cfg = CacheConfig(size=224, variants=4)
    need = estimate_bytes(cfg, 10_000, 16)
    assert need == 10_000 * 4 * 224 * 224 * 3 + 16 * 128 + 2**16
    with pytest.raises(BuildError) as e:
        check_space("/kaggle/working/c", need // 3, cfg, 10_000, 16)
    msg = str(e.value)
    assert f"{need:,} bytes" in msg and f"{need // 3:,} bytes" in msg and "/kaggle/working/c" in msg
    assert "--codec jpeg" in msg and "--variants 1" in msg and "--size 128" in msg
    check_space("/x", need, cfg, 10_000, 16)  # fits: no error


def test_small_tmpfs_is_refused_before_writing(tmpfs):
    out = tmpfs / "cache"
    with pytest.raises(BuildError, match=r"not enough space in .*cache.*disk has .*free.*Nothing was written"):
        build_cache(Pictures(), out, size=96, workers=1, verbose=False)  # 64 x 27,648 bytes > 1 MiB
    assert not out.exists() or list(out.iterdir()) == []


def test_disk_filled_mid_build_stops_cleanly_and_resumes_byte_identical(tmpfs, tmp_path):
    out = tmpfs / "cache"
    ballast = tmpfs / f"ballast-{uuid.uuid4().hex[:6]}"
    ballast.with_suffix(".flag").write_text("fill")
    kw = dict(size=32, workers=1, shard_size=4 * 3072, verbose=False)  # 64 x 3,072 bytes in 16 shards of 4
    with pytest.raises(DiskFullError) as e:
        build_cache(Pictures(ballast, fill_at=20), out, **kw)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{out}: disk full") and "bytes still needed" in msg
    print(msg)
    assert not [p for p in out.iterdir() if ".tmp-" in p.name]  # no temporary file keeps the space
    m = read_manifest(out)
    assert not m["complete"] and 1 <= len(m["shards"]) < 16
    ballast.unlink()
    ballast.with_suffix(".flag").unlink()
    r = build_cache(Pictures(ballast, fill_at=20), out, **kw)
    assert r.shards_reused == len(m["shards"]) and verify_cache(out).ok
    build_cache(Pictures(), tmp_path / "clean", **kw)
    for p in sorted((tmp_path / "clean").glob("shard-*")):
        assert (out / p.name).read_bytes() == p.read_bytes()
