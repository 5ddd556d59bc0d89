"""xla_utils.env.gpu: the host's GPUs read from nvidia-smi (no CUDA initialised)."""
from __future__ import annotations

import os
import stat
import sys

import pytest

from xla_utils import env as xenv
from xla_utils.env.gpu import (NVIDIA_SMI_QUERY, GPUFacts, gpu_facts, parse_nvidia_smi,
                                   report_lines, visible_gpus)

# What nvidia-smi --query-gpu=index,uuid,name,compute_cap,memory.total --format=csv,noheader,nounits
# prints for the GPUs of Kaggle (T4 x2, P100), Colab (T4) and the bigger clouds.
ROWS = {
    "t4": "0, GPU-2b4c7e1a-0000-0000-0000-000000000001, Tesla T4, 7.5, 15360",
    "t4b": "1, GPU-9f0d3c2e-0000-0000-0000-000000000002, Tesla T4, 7.5, 15360",
    "p100": "0, GPU-5a1b2c3d-0000-0000-0000-000000000003, Tesla P100-PCIE-16GB, 6.0, 16384",
    "a100": "0, GPU-77aa88bb-0000-0000-0000-000000000004, NVIDIA A100-SXM4-40GB, 8.0, 40960",
    "h100": "0, GPU-0c0ffee0-0000-0000-0000-000000000005, NVIDIA H100 80GB HBM3, 9.0, 81559",
}


def test_parse_nvidia_smi_rows():
    gpus = parse_nvidia_smi("\n".join([ROWS["t4"], ROWS["t4b"], "garbage line",
                                       "2, GPU-x, Odd, [N/A], 100"]) + "\n")
    assert [g.name for g in gpus] == ["Tesla T4", "Tesla T4"]  # rows that do not parse are left out
    t4 = gpus[0]
    assert t4.compute_capability == (7, 5) and t4.sm == "sm_75" and not t4.bf16_matrix_units
    assert t4.memory_mib == 15360 and t4.index == 0 and t4.uuid.startswith("GPU-2b4c")
    assert t4.describe() == "Tesla T4 (sm_75, 15 GiB)"
    h100 = parse_nvidia_smi(ROWS["h100"])[0]
    assert h100.name == "NVIDIA H100 80GB HBM3" and h100.bf16_matrix_units
    assert parse_nvidia_smi("0, GPU-y, Weird, Name, 8.6, 24576")[0].name == "Weird, Name"


def test_visible_gpus_follows_cuda_visible_devices():
    gpus = parse_nvidia_smi("\n".join([ROWS["t4"], ROWS["t4b"]]))
    assert visible_gpus(gpus, None) == gpus
    assert [g.index for g in visible_gpus(gpus, "1")] == [1]
    assert [g.index for g in visible_gpus(gpus, "1,0")] == [1, 0]
    assert [g.index for g in visible_gpus(gpus, "GPU-9f0d")] == [1]  # a uuid prefix
    assert visible_gpus(gpus, "") == []  # CUDA sees no GPU
    assert [g.index for g in visible_gpus(gpus, "0,7,1")] == [0]  # CUDA stops at an invalid entry
    assert visible_gpus(gpus, "MIG-abc") == gpus  # not mappable: every GPU, never fewer facts


def _fake_nvidia_smi(folder, out: str, code: int = 0) -> None:
    """An executable ``nvidia-smi`` in ``folder`` that checks its arguments and prints ``out``."""
    exe = folder / "nvidia-smi"
    exe.write_text(f"#!{sys.executable}\nimport sys\n"
                   f"assert sys.argv[1:] == {list(NVIDIA_SMI_QUERY)!r}, sys.argv\n"
                   f"sys.stdout.write({out!r})\nsys.exit({code})\n")
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)


def test_gpu_facts_runs_nvidia_smi(tmp_path, monkeypatch):
    _fake_nvidia_smi(tmp_path, ROWS["t4"] + "\n" + ROWS["t4b"] + "\n")
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    gpus = gpu_facts()
    assert [g.describe() for g in gpus] == ["Tesla T4 (sm_75, 15 GiB)"] * 2
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert [g.index for g in gpu_facts()] == [1]


def test_gpu_facts_without_an_answer(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi at all
    assert gpu_facts() == []
    # a driver too old for compute_cap fails the query: no facts, the replica decides
    _fake_nvidia_smi(tmp_path, 'Field "compute_cap" is not a valid field to query.\n', code=2)
    assert gpu_facts() == []


def test_gpu_facts_are_comparable():
    t4, a100 = GPUFacts("Tesla T4", (7, 5)), GPUFacts("NVIDIA A100", (8, 0))
    assert min([a100, t4], key=lambda g: g.compute_capability) is t4
    with pytest.raises(AttributeError):
        t4.name = "x"  # frozen


def test_env_reports_the_gpus_and_what_the_trainer_uses(tmp_path, monkeypatch):
    """Kaggle's T4 x2 as ``python -m xla_utils.env`` shows it (nvidia-smi, no CUDA)."""
    _fake_nvidia_smi(tmp_path, ROWS["t4"] + "\n" + ROWS["t4b"] + "\n")
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("XLA_UTILS_CPU_REPLICAS", raising=False)
    info = xenv.detect()
    assert (info.torch_replicas, info.torch_replica_kind) == (2, "cuda")
    text = xenv.report(info)
    assert text.count("Tesla T4 (sm_75, 15 GiB): precision='auto' -> fp16 autocast + gradient "
                      "scaler") == 2
    assert "fit(cores='all') runs 2 GPU processes over NCCL, one per GPU (cores=1: one GPU)" in text
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert xenv.detect().torch_replicas == 1
    monkeypatch.setenv("XLA_UTILS_CPU_REPLICAS", "3")
    assert "runs 3 CPU processes over gloo" in xenv.report(xenv.detect())


def test_report_lines_say_bf16_from_sm_80():
    h100 = parse_nvidia_smi(ROWS["h100"])
    lines = report_lines(h100, 1, "cuda")
    assert lines == ["  gpu 0        NVIDIA H100 80GB HBM3 (sm_90, 80 GiB): precision='auto' -> "
                     "bf16 autocast", "  trainer      fit(cores='all') runs one process on the GPU"]
