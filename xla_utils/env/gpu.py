"""The host's NVIDIA GPUs: name, compute capability, memory.

:func:`gpu_facts` asks ``nvidia-smi``, so the calling process never initialises CUDA (a
notebook that later forks one replica per GPU must not have: a forked child cannot use a
CUDA context its parent created). :func:`cuda_facts` asks torch about a device instead;
that initialises CUDA, so call it only where CUDA is in use already (inside a replica).
Both give :class:`GPUFacts`, whose compute capability decides what the trainer's
``precision="auto"`` means (:func:`xla_utils.step.device_plan.resolve_precision`).
:func:`torch_devices` says how many replicas the torch backend's launch runs (every GPU, or
``XLA_UTILS_CPU_REPLICAS`` CPU processes), also without initialising CUDA.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from typing import Any

__all__ = ["GPUFacts", "NVIDIA_SMI_QUERY", "parse_nvidia_smi", "visible_gpus", "gpu_facts",
           "cuda_facts", "cuda_possible", "cuda_available", "CPU_REPLICAS_ENV", "TorchDevices", "torch_devices",
           "report_lines"]

# The NVIDIA driver's device files on Linux (WSL2: the GPU paravirtualisation device).
NVIDIA_DEVICE_FILES = ("/dev/nvidiactl", "/dev/dxg")

# ``XLA_UTILS_CPU_REPLICAS=N``: the torch backend behaves as a machine with N devices, N CPU
# processes over gloo (rehearse a multi-GPU run, or test it, on a machine without GPUs).
CPU_REPLICAS_ENV = "XLA_UTILS_CPU_REPLICAS"

# index and uuid pick the GPUs CUDA_VISIBLE_DEVICES leaves visible; compute_cap needs a
# driver from 2022 or later (R510), older ones answer with an error and no facts.
NVIDIA_SMI_QUERY = ("--query-gpu=index,uuid,name,compute_cap,memory.total",
                    "--format=csv,noheader,nounits")


@dataclass(frozen=True)
class GPUFacts:
    """One NVIDIA GPU.

    Attributes:
        name: As the driver names it (``"Tesla T4"``, ``"NVIDIA H100 80GB HBM3"``).
        compute_capability: ``(major, minor)``: (7, 5) for a T4, (8, 0) for an A100.
        memory_mib: Total memory in MiB (None when unknown).
        index: The driver's index (``nvidia-smi``'s order; None when unknown).
        uuid: ``"GPU-..."`` (None when unknown).
    """

    name: str
    compute_capability: tuple[int, int]
    memory_mib: int | None = None
    index: int | None = None
    uuid: str | None = None

    @property
    def sm(self) -> str:
        """``"sm_75"`` style."""
        major, minor = self.compute_capability
        return f"sm_{major}{minor}"

    @property
    def bf16_matrix_units(self) -> bool:
        """Tensor cores that multiply bfloat16: compute capability 8.0 (Ampere) and later."""
        return self.compute_capability >= (8, 0)

    def describe(self) -> str:
        """``"Tesla T4 (sm_75, 15 GiB)"``."""
        mem = "" if self.memory_mib is None else f", {self.memory_mib / 1024:.0f} GiB"
        return f"{self.name} ({self.sm}{mem})"


def parse_nvidia_smi(text: str) -> list[GPUFacts]:
    """The GPUs in the output of ``nvidia-smi`` :data:`NVIDIA_SMI_QUERY` (one CSV row per
    GPU: index, uuid, name, compute capability, memory in MiB); rows that do not parse are
    left out."""
    gpus = []
    for line in text.strip().splitlines():
        if line.count(",") < 4:
            continue
        index, uuid, rest = (c.strip() for c in line.split(",", 2))
        name, cap, mem = (c.strip() for c in rest.rsplit(",", 2))  # a name may hold a comma
        try:
            major, minor = (int(p) for p in cap.split("."))
        except ValueError:
            continue
        gpus.append(GPUFacts(name=name, compute_capability=(major, minor),
                             memory_mib=int(mem) if mem.isdigit() else None,
                             index=int(index) if index.isdigit() else None,
                             uuid=uuid or None))
    return gpus


def visible_gpus(gpus: list[GPUFacts], cuda_visible_devices: str | None) -> list[GPUFacts]:
    """The GPUs of ``gpus`` that a process with ``CUDA_VISIBLE_DEVICES`` set to
    ``cuda_visible_devices`` (None: unset) can use: the listed indices or ``GPU-`` uuid
    prefixes, in the listed order; all of them when unset or when an entry is neither
    (a MIG instance, say), so the answer never claims more than the host has."""
    if cuda_visible_devices is None:
        return list(gpus)
    picked = []
    for entry in (e.strip() for e in cuda_visible_devices.split(",")):
        if not entry:
            break  # CUDA stops at the first empty or invalid entry
        if entry.isdigit():
            match = [g for g in gpus if g.index == int(entry)]
        elif entry.startswith("GPU-"):
            match = [g for g in gpus if g.uuid and g.uuid.startswith(entry)]
        else:
            return list(gpus)
        if not match:
            break
        picked.append(match[0])
    return picked


def gpu_facts(timeout: float = 15.0) -> list[GPUFacts]:
    """This host's GPUs visible to this process, from ``nvidia-smi`` (CUDA is not
    initialised here).

    Args:
        timeout: Seconds ``nvidia-smi`` may take (default 15).

    Returns:
        One :class:`GPUFacts` per visible GPU; empty when there is no ``nvidia-smi``, it
        fails or times out, or its driver cannot report the compute capability (the
        decision is then left to the replica, :func:`cuda_facts`).
    """
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return []
    try:
        p = subprocess.run([exe, *NVIDIA_SMI_QUERY], capture_output=True, text=True,
                           timeout=timeout)
    except (OSError, subprocess.TimeoutExpired):
        return []
    if p.returncode != 0:
        return []
    return visible_gpus(parse_nvidia_smi(p.stdout), os.environ.get("CUDA_VISIBLE_DEVICES"))


def cuda_possible() -> bool:
    """Whether this process could use an NVIDIA GPU, answered without starting CUDA.

    ``torch.cuda.is_available()`` on torch's CUDA wheels queries the driver where NVML does
    not answer (a machine without a GPU, CI's included), which registers torch's fork handler:
    every replica forked afterwards would have to start as a fresh interpreter instead. So:
    False for a torch built without CUDA and, on Linux, where the driver's device files
    (:data:`NVIDIA_DEVICE_FILES`) are absent; elsewhere True (then ask torch).
    """
    import torch

    if torch.version.cuda is None:
        return False
    if sys.platform.startswith("linux"):
        return any(os.path.exists(f) for f in NVIDIA_DEVICE_FILES)
    return True


def cuda_available() -> bool:
    """``torch.cuda.is_available()``, asked only where :func:`cuda_possible` (so that a
    machine without an NVIDIA driver never has its later forks poisoned by the question)."""
    import torch

    return cuda_possible() and torch.cuda.is_available()


def cuda_facts(dev: Any) -> GPUFacts:
    """The facts of CUDA device ``dev`` from torch. Initialises CUDA in this process:
    only where CUDA is in use already."""
    import torch

    props = torch.cuda.get_device_properties(dev)
    return GPUFacts(name=props.name, compute_capability=(props.major, props.minor),
                    memory_mib=props.total_memory // 2**20)


@dataclass(frozen=True)
class TorchDevices:
    """The devices a torch-backend launch with ``cores="all"`` uses.

    Attributes:
        count: Replicas (one process per device when more than one).
        kind: ``"cuda"`` (NCCL between the replicas) or ``"cpu"`` (gloo).
        gpus: The GPUs (empty on CPU).
        why: Where the count comes from, for reports.
    """

    count: int
    kind: str
    gpus: tuple[GPUFacts, ...] = ()
    why: str = ""


def torch_devices(environ: dict | None = None, gpus: list[GPUFacts] | None = None) -> TorchDevices:
    """How many replicas the torch backend runs, found without initialising CUDA.

    ``XLA_UTILS_CPU_REPLICAS=N`` wins (N CPU processes over gloo); else every GPU that
    ``nvidia-smi`` lists and this process may use (``CUDA_VISIBLE_DEVICES``), when torch
    was built with CUDA; else one CPU.

    Args:
        environ: The environment to read (default ``os.environ``).
        gpus: The host's GPUs (default :func:`gpu_facts`).

    Raises:
        ValueError: ``XLA_UTILS_CPU_REPLICAS`` is not a positive integer.
    """
    env = os.environ if environ is None else environ
    raw = env.get(CPU_REPLICAS_ENV, "").strip()
    if raw:
        if not raw.isdigit() or int(raw) < 1:
            raise ValueError(f"{CPU_REPLICAS_ENV}={raw!r}: set it to a positive integer (the "
                             "number of CPU replica processes the torch backend runs), or unset "
                             "it to use this machine's GPUs")
        return TorchDevices(int(raw), "cpu", why=f"{CPU_REPLICAS_ENV}={raw}")
    found = gpus
    if found is None:
        import torch

        if torch.version.cuda is None:  # a CPU (or ROCm) build: no NVIDIA GPU to use
            return TorchDevices(1, "cpu", why="torch has no CUDA")
        found = gpu_facts()
    if not found:
        return TorchDevices(1, "cpu", why="no NVIDIA GPU (nvidia-smi)")
    return TorchDevices(len(found), "cuda", tuple(found), why="nvidia-smi")


def report_lines(gpus: list[GPUFacts], replicas: int, kind: str) -> list[str]:
    """``python -m xla_utils.env``'s lines about the GPUs: each one's name, memory, compute
    capability and what ``precision="auto"`` picks on it, then how many replicas
    ``fit(cores="all")`` runs (``replicas`` of ``kind``, from :func:`torch_devices`)."""
    lines = [f"  gpu {i}        {g.describe()}: precision='auto' -> "
             + ("bf16 autocast" if g.bf16_matrix_units else
                "fp16 autocast + gradient scaler (no bf16 matrix units below sm_80)")
             for i, g in enumerate(gpus)]
    if kind == "cpu" and replicas > 1:
        use = f"{replicas} CPU processes over gloo ({CPU_REPLICAS_ENV}={replicas})"
    elif replicas > 1:
        use = f"{replicas} GPU processes over NCCL, one per GPU (cores=1: one GPU)"
    else:
        use = "one process" + (" on the GPU" if kind == "cuda" else "")
    return lines + [f"  trainer      fit(cores='all') runs {use}"]
