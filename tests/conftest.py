"""Test-session settings and shared fixtures.

XLA:CPU compiles without LLVM optimisation in the whole session (below). A real GCS
emulator on 127.0.0.1 serves the ``gs://`` tests.

The emulator (``gcp-storage-emulator``, in the ``test`` extra) is a real HTTP server that
this fixture starts once per session in its own process group and stops at the end;
gcsfs reaches it through ``STORAGE_EMULATOR_HOST``. No mock of gcsfs or of the storage API.
"""
from __future__ import annotations

import os
import re
import uuid

import pytest

# XLA:CPU compiles without LLVM's optimisation passes in every test process and every
# process a test starts (simulated replicas, notebook kernels, corpus programs), as the
# readiness check and the memory measurement already do: those passes took most of the
# suite's compile time (ResNet DDP on 2 simulated cores 33 s -> 20 s, the transfer test
# 63 s -> 36 s). Results change only by float rounding (a ResNet's first loss 2.5307639
# vs 2.5307641), and both sides of every comparison in a session use the same flag.
# Set before anything imports torch_xla; an optimisation level the caller set wins.
from xla_utils.runtime.xla import fast_cpu_compile_flags  # noqa: E402  (imports no torch_xla)

os.environ["XLA_FLAGS"] = fast_cpu_compile_flags(os.environ.get("XLA_FLAGS"))

# torch_xla's import starts torch inductor's compile-worker pool (a second interpreter importing
# torch: 4.0 s of CPU, measured on torch 2.8) in every process that imports it: each test
# subprocess, zygote, notebook kernel and replica started fresh. One compile thread starts no
# pool (inductor compiles in the process, as the tests' tiny torch.compile graphs need); the
# simulator sets the same for its replicas (xla_utils.runtime.fresh.child_env).
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

# The simulator records each program's peak memory per replica and refuses a later launch that
# would not fit (xla_utils.simulate.footprint). The session keeps its records in a file of its
# own: the user's ~/.cache record is left alone, and a figure from one test (or an earlier CI
# run on the same machine) never refuses another test's launch.
if "XLA_UTILS_SIM_FOOTPRINT_FILE" not in os.environ:
    import tempfile

    os.environ["XLA_UTILS_SIM_FOOTPRINT_FILE"] = os.path.join(
        tempfile.mkdtemp(prefix="xla_utils-footprint-"), "footprint.json")

from local_servers import free_port, start_emulator, stop, wait_port

# Programs that tests run (torch_xla's own tests among them, on simulated cores), not tests of
# this suite: collected, torch_xla's test_mp_sync_batch_norm.py ran its four tests once more on
# one device in the test process (100 s), besides the corpus test's run on 8 simulated cores.
collect_ignore = ["fixtures"]

__all__ = ["free_port"]  # test modules import it from here

BUCKET = "xla-utils-test"


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
    proc = start_emulator(port, BUCKET)
    try:
        wait_port(port, proc, 60)
        import fsspec

        fsspec.filesystem("gs").invalidate_cache()
        yield lambda: f"gs://{BUCKET}/{uuid.uuid4().hex[:10]}"
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        stop(proc)


@pytest.fixture(autouse=True)
def _xla_opt_level(request, monkeypatch):
    """``@pytest.mark.xla_opt_level(n)``: the processes this test starts compile XLA:CPU at LLVM
    optimisation level ``n`` instead of the session's 0. Level 0 compiles a ResNet-18 step in
    2.6 s and runs it in 1.3 s, level 1 in 7.8 s and 0.25 s (docs/BENCHMARKS.md "CI time"): a
    program whose replicas each compile a few large graphs wants 0, one that runs many steps
    of one graph (an SPMD program, the demo, mnist's 14 steps) wants 1. The marker is for tests
    that start processes: this test process's own runtime may already be running."""
    marker = request.node.get_closest_marker("xla_opt_level")
    if marker is not None:
        flags = re.sub(r"--xla_backend_optimization_level=\S+", "",
                       os.environ.get("XLA_FLAGS", ""))
        monkeypatch.setenv("XLA_FLAGS",
                           f"{flags.strip()} --xla_backend_optimization_level={marker.args[0]}".strip())
    yield


@pytest.fixture(autouse=True)
def _close_live_simulated_jobs():
    """A trainer's live predict/evaluate job (xla_utils.simulate.live) lives as long as
    the trainer; end any left by a test (a reference cycle, a kept traceback) so that
    the next test starts without its process or its /dev/shm folder."""
    yield
    import sys

    live = sys.modules.get("xla_utils.simulate.live")
    if live is not None:
        live.close_all()


def pytest_collection_modifyitems(config, items):
    """CI's stacks (``XLA_UTILS_CI_STACK``) each run their share of the suite (tests/stacks.py);
    a test with no entry there fails the collection on a CI stack. A ``slow`` test says so in
    the junit XML, so that .ci/budget.py can name the slow tests without the marker."""
    import stacks

    for item in items:
        if item.get_closest_marker("slow") is not None:
            item.user_properties.append(("slow", "1"))
    here = stacks.current()
    if here is None:
        return
    keep, other = [], []
    for item in items:
        (keep if stacks.stack_of(item.nodeid) in ("both", here) else other).append(item)
    if other:
        config.hook.pytest_deselected(items=other)
        items[:] = keep


# torch_xla not installed, as in a Kaggle GPU notebook: `import torch_xla` fails, importlib
# finds no spec and its metadata no distribution, in the process and every process it starts
# (a sitecustomize on PYTHONPATH).
NO_TORCH_XLA = """\
import sys
from importlib import metadata as _md

sys.modules["torch_xla"] = None
_version = _md.version


def _no_torch_xla(name):
    if name.replace("-", "_").lower() == "torch_xla":
        raise _md.PackageNotFoundError(name)
    return _version(name)


_md.version = _no_torch_xla
"""


@pytest.fixture
def no_torch_xla_env(tmp_path_factory):
    """The environment of a subprocess whose Python has no torch_xla (:data:`NO_TORCH_XLA`),
    this checkout first on its path."""
    shim = tmp_path_factory.mktemp("no_torch_xla")
    (shim / "sitecustomize.py").write_text(NO_TORCH_XLA)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k not in ("PJRT_DEVICE", "XLA_UTILS_CPU_REPLICAS")}
    env["PYTHONPATH"] = os.pathsep.join([str(shim), root])
    return env
