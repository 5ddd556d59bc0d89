"""Builds on Ray (xla_utils.cache.runners) against a real 2-node Ray cluster that this module starts
on 127.0.0.1 (`ray start --head` and `ray start --address=...`, each in its own process group, stopped
by their process ids): the same bytes as the local pool, bad images skipped and reported as locally.
Ray is heavy on a 2-core machine: one test, marked slow."""
from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from PIL import Image

from xla_utils.cache import CacheConfig, build_cache, read_manifest
from xla_utils.cache.storage import Store, load_manifest

from local_servers import free_port, ray_connect, start_ray_node, stop, wait_port, wait_ray_nodes
from slow_images import SlowImages

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ray_cluster(gcs_emulator):
    """A 2-node Ray cluster (1 CPU each) whose workers import this checkout (and ``tests/``) and see the
    GCS emulator; this process is connected to it as the driver. ``.address`` (HOST:PORT), ``.worker``
    (the second node's ``ray start --block`` process, leader of its process group), ``.worker_node``
    (that node's Ray id)."""
    ray = pytest.importorskip("ray")
    port = free_port()
    path = os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])
    # the head's GCS checks each node every second and declares it dead after 3 checks in a row
    # fail (Ray's defaults: every 3 s, 5 failures; each check's own 10 s timeout is kept, so
    # a busy node is not taken for a dead one): the killed node is found in about 3 s, not 15
    env = {**os.environ, "PYTHONPATH": path, "RAY_USAGE_STATS_ENABLED": "0",
           "RAY_health_check_period_ms": "1000", "RAY_health_check_failure_threshold": "3"}
    head_temp_dir = f"/tmp/xlr-{secrets.token_hex(3)}"
    procs = [start_ray_node(port, env, head_temp_dir=head_temp_dir)]
    try:
        wait_port(port, procs[0], 120)  # the head's GCS: the second node joins it there
        procs.append(start_ray_node(port, env))
        address = f"127.0.0.1:{port}"
        ray_connect(address)
        wait_ray_nodes(2)
        head_node = ray.get_runtime_context().get_node_id()
        worker_node = next(n["NodeID"] for n in ray.nodes() if n["Alive"] and n["NodeID"] != head_node)
        yield SimpleNamespace(address=address, worker=procs[1], worker_node=worker_node, env=env)
    finally:
        if ray.is_initialized():
            ray.shutdown()
        for p in reversed(procs):
            stop(p, grace=0)  # a test cluster: nothing of it is kept
        shutil.rmtree(head_temp_dir, ignore_errors=True)


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
    cfg = CacheConfig(size=16, variants=2, seed=2, shard_size=TWO_A_SHARD)
    local = build_cache(pictures, tmp_path / "local", cfg, workers=2, verbose=False)
    on_ray = build_cache(pictures, tmp_path / "ray", cfg, engine="ray", ray_address=ray_cluster.address,
                         verbose=False)
    url = gcs_emulator()
    to_gs = build_cache(pictures, url, cfg, engine="ray", ray_address=ray_cluster.address, verbose=False)
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


def _same_as_local(local: Path, url: str) -> None:
    """The cache at ``url`` is complete with the shards (bytes and image ids) of the local cache, each
    source item exactly once."""
    m, want = load_manifest(url), read_manifest(local)
    assert m["complete"] and m["num_shards"] == want["num_shards"]
    assert [s["ids"] for s in m["shards"]] == [s["ids"] for s in want["shards"]]
    ids = [i for s in m["shards"] for i in s["ids"]]
    assert len(ids) == len(set(ids)) == want["source"]["num_items"]
    st = Store(url)
    for p in sorted(local.glob("shard-*")):
        assert st.read_bytes(p.name) == p.read_bytes(), p.name
    assert sorted(n for n in st.listdir() if n.startswith("shard-")) == sorted(p.name for p in local.glob("shard-*"))


N_SLOW = 24  # images of the slowed-down builds below: 0.25 s each, so a build lasts several seconds
TWO_A_SHARD = 2 * 2 * 16 * 16 * 3  # bytes of two images (2 variants at 16x16): shards of 2 images


@pytest.mark.timeout(600)
def test_a_killed_driver_is_rerun_to_the_same_bytes(ray_cluster, gcs_emulator, tmp_path):
    cfg = CacheConfig(size=16, variants=2, seed=3, shard_size=TWO_A_SHARD)
    build_cache(SlowImages(N_SLOW), tmp_path / "local", cfg, workers=2, verbose=False)
    url = gcs_emulator()
    code = ("from xla_utils.cache import CacheConfig, build_cache; from slow_images import SlowImages; "
            f"build_cache(SlowImages({N_SLOW}, delay=0.25), {url!r}, "
            f"CacheConfig(size=16, variants=2, seed=3, shard_size={TWO_A_SHARD}), "
            f"engine='ray', ray_address={ray_cluster.address!r}, verbose=False)")
    driver = subprocess.Popen([sys.executable, "-c", code], env=ray_cluster.env, start_new_session=True)
    deadline, m = time.monotonic() + 300, None
    while driver.poll() is None and time.monotonic() < deadline:
        with __import__("contextlib").suppress(Exception):
            m = load_manifest(url)
        if m and m["shards"]:  # at least one shard recorded: kill the driver mid-build
            break
        time.sleep(0.2)
    os.killpg(driver.pid, signal.SIGKILL)
    driver.wait()
    assert m and m["shards"] and not m["complete"], "the driver was not killed mid-build"
    again = build_cache(SlowImages(N_SLOW), url, cfg, engine="ray", ray_address=ray_cluster.address, verbose=False)
    assert again.shards_reused >= len(m["shards"]) and again.shards_built + again.shards_reused == again.num_shards
    _same_as_local(tmp_path / "local", url)


@pytest.mark.timeout(600)
def test_a_node_killed_mid_build_changes_nothing(ray_cluster, gcs_emulator, tmp_path):
    """Kills the second node (SIGKILL to its whole process group: raylet, object store, workers) as
    soon as one of its tasks is loading an image; Ray redoes its tasks on the head node. Last in this
    module: the cluster keeps one node afterwards."""
    cfg = CacheConfig(size=16, variants=2, seed=4, shard_size=TWO_A_SHARD)
    build_cache(SlowImages(N_SLOW), tmp_path / "local", cfg, workers=2, verbose=False)
    url, marks = gcs_emulator(), tmp_path / "marks"
    marks.mkdir()
    seen: dict[str, float] = {}

    def kill_when_busy() -> None:
        deadline = time.monotonic() + 300
        while not (marks / ray_cluster.worker_node).exists():
            if time.monotonic() > deadline:
                return
            time.sleep(0.05)
        os.killpg(ray_cluster.worker.pid, signal.SIGKILL)
        seen["killed"] = time.monotonic()

    killer = threading.Thread(target=kill_when_busy, daemon=True)
    killer.start()
    report = build_cache(SlowImages(N_SLOW, delay=0.25, marks=str(marks)), url, cfg, engine="ray",
                         ray_address=ray_cluster.address, verbose=False)
    done = time.monotonic()
    killer.join(1)
    assert "killed" in seen and seen["killed"] < done, "the second node was not killed mid-build"
    assert ray_cluster.worker.wait(30) is not None
    assert report.shards_built == report.num_shards and report.num_images == N_SLOW
    _same_as_local(tmp_path / "local", url)
