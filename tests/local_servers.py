"""Real servers started on 127.0.0.1 for the tests and for scripts/bench_remote.py: an in-memory GCS
emulator and Ray nodes (`ray start --block`), each in its own process group, stopped by its process id
(never by name). Plain functions, no pytest: the fixtures in conftest.py and test_runners.py and
the benchmark share them."""
from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port: int, proc: subprocess.Popen, seconds: float) -> None:
    """Wait until 127.0.0.1:``port`` accepts connections; raise if ``proc`` exits or time runs out."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the process serving port {port} exited with {proc.returncode}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise RuntimeError(f"nothing listens on 127.0.0.1:{port} after {seconds} s")


def start_emulator(port: int, bucket: str) -> subprocess.Popen:
    """``gcp-storage-emulator`` in memory on 127.0.0.1:``port`` with ``bucket``, in its own process group."""
    return subprocess.Popen([sys.executable, "-m", "gcp_storage_emulator", "start", "--host", "127.0.0.1",
                             "--port", str(port), "--in-memory", "--default-bucket", bucket],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


def stop(proc: subprocess.Popen, grace: float = 8.0) -> None:
    """TERM then KILL ``proc``'s process group (ray's daemons can outlive the TERM), then reap it.

    ``grace``: seconds between the two (default 8); 0 kills at once. A Ray node's ``ray start
    --block`` did not end within 8 s of its TERM (a throwaway test node is killed at once)."""
    if grace > 0:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            pass
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


RAY_COMMON = ["--node-ip-address=127.0.0.1", "--num-cpus=1", "--object-store-memory=80000000", "--block",
              "--disable-usage-stats"]


def start_ray_node(port: int, env: dict, head_temp_dir: str | None = None) -> subprocess.Popen:
    """One Ray node (1 CPU) in its own process group: the head on ``port`` when ``head_temp_dir`` is given
    (its ``--temp-dir``), else a node joining the head at 127.0.0.1:``port``."""
    ray_bin = str(Path(sys.executable).with_name("ray"))
    if head_temp_dir is not None:
        args = ["--head", f"--port={port}", "--include-dashboard=false", f"--temp-dir={head_temp_dir}"]
    else:
        args = [f"--address=127.0.0.1:{port}"]
    return subprocess.Popen([ray_bin, "start", *args, *RAY_COMMON], env=env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def ray_connect(address: str, seconds: float = 120) -> None:
    """``ray.init`` this process as a driver of ``address``, retrying while the head starts."""
    import ray

    deadline = time.monotonic() + seconds
    while True:
        try:
            ray.init(address=address, log_to_driver=False, logging_level="ERROR")
            return
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(1)


def wait_ray_nodes(n: int, seconds: float = 120) -> None:
    """Wait until the connected cluster has ``n`` live nodes."""
    import ray

    deadline = time.monotonic() + seconds
    while sum(node["Alive"] for node in ray.nodes()) < n:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the Ray cluster has fewer than {n} live nodes after {seconds} s")
        time.sleep(0.5)
