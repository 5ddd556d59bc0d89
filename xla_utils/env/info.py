"""What :func:`~xla_utils.env.detect` and :func:`~xla_utils.env.advise` return: the
:class:`EnvInfo` of a machine and the :class:`Advice` for it."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, Callable

__all__ = ["EnvInfo", "Advice", "VersionOf"]

# name of an installed distribution -> its version, or None when it is not installed
VersionOf = Callable[[str], "str | None"]


@dataclass
class EnvInfo:
    """What :func:`detect` found. Every field is JSON-serialisable.

    Sizes are GiB (2**30 bytes). Versions are distribution versions as pip shows
    them (``"2.8.0+cpu"``) or ``None`` when not installed.
    """

    platform: str  # "kaggle" | "colab" | "tpu-vm" | "local"
    accelerator: str  # "tpu" | "gpu" | "cpu"
    tpu_generation: str | None  # "v2" "v3" "v4" "v5e" "v5p" "v6e", "v2/v3" if ambiguous, "unknown"
    tpu_type: str | None  # slice name for this host, e.g. "v5e-8", "v3-8", "v4-8"
    tpu_chips: int  # TPU chips on this host (0 without a TPU)
    num_devices: int  # devices xmp.spawn uses: TPU XLA devices; GPUs; 1 on a CPU
    gpu_count: int  # NVIDIA GPUs found (0 if none)
    gpu_name: str | None  # model of the first GPU when the driver reports it
    python: str  # e.g. "3.12.3"
    os: str  # platform.system(), e.g. "Linux"
    machine: str  # platform.machine(), e.g. "x86_64"
    torch: str | None
    torchvision: str | None
    torch_xla: str | None
    libtpu: str | None
    paired: bool  # torch and torch_xla both installed with the same major.minor
    pjrt_device: str | None  # PJRT_DEVICE as set now (None if unset)
    cpus: int | None  # host vCPUs usable by this process (affinity and cgroup quota)
    ram_gb: float | None  # RAM usable by this process, GiB (MemTotal, capped by cgroup)
    disk_free_gb: float | None  # free space of the working directory's file system, GiB
    cwd: str  # the working directory measured for disk_free_gb
    root: str  # the file-system root that was scanned ("/" normally)
    evidence: list[str] = field(default_factory=list)  # why platform/accelerator were chosen
    warnings: list[str] = field(default_factory=list)
    import_error: str | None = None  # why `import torch_xla` failed (only checked with check_import=True)
    ready: bool = False  # nothing to install or fix before training
    next_step: str = ""  # one line: "ready ..." or what to do, with the exact command
    next_command: str | None = None  # just the shell command of next_step, if any
    # nvidia-smi's GPUs (name, compute_capability, memory_mib, index, uuid), on root "/" only
    gpus: list[dict[str, Any]] = field(default_factory=list)
    torch_replicas: int = 1  # processes fit(cores="all") runs on the torch backend
    torch_replica_kind: str = "cpu"  # "cuda" (NCCL) or "cpu"

    def to_dict(self) -> dict[str, Any]:
        """Fields as a plain dict (stable keys, declaration order)."""
        return dataclasses.asdict(self)

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)


@dataclass
class Advice:
    """One recommendation from :func:`advise`.

    ``kind`` is one of: ``ready``, ``install-torch``, ``install-torch-xla``,
    ``mismatch``, ``broken-import``, ``install-libtpu``, ``torch-too-new``, ``torch-too-old``,
    ``python-unsupported``, ``no-xla-wheels``, ``pjrt-without-tpu``.
    ``pip_args`` are the arguments after ``pip install`` when :func:`setup` may run
    them (only for torch_xla/libtpu fixes that keep the installed torch).
    """

    kind: str
    message: str
    command: str | None = None
    pip_args: list[str] | None = None
    blocking: bool = True

