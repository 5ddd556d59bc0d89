"""scripts/bench_gpu.py completes on the CPU with tiny sizes and reports its figures (the
GPU figures themselves come from a GPU machine: docs/BENCHMARKS.md)."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_bench_gpu_smoke_on_the_cpu(tmp_path):
    out = tmp_path / "gpu.json"
    env = dict(os.environ, PJRT_DEVICE="CPU", PYTHONPATH="")  # the script finds the checkout itself
    p = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_gpu.py"), "--models",
                        "mobilenet_v3_small", "--image", "32", "--batch", "8", "--images", "32",
                        "--epochs", "1", "--workers", "0", "--predict-reps", "1",
                        "--cache", str(tmp_path / "cache"), "--json", str(out)],
                       capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "mobilenet_v3_small: ceiling " in p.stdout and "fit/hand" in p.stdout
    assert "predict/hand" in p.stdout
    r = json.loads(out.read_text())
    (res,) = r["results"]
    for key in ("ceiling", "hand", "fit", "predict", "hand_predict"):
        assert math.isfinite(res[key]) and res[key] > 0, key
    assert res["predict_shape"] == res["hand_predict_shape"] == [32, 10]
    assert r["precision"] == "fp32" and r["device"].startswith("cpu")


@pytest.mark.slow
@pytest.mark.multicore
def test_bench_gpu_scaling_rehearsed_on_two_cpu_replicas(tmp_path):
    """``--gpus all`` with ``XLA_UTILS_CPU_REPLICAS=2``: fit on one replica and on both, the
    scaling efficiency and the all-reduce time of the model's gradients on the two."""
    out = tmp_path / "scaling.json"
    env = dict(os.environ, PJRT_DEVICE="CPU", PYTHONPATH="", XLA_UTILS_CPU_REPLICAS="2")
    p = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_gpu.py"), "--gpus", "all",
                        "--models", "mobilenet_v3_small", "--image", "32", "--batch", "8",
                        "--images", "32", "--epochs", "1", "--cache", str(tmp_path / "cache"),
                        "--json", str(out)],
                       capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "mobilenet_v3_small: fit cores=1 " in p.stdout and "efficiency" in p.stdout
    (res,) = json.loads(out.read_text())["results"]
    assert res["replicas"] == res["allreduce_world"] == 2
    for key in ("fit_1", "fit_all", "efficiency", "allreduce_ms"):
        assert math.isfinite(res[key]) and res[key] > 0, key
    assert res["params"] > 1e5


@pytest.mark.slow
def test_bench_gpu_compile_rehearsed_on_the_cpu(tmp_path):
    """``--compile`` (issue 45) end to end on a two-convolution model, dynamo and AOTAutograd
    without inductor (``--compile-backend aot_eager``): eager and compiled hand loops, eager
    fit, and fit(compile=) cold and warm in two fresh processes; the figures' shape only."""
    out = tmp_path / "compile.json"
    env = dict(os.environ, PJRT_DEVICE="CPU", PYTHONPATH="")
    p = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_gpu.py"), "--compile",
                        "--compile-backend", "aot_eager", "--models", "tiny", "--image", "16",
                        "--batch", "8", "--images", "32", "--epochs", "1", "--workers", "0",
                        "--cache", str(tmp_path / "cache"), "--json", str(out)],
                       capture_output=True, text=True, env=env, cwd=tmp_path, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "tiny (default): hand " in p.stdout and "first epoch cold" in p.stdout
    (res,) = json.loads(out.read_text())["results"]
    for key in ("hand", "hand_compiled", "fit", "fit_compiled", "fit_compiled_warm"):
        assert math.isfinite(res[key]) and res[key] > 0, key
    for run in (res["cold"], res["warm"]):
        assert run["compile_s"] > 0 and run["compiles"] == [1]
