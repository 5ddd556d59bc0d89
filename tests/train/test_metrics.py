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
    acc = MetricAccumulator(resolve_metrics(None, "multilabel", 5),
                            nn.BCEWithLogitsLoss(), torch.device("cpu"))
    for o, t, v in batches:
        acc.update(o, t, v)
    res = acc.compute()
    pred = (torch.sigmoid(out) > 0.5).numpy()
    assert res["f1"] == pytest.approx(f1_score(y.numpy(), pred, average="micro"))
    ref = nn.functional.binary_cross_entropy_with_logits(out, y).item()
    assert res["loss"] == pytest.approx(ref, rel=1e-5)


def test_resolve_and_per_sample_loss():
    assert resolve_metrics(None, "multiclass", 10) == ("accuracy",)
    assert resolve_metrics(None, "multiclass", 100) == ("accuracy", "top5")
    assert resolve_metrics(("top3",), "multiclass", 10) == ("top3",)
    assert resolve_metrics(None, "binary", 1) == ("accuracy", "auc")
    assert resolve_metrics(None, "regression", 1) == ("rmse",)
    with pytest.raises(ValueError, match=r"unknown metric 'aucc' \(did you mean 'auc'\?\)"):
        resolve_metrics(("aucc",), "binary", 1)
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


# ----------------------------------------------------------- competition metrics (issue 53)
def _digits_task(kind: str, n: int = 300, seed: int = 0):
    """Predictions and targets of a real task (digits, a seeded ridge fit on half of them,
    scored on the rest), as a trainer's metrics see them."""
    from sklearn.datasets import load_digits
    from sklearn.linear_model import Ridge

    d = load_digits()
    x, y = d.data / 16, d.target
    rng = np.random.default_rng(seed)
    idx = rng.permutation(len(y))
    a, b = idx[:600], idx[600:600 + n]
    if kind == "multiclass":
        z = Ridge(alpha=30.0).fit(x[a], np.eye(10)[y[a]]).predict(x[b]) * 4
        p = np.exp(z - z.max(1, keepdims=True))
        return p / p.sum(1, keepdims=True), y[b]
    if kind == "binary":
        z = Ridge(alpha=30.0).fit(x[a], y[a] == 8).predict(x[b]) * 6 - 2
        return 1 / (1 + np.exp(-z[:, None])), (y[b] == 8).astype(np.int64)
    if kind == "multilabel":
        t = np.stack([y % 2 == 0, y > 4, np.isin(y, [0, 6, 8, 9])], 1).astype(np.float32)
        z = Ridge(alpha=30.0).fit(x[a], t[a]).predict(x[b]) * 6 - 3
        return 1 / (1 + np.exp(-z)), t[b]
    z = Ridge(alpha=30.0).fit(x[a], y[a].astype(float)).predict(x[b])  # regression: the digit
    return z[:, None], y[b].astype(np.float32)


def test_host_metrics_match_sklearn():
    from sklearn.metrics import (cohen_kappa_score, log_loss, mean_absolute_error,
                                 mean_squared_error, roc_auc_score)

    from xla_utils.train.metrics import host_metric

    p, y = _digits_task("multiclass")
    assert host_metric("auc", p, y, "multiclass") == pytest.approx(
        roc_auc_score(y, p, multi_class="ovr", average="macro"), rel=1e-12)
    assert host_metric("logloss", p, y, "multiclass") == pytest.approx(log_loss(y, p), rel=1e-9)
    assert host_metric("qwk", p, y, "multiclass") == pytest.approx(
        cohen_kappa_score(y, p.argmax(1), weights="quadratic"), rel=1e-12)
    assert host_metric("macro_f1", p, y, "multiclass") == pytest.approx(
        f1_score(y, p.argmax(1), average="macro"), rel=1e-12)
    assert host_metric("top3", p, y, "multiclass") == pytest.approx(
        top_k_accuracy_score(y, p, k=3))
    p, y = _digits_task("binary")
    assert 0.05 < y.mean() < 0.15  # about 10% positive
    assert host_metric("auc", p, y, "binary") == pytest.approx(roc_auc_score(y, p[:, 0]), rel=1e-12)
    assert host_metric("logloss", p, y, "binary") == pytest.approx(log_loss(y, p[:, 0]), rel=1e-9)
    assert host_metric("macro_f1", p, y, "binary") == pytest.approx(
        f1_score(y, p[:, 0] > 0.5, average="macro"), rel=1e-12)
    assert host_metric("accuracy", p, y, "binary") == pytest.approx(((p[:, 0] > 0.5) == y).mean())
    # ties count half: a constant score has AUC 0.5
    assert host_metric("auc", np.full((len(y), 1), 0.3), y, "binary") == 0.5
    p, y = _digits_task("multilabel")
    assert host_metric("auc", p, y, "multilabel") == pytest.approx(
        roc_auc_score(y, p, average="macro"), rel=1e-12)
    assert host_metric("macro_f1", p, y, "multilabel") == pytest.approx(
        f1_score(y, p > 0.5, average="macro"), rel=1e-12)
    assert host_metric("f1", p, y, "multilabel") == pytest.approx(
        f1_score(y, p > 0.5, average="micro"), rel=1e-12)
    assert host_metric("logloss", p, y, "multilabel") == pytest.approx(
        np.mean([log_loss(y[:, j], p[:, j]) for j in range(3)]), rel=1e-9)
    p, y = _digits_task("regression")
    assert host_metric("rmse", p, y, "regression") == pytest.approx(
        mean_squared_error(y, p[:, 0]) ** 0.5, rel=1e-12)
    assert host_metric("mae", p, y, "regression") == pytest.approx(
        mean_absolute_error(y, p[:, 0]), rel=1e-12)
    grades = np.clip(np.rint(p[:, 0]), 0, 9)
    assert host_metric("qwk", p, y, "regression") == pytest.approx(
        cohen_kappa_score(y.astype(int), grades.astype(int), weights="quadratic"), rel=1e-12)
    with pytest.raises(ValueError, match="metric 'auc' needs class or 0/1 targets; this task is "
                                         "regression"):
        host_metric("auc", p, y, "regression")


def test_target_kind_and_direction():
    from xla_utils.train.metrics import lower_is_better, target_kind

    ints, floats = torch.zeros(4, dtype=torch.long), torch.zeros(4)
    assert target_kind(torch.zeros(4, 10), ints, nn.CrossEntropyLoss()) == "multiclass"
    assert target_kind(torch.zeros(4, 1), ints, nn.BCEWithLogitsLoss()) == "binary"
    assert target_kind(torch.zeros(4, 1), floats.view(4, 1), nn.BCEWithLogitsLoss()) == "binary"
    assert target_kind(torch.zeros(4, 3), torch.zeros(4, 3), nn.BCEWithLogitsLoss()) == "multilabel"
    assert target_kind(torch.zeros(4, 1), floats, nn.MSELoss()) == "regression"
    assert target_kind(torch.zeros(4, 3), torch.zeros(4, 3), nn.functional.l1_loss) == "regression"
    assert target_kind(torch.zeros(4), floats, lambda o, t: (o - t).abs().mean()) == "regression"
    assert [n for n in ("val_loss", "logloss", "rmse", "mae", "auc", "qwk", "accuracy",
                        "my_error", "kappa") if lower_is_better(n)] == [
        "val_loss", "logloss", "rmse", "mae", "my_error"]


@pytest.mark.parametrize("kind", ["binary", "regression", "multiclass"])
def test_accumulator_whole_set_metrics_with_padding(kind):
    """The accumulator's values (device sums and gathered rows) equal the host functions on
    the real rows: padding removed, targets as given (the one-logit binary task has
    ``int64[B]`` labels and a ``[B, 1]`` output; regression ``float32[B]`` targets)."""
    from xla_utils.train.metrics import host_metric

    p, y = _digits_task(kind, n=101)
    if kind == "binary":
        out, loss, names = torch.logit(torch.tensor(p)).float(), nn.BCEWithLogitsLoss(), \
            ("accuracy", "auc", "logloss", "rmse", "macro_f1")

        def per(o, t):  # BCE on int labels of a one-logit model (the targets helper's case)
            return nn.functional.binary_cross_entropy_with_logits(o[:, 0], t.float())
        loss = per
    elif kind == "regression":
        out, loss, names = torch.tensor(p[:, 0]).float(), nn.MSELoss(), ("rmse", "mae", "qwk")
    else:
        out, loss, names = torch.log(torch.tensor(p)).float(), nn.CrossEntropyLoss(), \
            ("accuracy", "auc", "qwk", "macro_f1", "logloss")
    yt = torch.tensor(y)
    n, batch = len(y), 16
    idx = torch.arange(7 * batch) % n
    valid = torch.arange(7 * batch) < n
    acc = MetricAccumulator(names, loss, torch.device("cpu"))
    for k in range(7):
        s = slice(k * batch, (k + 1) * batch)
        acc.update(out[idx[s]], yt[idx[s]], valid[s])
    res = acc.compute()
    assert acc.kind == kind and res["samples"] == n and list(res)[2:] == list(names)
    probs = (torch.sigmoid(out) if kind == "binary" else torch.softmax(out, 1)
             if kind == "multiclass" else out).double().numpy()
    for name in names:
        assert res[name] == pytest.approx(host_metric(name, probs, y, kind), rel=1e-5, abs=1e-6), name


def test_metric_names_checked_when_configured():
    from xla_utils.train.config import TrainerConfig

    def kappa(p, t):
        return 0.0

    cfg = TrainerConfig(metrics=["AUC ", kappa, {"Lam": lambda p, t: 1.0}], monitor="lam")
    assert [str(m) for m in cfg.metrics] == ["auc", "kappa", "lam"]
    assert cfg.stored_options()["metrics"] == ["auc", "kappa", "lam"]  # a checkpoint's: names
    assert TrainerConfig(metrics="qwk").metrics == ["qwk"]
    with pytest.raises(ValueError, match=r"unknown metric 'aucc' \(did you mean 'auc'\?\)"):
        OneCycleTrainer(nn.Linear(2, 1), nn.BCEWithLogitsLoss(), None, metrics=["aucc"])
    with pytest.raises(ValueError, match=r"pass it in a dict, e.g. metrics=\{'qwk': lambda"):
        TrainerConfig(metrics=[lambda p, t: 0.0])
    with pytest.raises(ValueError, match="takes a name the trainer uses already"):
        TrainerConfig(metrics={"auc": kappa})
    with pytest.raises(ValueError, match=r"metrics names \['kappa'\] more than once"):
        TrainerConfig(metrics=[kappa, {"kappa": kappa}])


def _binary_digits():
    """Digits, positive = an 8 (about 10%): 400 to train, 400 to validate, float ``[N, 1]``
    targets for a one-output model with ``BCEWithLogitsLoss``."""
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.tensor(d.data, dtype=torch.float32) / 16
    y = torch.tensor(d.target == 8, dtype=torch.float32).view(-1, 1)
    g = np.random.default_rng(0).permutation(len(y))
    tr, va = g[:400], g[400:800]
    ds = torch.utils.data.TensorDataset
    return ds(x[tr], y[tr]), ds(x[va], y[va])


def _one_logit():
    return nn.Sequential(nn.Linear(64, 8), nn.ReLU(), nn.Linear(8, 1))


def test_fit_keeps_the_best_epoch_by_auc(tmp_path, capsys):
    """A 10%-positive binary task, one output and BCEWithLogitsLoss: ``monitor="auc"`` keeps
    the best epoch's weights (not the last's), whose AUC is scikit-learn's on predict."""
    from sklearn.metrics import roc_auc_score

    train, val = _binary_digits()
    t = OneCycleTrainer(_one_logit, nn.BCEWithLogitsLoss(), train, val, batch_size=32, epochs=5,
                        max_lr=0.3, seed=0, metrics=["auc"], monitor="auc")
    h = t.fit()
    aucs = [e["auc"] for e in h]
    assert h.best_epoch == int(np.argmax(aucs)) + 1 < len(h)  # an earlier epoch than the last
    import re

    assert re.search(r"epoch 5  train_loss \S+  val_loss \S+  auc 0\.\d{4}  ", capsys.readouterr().out)
    assert f"best epoch {h.best_epoch} (auc {aucs[h.best_epoch - 1]:.4g})" in str(h)
    y = val.tensors[1].numpy()[:, 0]
    preds = t.predict(val)
    assert preds.shape == (len(val), 1)
    assert roc_auc_score(y, preds[:, 0]) == pytest.approx(aucs[h.best_epoch - 1], abs=1e-6)
    assert roc_auc_score(y, preds[:, 0]) != pytest.approx(aucs[-1], abs=1e-6)
    assert h.best_score == aucs[h.best_epoch - 1]
    assert t.evaluate(val)["auc"] == pytest.approx(roc_auc_score(y, preds[:, 0]), abs=1e-6)
    h.to_csv(tmp_path / "h.csv")
    assert (tmp_path / "h.csv").read_text().splitlines()[0].split(",")[:5] == [
        "epoch", "train_loss", "val_loss", "samples", "auc"]


def test_a_failing_metric_is_refused_before_any_step():
    calls = []

    def step(model, batch, loss_fn):
        calls.append(1)
        return loss_fn(model(batch[0]), batch[1])

    train, val = _binary_digits()
    t = OneCycleTrainer(_one_logit, nn.BCEWithLogitsLoss(), train, val, batch_size=32,
                        train_step=step, metrics={"second": lambda p, t: float(p[:, 1].mean())})
    with pytest.raises(ValueError, match=r"metric 'second' failed before training, on a sample "
                                         r"shaped like val_data's validation \(preds float64\[\d+, 1\]"
                                         r".*IndexError: index 1 is out of bounds"):
        t.fit()
    t = OneCycleTrainer(_one_logit, nn.BCEWithLogitsLoss(), train, val, batch_size=32,
                        train_step=step, metrics=["qwk", "top3"])
    with pytest.raises(ValueError, match="metric 'top3' needs class targets"):
        t.fit()
    assert calls == []  # no training step ran


@pytest.mark.multicore
@pytest.mark.timeout(300)
def test_callable_metric_on_two_simulated_cores_sees_every_row_once():
    """A callable (scikit-learn's QWK of the argmax) monitored on 2 simulated cores: every
    validation row once (45: padded on one core), its value the function's on predict's
    gathered predictions."""
    from sklearn.metrics import cohen_kappa_score

    from helpers import digits_split, tiny_mlp

    train, val = digits_split(n_val=45, n_train=128)

    def qwk(p, t):
        return cohen_kappa_score(t, p.argmax(1), weights="quadratic")

    t = OneCycleTrainer(lambda: tiny_mlp(seed=0), nn.CrossEntropyLoss(), train, val,
                        batch_size=16, epochs=2, max_lr=0.1, seed=0, metrics={"kappa": qwk},
                        monitor="kappa")
    h = t.fit(simulate=2)
    assert h.world_size == 2 and h[-1]["samples"] == len(val) and "accuracy" not in h[-1]
    assert h[1]["compiles"] == h[0]["compiles"]  # the gather compiles once, in epoch 1
    with torch.no_grad():  # the best epoch's weights, on the host
        preds = torch.softmax(t.model(val.tensors[0]), 1).numpy()
    assert h.best_score == pytest.approx(qwk(preds, val.tensors[1].numpy()), abs=1e-12)
    assert h.best_score > 0.3  # it learned: a kappa of chance would pass any pairing of rows


def test_check_metrics_on_a_sample_of_the_targets():
    """Every metric runs on the validation targets' sample (each class among them) and
    made-up predictions of the model's width; a callable that returns no number is refused."""
    from sklearn.metrics import roc_auc_score

    from xla_utils.train.metrics import check_metrics, normalize_metrics

    y = np.r_[np.zeros(500, np.int64), 1, 2]  # classes 1 and 2 once each, at the end
    ovr = {"ovr_auc": lambda p, t: roc_auc_score(t, p, multi_class="ovr")}  # needs all 3
    assert check_metrics(normalize_metrics(["auc", ovr]), targets=y, width=3,
                         loss_fn=nn.CrossEntropyLoss()) == ("auc", "ovr_auc")
    assert check_metrics(None, targets=y.astype(np.float32), width=1,
                         loss_fn=nn.MSELoss()) == ("rmse",)
    with pytest.raises(ValueError, match=r"metric 'pair' failed before training.*it returned "
                                         r"tuple, not a number"):
        check_metrics(normalize_metrics({"pair": lambda p, t: (1.0, 2.0)}), targets=y, width=3,
                      loss_fn=nn.CrossEntropyLoss())
    with pytest.raises(ValueError, match="metric 'auc' needs class or 0/1 targets; this task "
                                         "is regression"):
        check_metrics(["auc"], targets=y.astype(np.float32), width=1, loss_fn=nn.L1Loss())
