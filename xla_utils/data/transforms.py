"""Device transforms of uint8 image batches (what the reader's batches become on the device).

* :func:`images_to_float` - uint8 NHWC (or NCHW) -> normalised NCHW float/bf16
  (optional random flip; NCHW or channels_last in memory) on the batch's device,
  so the host never normalises;
* :func:`image_layout` - tells the two layouts of one sample apart;
* :func:`apply_batch_transform` - a user's batch-level hook (``batch_transform=``), its
  shapes checked.

Also importable from :mod:`xla_utils.data`. torch_xla is never imported here.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

__all__ = ["IMAGENET_MEAN", "IMAGENET_STD", "IMAGE_CHANNELS", "image_layout", "images_to_float",
           "apply_batch_transform"]

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
IMAGE_CHANNELS = (1, 3, 4)


def image_layout(shape: Sequence[int], *, channels_first_on_tie: bool) -> str | None:
    """The layout of one uint8 image of ``shape``: ``"channels_last"`` (``[H, W, C]``),
    ``"channels_first"`` (``[C, H, W]``) or None (not an image the trainer normalises).

    The rule: a 3-D shape is channels-last when only its last axis is 1, 3 or 4,
    channels-first when only its first axis is. When both are (an ambiguous shape:
    ``[3, 32, 3]`` is a 3-pixel-wide CHW image or a 3-pixel-high HWC one,
    ``[4, 4, 3]`` likewise) ``channels_first_on_tie`` decides; the trainer passes
    True for torch tensors (torchvision's convention: ``read_image``, ``PILToTensor``,
    ``tv_tensors.Image`` are CHW) and False for numpy arrays (PIL's and OpenCV's
    convention: HWC). ``tv_tensors.Image`` is channels-first whatever its shape.

    Args:
        shape: one sample's shape (no batch axis).
        channels_first_on_tie: the answer for an ambiguous shape.

    Returns:
        The layout, or None when ``shape`` is not 3-D or neither end is 1, 3 or 4.
    """
    if len(shape) != 3:
        return None
    first, last = shape[0] in IMAGE_CHANNELS, shape[2] in IMAGE_CHANNELS
    if first and last:
        return "channels_first" if channels_first_on_tie else "channels_last"
    if first:
        return "channels_first"
    return "channels_last" if last else None


def images_to_float(x: torch.Tensor, mean: Sequence[float] = IMAGENET_MEAN, std: Sequence[float] = IMAGENET_STD,
                    flip: bool = False, dtype: torch.dtype = torch.float32, *,
                    channels_first: bool = False,
                    memory_format: torch.memory_format = torch.contiguous_format) -> torch.Tensor:
    """uint8 ``[B, H, W, C]`` (or ``[B, C, H, W]``) -> ``(x / 255 - mean) / std`` as a ``[B, C, H, W]`` tensor.

    Runs on ``x``'s device (call it after moving the uint8 batch to the TPU: 4x
    less to transfer, no host float work). Arithmetic is float32; no shape depends
    on the data. Both layouts give the same numbers for the same pixels (and the
    same flips for the same device RNG state).

    Args:
        x: the uint8 batch.
        mean: per-channel mean on the 0-1 scale. Default ImageNet's.
        std: per-channel standard deviation on the 0-1 scale. Default ImageNet's.
        flip: mirror a random half of the batch horizontally (along the width axis;
            device RNG). Default False.
        dtype: result dtype (e.g. ``torch.bfloat16``). Default ``torch.float32``.
        channels_first: ``x`` is ``[B, C, H, W]`` (torchvision's layout) instead of
            ``[B, H, W, C]`` (the cache's). Default False.
        memory_format: of the result: ``torch.contiguous_format`` (default: NCHW in
            memory) or ``torch.channels_last``, what a channels_last model on a GPU wants:
            from an NHWC batch it is made without a layout copy.

    Returns:
        The normalised ``[B, C, H, W]`` tensor on ``x``'s device.

    Raises:
        ValueError: ``x`` is not 4-D, or ``mean``/``std`` do not have ``C`` values.
    """
    if x.dim() != 4:
        layout = "[B, C, H, W]" if channels_first else "[B, H, W, C]"
        raise ValueError(f"expected a uint8 {layout} batch, got shape {tuple(x.shape)}")
    c = x.shape[1] if channels_first else x.shape[3]
    if len(mean) != c or len(std) != c:
        raise ValueError(f"mean/std have {len(mean)}/{len(std)} values for {c} channels")
    if not channels_first:
        x = x.permute(0, 3, 1, 2)
    if flip:
        coin = torch.rand(x.shape[0], 1, 1, 1, device=x.device) < 0.5
        x = torch.where(coin, x.flip(3), x)
    scale = torch.tensor([1.0 / (255.0 * s) for s in std], dtype=torch.float32).view(1, c, 1, 1)
    shift = torch.tensor([-m / s for m, s in zip(mean, std)], dtype=torch.float32).view(1, c, 1, 1)
    y = x.to(torch.float32) * scale.to(x.device) + shift.to(x.device)
    return y.to(dtype).contiguous(memory_format=memory_format)


def apply_batch_transform(fn: Callable[[torch.Tensor, Any], tuple[torch.Tensor, Any]], x: torch.Tensor,
                          y: Any) -> tuple[torch.Tensor, Any]:
    """``fn(x, y)``, the trainer's ``batch_transform=`` hook, on a device batch: ``x`` the
    normalised ``[B, C, H, W]`` inputs, ``y`` the targets. Its ops join the step's graph; only
    shapes are checked (metadata: no device read).

    Raises:
        ValueError: ``fn`` did not return an ``(x, y)`` pair of the shapes it was given
            (a changed shape would be a new graph: a recompile on XLA).
    """
    out = fn(x, y)
    shape = lambda v: tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__  # noqa: E731
    if not (isinstance(out, (tuple, list)) and len(out) == 2 and isinstance(out[0], torch.Tensor)
            and shape(out[0]) == shape(x) and shape(out[1]) == shape(y)):
        got = (f"({', '.join(str(shape(v)) for v in out)})" if isinstance(out, (tuple, list))
               else type(out).__name__)
        raise ValueError(f"batch_transform= must return (x, y) of the shapes it is given, "
                         f"({shape(x)}, {shape(y)}), but it returned {got}: a batch of another shape "
                         "is another graph (a recompile on XLA). Fix: keep the shapes (e.g. erase or "
                         "mix in place instead of cropping); resize in transform= or the cache")
    return out[0], out[1]
