"""Helpers the test modules share (import them as ``from helpers import ...``)."""
from __future__ import annotations

__all__ = ["cuda_gpu"]


def cuda_gpu() -> bool:
    """Whether a CUDA GPU is here, asked as xla_utils asks (``runtime.device()``): on torch's
    CUDA wheels ``torch.cuda.is_available()`` where no GPU exists queries the driver, and every
    torch-replica launch of this test process would then start fresh interpreters instead of
    forking (xla_utils.runtime.torch_launch.cuda_in_use)."""
    import torch

    from xla_utils.env.gpu import cuda_possible

    return cuda_possible() and torch.cuda.is_available()
