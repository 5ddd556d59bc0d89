"""Validation metrics accumulated on the device and reduced across replicas.

Every batch adds to a handful of device tensors (no host sync); at the end of
an evaluation pass one ``all_reduce`` and one read bring the totals to the
host. Padded samples (``valid == False``, see
:func:`xla_utils.data.iterate_batches`) are masked out, so each sample counts
exactly once across all replicas and no batch ever changes shape.
"""
from __future__ import annotations

import copy
import inspect
from typing import Callable, Sequence

import torch

from .. import runtime

__all__ = ["MetricAccumulator", "per_sample_loss", "resolve_metrics", "METRICS"]

# name -> description, for errors and docs
METRICS = {
    "accuracy": "top-1 accuracy (single-label)",
    "top5": "top-5 accuracy (single-label; top<k> for any k)",
    "f1": "micro-averaged F1 at threshold 0.5 on sigmoid outputs (multi-label)",
}


def resolve_metrics(metrics: Sequence[str] | None, multilabel: bool, num_classes: int | None
                    ) -> tuple[str, ...]:
    """Default metrics: ``("f1",)`` for multi-label data, else ``("accuracy",)``
    plus ``"top5"`` when there are more than 10 classes."""
    if metrics is None:
        if multilabel:
            return ("f1",)
        return ("accuracy", "top5") if (num_classes or 0) > 10 else ("accuracy",)
    out = tuple(metrics)
    for m in out:
        if m not in METRICS and not (m.startswith("top") and m[3:].isdigit()):
            raise ValueError(f"unknown metric {m!r}; choose from {sorted(METRICS)} or top<k>")
    return out


def per_sample_loss(loss_fn: Callable) -> Callable | None:
    """A version of ``loss_fn`` returning one value per sample, or None.

    Works for torch loss modules with a ``reduction`` attribute and for
    functions accepting a ``reduction`` keyword (``F.cross_entropy`` ...).
    """
    if isinstance(loss_fn, torch.nn.Module) and hasattr(loss_fn, "reduction"):
        m = copy.copy(loss_fn)
        m.reduction = "none"
        return m
    try:
        params = inspect.signature(loss_fn).parameters
    except (TypeError, ValueError):
        return None
    if "reduction" in params:
        return lambda out, y: loss_fn(out, y, reduction="none")
    return None


class MetricAccumulator:
    """Device-side sums for loss and the chosen metrics over one eval pass."""

    def __init__(self, names: Sequence[str], loss_fn: Callable, device):
        self.names = tuple(names)
        self.loss_fn = loss_fn
        self.sample_loss = per_sample_loss(loss_fn)
        self.device = device
        # [loss_sum, n, then per metric: numerator (and f1: tp, fp, fn)]
        self._slots = ["loss", "n"]
        for m in self.names:
            self._slots += ["tp", "fp", "fn"] if m == "f1" else [m]
        self.totals = runtime.to_device(torch.zeros(len(self._slots)), device)

    def update(self, outputs: torch.Tensor, targets: torch.Tensor, valid: torch.Tensor) -> None:
        """Add one batch. ``valid`` is bool[B]; invalid (padding) rows count for nothing."""
        w = valid.to(torch.float32)
        out = outputs.float()
        if self.sample_loss is not None:
            per = self.sample_loss(out, targets).float()
            if per.dim() > 1:  # e.g. BCE with reduction='none' gives [B, C]
                per = per.flatten(1).mean(1)
            loss_sum = (per * w).sum()
        else:
            # Unknown loss: batch mean weighted by valid count (padding rows are
            # duplicates of real samples, so only the padded batch is approximate).
            loss_sum = self.loss_fn(out, targets).float() * w.sum()
        parts = [loss_sum, w.sum()]
        for m in self.names:
            if m == "f1":
                pred = (out > 0).to(torch.float32)  # sigmoid(x) > 0.5
                t = targets.to(torch.float32)
                wm = w.unsqueeze(1)
                parts += [(pred * t * wm).sum(), (pred * (1 - t) * wm).sum(),
                          ((1 - pred) * t * wm).sum()]
            else:
                k = 1 if m == "accuracy" else int(m[3:])
                k = min(k, out.shape[1])
                topk = out.topk(k, dim=1).indices
                hit = (topk == targets.view(-1, 1)).any(dim=1).to(torch.float32)
                parts.append((hit * w).sum())
        self.totals = self.totals + torch.stack(parts)

    def compute(self) -> dict[str, float]:
        """All-reduce over replicas and read once: ``{"loss": .., metric: ..}``."""
        totals = runtime.all_reduce(self.totals)
        runtime.sync()
        vals = dict(zip(self._slots, totals.cpu().tolist()))
        n = max(vals["n"], 1.0)
        res = {"loss": vals["loss"] / n, "samples": int(round(vals["n"]))}
        for m in self.names:
            if m == "f1":
                tp, fp, fn = vals["tp"], vals["fp"], vals["fn"]
                res["f1"] = 2 * tp / max(2 * tp + fp + fn, 1e-12)
            else:
                res[m] = vals[m] / n
        return res
