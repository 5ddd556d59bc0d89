"""Device-side validation metrics against scikit-learn, padding masked out."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from sklearn.metrics import f1_score, log_loss, top_k_accuracy_score
from torch import nn

from xla_utils import OneCycleTrainer
from xla_utils.train.metrics import MetricAccumulator, per_sample_loss, resolve_metrics


def _batches(n_valid: int, batch: int, make, seed=0):
    """Split n_valid samples into full batches, padding the last one with repeats."""
    g = torch.Generator().manual_seed(seed)
    out, y = make(n_valid, g)
    n_batches = -(-n_valid // batch)
    idx = torch.arange(n_batches * batch) % n_valid
    valid = torch.arange(n_batches * batch) < n_valid
    return out, y, [(out[idx[k * batch:(k + 1) * batch]], y[idx[k * batch:(k + 1) * batch]],
                     valid[k * batch:(k + 1) * batch]) for k in range(n_batches)]


def test_single_label_loss_accuracy_topk_match_sklearn():
    def make(n, g):
        return torch.randn(n, 12, generator=g) * 2, torch.randint(0, 12, (n,), generator=g)

    out, y, batches = _batches(101, 16, make)  # 7 batches, 11 padded slots
    acc = MetricAccumulator(("accuracy", "top5"), nn.CrossEntropyLoss(), torch.device("cpu"))
    for o, t, v in batches:
        acc.update(o, t, v)
    res = acc.compute()
    probs = torch.softmax(out, 1).numpy()
    assert res["samples"] == 101
    assert res["loss"] == pytest.approx(log_loss(y.numpy(), probs, labels=range(12)), rel=1e-5)
    assert res["accuracy"] == pytest.approx((out.argmax(1) == y).float().mean().item())
    assert res["top5"] == pytest.approx(top_k_accuracy_score(y.numpy(), probs, k=5, labels=range(12)))


def test_multilabel_micro_f1_matches_sklearn():
    def make(n, g):
        return torch.randn(n, 5, generator=g), (torch.rand(n, 5, generator=g) > 0.6).float()

    out, y, batches = _batches(77, 8, make, seed=1)
    acc = MetricAccumulator(resolve_metrics(None, multilabel=True, num_classes=5),
                            nn.BCEWithLogitsLoss(), torch.device("cpu"))
    for o, t, v in batches:
        acc.update(o, t, v)
    res = acc.compute()
    pred = (torch.sigmoid(out) > 0.5).numpy()
    assert res["f1"] == pytest.approx(f1_score(y.numpy(), pred, average="micro"))
    ref = nn.functional.binary_cross_entropy_with_logits(out, y).item()
    assert res["loss"] == pytest.approx(ref, rel=1e-5)


def test_resolve_and_per_sample_loss():
    assert resolve_metrics(None, multilabel=False, num_classes=10) == ("accuracy",)
    assert resolve_metrics(None, multilabel=False, num_classes=100) == ("accuracy", "top5")
    assert resolve_metrics(("top3",), multilabel=False, num_classes=10) == ("top3",)
    with pytest.raises(ValueError, match="unknown metric"):
        resolve_metrics(("auc",), False, 3)
    ps = per_sample_loss(nn.functional.cross_entropy)
    assert ps(torch.zeros(4, 3), torch.zeros(4, dtype=torch.long)).shape == (4,)
    assert per_sample_loss(lambda o, t: (o - t).mean()) is None
    loss = nn.CrossEntropyLoss()
    per_sample_loss(loss)
    assert loss.reduction == "mean"  # the caller's module is not modified


def test_trainer_multilabel_f1_on_digits():
    """The predecessor's use case: multi-label targets, F1 reported per epoch."""
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.tensor(d.data, dtype=torch.float32) / 16
    t = torch.tensor(d.target)
    # three real labels per image: even?, > 4?, a "round" digit (0, 6, 8, 9)?
    y = torch.stack([(t % 2 == 0), (t > 4), torch.isin(t, torch.tensor([0, 6, 8, 9]))], 1).float()
    train = torch.utils.data.TensorDataset(x[:1400], y[:1400])
    val = torch.utils.data.TensorDataset(x[1400:], y[1400:])
    h = OneCycleTrainer(nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 3)),
                        nn.BCEWithLogitsLoss(), train, val, batch_size=32, epochs=4, max_lr=1e-2,
                        seed=0).fit()
    assert set(h[-1]) >= {"f1", "val_loss"} and "accuracy" not in h[-1]
    assert h[-1]["samples"] == len(val)
    assert h[-1]["f1"] > 0.85
    assert np.isfinite(h[-1]["val_loss"])
