"""split, cross_validate and CacheSubset on a real cache, on XLA:CPU (1 core and simulated cores)."""
from __future__ import annotations

import pickle
from functools import partial

import numpy as np
import pytest
import torch
from torch import nn

from helpers import digit_images, tiny_cnn

import xla_utils
from xla_utils import CachedImageDataset, OneCycleTrainer, build_cache, cross_validate
from xla_utils.train.crossval import CacheSubset, fold_assignment, subset
from xla_utils.data import images_to_float, iterate_batches

SIZE = 12
CLASSES = 5
MEAN, STD = (0.5,) * 3, (0.25,) * 3


@pytest.fixture(scope="module")
def caches(tmp_path_factory):
    root = tmp_path_factory.mktemp("cv")
    items = digit_images(120 + 21, classes=CLASSES)
    build_cache(items[:120], root / "train", size=SIZE, verbose=False)
    build_cache([x for x, _ in items[120:]], root / "test", size=SIZE, unlabeled=True, verbose=False)
    return CachedImageDataset(root / "train"), CachedImageDataset(root / "test")


_model = partial(tiny_cnn, CLASSES, size=SIZE)  # a make_model: built in each replica


def _make(train, val):
    return OneCycleTrainer(_model, nn.CrossEntropyLoss(), train, val, batch_size=4, epochs=2,
                           max_lr=3e-3, mean=MEAN, std=STD, seed=1)


def _cpu_probs(state, ds):
    m = _model()
    m.load_state_dict(state)
    x = images_to_float(torch.from_numpy(np.stack([ds.image(i) for i in range(len(ds))])), MEAN, STD)
    with torch.no_grad():
        return torch.softmax(m.eval()(x), 1).numpy()


def test_cache_subset_is_a_view_in_order(caches):
    train, test = caches
    idx = np.array([7, 3, 100, 3, 0])
    sub = CacheSubset(train, idx)
    assert isinstance(sub, CachedImageDataset) and len(sub) == 5
    for k, i in enumerate(idx):
        assert np.array_equal(sub.image(k), train.image(i)) and sub.label(k) == train.label(i)
    assert sub.ids == [train.ids[i] for i in idx]
    nested = CacheSubset(sub, [4, 2])  # a subset of a subset maps to the parent
    assert nested.indices.tolist() == [0, 100]
    again = pickle.loads(pickle.dumps(sub))
    assert np.array_equal(again.image(2), train.image(100)) and again.indices.tolist() == idx.tolist()
    x, y, _ = next(iter(iterate_batches(sub, 5, shuffle=False, num_workers=0)))
    assert np.array_equal(x.numpy()[2], train.image(100)) and y.tolist() == train.labels[idx].tolist()
    assert sub._slabs[0][0] is train._slabs[0][0]  # the same memory maps: nothing copied
    assert isinstance(subset(torch.utils.data.TensorDataset(torch.zeros(4, 2)), [1, 2]),
                      torch.utils.data.Subset)


def test_split_in_one_call_stratified_seeded_no_copy(caches, capsys):
    """One training folder -> train and validation views (the Kaggle layout), straight into
    the trainer."""
    train_all, test = caches
    train, val = xla_utils.split(train_all, val_fraction=0.2)
    assert isinstance(train, CacheSubset) and isinstance(val, CacheSubset)
    assert len(train) == 96 and len(val) == 24
    ti, vi = train.indices, val.indices
    assert sorted(np.concatenate([ti, vi]).tolist()) == list(range(120))  # disjoint, covering
    assert ti.tolist() == sorted(ti.tolist()) and vi.tolist() == sorted(vi.tolist())  # cache order
    counts, held = np.bincount(train_all.labels, minlength=CLASSES), np.bincount(val.labels, minlength=CLASSES)
    assert np.all(np.abs(held - counts * 0.2) < 1), (counts, held)  # every class's share
    assert val._slabs[0][0] is train_all._slabs[0][0]  # views: no image copied
    again, other = xla_utils.split(train_all, 0.2)[1], xla_utils.split(train_all, 0.2, seed=1)[1]
    assert again.indices.tolist() == vi.tolist() and other.indices.tolist() != vi.tolist()
    # a class with one image keeps it for training; multi-label / float targets: a plain split
    tiny = torch.utils.data.TensorDataset(torch.zeros(6, 2), torch.tensor([0, 0, 0, 0, 1, 2]))
    t2, v2 = xla_utils.split(tiny, 0.5)
    assert [int(tiny[i][1]) for i in v2.indices] == [0, 0, 0] and len(t2) == 3
    with pytest.raises(ValueError, match="val_fraction must be a number in \\(0, 1\\)"):
        xla_utils.split(train_all, 20)
    with pytest.raises(ValueError, match="unlabeled=True"):
        xla_utils.split(test)
    h = OneCycleTrainer(_model, nn.CrossEntropyLoss(), train, val, batch_size=8, epochs=1, max_lr=3e-3,
                        mean=MEAN, std=STD).fit(cores=1)
    assert h[-1]["samples"] == 24  # validated on exactly the held-out images


def test_fold_assignment_stratified_and_covering():
    labels = np.random.default_rng(0).integers(0, 4, 103)
    f = fold_assignment(labels, 5, seed=3)
    assert sorted(np.bincount(f).tolist()) in ([20, 20, 21, 21, 21],)
    for c in range(4):
        counts = np.bincount(f[labels == c], minlength=5)
        assert counts.max() - counts.min() <= 1
    assert not np.array_equal(f, fold_assignment(labels, 5, seed=4))
    g = fold_assignment(np.zeros((10, 3), np.float32), 3, seed=0)  # multi-label: plain split
    assert sorted(np.bincount(g).tolist()) == [3, 3, 4]
    with pytest.raises(ValueError, match="folds must be an int >= 2"):
        cross_validate(_make, list(range(10)), folds=1)


def test_fold_assignment_of_regression_targets_spans_their_range():
    values = np.random.default_rng(0).normal(size=103).astype(np.float32)
    f = fold_assignment(values, 5, seed=3)
    assert sorted(np.bincount(f).tolist()) == [20, 20, 21, 21, 21]
    dealt = f[np.argsort(values)]
    for start in range(0, 100, 5):  # every 5 neighbouring values go to 5 different folds
        assert sorted(dealt[start:start + 5].tolist()) == [0, 1, 2, 3, 4]
    np.testing.assert_array_equal(f, fold_assignment(values[:, None], 5, seed=3))  # [N, 1] alike


def test_cross_validate_a_regression_cache_gives_the_oof_rmse(tmp_path):
    from helpers import digit_score_csv

    csv_path, _ = digit_score_csv(tmp_path, 48)
    build_cache(csv_path, tmp_path / "train", size=8, verbose=False)
    data = CachedImageDataset(tmp_path / "train")

    def make(train, val):
        return OneCycleTrainer(partial(tiny_cnn, 1, size=8, seed=0), nn.MSELoss(), train, val,
                               batch_size=8, epochs=1, max_lr=1e-2, mean=MEAN, std=STD)

    res = cross_validate(make, data, folds=2, cores=1)
    assert res.oof.shape == (48, 1) and np.isfinite(res.oof).all()
    rmse = float(np.sqrt(((res.oof - data.labels) ** 2).mean()))
    assert res.oof_score == pytest.approx(rmse, rel=1e-5) and rmse > 0
    for rec in res.folds:
        k = rec["fold"]
        fold = res.fold_of == k
        assert rec["score"] == pytest.approx(float(np.sqrt(((res.oof[fold] - data.labels[fold]) ** 2).mean())),
                                             rel=1e-5)
        assert rec["val_loss"] == pytest.approx(rec["score"] ** 2, rel=1e-3)  # the fold's MSE


@pytest.mark.parametrize("simulate", [1, pytest.param(2, marks=pytest.mark.multicore)])
@pytest.mark.timeout(600)
def test_cross_validate_oof_test_average_and_resume(caches, tmp_path, simulate):
    """3 folds: OOF rows cover every image exactly once, each row is its fold model's own
    prediction, the test prediction is the mean of the folds' own; a crash in the third
    fold resumes there (the first two are not trained again)."""
    train, test = caches
    calls = []

    def make(tr, va, fold):
        calls.append(fold)
        if fold == 2 and len(calls) == 3:
            raise RuntimeError("crash in fold 3")
        assert isinstance(tr, CacheSubset) and isinstance(va, CacheSubset)
        assert not set(tr.indices.tolist()) & set(va.indices.tolist())
        return _make(tr, va)

    folder = tmp_path / "cv"
    with pytest.raises(RuntimeError, match="crash in fold 3"):
        cross_validate(make, train, folds=3, test=test, folder=folder, simulate=simulate)
    assert sorted(p.name for p in folder.glob("fold_*.npz")) == ["fold_0.npz", "fold_1.npz"]
    res = cross_validate(make, train, folds=3, test=test, folder=folder, simulate=simulate)
    assert calls == [0, 1, 2, 2], calls  # resumed at fold 3
    assert res.histories[:2] == [None, None] and res.histories[2] is not None
    # every training image exactly once
    assert res.oof.shape == (len(train), CLASSES) and np.isfinite(res.oof).all()
    assert sorted(np.bincount(res.fold_of).tolist()) == [40, 40, 40]
    with np.load(folder / "fold_2.npz") as z:
        val_idx = z["val_idx"]
    assert np.array_equal(val_idx, np.flatnonzero(res.fold_of == 2))
    # fold 3's rows and test predictions are its own model's, on the CPU
    state = res.histories[2].state_dict
    own = _cpu_probs(state, CacheSubset(train, val_idx))
    np.testing.assert_allclose(res.oof[val_idx], own, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(res.test_folds[2], _cpu_probs(state, test), rtol=1e-4, atol=1e-5)
    # the averaged test predictions are the mean of the folds' own
    assert res.test_folds.shape == (3, len(test), CLASSES)
    np.testing.assert_allclose(res.test, res.test_folds.mean(0), rtol=0, atol=1e-7)
    np.testing.assert_allclose(res.test.sum(1), 1.0, rtol=1e-5)
    acc = float((res.oof.argmax(1) == train.labels).mean())
    assert res.oof_score == pytest.approx(acc)
    assert [f["fold"] for f in res.folds] == [0, 1, 2] and all("accuracy" in f for f in res.folds)
    assert res.metric == "accuracy" and "OOF accuracy" in str(res)  # the trainer's metric
    with pytest.raises(ValueError, match="another split"):
        cross_validate(make, train, folds=3, test=test, folder=folder, seed=9)


def test_oof_score_is_the_trainers_monitored_metric():
    """The OOF score is the trainer's ``monitor`` (here logloss of a one-logit binary task),
    computed as validation computes it; every configured metric of the OOF rows is kept."""
    from sklearn.datasets import load_digits
    from sklearn.metrics import log_loss, roc_auc_score

    d = load_digits()
    x = torch.tensor(d.data[:240], dtype=torch.float32) / 16
    y = torch.tensor(d.target[:240] == 8, dtype=torch.float32).view(-1, 1)
    data = torch.utils.data.TensorDataset(x, y)

    def make(tr, va):
        return OneCycleTrainer(nn.Sequential(nn.Linear(64, 1)), nn.BCEWithLogitsLoss(), tr, va,
                               batch_size=16, epochs=1, max_lr=3e-2, seed=0,
                               metrics=["auc", "logloss"], monitor="logloss")

    res = cross_validate(make, data, folds=2)
    t = y.numpy()[:, 0]
    assert res.metric == "logloss" and res.oof.shape == (240, 1)
    assert res.oof_score == pytest.approx(log_loss(t, res.oof[:, 0]), rel=1e-6)
    assert res.oof_metrics["auc"] == pytest.approx(roc_auc_score(t, res.oof[:, 0]), rel=1e-9)
    assert all({"auc", "logloss"} <= set(f) for f in res.folds)
    assert f"OOF logloss {res.oof_score:.4f}" in str(res)
