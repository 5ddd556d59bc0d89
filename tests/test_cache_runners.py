"""Builds on Ray (xla_utils.cache.runners) against a real 2-node Ray cluster that this module starts
on 127.0.0.1 (`ray start --head` and `ray start --address=...`, each in its own process group, stopped
by their process ids): the same bytes as the local pool, bad images skipped and reported as locally.
Ray is heavy on a 2-core machine: one test, marked slow."""
from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from xla_utils.cache import CacheConfig, build_cache, read_manifest
from xla_utils.cache.storage import Store, load_manifest

from conftest import free_port

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def _stop(proc: subprocess.Popen) -> None:
    with __import__("contextlib").suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        pass
    with __import__("contextlib").suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # ray's daemons that outlived the TERM
    proc.wait()


@pytest.fixture(scope="module")
def ray_cluster(gcs_emulator):
    """HOST:PORT of a 2-node Ray cluster (1 CPU each) whose workers import this checkout and see the
    GCS emulator; this process is connected to it as the driver."""
    ray = pytest.importorskip("ray")
    port = free_port()
    ray_bin = str(Path(sys.executable).with_name("ray"))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "RAY_USAGE_STATS_ENABLED": "0"}
    common = ["--node-ip-address=127.0.0.1", "--num-cpus=1", "--object-store-memory=80000000", "--block",
              "--disable-usage-stats"]
    temp = f"/tmp/xlr-{secrets.token_hex(3)}"
    head = subprocess.Popen([ray_bin, "start", "--head", f"--port={port}", "--include-dashboard=false",
                             f"--temp-dir={temp}", *common], env=env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    procs = [head]
    try:
        time.sleep(3)
        procs.append(subprocess.Popen([ray_bin, "start", f"--address=127.0.0.1:{port}", *common], env=env,
                                      start_new_session=True, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL))
        address = f"127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            try:
                ray.init(address=address, log_to_driver=False, logging_level="ERROR")
                break
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(1)
        while sum(n["Alive"] for n in ray.nodes()) < 2:
            assert time.monotonic() < deadline, "the second Ray node did not join"
            time.sleep(0.5)
        yield address
    finally:
        if ray.is_initialized():
            ray.shutdown()
        for p in reversed(procs):
            _stop(p)


@pytest.fixture(scope="module")
def pictures(tmp_path_factory) -> Path:
    """2 classes x 10 images, one of them a broken file."""
    root = tmp_path_factory.mktemp("pics")
    rng = np.random.default_rng(1)
    for c in ("a", "b"):
        (root / c).mkdir()
        for i in range(10):
            Image.fromarray(rng.integers(0, 256, (20 + i, 26, 3), dtype=np.uint8)).save(root / c / f"{i}.png")
    (root / "b" / "3.png").write_bytes(b"\x89PNG\r\n\x1a\n not really")
    return root


@pytest.mark.timeout(600)
def test_ray_build_on_two_nodes_gives_the_local_bytes(ray_cluster, pictures, gcs_emulator, tmp_path):
    cfg = CacheConfig(size=16, variants=2, seed=2)
    local = build_cache(pictures, tmp_path / "local", cfg, workers=2, verbose=False)
    on_ray = build_cache(pictures, tmp_path / "ray", cfg, engine="ray", ray_address=ray_cluster, verbose=False)
    url = gcs_emulator()
    to_gs = build_cache(pictures, url, cfg, engine="ray", ray_address=ray_cluster, verbose=False)
    shards = sorted(p.name for p in (tmp_path / "local").glob("shard-*"))
    assert len(shards) == local.num_shards == on_ray.num_shards == to_gs.num_shards == 10
    st = Store(url)
    for name in shards:
        want = (tmp_path / "local" / name).read_bytes()
        assert (tmp_path / "ray" / name).read_bytes() == want and st.read_bytes(name) == want
    # the bad image is skipped and reported as locally; labels and ids agree
    for m in (read_manifest(tmp_path / "ray"), load_manifest(url)):
        assert m["skipped"] == read_manifest(tmp_path / "local")["skipped"] and len(m["skipped"]) == 1
        assert m["complete"] and [s["ids"] for s in m["shards"]] == [
            s["ids"] for s in read_manifest(tmp_path / "local")["shards"]]
    assert (tmp_path / "ray" / "labels.npy").read_bytes() == (tmp_path / "local" / "labels.npy").read_bytes()
    # both nodes took part
    import ray
    assert sum(n["Alive"] for n in ray.nodes()) == 2
