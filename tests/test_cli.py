"""The tpu_cache_ds command (xla_utils.cli) and its script / module entry points."""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from xla_utils.cli import main, parse_bytes

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], env=ENV, capture_output=True, text=True, timeout=180)


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("src")
    rng = np.random.default_rng(0)
    for c in ("cat", "dog"):
        (root / c).mkdir()
        for i in range(6):
            arr = np.clip(rng.normal(120, 40, (40 + 4 * i, 50, 3)), 0, 255).astype(np.uint8)
            Image.fromarray(arr).save(root / c / f"{i}.jpg", quality=92)
    return root


@pytest.fixture(scope="module")
def built(src, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("built") / "cache"
    # one image a shard (3 x 24 x 24 x 3 bytes): 12 shards
    assert main(["build", str(src), str(out), "--size", "24", "--variants", "3", "--shard-size", "5184",
                 "--quiet"]) == 0
    return out


def test_parse_bytes():
    assert parse_bytes("256MiB") == 256 * 2**20
    assert parse_bytes("256MB") == 256 * 10**6
    assert parse_bytes("1.5G") == 1_500_000_000
    assert parse_bytes("4096") == 4096
    with pytest.raises(argparse.ArgumentTypeError):
        parse_bytes("lots")


def test_build_prints_summary_then_info(src, built, tmp_path, capsys):
    out = tmp_path / "c"
    assert main(["build", str(src), str(out), "--size", "20x30", "--shard-size", "1MB", "--workers", "1"]) == 0
    printed = capsys.readouterr().out
    assert "cached 12 of 12 images x 1 variant(s) at 30x20 (raw)" in printed
    assert main(["info", str(built), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["num_images"] == 12 and info["num_variants"] == 3 and info["classes"] == ["cat", "dog"]
    assert info["complete"] and info["files"] == info["num_shards"] + 2
    assert main(["info", str(built)]) == 0
    text = capsys.readouterr().out
    assert "complete" in text and "2 classes: cat, dog" in text and "3 variant(s) at 24x24" in text


def test_verify_exit_status_names_the_bad_shard(built, tmp_path):
    out = tmp_path / "copy"
    shutil.copytree(built, out)
    r = run("-m", "xla_utils.cache", "verify", str(out))
    assert r.returncode == 0 and r.stdout.startswith("OK:")
    assert main(["verify", str(out), "--full"]) == 0
    shard = out / "shard-00002.npy"
    data = bytearray(shard.read_bytes())
    data[-7] ^= 0xFF
    shard.write_bytes(bytes(data))
    r = run("-m", "xla_utils.cache", "verify", str(out))
    assert r.returncode == 1 and "shard-00002.npy" in r.stderr and "crc32" in r.stderr


def test_preview_writes_a_grid(built, tmp_path, capsys):
    png = tmp_path / "grid.png"
    assert main(["preview", str(built), "--out", str(png), "--images", "4"]) == 0
    with Image.open(png) as im:
        assert im.size == (4 + 3 * (24 + 4), 4 + 4 * (24 + 14 + 4))  # 3 variants x 4 images
    assert "4 images x 3 variant(s)" in capsys.readouterr().out


def test_bench_reports_samples_per_second(built, capsys):
    assert main(["bench", str(built), "--json", "--seconds", "0.2", "--batch-size", "4"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["samples_per_s"] > 0 and res["batch_size"] == 4 and res["codec"] == "raw"


def test_dry_run_writes_nothing(src, tmp_path, capsys):
    out = tmp_path / "planned"
    assert main(["build", str(src), str(out), "--size", "24", "--variants", "2", "--codec", "jpeg",
                 "--dry-run"]) == 0
    printed = capsys.readouterr().out
    assert "dry run" in printed and "12 images x 2 variant(s)" in printed and "shards" in printed
    assert not out.exists()


def test_other_config_refused_then_overwrite(src, built, tmp_path):
    out = tmp_path / "c"
    shutil.copytree(built, out)
    r = run("-m", "xla_utils.cache", "build", str(src), str(out), "--size", "32", "--variants", "3", "--quiet")
    assert r.returncode == 1 and "--overwrite" in r.stderr and "size" in r.stderr and "Traceback" not in r.stderr
    assert main(["build", str(src), str(out), "--size", "32", "--variants", "3", "--overwrite", "--quiet"]) == 0
    assert json.loads((out / "manifest.json").read_text())["image_size"] == [32, 32]


def test_strict_names_the_bad_file(src, tmp_path):
    bad_src = tmp_path / "src"
    shutil.copytree(src, bad_src)
    (bad_src / "cat" / "3.jpg").write_bytes(b"")
    r = run("-m", "xla_utils.cache", "build", str(bad_src), str(tmp_path / "c"), "--size", "16", "--strict",
            "--quiet")
    assert r.returncode == 1 and "cat/3.jpg" in r.stderr
    assert main(["build", str(bad_src), str(tmp_path / "c"), "--size", "16", "--quiet"]) == 0  # resumes


def test_labels_csv_and_classes_from(src, built, tmp_path, capsys):
    csv = tmp_path / "labels.csv"
    csv.write_text("path,label\ncat/0.jpg,dog\ncat/1.jpg,cat\ndog/0.jpg,dog\n")
    out = tmp_path / "c"
    assert main(["build", str(src), str(out), "--labels", str(csv), "--size", "16", "--classes-from", str(built),
                 "--quiet"]) == 0
    assert main(["info", str(out), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["num_images"] == 3 and info["classes"] == ["cat", "dog"]
    assert np.load(out / "labels.npy").tolist() == [1, 0, 1]


def test_entry_points_show_help():
    for args in (["-m", "xla_utils.cache", "--help"], ["-m", "xla_utils.cli", "build", "--help"],
                 [str(ROOT / "scripts" / "tpu_cache_ds_utils.py"), "--help"]):
        r = run(*args)
        assert r.returncode == 0 and "tpu_cache_ds" in r.stdout, (args, r.stderr)
    r = run("-m", "xla_utils.cache", "build")
    assert r.returncode == 2 and "SRC" in r.stderr
    exe = shutil.which("tpu_cache_ds")
    if exe:  # only when the package is installed
        assert subprocess.run([exe, "--help"], capture_output=True).returncode == 0


def test_missing_or_broken_cache_is_a_clear_error(built, tmp_path, capsys):
    missing = tmp_path / "nothing"
    for cmd in ("info", "verify"):
        assert main([cmd, str(missing)]) == 1
        err = capsys.readouterr().err
        assert err.startswith(f"tpu_cache_ds {cmd}: error: {missing} does not exist") and "Traceback" not in err
    broken = tmp_path / "broken"
    shutil.copytree(built, broken)
    (broken / "manifest.json").write_text('{"format": "xla_utils-image-cache", "shards": [')
    assert main(["verify", str(broken)]) == 1
    err = capsys.readouterr().err
    assert f"{broken / 'manifest.json'} is not valid JSON" in err and "--overwrite" in err


def test_unlabeled_test_set(tmp_path, capsys):
    test = tmp_path / "test_images"
    test.mkdir()
    for i in range(3):
        Image.fromarray(np.full((30, 30, 3), 40 * i, np.uint8)).save(test / f"t{i}.png")
    assert main(["build", str(test), str(tmp_path / "c"), "--size", "16", "--unlabeled"]) == 0
    assert "unlabelled cache (unlabeled=True)" in capsys.readouterr().out
    assert main(["info", str(tmp_path / "c")]) == 0
    assert "labels:   none (unlabelled: a test set)" in capsys.readouterr().out
    from xla_utils.data import CachedImageDataset

    assert CachedImageDataset(tmp_path / "c").ids == ["t0.png", "t1.png", "t2.png"]


def test_unlabeled_build_says_loudly_that_skipped_images_will_be_missing(tmp_path, capsys):
    test = tmp_path / "test"
    test.mkdir()
    for i in (0, 1, 2):
        Image.fromarray(np.full((30, 30, 3), 40 * i, np.uint8)).save(test / f"img_{i}.png")
    full = test / "img_9.full.jpg"
    Image.fromarray(np.full((30, 30, 3), 90, np.uint8)).save(full)
    (test / "img_9.jpg").write_bytes(full.read_bytes()[:300])  # truncated
    full.unlink()
    assert main(["build", str(test), str(tmp_path / "c"), "--size", "16", "--unlabeled"]) == 0
    out = capsys.readouterr().out
    assert "skipped 1 image(s)" in out and "img_9.jpg" in out
    assert ("WARNING: 1 test image(s) were skipped (img_9.jpg) and will be MISSING from a submission"
            in out) and "--overwrite" in out and "missing='fill'" in out
    # --quiet hides the summary, not the missing rows (on stderr)
    assert main(["build", str(test), str(tmp_path / "q"), "--size", "16", "--unlabeled", "--quiet"]) == 0
    quiet = capsys.readouterr()
    assert quiet.out == "" and "WARNING: 1 test image(s) were skipped (img_9.jpg)" in quiet.err
    # a training build that skips an image lists it without the submission warning
    (tmp_path / "train" / "a").mkdir(parents=True)
    shutil.copy(test / "img_0.png", tmp_path / "train" / "a" / "0.png")
    shutil.copy(test / "img_9.jpg", tmp_path / "train" / "a" / "9.jpg")
    assert main(["build", str(tmp_path / "train"), str(tmp_path / "t"), "--size", "16"]) == 0
    out = capsys.readouterr().out
    assert "skipped 1 image(s)" in out and "MISSING" not in out


def test_a_misspelled_option_gets_a_suggestion(src, tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["build", str(src), str(tmp_path / "c"), "--varients", "2"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "unrecognized arguments: --varients (did you mean --variants?) 2" in err
    assert not (tmp_path / "c").exists()
    r = run("-m", "xla_utils.cache", "info", str(tmp_path), "--jsn")
    assert r.returncode == 2 and "--jsn (did you mean --json?)" in r.stderr
