"""The one table of TPU chip facts: what each generation is and holds.

Detection (:mod:`xla_utils.env`: PCI ids, devices per chip, how slice names count),
the readiness check's figures (:mod:`xla_utils.diagnostics.findings`: peak bf16 FLOP/s, HBM,
matrix-unit side) and the memory plan (:mod:`xla_utils.diagnostics.memory`: devices of a slice
name) all read this module. Public spec-sheet figures; imports nothing of xla_utils.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

__all__ = ["TPUChip", "TPU_CHIPS", "TPU_PCI_DEVICES", "DEVICES_PER_CHIP", "TYPE_COUNTS_CORES",
           "MEGACORE", "tpu_devices"]

# PCI device id -> TPU generation. 0x0027 is shared by v2 and v3.
TPU_PCI_DEVICES = {
    "0x0027": "v2/v3",
    "0x005e": "v4",
    "0x0063": "v5e",
    "0x0062": "v5p",
    "0x006f": "v6e",
}
# XLA devices per chip as seen by xmp.spawn: v2/v3 have two TensorCores per chip
# that PJRT exposes separately (one process per chip, two threads each); v4/v5p
# fuse them (megacore); v5e/v6e have one core per chip.
DEVICES_PER_CHIP = {"v2": 2, "v3": 2, "v2/v3": 2, "v4": 1, "v5p": 1, "v5e": 1, "v6e": 1}
# Generations whose two TensorCores per chip are one XLA device (megacore).
MEGACORE = frozenset({"v4", "v5p"})
# Generations whose accelerator-type suffix counts TensorCores, not chips
# (v3-8 = 4 chips, v4-8 = 4 chips, v5p-8 = 4 chips; v5litepod-8 = 8 chips).
TYPE_COUNTS_CORES = frozenset({"v2", "v3", "v4", "v5p"})


@dataclass(frozen=True)
class TPUChip:
    """Public spec-sheet figures of one TPU generation (per chip).

    Attributes:
        name: generation, e.g. ``"v5e"``.
        bf16_tflops: peak bfloat16 TFLOP/s of one chip.
        hbm_gib: HBM of one chip in GiB.
        mxu: side of the matrix unit (128 -> 128x128); matmul/conv widths are padded to it.
        devices_per_chip: XLA devices (replicas) per chip in torch_xla (2 on v2/v3).
    """

    name: str
    bf16_tflops: float
    hbm_gib: float
    mxu: int
    devices_per_chip: int

    @property
    def hbm_per_device(self) -> float:
        """HBM of one XLA device, in bytes."""
        return self.hbm_gib * 2**30 / self.devices_per_chip

    @property
    def flops_per_device(self) -> float:
        """Peak bf16 FLOP/s of one XLA device."""
        return self.bf16_tflops * 1e12 / self.devices_per_chip


TPU_CHIPS: dict[str, TPUChip] = {c.name: c for c in (
    TPUChip("v2", 45, 16, 128, DEVICES_PER_CHIP["v2"]),
    TPUChip("v3", 123, 32, 128, DEVICES_PER_CHIP["v3"]),
    TPUChip("v4", 275, 32, 128, DEVICES_PER_CHIP["v4"]),
    TPUChip("v5e", 197, 16, 128, DEVICES_PER_CHIP["v5e"]),
    TPUChip("v5p", 459, 95, 128, DEVICES_PER_CHIP["v5p"]),
    TPUChip("v6e", 918, 32, 256, DEVICES_PER_CHIP["v6e"]),
)}


def tpu_devices(tpu: Any) -> int | None:
    """XLA devices of a slice name (``"v5e-8"`` -> 8, ``"v3-8"`` -> 8, ``"v4-8"`` -> 4:
    v4/v5p names count TensorCores, two per device), or None without a ``-N`` suffix."""
    m = re.fullmatch(r"\s*(v\d+[a-z]*)-(\d+)\s*", str(tpu).lower())
    if m is None:
        return None
    n = int(m.group(2))
    return max(n // 2, 1) if m.group(1) in MEGACORE else n
