"""Shared fixtures: a real GCS emulator on 127.0.0.1 (for the ``gs://`` tests).

The emulator (``gcp-storage-emulator``, in the ``test`` extra) is a real HTTP server that
this fixture starts once per session in its own process group and stops at the end;
gcsfs reaches it through ``STORAGE_EMULATOR_HOST``. No mock of gcsfs or of the storage API.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import uuid

import pytest

BUCKET = "xla-utils-test"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_port(port: int, proc: subprocess.Popen, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the process serving port {port} exited with {proc.returncode}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise RuntimeError(f"nothing listens on 127.0.0.1:{port} after {seconds} s")


@pytest.fixture(scope="session")
def gcs_emulator():
    """``gs://`` prefix factory on a fresh in-memory emulator: ``gcs_emulator()`` -> ``gs://BUCKET/<unique>``."""
    port = free_port()
    saved = {k: os.environ.get(k) for k in ("STORAGE_EMULATOR_HOST", "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT")}
    # gcsfs reads these when it is imported: set them first
    os.environ["STORAGE_EMULATOR_HOST"] = f"http://127.0.0.1:{port}"
    os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] = "false"  # else gcsfs waits 60 s on a gRPC probe
    pytest.importorskip("gcsfs")
    pytest.importorskip("gcp_storage_emulator")
    proc = subprocess.Popen([sys.executable, "-m", "gcp_storage_emulator", "start", "--host", "127.0.0.1",
                             "--port", str(port), "--in-memory", "--default-bucket", BUCKET],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        _wait_port(port, proc, 60)
        import fsspec

        fsspec.filesystem("gs").invalidate_cache()
        yield lambda: f"gs://{BUCKET}/{uuid.uuid4().hex[:10]}"
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(10)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(proc.pid, signal.SIGKILL)
