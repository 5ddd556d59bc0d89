"""Builder, format, resume, verify and bad-input handling of xla_utils.cache."""
from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from xla_utils.cache import (BadImageError, BuildError, CacheConfig, build_cache, cache_info, decode_source,
                             make_variants, read_manifest, verify_cache)

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


def textured(seed: int, h: int, w: int) -> np.ndarray:
    """A smooth colour field plus grain: compresses like a photo, unlike pure noise."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w] / max(h, w)
    phase = rng.uniform(0, 6, 3)
    base = 127 + 100 * np.sin(6 * xx[..., None] + 4 * yy[..., None] + phase)
    return np.clip(base + rng.normal(0, 8, (h, w, 3)), 0, 255).astype(np.uint8)


def photos() -> list[np.ndarray]:
    import skimage.data as sd

    return [sd.astronaut(), sd.coffee(), sd.chelsea(), sd.rocket()]


def files(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.iterdir()) if not p.name.startswith(".")}


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """3 classes x 6 images: real photos (downscaled) and textured images, JPEG and PNG."""
    root = tmp_path_factory.mktemp("folder")
    pics = photos()
    for c, name in enumerate(["apple", "banana", "cherry"]):
        (root / name).mkdir()
        for i in range(6):
            k = c * 6 + i
            if i % 2:
                arr = pics[k % len(pics)]
                img = Image.fromarray(arr).resize((arr.shape[1] // 4, arr.shape[0] // 4))
                img.save(root / name / f"{i}.jpg", quality=95)
            else:
                Image.fromarray(textured(k, 60 + 5 * i, 90 - 3 * i)).save(root / name / f"{i}.png")
    (root / "apple" / "notes.txt").write_text("not an image, ignored by extension")
    return root


# ----------------------------------------------------------------------------- config


def test_config_validates_and_sizes_shards():
    with pytest.raises(ValueError, match="variants=3 with augment=False"):
        CacheConfig(variants=3, augment=False)
    with pytest.raises(ValueError, match="codec"):
        CacheConfig(codec="png")
    with pytest.raises(ValueError, match="scale"):
        CacheConfig(scale=(0.5, 0.2))
    cfg = CacheConfig(size=224, variants=4)
    assert cfg.size == (224, 224) and cfg.augment is True
    assert CacheConfig(size="256x224").size == (256, 224)
    per_image = 4 * 224 * 224 * 3
    assert cfg.images_per_shard(10**6) == 256 * 2**20 // per_image  # size-bound
    assert CacheConfig(size=224, variants=4, codec="jpeg").images_per_shard(10**6) == 256 * 2**20 // (per_image // 8)
    # A build under 16 x MIN_SHARD_BYTES of pixels has fewer shards, of at least that much each:
    # the 40 test images (6 MiB of pixels at 224) are one shard, 10,000 are 16.
    assert cfg.images_per_shard(100) == 100 and CacheConfig(size=224).images_per_shard(40) == 40
    assert CacheConfig(size=224).images_per_shard(10_000) == 625  # 16 shards: every worker has one
    assert CacheConfig(size=224).images_per_shard(500) == 250  # 75 MiB of pixels: 2 shards
    assert CacheConfig.from_dict(cfg.to_dict()) == cfg
    assert cfg.fingerprint() != CacheConfig(size=224, variants=4, seed=1).fingerprint()


def test_file_count_grows_with_bytes_not_samples(tmp_path):
    class Arrays:
        def __init__(self, n):
            self.n = n

        def __len__(self):
            return self.n

        def __getitem__(self, i):
            return np.full((8, 8, 3), i % 256, np.uint8), i % 3

    counts = {}
    for n in (200, 800):
        r = build_cache(Arrays(n), tmp_path / f"n{n}", size=8, verbose=False)
        counts[n] = r.files
    assert counts[200] == counts[800] == 1 + 2  # one shard (little data) + manifest + labels
    r = build_cache(Arrays(800), tmp_path / "small_shards", size=8, shard_size=20 * 192, verbose=False)
    assert r.num_shards == 40 and r.files == 42  # bytes / shard_size


# ----------------------------------------------------------------------------- round trips


def test_a_small_test_folder_is_one_shard_and_reads_back(tmp_path):
    """The issue's case: 40 test images (a flat folder, ~0.5 MiB of JPEGs) cached at 224 on every
    core were 14 shards; the README promises a few large ones: now one, verified and read back."""
    from xla_utils.data import CachedImageDataset

    test = tmp_path / "test"
    test.mkdir()
    for i in range(40):
        Image.fromarray(textured(i, 240, 256)).save(test / f"{i:03d}.jpg", quality=90)
    r = build_cache(test, tmp_path / "c", size=224, unlabeled=True, workers=2, verbose=False)
    assert r.num_shards == 1 and r.files == 3 and r.num_images == 40, r
    assert verify_cache(tmp_path / "c").ok
    ds = CachedImageDataset(tmp_path / "c")
    assert len(ds) == 40 and ds.ids[:2] == ["000.jpg", "001.jpg"]


def test_raw_round_trip_is_exact(tmp_path):
    from xla_utils.data import CachedImageDataset

    src = tmp_path / "src"
    arrays = {}
    for c in ("a", "b"):
        (src / c).mkdir(parents=True)
        for i in range(5):
            arr = np.random.default_rng(hash((c, i)) % 2**32).integers(0, 256, (32, 32, 3), dtype=np.uint8)
            Image.fromarray(arr).save(src / c / f"{i}.png")
            arrays[f"{c}/{i}.png"] = arr
    build_cache(src, tmp_path / "plain", size=32, verbose=False)
    ds = CachedImageDataset(tmp_path / "plain")
    assert ds.classes == ["a", "b"] and len(ds) == 10 and ds.num_variants == 1
    for n, (name, arr) in enumerate(sorted(arrays.items())):  # the builder keeps sorted order
        img, label = ds[n]
        np.testing.assert_array_equal(img, arr)
        assert label == (0 if name.startswith("a/") else 1)

    cfg = CacheConfig(size=24, variants=3, rotate=10, flip=True)
    build_cache(src, tmp_path / "aug", cfg, verbose=False)
    ds = CachedImageDataset(tmp_path / "aug")
    for n, name in enumerate(sorted(arrays)):
        expected = make_variants(decode_source(src / name, cfg)[0], cfg, n)
        for v in range(3):
            np.testing.assert_array_equal(ds.image(n, v), expected[v])


def test_jpeg_round_trip_psnr(folder, tmp_path):
    from xla_utils.data import CachedImageDataset

    for codec in ("raw", "jpeg"):
        build_cache(folder, tmp_path / codec, size=64, variants=2, codec=codec, verbose=False)
    raw, jpg = CachedImageDataset(tmp_path / "raw"), CachedImageDataset(tmp_path / "jpeg")
    assert len(raw) == len(jpg) == 18
    psnr = []
    for i in range(len(raw)):
        for v in range(2):
            mse = np.mean((raw.image(i, v).astype(np.float64) - jpg.image(i, v)) ** 2)
            psnr.append(10 * np.log10(255**2 / mse))
    assert min(psnr) >= 30.0, psnr  # documented: q90 keeps >= 30 dB on photos and textures
    assert verify_cache(tmp_path / "jpeg", full=True).ok


def test_format_jpeg_index_and_manifest_text_round_trip(folder, tmp_path):
    from xla_utils.cache.format import jpeg_shard_chunks, manifest_text, read_jpeg_index, shard_name

    jpegs = [b"\xff\xd8one", b"\xff\xd8second", b""]
    data = np.frombuffer(b"".join(jpeg_shard_chunks(jpegs)), np.uint8)
    offsets = read_jpeg_index(data)
    assert [data[offsets[k]:offsets[k + 1]].tobytes() for k in range(len(jpegs))] == jpegs
    assert offsets[-1] == len(data)
    for broken in (data[:12], np.concatenate([np.zeros(8, np.uint8), data[8:]]), data[:20]):
        with pytest.raises(ValueError):
            read_jpeg_index(broken)
    assert (shard_name("raw", 3), shard_name("jpeg", 12)) == ("shard-00003.npy", "shard-00012.jpgs")
    m = {"format": "x", "shards": [{"index": 0, "labels": [1, 2]}, {"index": 1, "labels": []}], "n": None}
    assert json.loads(manifest_text(m)) == m
    # verify --full reads a shard's index through the same function
    out = tmp_path / "j"
    build_cache(folder, out, size=32, codec="jpeg", verbose=False)
    shard = out / "shard-00000.jpgs"
    raw = bytearray(shard.read_bytes())
    raw[:8] = b"NOTJPEG!"
    shard.write_bytes(bytes(raw))
    entry = read_manifest(out)["shards"][0]
    entry_crc = zlib.crc32(bytes(raw))
    m = json.loads((out / "manifest.json").read_text())
    m["shards"][0]["crc32"] = entry_crc  # only --full can see it now
    (out / "manifest.json").write_text(json.dumps(m))
    r = verify_cache(out, full=True)
    assert not r.ok and r.bad_files == [entry["file"]] and "bad JPEG shard header" in r.problems[0]
    assert verify_cache(out).ok


def test_two_builds_are_byte_identical(folder, tmp_path):
    cfg = CacheConfig(size=40, variants=3, rotate=12, flip=True, seed=7)
    build_cache(folder, tmp_path / "one", cfg, workers=1, verbose=False)
    build_cache(folder, tmp_path / "two", cfg, workers=2, verbose=False)
    a, b = files(tmp_path / "one"), files(tmp_path / "two")
    assert a == b and len(a) == read_manifest(tmp_path / "one")["num_shards"] + 2
    jcfg = CacheConfig(size=40, codec="jpeg")
    build_cache(folder, tmp_path / "j1", jcfg, workers=1, verbose=False)
    build_cache(folder, tmp_path / "j2", jcfg, workers=2, verbose=False)
    assert files(tmp_path / "j1") == files(tmp_path / "j2")


def test_variants_are_deterministic_and_rotations_stay_inside():
    white = Image.new("RGB", (120, 80), (255, 255, 255))
    cfg = CacheConfig(size=32, variants=6, rotate=30, scale=(0.2, 1.0))
    v1, v2 = make_variants(white, cfg, 5), make_variants(white, cfg, 5)
    for a, b in zip(v1, v2):
        np.testing.assert_array_equal(a, b)
    for a in v1:
        assert a.shape == (32, 32, 3) and a.min() >= 250  # no black corners from rotation
    tex = Image.fromarray(textured(0, 80, 120))
    vs = make_variants(tex, cfg, 0)
    assert len({a.tobytes() for a in vs}) == 6
    assert make_variants(tex, cfg, 1)[0].tobytes() != vs[0].tobytes()


# ----------------------------------------------------------------------------- crash safety


SLOW_BUILD = textwrap.dedent("""
    import os, sys, time
    import numpy as np
    from xla_utils.cache import build_cache

    class Slow:
        def __len__(self):
            return 64
        def __getitem__(self, i):
            time.sleep(float(os.environ.get("DELAY", "0")))
            return np.random.default_rng(i).integers(0, 256, (40, 50, 3), dtype=np.uint8), i % 4

    build_cache(Slow(), sys.argv[1], size=24, variants=2, workers=1, shard_size=4 * 2 * 24 * 24 * 3,
                verbose=False)  # 4 images a shard: 16 shards
""")


def test_sigkill_mid_build_then_resume_is_byte_identical(tmp_path):
    script = tmp_path / "slow_build.py"
    script.write_text(SLOW_BUILD)
    out = tmp_path / "killed"
    proc = subprocess.Popen([sys.executable, str(script), str(out)], env={**ENV, "DELAY": "0.03"},
                            start_new_session=True)
    try:
        deadline = time.time() + 60
        shards = 0
        while time.time() < deadline and proc.poll() is None:
            try:
                shards = len(json.loads((out / "manifest.json").read_text())["shards"])
            except (OSError, ValueError, KeyError):
                shards = 0
            if shards >= 2:
                break
            time.sleep(0.005)
        os.killpg(proc.pid, signal.SIGKILL)  # coordinator and workers, no cleanup
    finally:
        proc.wait()
    m = read_manifest(out)
    assert not m["complete"] and 2 <= len(m["shards"]) < m["num_shards"] == 16
    assert not verify_cache(out).ok  # incomplete

    subprocess.run([sys.executable, str(script), str(out)], env=ENV, check=True, timeout=120)
    subprocess.run([sys.executable, str(script), str(tmp_path / "clean")], env=ENV, check=True, timeout=120)
    assert files(out) == files(tmp_path / "clean")
    assert not list(out.glob("*.tmp-*")) and verify_cache(out).ok


def test_verify_catches_flipped_byte_and_missing_shard(folder, tmp_path):
    out = tmp_path / "c"
    build_cache(folder, out, size=32, variants=2, shard_size=2 * 2 * 32 * 32 * 3, verbose=False)
    assert verify_cache(out).ok
    shard = out / "shard-00003.npy"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    r = verify_cache(out)
    assert not r.ok and r.bad_files == ["shard-00003.npy"] and "crc32" in r.problems[0]
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    assert verify_cache(out, full=True).ok
    (out / "shard-00005.npy").unlink()
    r = verify_cache(out)
    assert not r.ok and r.bad_files == ["shard-00005.npy"] and "missing" in r.problems[0]


# ----------------------------------------------------------------------------- bad input


def forged_bomb_png() -> bytes:
    """A 100-byte PNG whose header claims 100000 x 100000 pixels."""
    buf = io.BytesIO()
    Image.new("L", (1, 1)).save(buf, "PNG")
    b = bytearray(buf.getvalue())
    b[16:20] = (100_000).to_bytes(4, "big")
    b[20:24] = (100_000).to_bytes(4, "big")
    b[29:33] = zlib.crc32(bytes(b[12:29])).to_bytes(4, "big")
    return bytes(b)


@pytest.fixture(scope="module")
def bad_folder(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("bad")
    c = root / "cls"
    c.mkdir()
    good = io.BytesIO()
    Image.fromarray(textured(1, 48, 64)).save(good, "JPEG", quality=90)
    good = good.getvalue()
    (c / "a_good.jpg").write_bytes(good)
    (c / "b_corrupt.jpg").write_bytes(b"\xff\xd8\xff" + os.urandom(2000))
    (c / "c_truncated.jpg").write_bytes(good[: len(good) * 6 // 10])
    (c / "d_zero.jpg").write_bytes(b"")
    (c / "e_text.png").write_text("this is not a PNG")
    (c / "f_bomb.png").write_bytes(forged_bomb_png())
    Image.fromarray(textured(2, 300, 300)).save(c / "g_too_many_pixels.png")
    Image.fromarray(textured(3, 12, 20)).save(c / "h_small.png")
    Image.fromarray(textured(4, 40, 40)).convert("CMYK").save(c / "i_cmyk.jpg")
    Image.fromarray((np.arange(40 * 40).reshape(40, 40) * 40).astype(np.uint16)).save(c / "j_16bit.png")
    Image.fromarray(textured(5, 40, 40)).convert("P").save(c / "k_palette.png")
    Image.fromarray(textured(6, 40, 40)).convert("LA").save(c / "l_la.png")
    Image.fromarray(textured(7, 40, 40)).save(c / "m_good.png")
    return root


def test_bad_input_matrix_is_skipped_and_listed(bad_folder, tmp_path, capsys):
    from xla_utils.data import CachedImageDataset

    r = build_cache(bad_folder, tmp_path / "c", size=32, max_pixels=50_000, verbose=True)
    reasons = {e["path"]: e["reason"] for e in r.skipped}
    assert set(reasons) == {"cls/b_corrupt.jpg", "cls/c_truncated.jpg", "cls/d_zero.jpg", "cls/e_text.png",
                            "cls/f_bomb.png", "cls/g_too_many_pixels.png"}
    assert "truncated" in reasons["cls/c_truncated.jpg"]
    assert "bomb" in reasons["cls/f_bomb.png"].lower()
    assert "max_pixels" in reasons["cls/g_too_many_pixels.png"]
    assert "UnidentifiedImageError" in reasons["cls/d_zero.jpg"]
    assert [e["path"] for e in r.upscaled] == ["cls/h_small.png"]
    m = read_manifest(tmp_path / "c")
    assert m["complete"] and len(m["skipped"]) == 6 and m["upscaled"][0]["size"] == [20, 12]
    ds = CachedImageDataset(tmp_path / "c")
    assert len(ds) == 7 and r.num_images == 7
    printed = capsys.readouterr().out
    assert "skipped 6 image(s)" in printed and "cls/f_bomb.png" in printed and "upscaled 1" in printed


def test_small_images_can_be_skipped(bad_folder, tmp_path):
    r = build_cache(bad_folder, tmp_path / "c", size=32, small="skip", verbose=False)
    assert "smaller than the target" in {e["path"]: e["reason"] for e in r.skipped}["cls/h_small.png"]
    assert not r.upscaled


@pytest.mark.parametrize("workers", [1, 2])
def test_strict_stops_at_first_bad_file_and_keeps_finished_shards(bad_folder, tmp_path, workers):
    out = tmp_path / "c"
    with pytest.raises(BadImageError, match="cls/b_corrupt.jpg") as err:
        build_cache(bad_folder, out, size=32, strict=True, workers=workers, shard_size=32 * 32 * 3,
                    verbose=False)  # one image a shard
    assert err.value.path == "cls/b_corrupt.jpg" and err.value.index == 1  # not c_truncated.jpg (index 2)
    m = read_manifest(out)
    kept = [s["index"] for s in m["shards"]]
    # a_good.jpg (shard 0, before the bad file) is kept; shard 1 holds the bad file. A worker
    # may also have finished a later shard before the stop: kept too, never corrupted.
    assert not m["complete"] and kept[0] == 0 and 1 not in kept
    problems = verify_cache(out).problems
    assert len(problems) == 1 and problems[0].startswith("incomplete build"), problems
    before = (out / "shard-00000.npy").read_bytes()
    r = build_cache(bad_folder, out, size=32, shard_size=32 * 32 * 3, verbose=False)  # resumes
    assert r.shards_reused == len(kept) and (out / "shard-00000.npy").read_bytes() == before
    assert verify_cache(out).ok


class _SlowFirstBad:
    """32 items; item 0 is bad but slow to fail, item 5 is bad at once."""

    def __len__(self):
        return 32

    def __getitem__(self, i):
        if i == 0:
            time.sleep(1.5)
            raise OSError("slow bad item")
        if i == 5:
            raise OSError("fast bad item")
        return textured(i, 20, 20), i % 2


def test_strict_build_bar_is_titled_and_ends_its_line_before_the_error(bad_folder, tmp_path,
                                                                      monkeypatch, capsys):
    monkeypatch.setenv("XLA_UTILS_PROGRESS", "redraw")  # a terminal's bar: one line redrawn
    with pytest.raises(BadImageError):
        build_cache(bad_folder, tmp_path / "c", size=32, strict=True, workers=2, shard_size=3072)
    out = capsys.readouterr().out
    assert "build_cache: " in out and "images on 2 workers |" in out, out
    assert out.endswith("\n"), repr(out[-200:])  # the traceback starts on a line of its own


def test_strict_names_the_first_bad_item_in_source_order_not_the_first_to_fail(tmp_path):
    # Two shards of 2 items run at once: shard 2 meets item 5 long before shard 0 fails on item 0.
    with pytest.raises(BadImageError) as err:
        build_cache(_SlowFirstBad(), tmp_path / "c", size=16, strict=True, workers=2, verbose=False)
    assert (err.value.path, err.value.index) == ("dataset[0]", 0) and "slow bad item" in err.value.reason
    m = read_manifest(tmp_path / "c")
    assert not m["complete"] and 0 not in [s["index"] for s in m["shards"]]
    assert verify_cache(tmp_path / "c").problems[0].startswith("incomplete build")


def test_modes_and_orientation(bad_folder, tmp_path):
    cfg = CacheConfig(size=16, resize="stretch")
    # EXIF orientation 6: stored 40x20 with red on the left; displayed 20x40 with red on top.
    arr = np.zeros((20, 40, 3), np.uint8)
    arr[:, :20] = (255, 0, 0)
    arr[:, 20:] = (0, 0, 255)
    exif = Image.Exif()
    exif[0x0112] = 6
    Image.fromarray(arr).save(tmp_path / "rot.jpg", exif=exif, quality=95)
    img, wh = decode_source(tmp_path / "rot.jpg", cfg)
    assert img.size == (20, 40) and wh == (20, 40)
    px = np.asarray(img)
    assert px[2, 10, 0] > 200 and px[2, 10, 2] < 60 and px[37, 10, 2] > 200

    def rgb(image) -> np.ndarray:
        im, _ = decode_source(image, cfg)
        assert im.mode == "RGB"
        return np.asarray(im)

    la = Image.fromarray(np.array([[[50, 255], [50, 0]]], np.uint8), "LA")
    np.testing.assert_array_equal(rgb(la)[0], [[50, 50, 50], [255, 255, 255]])  # transparent -> white
    rgba = Image.fromarray(np.array([[[10, 20, 30, 255], [10, 20, 30, 0]]], np.uint8), "RGBA")
    np.testing.assert_array_equal(rgb(rgba)[0], [[10, 20, 30], [255, 255, 255]])
    i16 = Image.fromarray(np.array([[0, 32896, 65535]], np.uint16))
    np.testing.assert_array_equal(rgb(i16)[0, :, 0], [0, 128, 255])
    p = Image.new("P", (2, 1))
    p.putpalette([0, 0, 0, 200, 100, 50] + [0] * 762)
    p.putpixel((1, 0), 1)
    np.testing.assert_array_equal(rgb(p)[0, 1], [200, 100, 50])
    assert rgb(Image.new("L", (3, 3), 77))[0, 0].tolist() == [77, 77, 77]
    assert rgb(Image.new("1", (3, 3), 1))[0, 0].tolist() == [255, 255, 255]
    assert rgb(bad_folder / "cls" / "i_cmyk.jpg").shape == (20, 20, 3)  # JPEG draft: 1/2 scale covers 16 px
    Image.new("CMYK", (16, 16), (0, 0, 0, 0)).save(tmp_path / "white_cmyk.jpg")  # no ink = white
    assert rgb(tmp_path / "white_cmyk.jpg").min() > 240
    assert rgb(np.zeros((3, 5), np.uint8)).shape == (3, 5, 3)  # HW array
    assert rgb(np.zeros((3, 6, 5), np.uint8)).shape == (6, 5, 3)  # CHW array


def test_large_jpegs_use_reduced_decode(tmp_path):
    Image.fromarray(textured(0, 1200, 1600)).save(tmp_path / "big.jpg", quality=90)
    img, wh = decode_source(tmp_path / "big.jpg", CacheConfig(size=64))
    assert wh == (1600, 1200) and img.size == (200, 150)  # 1/8 scale still covers 64 px
    img, _ = decode_source(tmp_path / "big.jpg", CacheConfig(size=64, variants=2))  # crops need more
    assert img.size == (200, 150) and min(img.size) >= 64 / 0.5
    img, _ = decode_source(tmp_path / "big.jpg", CacheConfig(size=224, variants=2))
    assert img.size == (800, 600)


# ----------------------------------------------------------------------------- sources


def test_csv_source_multilabel_missing_files_and_ids_without_extension(tmp_path):
    from xla_utils.data import CachedImageDataset

    img_dir = tmp_path / "train_images"
    img_dir.mkdir()
    for name in ("a.jpg", "b.jpg", "c.jpg", "d.png"):
        Image.fromarray(textured(len(name) + ord(name[0]), 40, 40)).save(img_dir / name)
    rows = ["image,labels", "a.jpg,scab frog_eye", "b.jpg,healthy", "c.jpg,", "missing.jpg,scab", "d,rust"]
    (tmp_path / "training_labels.csv").write_text("\n".join(rows) + "\n")
    r = build_cache(img_dir, tmp_path / "c", labels=tmp_path / "training_labels.csv", size=16, verbose=False)
    assert [(e["path"], e["reason"]) for e in r.skipped] == [("missing.jpg", "file not found")]
    ds = CachedImageDataset(tmp_path / "c")
    assert ds.multilabel and ds.classes == ["frog_eye", "healthy", "rust", "scab"]
    y = np.stack([ds[i][1] for i in range(len(ds))])
    assert y.dtype == np.float32
    np.testing.assert_array_equal(y, [[1, 0, 0, 1], [0, 1, 0, 0], [0, 0, 0, 0], [0, 0, 1, 0]])
    np.testing.assert_array_equal(ds.source_indices, [0, 1, 2, 4])

    (img_dir / "single.csv").write_text("a.jpg,2\nb.jpg,0\n")  # SRC is the CSV; no header
    build_cache(img_dir / "single.csv", tmp_path / "s", size=16, verbose=False)
    ds = CachedImageDataset(tmp_path / "s")
    assert not ds.multilabel and ds.classes == ["0", "1", "2"] and [ds[0][1], ds[1][1]] == [2, 0]


def test_csv_of_numbers_is_a_regression_cache(tmp_path, capsys):
    """Numbers that are not all integers are regression targets (float32 [N, k], named by the
    header); integers stay classes unless task='regression'; the summary says which reading."""
    from helpers import digit_score_csv

    from xla_utils.data import CachedImageDataset

    csv_path, scores = digit_score_csv(tmp_path, 24)
    build_cache(csv_path, tmp_path / "reg", size=8)
    said = capsys.readouterr().out
    assert "regression targets (1 per image, float32, read as numbers because some are not integers" in said
    ds = CachedImageDataset(tmp_path / "reg")
    assert (ds.task, ds.targets, ds.num_targets, ds.num_classes, ds.classes) == (
        "regression", ["score"], 1, None, [])
    assert ds.labels.dtype == np.float32 and ds.labels.shape == (24, 1)
    np.testing.assert_array_equal(ds.labels[:, 0], scores)
    assert ds[3][1].dtype == np.float32 and ds[3][1].shape == (1,) and "regression" in repr(ds)
    manifest = json.loads((tmp_path / "reg" / "manifest.json").read_text())
    assert (manifest["format_version"], manifest["task"], manifest["targets"]) == (2, "regression", ["score"])
    rerun = build_cache(csv_path, tmp_path / "reg", size=8, verbose=False)  # the same cache: nothing built
    assert rerun.shards_built == 0

    ints = tmp_path / "ints.csv"
    ints.write_text("image_id,count\n" + "".join(f"img/{k}.png,{k % 3}\n" for k in range(6)))
    build_cache(ints, tmp_path / "cls", size=8)
    assert "integers read as 3 classes (task='regression'" in capsys.readouterr().out
    ds = CachedImageDataset(tmp_path / "cls")
    assert ds.task == "classification" and ds.classes == ["0", "1", "2"] and ds.labels.dtype == np.int64
    assert json.loads((tmp_path / "cls" / "manifest.json").read_text())["format_version"] == 1
    build_cache(ints, tmp_path / "count", size=8, task="Regression", verbose=False)
    ds = CachedImageDataset(tmp_path / "count")
    assert ds.targets == ["count"] and ds.labels[:, 0].tolist() == [0, 1, 2, 0, 1, 2]
    two = tmp_path / "two.csv"  # several targets per image: space-separated; a non-number: skipped
    two.write_text("".join(f"img/{k}.png,{k}.5 -{k}\n" for k in range(4)) + "img/5.png,n/a 1\n")
    r = build_cache(two, tmp_path / "two", size=8, task="regression", verbose=False)
    assert len(r.skipped) == 1 and "target 'n/a' is not a finite number" in r.skipped[0]["reason"]
    ds = CachedImageDataset(tmp_path / "two")
    assert ds.targets == ["target_0", "target_1"] and ds.labels.tolist()[1] == [1.5, -1.0]
    with pytest.raises(BuildError, match="task='regression' and classes= contradict"):
        build_cache(csv_path, tmp_path / "x", size=8, task="regression", classes=["a"], verbose=False)
    with pytest.raises(ValueError, match="did you mean 'regression'"):
        build_cache(csv_path, tmp_path / "x", size=8, task="regresion", verbose=False)


def test_dataset_sources(tmp_path):
    from xla_utils.data import CachedImageDataset

    Image.fromarray(textured(1, 30, 30)).save(tmp_path / "f.png")

    class Items:
        classes = ["zero", "one", "two"]
        items = [(Image.fromarray(textured(2, 30, 30)), 0), (textured(3, 30, 30), 1), (str(tmp_path / "f.png"), 2),
                 (None, 1)]

        def __len__(self):
            return len(self.items)

        def __getitem__(self, i):
            if self.items[i][0] is None:
                raise RuntimeError("broken sample")
            return self.items[i]

    r = build_cache(Items(), tmp_path / "c", size=16, verbose=False)
    assert r.skipped[0]["path"] == "dataset[3]" and "broken sample" in r.skipped[0]["reason"]
    ds = CachedImageDataset(tmp_path / "c")
    assert ds.classes == ["zero", "one", "two"] and [ds[i][1] for i in range(3)] == [0, 1, 2]

    multi = [(textured(i, 20, 20), np.array([1.0, 0.0, float(i % 2)])) for i in range(4)]
    build_cache(multi, tmp_path / "m", size=16, verbose=False)
    ds = CachedImageDataset(tmp_path / "m")
    assert ds.multilabel and ds.num_classes == 3
    np.testing.assert_array_equal(ds.labels, [[1, 0, 0], [1, 0, 1], [1, 0, 0], [1, 0, 1]])


TORCH_DATASET_BUILD = r"""
import sys
import numpy as np
import torch
from sklearn.datasets import load_digits
from xla_utils.cache import build_cache

torch.set_num_threads(2)  # an OpenMP team of two, as on any multi-core host
digits = load_digits()


class Digits224(torch.utils.data.Dataset):  # digits rendered at 224x224x3 by a parallel torch op

    def __len__(self):
        return 24

    def __getitem__(self, i):
        img = torch.from_numpy(digits.images[i]).repeat_interleave(28, 0).repeat_interleave(28, 1)
        img = (img[..., None].expand(224, 224, 3) * (255 / 16)).clamp(0, 255).to(torch.uint8)
        return img.numpy(), int(digits.target[i])


build_cache(Digits224(), sys.argv[1], size=32, workers=2, shard_size=16384, verbose=False)
"""


@pytest.mark.slow
def test_torch_dataset_with_parallel_ops_builds_on_several_workers(tmp_path):
    """The workers fork from a caller whose thread owns an OpenMP team (reading the dataset's item 0
    ran a parallel op): without the workers' one-thread limit their first parallel op hangs."""
    script = tmp_path / "torch_dataset_build.py"
    script.write_text(TORCH_DATASET_BUILD)
    p = subprocess.run([sys.executable, str(script), str(tmp_path / "c")], env=ENV, capture_output=True,
                       text=True, timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    assert verify_cache(tmp_path / "c").ok and read_manifest(tmp_path / "c")["num_shards"] >= 2  # a pool ran


FORK_WARNINGS = r"""
import multiprocessing, sys, threading, time, warnings
import numpy as np
from PIL import Image
from pathlib import Path
from xla_utils.cache import build_cache

root = Path(sys.argv[1])
for c in range(2):
    (root / "img" / str(c)).mkdir(parents=True)
    for i in range(4):
        Image.fromarray(np.full((20, 20, 3), 20 * i + c, np.uint8)).save(root / "img" / str(c) / f"{i}.png")
threading.Thread(target=time.sleep, args=(60,), daemon=True).start()  # a multi-threaded caller
with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    build_cache(root / "img", root / "cache", size=16, workers=2, verbose=False)
    build_cache(root / "img", root / "dry", size=16, workers=2, verbose=False, dry_run=True)
    print("builder", sum("multi-threaded" in str(w.message) for w in seen))
    p = multiprocessing.get_context("fork").Process(target=print)
    p.start(), p.join()
    print("other", sum("multi-threaded" in str(w.message) for w in seen))
"""


@pytest.mark.skipif(sys.version_info < (3, 12), reason="Python warns about forking threads since 3.12")
def test_only_the_builders_own_forks_are_quiet(tmp_path):
    """The pool's workers fork without Python's multi-threaded-fork DeprecationWarning (their hazard is
    handled, see the torch dataset test above); any other fork in the same process still warns."""
    script = tmp_path / "fork_warnings.py"
    script.write_text(FORK_WARNINGS)
    p = subprocess.run([sys.executable, str(script), str(tmp_path)], env=ENV, capture_output=True,
                       text=True, timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.split() == ["builder", "0", "other", "1"], p.stdout


def test_flat_folder_is_unlabelled_and_classes_can_be_fixed(folder, tmp_path):
    from xla_utils.data import CachedImageDataset

    flat = tmp_path / "test_images"
    flat.mkdir()
    for i in range(3):
        Image.fromarray(textured(i, 20, 20)).save(flat / f"{i}.png")
    build_cache(flat, tmp_path / "t", size=16, verbose=False)
    ds = CachedImageDataset(tmp_path / "t")
    assert ds.classes == [] and ds[0][1] == -1

    r = build_cache(folder, tmp_path / "v", size=16, classes=["banana", "cherry", "apple", "durian"], verbose=False)
    assert len(r.skipped) == 0
    ds = CachedImageDataset(tmp_path / "v")
    assert ds.classes[:3] == ["banana", "cherry", "apple"] and ds[0][1] == 2  # apple images first on disk
    r = build_cache(folder, tmp_path / "w", size=16, classes=["apple"], verbose=False)
    assert len(r.skipped) == 12 and "not in the given classes" in r.skipped[0]["reason"]


# ----------------------------------------------------------------------------- resume rules


def test_rerun_reuses_and_other_config_is_refused(folder, tmp_path):
    out = tmp_path / "c"
    first = build_cache(folder, out, size=32, verbose=False)
    before = files(out)
    again = build_cache(folder, out, size=32, verbose=False)
    assert again.shards_built == 0 and again.shards_reused == first.num_shards and files(out) == before
    with pytest.raises(BuildError, match=r"size: \[32, 32\] -> \[48, 48\].*--overwrite"):
        build_cache(folder, out, size=48, verbose=False)
    assert files(out) == before  # refused without touching anything
    r = build_cache(folder, out, size=48, overwrite=True, verbose=False)
    assert r.shards_built == r.num_shards and read_manifest(out)["image_size"] == [48, 48]
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "thesis.tex").write_text("precious")
    with pytest.raises(BuildError, match="not empty"):
        build_cache(folder, tmp_path / "foreign", size=32, verbose=False)


def _read_only_command(kind: str, folder: Path) -> list[str] | None:
    """A command prefix that runs a program with ``folder`` really read-only, or None.

    ``erofs``: a read-only bind mount in a private user + mount namespace (like
    Kaggle's /kaggle/input; works as root and as a normal user where user namespaces
    are allowed). ``eacces``: ``chmod -R a-w``; root ignores permission bits, so as root
    the program runs without the capabilities that bypass them.
    """
    if kind == "erofs":
        if not shutil.which("unshare"):
            return None
        prefix = ["unshare", "-Urm", "sh", "-c",
                  'mount --bind "$0" "$0" && mount -o remount,ro,bind "$0" "$0" && exec "$@"', str(folder)]
    else:
        subprocess.run(["chmod", "-R", "a-w", str(folder)], check=True)
        prefix = []
        if os.geteuid() == 0:
            if not shutil.which("setpriv"):
                return None
            caps = "-dac_override,-dac_read_search,-fowner"
            prefix = ["setpriv", f"--bounding-set={caps}", f"--inh-caps={caps}"]
    probe = folder / "probe"
    p = subprocess.run(prefix + [sys.executable, "-c", f"open({str(probe)!r}, 'w')"], capture_output=True,
                       text=True, timeout=60)
    if p.returncode == 0 or ("Read-only file system" if kind == "erofs" else "Permission denied") not in p.stderr:
        with contextlib.suppress(OSError):
            probe.unlink()
        return None
    return prefix


def _snapshot(folder: Path) -> dict[str, tuple[int, int, bytes]]:
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns, p.read_bytes())
            for p in sorted(folder.rglob("*")) if p.is_file()}


READ_ONLY_SESSION = textwrap.dedent("""
    import json, sys
    from xla_utils.cache import BuildError, build_cache
    from xla_utils.cli import main
    from xla_utils.data import CachedImageDataset

    src, ro = sys.argv[1], sys.argv[2]
    res = {}
    r = build_cache(src, ro + "/complete", size=32, verbose=True)  # the same build again: nothing to do
    res["rerun"] = [r.shards_built, r.shards_reused, r.num_images, len(CachedImageDataset(ro + "/complete"))]
    for name, folder, size in (("other_config", "complete", 48), ("partial", "partial", 32), ("new", "new/c", 32)):
        try:
            build_cache(src, f"{ro}/{folder}", size=size, verbose=False)
            res[name] = "built?!"
        except BuildError as e:
            res[name] = str(e)
    res["cli"] = main(["build", src, ro + "/new/c", "--size", "32", "--quiet"])
    print(json.dumps(res))
""")


@pytest.mark.parametrize("kind", ["erofs", "eacces"])
def test_read_only_folder_reruns_a_complete_cache_and_refuses_clearly(folder, tmp_path, kind):
    ro = tmp_path / "ro"
    first = build_cache(folder, ro / "complete", size=32, verbose=False)
    build_cache(folder, ro / "partial", size=32, verbose=False)
    (ro / "partial" / "shard-00000.npy").unlink()  # an unfinished copy: needs writing to finish
    before = _snapshot(ro)
    try:
        prefix = _read_only_command(kind, ro)
        if prefix is None:
            pytest.skip(f"cannot make a {kind} read-only folder on this machine")
        p = subprocess.run(prefix + [sys.executable, "-c", READ_ONLY_SESSION, str(folder), str(ro)], env=ENV,
                           capture_output=True, text=True, timeout=300)
    finally:
        subprocess.run(["chmod", "-R", "u+w", str(ro)], check=True)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(p.stdout.strip().splitlines()[-1])
    assert res["rerun"] == [0, first.num_shards, 18, 18]
    assert "cached 18 of 18 images" in p.stdout  # the usual summary
    for name, folder_name in (("other_config", "complete"), ("partial", "partial"), ("new", "new/c")):
        msg = res[name]
        assert f"cannot write to {ro / folder_name}" in msg and "read-only" in msg, msg
        assert "/kaggle/working/" in msg and "Nothing was written" in msg, msg
    assert "size: [32, 32] -> [48, 48]" in res["other_config"] and "unfinished" in res["partial"]
    assert res["cli"] == 1 and f"cannot write to {ro / 'new' / 'c'}" in p.stderr
    assert _snapshot(ro) == before  # no .lock, no temp file, nothing changed or lost


def test_missing_shard_of_a_complete_cache_is_rebuilt_by_a_rerun(folder, tmp_path):
    out = tmp_path / "c"
    build_cache(folder, out, size=32, shard_size=2 * 32 * 32 * 3, verbose=False)  # 9 shards
    before = files(out)
    (out / "shard-00004.npy").unlink()
    r = build_cache(folder, out, size=32, shard_size=2 * 32 * 32 * 3, verbose=False)
    assert r.shards_built == 1 and r.shards_reused == r.num_shards - 1
    assert files(out) == before and verify_cache(out).ok


def test_broken_manifest_names_the_file_and_the_fix(folder, tmp_path):
    from xla_utils.data import CachedImageDataset

    out = tmp_path / "c"
    build_cache(folder, out, size=32, verbose=False)
    text = (out / "manifest.json").read_text()
    (out / "manifest.json").write_text(text[: len(text) // 2])  # cut short, as by a full disk
    for call in (read_manifest, cache_info, verify_cache, CachedImageDataset):
        with pytest.raises(ValueError) as err:
            call(out)
        assert not isinstance(err.value, json.JSONDecodeError)
        msg = str(err.value)
        assert str(out / "manifest.json") in msg and "is not valid JSON" in msg, msg
        assert "--overwrite" in msg and "tpu_cache_ds verify" in msg, msg
    (out / "manifest.json").write_text(json.dumps({**json.loads(text), "shards": None} | {"shards": 1})
                                       .replace('"shards": 1', '"shard": 1'))
    with pytest.raises(ValueError, match=r"manifest.json lacks shards: .*--overwrite"):
        read_manifest(out)
    with pytest.raises(BuildError, match=r"manifest.json is unreadable.*overwrite=True"):
        build_cache(folder, out, size=32, verbose=False)
    r = build_cache(folder, out, size=32, overwrite=True, verbose=False)
    assert r.shards_built == r.num_shards and verify_cache(out).ok


def test_build_report_repr_is_short(bad_folder, tmp_path):
    r = build_cache(bad_folder, tmp_path / "c", size=32, verbose=False)
    text = repr(r)
    assert str(tmp_path / "c") in text and "8 of 13 images" in text and "skipped 5" in text
    assert len(text.splitlines()) <= 6
    many = dataclasses.replace(r, skipped=r.skipped * 1000, upscaled=r.upscaled * 1000)
    assert len(many.skipped) == 5000  # the full lists stay available
    text = repr(many)
    assert len(text.splitlines()) <= 6 and len(text) < 1000 and "skipped 5,000" in text


def test_dry_run_estimates_without_writing(folder, tmp_path):
    est = build_cache(folder, tmp_path / "none", size=32, variants=2, dry_run=True, verbose=False)
    assert not (tmp_path / "none").exists()
    r = build_cache(folder, tmp_path / "real", size=32, variants=2, verbose=False)
    assert est.num_shards == r.num_shards and est.num_sources == 18
    shard_bytes = r.bytes - (tmp_path / "real" / "manifest.json").stat().st_size - 128 - 18 * 8
    assert abs(est.estimated_bytes - shard_bytes) / shard_bytes < 0.05
    assert est.estimated_seconds > 0 and "fresh" in est.existing
    info = cache_info(tmp_path / "real")
    assert info["num_images"] == 18 and info["files"] == r.files and info["bytes"] == r.bytes


def test_building_imports_neither_torch_nor_torch_xla(folder, tmp_path):
    code = textwrap.dedent(f"""
        import sys
        from xla_utils import build_cache
        from xla_utils.cli import main
        build_cache({str(folder)!r}, {str(tmp_path / 'a')!r}, size=16, variants=2, verbose=False)
        assert main(["build", {str(folder)!r}, {str(tmp_path / 'b')!r}, "--size", "16", "--quiet"]) == 0
        assert main(["verify", {str(tmp_path / 'b')!r}]) == 0
        assert main(["info", {str(tmp_path / 'b')!r}, "--json"]) == 0
        bad = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "torch_xla", "torchvision"))
        assert not bad, bad
    """)
    subprocess.run([sys.executable, "-c", code], env=ENV, check=True, timeout=120, capture_output=True)


# ----------------------------------------------------------------------------- ids, unlabelled caches


def test_every_cache_records_image_ids_in_dataset_order(folder, tmp_path):
    from xla_utils.data import CachedImageDataset

    build_cache(folder, tmp_path / "f", size=16, verbose=False)
    ds = CachedImageDataset(tmp_path / "f")
    expected = [f"{c}/{p.name}" for c in ("apple", "banana", "cherry") for p in sorted((folder / c).iterdir())
                if p.suffix != ".txt"]
    assert ds.ids == expected and len(ds.ids) == len(ds) == 18

    img_dir = tmp_path / "imgs"
    img_dir.mkdir()
    for name in ("x1.jpg", "x2.jpg", "x3.png"):
        Image.fromarray(textured(len(name), 30, 30)).save(img_dir / name)
    # ids are the CSV's values as written (x2 without extension), skipped rows left out
    (tmp_path / "l.csv").write_text("image_id,label\nx3.png,b\nx2,a\nmissing.jpg,a\nx1.jpg,b\n")
    build_cache(img_dir, tmp_path / "c", labels=tmp_path / "l.csv", size=16, verbose=False)
    ds = CachedImageDataset(tmp_path / "c")
    assert ds.ids == ["x3.png", "x2", "x1.jpg"] and list(ds.labels) == [1, 0, 1]

    items = [(textured(i, 20, 20), i % 2) for i in range(5)]
    items[2] = (None, 0)  # skipped: its index is not an id
    build_cache(items, tmp_path / "d", size=16, verbose=False)
    ds = CachedImageDataset(tmp_path / "d")
    assert ds.ids == ["0", "1", "3", "4"]


def test_unlabeled_test_sets_folder_csv_and_dataset(tmp_path, capsys):
    from xla_utils.data import CachedImageDataset

    test = tmp_path / "test_images"
    (test / "sub").mkdir(parents=True)
    for name in ("b.png", "a.png", "sub/c.png"):
        Image.fromarray(textured(len(name) + ord(name[0]), 24, 24)).save(test / name)
    (test / "readme.txt").write_text("ignored")
    r = build_cache(test, tmp_path / "u", size=16, unlabeled=True)
    out = capsys.readouterr().out
    assert r.unlabeled and "unlabelled cache (unlabeled=True)" in out and "WARNING" not in out
    ds = CachedImageDataset(tmp_path / "u")
    assert ds.unlabeled and ds.ids == ["a.png", "b.png", "sub/c.png"] and ds.classes == []
    assert (ds.labels == -1).all() and "unlabelled" in repr(ds)
    assert cache_info(tmp_path / "u")["unlabeled"] is True

    # Kaggle's sample_submission.csv as the source: first column = ids without extension
    (test / "sample_submission.csv").write_text("image_id,healthy,rust\nb,0.5,0.5\na,0.5,0.5\n")
    build_cache(test / "sample_submission.csv", tmp_path / "s", size=16, unlabeled=True, verbose=False,
                classes=["healthy", "rust"])
    ds = CachedImageDataset(tmp_path / "s")
    assert ds.ids == ["b", "a"] and ds.unlabeled and ds.classes == ["healthy", "rust"]
    np.testing.assert_array_equal(ds.image(0), CachedImageDataset(tmp_path / "u").image(1))

    # a dataset of bare images (or (image, anything) tuples)
    build_cache([textured(i, 20, 20) for i in range(3)], tmp_path / "d", size=16, unlabeled=True, verbose=False)
    ds = CachedImageDataset(tmp_path / "d")
    assert ds.unlabeled and ds.ids == ["0", "1", "2"] and len(ds) == 3

    with pytest.raises(BuildError, match="contradict"):
        build_cache(test, tmp_path / "x", labels=test / "sample_submission.csv", unlabeled=True)


def test_flat_folder_without_labels_warns_and_says_how_to_label(tmp_path, capsys):
    """Kaggle's train_images/ + train.csv with the CSV forgotten: not silently -1 labels."""
    from xla_utils.data import CachedImageDataset

    flat = tmp_path / "train_images"
    flat.mkdir()
    for i in range(4):
        Image.fromarray(textured(i, 20, 20)).save(flat / f"{i}.png")
    r = build_cache(flat, tmp_path / "t", size=16)
    out = capsys.readouterr().out
    assert r.unlabeled and "UNLABELLED" in out
    assert 'labels="train.csv"' in out and "--labels" in out and "unlabeled=True" in out
    assert CachedImageDataset(tmp_path / "t").unlabeled
    # saying it was meant (a test set) reuses the finished cache and drops the warning
    r = build_cache(flat, tmp_path / "t", size=16, unlabeled=True)
    out = capsys.readouterr().out
    assert r.shards_built == 0 and "WARNING" not in out


def test_old_caches_without_ids(tmp_path):
    from xla_utils.data import CachedImageDataset

    flat = tmp_path / "imgs"
    flat.mkdir()
    for i in range(3):
        Image.fromarray(textured(i, 20, 20)).save(flat / f"{i}.png")
    build_cache(flat, tmp_path / "f", size=16, verbose=False)
    build_cache([(textured(i, 20, 20), 0) for i in range(3)], tmp_path / "d", size=16, verbose=False)
    for name in ("f", "d"):  # as an older xla_utils wrote them
        m = json.loads((tmp_path / name / "manifest.json").read_text())
        m.pop("unlabeled")
        for s in m["shards"]:
            s.pop("ids")
        (tmp_path / name / "manifest.json").write_text(json.dumps(m))
    assert CachedImageDataset(tmp_path / "d").ids == ["0", "1", "2"]
    old = CachedImageDataset(tmp_path / "f")
    assert old.unlabeled  # every label -1
    with pytest.raises(ValueError, match="did not record image ids.*overwrite=True"):
        old.ids
