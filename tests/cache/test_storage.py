"""xla_utils.cache.storage and builds into / reads from gs:// against a real GCS emulator
(tests/conftest.py starts it on 127.0.0.1; no mock of gcsfs or of the storage API)."""
from __future__ import annotations

import json
import os
import re
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

from xla_utils.cache import BuildError, CacheConfig, build_cache, cache_info, read_manifest, verify_cache
from xla_utils.cache.storage import Store, StorageError, is_url, load_manifest
from xla_utils.cli import main

ROOT = Path(__file__).resolve().parents[2]


def env(**extra: str) -> dict[str, str]:
    """This process's environment (the emulator's address included) for a child Python."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]), **extra}


def local_files(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.iterdir()) if p.name.startswith("shard-")}


def gs_files(url: str) -> dict[str, bytes]:
    st = Store(url)
    return {n: st.read_bytes(n) for n in st.listdir() if n.startswith("shard-")}


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> Path:
    """2 classes x 8 small PNG/JPEG images."""
    root = tmp_path_factory.mktemp("imgs")
    rng = np.random.default_rng(0)
    for c in ("cat", "dog"):
        (root / c).mkdir()
        for i in range(8):
            arr = np.broadcast_to(rng.integers(0, 256, (1, 1, 3)), (30 + i, 40, 3))
            arr = np.clip(arr.astype(int) + rng.integers(-20, 20, arr.shape), 0, 255).astype(np.uint8)
            Image.fromarray(arr).save(root / c / (f"{i}.png" if i % 2 else f"{i}.jpg"))
    return root


def test_urls_and_sizes_are_recognised():
    assert is_url("gs://b/x") and is_url("s3://b") and not is_url("/tmp/x") and not is_url("gs:/b/x")
    with pytest.raises(ImportError, match=r"nosuchproto://.*pip install"):
        Store("nosuchproto://bucket/cache")
    with pytest.raises(ImportError, match="s3fs"):
        import importlib.util
        if importlib.util.find_spec("s3fs") is not None:
            raise ImportError("s3fs is installed here")
        build_cache(".", "s3://bucket/cache")
    assert CacheConfig(shard_size="256MiB").shard_size == 256 * 2**20
    assert CacheConfig(shard_size="1.5MB").shard_size == 1_500_000
    with pytest.raises(ValueError, match="not a size"):
        CacheConfig(shard_size="lots")


@pytest.mark.parametrize("kind", ["local", "gs"])
def test_store_publish_list_read_and_checked_download(kind, gcs_emulator, tmp_path):
    st = Store(tmp_path / "root") if kind == "local" else Store(gcs_emulator())
    st.mkdir()
    data = np.arange(100_000, dtype=np.uint8)
    n, crc = st.write("a.bin", [b"head", data])
    assert (n, crc) == (100_004, zlib.crc32(data.tobytes(), zlib.crc32(b"head")))
    assert st.sizes() == {"a.bin": 100_004} and st.exists("a.bin") and not st.exists("b.bin")
    assert st.read_bytes("a.bin", 2, 6) == b"ad\x00\x01"
    assert st.read_ranges("a.bin", [(0, 4), (4, 6)]) == [b"head", b"\x00\x01"]
    assert st.crc32("a.bin") == crc
    st.download("a.bin", tmp_path / "copy", 100_004, crc)
    assert (tmp_path / "copy").read_bytes() == b"head" + data.tobytes()
    with pytest.raises(StorageError, match="a.bin.*crc32.*damaged"):
        import xla_utils.cache.storage as storage
        old = storage.retry.__defaults__
        storage.retry.__defaults__ = (2, 0.01)  # two quick tries, not five
        try:
            st.download("a.bin", tmp_path / "bad", 100_004, crc ^ 1)
        finally:
            storage.retry.__defaults__ = old
    assert not [p for p in tmp_path.iterdir() if p.name not in ("copy", "root")]  # no partial download left
    st.remove("a.bin")
    assert st.sizes() == {}


def test_build_into_gs_gives_the_local_bytes_and_cli_reads_it(images, gcs_emulator, tmp_path, capsys):
    url = gcs_emulator()
    cfg = CacheConfig(size=24, variants=2, seed=3, shard_size=2 * 24 * 24 * 3)  # one image a shard
    local = build_cache(images, tmp_path / "local", cfg, workers=2, verbose=False)
    remote = build_cache(images, url, cfg, workers=2, verbose=False)
    assert remote.num_images == local.num_images == 16 and remote.path == url
    assert gs_files(url) == local_files(tmp_path / "local") and len(gs_files(url)) == remote.num_shards
    st = Store(url)
    assert not [n for n in st.listdir() if ".tmp-" in n or n == ".lock"]  # temporaries and lock gone
    m = load_manifest(url)
    assert m["complete"] and all(s.get("crc32c") for s in m["shards"])
    assert cache_info(url)["bytes"] == remote.bytes and verify_cache(url, full=True).ok
    assert main(["verify", url, "--full"]) == 0 and main(["info", url]) == 0
    assert url in capsys.readouterr().out
    again = build_cache(images, url, cfg, verbose=False)  # complete: nothing rebuilt
    assert again.shards_built == 0
    # a corrupted object: verify names it; a rerun rebuilds it (its store checksum changed)
    name = m["shards"][1]["file"]
    blob = bytearray(st.read_bytes(name))
    blob[200] ^= 0xFF
    st.fs.pipe_file(st._k(name), bytes(blob))
    r = verify_cache(url)
    assert not r.ok and r.bad_files == [name]
    m2 = dict(m, complete=False)
    from xla_utils.cache.format import manifest_text
    st.write("manifest.json", [manifest_text(m2).encode()])
    rerun = build_cache(images, url, cfg, workers=1, verbose=False)
    assert rerun.shards_built == 1 and verify_cache(url).ok and gs_files(url) == local_files(tmp_path / "local")


def test_build_into_gs_is_refused_while_locked_and_names_a_missing_bucket(images, gcs_emulator):
    url = gcs_emulator()
    st = Store(url)
    st.fs.pipe_file(st._k(".lock"), json.dumps({"token": "x", "host": "elsewhere", "pid": 1,
                                                "time": time.time()}).encode())
    with pytest.raises(BuildError, match=r"another build is writing gs://.*\.lock"):
        build_cache(images, url, size=16, verbose=False)
    assert st.listdir() == [".lock"]
    # a lock whose heartbeat stopped long ago is stale: taken over
    st.fs.pipe_file(st._k(".lock"), json.dumps({"token": "x", "host": "elsewhere", "pid": 1,
                                                "time": time.time() - 3600}).encode())
    assert build_cache(images, url, size=16, verbose=False).num_images == 16
    with pytest.raises(StorageError, match=r"gs://no-such-bucket-xyz.*does not exist"):
        build_cache(images, "gs://no-such-bucket-xyz/cache", size=16, verbose=False)
    with pytest.raises(FileNotFoundError, match=r"holds no xla_utils image cache.*build_cache"):
        cache_info(gcs_emulator())


SLOW_BUILD = textwrap.dedent("""
    import os, sys, time
    import numpy as np
    from xla_utils.cache import build_cache

    class Slow:
        def __len__(self):
            return 48
        def __getitem__(self, i):
            time.sleep(float(os.environ.get("DELAY", "0")))
            return np.random.default_rng(i).integers(0, 256, (40, 50, 3), dtype=np.uint8), i % 4

    build_cache(Slow(), sys.argv[1], size=24, variants=2, workers=1, shard_size=3 * 2 * 24 * 24 * 3,
                verbose=False)  # 16 shards of 3
""")


def test_gs_build_killed_mid_way_resumes_to_the_same_bytes(gcs_emulator, tmp_path):
    script = tmp_path / "slow_build.py"
    script.write_text(SLOW_BUILD)
    url = gcs_emulator()
    st = Store(url)
    proc = subprocess.Popen([sys.executable, str(script), url], env=env(DELAY="0.05"),
                            start_new_session=True)
    try:
        deadline = time.time() + 120
        while time.time() < deadline and proc.poll() is None:
            try:
                if len(json.loads(st.read_bytes("manifest.json"))["shards"]) >= 2:
                    break
            except (OSError, ValueError, KeyError):
                pass
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGKILL)  # coordinator and workers, no cleanup: the lock stays
    finally:
        proc.wait()
    m = load_manifest(url)
    assert not m["complete"] and 2 <= len(m["shards"]) < m["num_shards"]
    done = len(m["shards"])
    # the dead build's lock is recognised (same host, its process is gone) and taken over
    subprocess.run([sys.executable, str(script), url], env=env(), check=True, timeout=300)
    m = load_manifest(url)
    assert m["complete"] and verify_cache(url).ok
    subprocess.run([sys.executable, str(script), str(tmp_path / "clean")], env=env(), check=True, timeout=300)
    assert gs_files(url) == local_files(tmp_path / "clean")
    assert done < m["num_shards"] and not [n for n in st.listdir() if ".tmp-" in n or n == ".lock"]


def test_build_from_a_gs_folder_and_a_csv_of_urls_gives_the_local_bytes(images, gcs_emulator, tmp_path):
    src = gcs_emulator()
    st = Store(src)
    for p in sorted(images.rglob("*")):
        if p.is_file():
            st.write(p.relative_to(images).as_posix(), [p.read_bytes()])
    st.write("readme.txt", [b"not an image"])
    cfg = CacheConfig(size=24, variants=2, seed=3, shard_size=2 * 24 * 24 * 3)  # one image a shard
    local = build_cache(images, tmp_path / "local", cfg, workers=2, verbose=False)
    url = gcs_emulator()
    r = build_cache(src, url, cfg, workers=2, verbose=False)  # gs:// -> gs://
    assert r.num_images == local.num_images == 16
    assert gs_files(url) == local_files(tmp_path / "local")
    m, lm = load_manifest(url), read_manifest(tmp_path / "local")
    assert [s["ids"] for s in m["shards"]] == [s["ids"] for s in lm["shards"]] and m["classes"] == ["cat", "dog"]
    assert m["source"]["fingerprint"] == lm["source"]["fingerprint"] and m["source"]["path"] == src
    # a local CSV of URLs
    csv = tmp_path / "list.csv"
    csv.write_text("path,label\n" + "".join(f"{src}/{c}/{i}.{'png' if i % 2 else 'jpg'},{c}\n"
                                            for c in ("cat", "dog") for i in range(8)))
    build_cache(csv, tmp_path / "from_csv", cfg, workers=1, verbose=False)
    assert local_files(tmp_path / "from_csv") == local_files(tmp_path / "local")
    with pytest.raises(BuildError, match=r"no objects under gs://"):
        build_cache(gcs_emulator(), tmp_path / "none", cfg, verbose=False)


def test_transient_errors_are_retried_with_backoff_and_others_are_not():
    from xla_utils.cache.storage import retry

    calls = []

    def flaky():
        calls.append(time.monotonic())
        if len(calls) < 3:
            raise ConnectionResetError("connection dropped mid-download")
        return "ok"

    assert retry(flaky, "reading gs://b/x", base_delay=0.01) == "ok" and len(calls) == 3

    def always():
        raise TimeoutError("read timed out")

    with pytest.raises(StorageError, match=r"reading gs://b/x failed 3 times.*TimeoutError.*rerun later"):
        retry(always, "reading gs://b/x", attempts=3, base_delay=0.001)
    missing = []

    def gone():
        missing.append(1)
        raise FileNotFoundError("gs://b/x")

    with pytest.raises(FileNotFoundError):
        retry(gone, "reading gs://b/x", base_delay=0.001)
    assert len(missing) == 1  # not retried


def test_missing_or_bad_credentials_are_named_before_anything_runs(images, gcs_emulator, tmp_path, monkeypatch,
                                                                    capsys):
    import fsspec

    url = gcs_emulator()
    missing, garbage = tmp_path / "no-key.json", tmp_path / "key.json"
    garbage.write_text("not json")
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(missing))
    for call in (lambda: build_cache(images, url, verbose=False), lambda: load_manifest(url)):
        with pytest.raises(StorageError, match=rf"no credentials for {url}: GOOGLE_APPLICATION_CREDENTIALS="
                                               rf"{missing} names no file.*gcloud auth application-default login"):
            call()
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(garbage))
    with pytest.raises(StorageError, match=rf"{garbage} is not a Google credentials file"):
        build_cache(images, url, verbose=False)
    monkeypatch.delenv("GOOGLE_APPLICATION_CREDENTIALS")
    # fsspec's own setting (FSSPEC_GCS_TOKEN): gcsfs would send a missing path as an access token
    monkeypatch.setitem(fsspec.config.conf, "gcs", {"token": str(missing)})
    assert main(["info", url]) != 0
    assert re.search(r"error: no credentials for gs://.*fsspec's gcs token setting \(FSSPEC_GCS_TOKEN\)=.*names no "
                     r"file", capsys.readouterr().err)
    monkeypatch.delitem(fsspec.config.conf, "gcs")
    assert Store(url).listdir() == []  # nothing was written
