"""The inference loop of ``predict`` and ``evaluate`` as plain functions with explicit
arguments: the run's :class:`InferencePlan` (built on the host by the trainer), its TTA views,
one pass over each replica's share of the data, and the predictions gathered in order or the
metrics reduced (:func:`xla_utils.train.replica_loops.inference_replica` runs them). The input
preparation and the metrics are the training loop's own (:mod:`xla_utils.train.loop`).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import numpy as np
import torch

from .. import runtime
from ..data import CachedImageDataset, iterate_batches
from ..step.device_plan import DevicePlan, DeviceRequest
from .loop import loader_words, metric_accumulator, prepare_input
from .metrics import gather_rows
from .torch_compile import inference_module

if TYPE_CHECKING:
    from .config import TrainerConfig
    from ..step.inputs import InputSpec

__all__ = ["InferencePlan", "tta_views", "activate", "inference_pass", "gather_predictions",
           "inference_metrics"]


@dataclass
class InferencePlan:
    """What one inference run does in every replica (built and checked on the host by the
    trainer; :func:`xla_utils.train.replica_loops.inference_replica` runs it).

    Attributes:
        data: The dataset (a cache, or ``(x, y)`` pairs) as the loader collates it.
        inputs: Its :class:`~xla_utils.step.inputs.InputSpec`.
        n: Its length (predictions beyond it are padding).
        views: ``(stored variant, mirrored)`` of each TTA view, in order.
        batch_size: Per core.
        activation: ``"softmax"``, ``"sigmoid"`` or ``None``.
        model: The model to run (the trainer's, or one with other weights).
        labelled: Compute metrics (``evaluate``) instead of predictions.
        tta: Number of views averaged.
        config: The trainer's configuration (normalisation, bf16, metrics, workers).
        eval_step: ``eval_step(model, (x, y)) -> outputs``.
        loss: The loss the metrics report (``evaluate``).
    """

    data: Any
    inputs: InputSpec
    n: int
    views: list[tuple[int, bool]]
    batch_size: int
    activation: str | None
    model: torch.nn.Module
    labelled: bool
    tta: int
    config: TrainerConfig
    eval_step: Callable
    loss: Callable


def tta_views(data, tta: int, shape: Any, flip: bool) -> list[tuple[int, bool]]:
    """The ``(stored variant, mirrored)`` pair of each of ``tta`` views of ``data`` (inputs of
    ``shape``), in order (see :meth:`OneCycleTrainer.predict
    <xla_utils.train.trainer.OneCycleTrainer.predict>`): the stored variants, then (``flip``, 3-D
    images) the same mirrored.

    Raises:
        ValueError: ``tta`` is not a positive int or exceeds the views ``data`` offers.
    """
    if not isinstance(tta, int) or isinstance(tta, bool) or tta < 1:
        raise ValueError(f"tta must be a positive int (views per image), got {tta!r}")
    v = data.num_variants if isinstance(data, CachedImageDataset) else 1
    can_flip = flip and shape is not None and len(shape) == 3
    views = [(j, f) for f in ((False, True) if can_flip else (False,)) for j in range(v)]
    if tta > len(views):
        if can_flip:
            why = f"{v} stored variant(s), each also mirrored"
        elif not flip:
            why = f"{v} stored variant(s); no mirrored views because the trainer has flip=False"
        else:
            why = f"{v} stored variant(s); inputs of shape {shape} cannot be mirrored"
        raise ValueError(f"tta={tta} but data offers {len(views)} distinct view(s): {why}. Build the "
                         f"test cache with more variants (build_cache(..., variants={tta}, "
                         "unlabeled=True)) or lower tta")
    return views[:tta]


def activate(out: torch.Tensor, activation: str | None) -> torch.Tensor:
    """Apply ``activation`` (sigmoid for a single output column) to model outputs."""
    if activation is None:
        return out
    if activation == "sigmoid" or out.shape[1] == 1:
        return torch.sigmoid(out)
    return torch.softmax(out, dim=1)


def inference_pass(model: torch.nn.Module, plan: InferencePlan, *, cfg: TrainerConfig,
                   eval_step: Callable,
                   world_size: int, rank: int, dev: torch.device, feed: Callable | None = None
                   ) -> tuple[list[torch.Tensor | None], list[tuple[torch.Tensor, torch.Tensor]]]:
    """Run every TTA view of ``plan`` over this rank's share of the data.

    Every view is one pass in dataset order over this rank's share of the padded
    index list; per batch the activation output is added to a device
    accumulator (one graph for every batch and view: the mirror flag is device
    data). Precision, layout and host buffers are a
    :class:`~xla_utils.step.device_plan.DevicePlan`'s (``model`` is converted in place; on
    the torch backend a first line says what was chosen).

    Returns:
        ``(acc, targets)``: per batch the summed activations of all views, and
        (when ``plan.labelled``) per batch the ``(y, valid)`` device tensors.
    """
    ws, rk, bs = world_size, rank, plan.batch_size
    dp = DevicePlan.build(DeviceRequest(cfg.precision, cfg.channels_last, plan.inputs), dev, model,
                          train=False)
    model, words = inference_module(model, cfg.compile, dev)  # compile= (issue 45): after the plan
    if dp.words:
        runtime.master_print(f"{'evaluate' if plan.labelled else 'predict'} on {dp.words}, "
                             f"{loader_words(plan.data, cfg.data)}"
                             + (f"; {words}" if words else ""))
    mirror = any(f for _, f in plan.views)
    batches = iterate_batches(plan.data, bs, world_size=ws, rank=rk, shuffle=False,
                              drop_last=False, num_workers=cfg.num_workers)
    nb = len(batches)
    acc: list[torch.Tensor | None] = [None] * nb
    targets: list[tuple[torch.Tensor, torch.Tensor]] = []
    zeros = None
    _, progress_bar = runtime.progress_bars()
    total = nb * len(plan.views)
    what = "evaluate" if plan.labelled else "predict"
    pb = progress_bar(range(total), title=f"{what}: {plan.n} samples x {len(plan.views)} "
                      f"view{'s' if len(plan.views) > 1 else ''} on {runtime.replicas_word(ws, dev.type)}"
                      ) if runtime.is_master() else None

    def steps():
        for variant, flip in plan.views:
            flag = runtime.to_device(torch.tensor(flip), dev) if mirror else None
            for k, (x, y, valid) in enumerate((feed or runtime.device_prefetch)(
                    iterate_batches(plan.data, bs, world_size=ws, rank=rk, shuffle=False,
                                    epoch=variant, drop_last=False, num_workers=cfg.num_workers,
                                    pin_memory=dp.pinned))):
                yield k, flag, x, y, valid

    t0 = time.perf_counter()
    it = steps()
    with torch.no_grad():
        for done, (_, (k, flag, x, y, valid)) in enumerate(
                zip(pb if pb is not None else range(total), it), 1):
            x = prepare_input(x, cfg.data, False, plan.inputs, dp.memory_format)
            if flag is not None:
                x = torch.where(flag, x.flip(3), x)
            with dp.autocast:
                out = eval_step(model, (x, y))
            out = out.float()
            if out.dim() == 1:
                out = out.unsqueeze(1)
            p = activate(out, plan.activation)
            if zeros is None:  # device data, so the first view's steps use the same graph
                zeros = runtime.to_device(torch.zeros(tuple(p.shape)), dev)
            acc[k] = (zeros if acc[k] is None else acc[k]) + p
            if plan.labelled and len(targets) < nb:
                targets.append((y.clone(), valid.clone()))  # loader buffers are reused
            runtime.sync()
            if pb is not None and (done % cfg.log_every == 0 or done == total):
                pb.comment = f"{done * bs * ws / (time.perf_counter() - t0):.0f} img/s"
    it.close()
    return acc, targets


def gather_predictions(acc: list[torch.Tensor], plan: InferencePlan, *, world_size: int,
                       rank: int, dev: torch.device) -> np.ndarray | None:
    """All ranks' predictions in dataset order, on the master (``None`` elsewhere).

    One all_reduce of a zero-filled ``[batches, world, batch, C]`` tensor, where
    each rank fills its own slots, gathers the predictions exactly
    (:func:`~xla_utils.train.metrics.gather_rows`).
    """
    local = torch.stack(acc)  # [nb, B, C]
    if plan.tta > 1:
        local = local / plan.tta
    rows = gather_rows(local, world_size=world_size, rank=rank, dev=dev)
    return None if rows is None else rows[:plan.n].astype(np.float32, copy=False)


def inference_metrics(acc: list[torch.Tensor], targets: list[tuple[torch.Tensor, torch.Tensor]],
                      plan: InferencePlan, *, cfg: TrainerConfig, loss_fn: Callable,
                      dev: torch.device) -> dict[str, float]:
    """Loss and metrics of the (TTA-averaged) predictions ``acc`` against ``targets``.

    With ``tta > 1`` the averaged probabilities are turned back into the logits
    the loss expects: ``log(mean softmax)`` or ``logit(mean sigmoid)``; raw outputs
    (regression: no activation) are averaged.
    """
    metrics = None
    for out, (y, valid) in zip(acc, targets):
        if plan.tta > 1 and plan.activation is None:
            out = out / plan.tta
        elif plan.tta > 1:  # averaged probabilities -> the logits the loss expects
            p = out / plan.tta
            if plan.activation == "sigmoid":
                p = p.clamp(1e-7, 1 - 1e-7)
                out = torch.log(p) - torch.log1p(-p)
            else:
                out = torch.log(p.clamp_min(1e-30))
        if metrics is None:
            metrics = metric_accumulator(cfg.metrics, loss_fn, out, y, dev)
        metrics.update(out, y, valid)
        runtime.sync()
    return metrics.compute()
