"""OneCycleTrainer.predict / evaluate on real XLA:CPU (simulated cores) and plain torch."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from helpers import digit_images, tiny_cnn

from xla_utils import CachedImageDataset, OneCycleTrainer, build_cache
from xla_utils.data import images_to_float

SIZE = 12
CLASSES = 5


@pytest.fixture(scope="module")
def caches(tmp_path_factory):
    root = tmp_path_factory.mktemp("predict")
    items = digit_images(64 + 37, classes=CLASSES)
    build_cache(items[:64], root / "c64", size=SIZE, variants=2, scale=(0.6, 1.0), verbose=False)
    build_cache(items[64:], root / "c37", size=SIZE, variants=2, scale=(0.6, 1.0), verbose=False)
    build_cache([x for x, _ in items[64:]], root / "u37", size=SIZE, variants=2, scale=(0.6, 1.0),
                unlabeled=True, verbose=False)
    return root


def _cpu_views(model, ds, views, mean=(0.5,) * 3, std=(0.25,) * 3):
    """The model on the CPU, once per image and view: float32[views, N, C] softmax outputs."""
    out = []
    model = model.eval()
    for variant, flip in views:
        x = torch.from_numpy(np.stack([ds.image(i, variant=variant) for i in range(len(ds))]))
        x = images_to_float(x, mean, std)
        if flip:
            x = x.flip(3)
        with torch.no_grad():
            out.append(torch.softmax(model(x), 1).numpy())
    return np.stack(out)


def _trainer(train, **kw):
    return OneCycleTrainer(tiny_cnn(CLASSES, size=SIZE, seed=0), nn.CrossEntropyLoss(), train, batch_size=4,
                           mean=(0.5,) * 3, std=(0.25,) * 3, **kw)


@pytest.mark.multicore
def test_predict_on_8_simulated_cores_equals_cpu_in_order_with_tta(caches):
    """Every image exactly once, in order, for 64 (= 2 x 8 cores x 4) and 37 images;
    TTA over 4 views (2 stored variants, each also mirrored) is the mean of the views."""
    c64, c37 = CachedImageDataset(caches / "c64"), CachedImageDataset(caches / "c37")
    t = _trainer(c64)
    views = [(0, False), (1, False), (0, True), (1, True)]
    for ds in (c64, c37):
        single = _cpu_views(t.model, ds, views)
        p1 = t.predict(ds, simulate=8)
        assert p1.shape == (len(ds), CLASSES) and p1.dtype == np.float32
        np.testing.assert_allclose(p1, single[0], atol=1e-5)
        p4 = t.predict(ds, tta=4, simulate=8)
        np.testing.assert_allclose(p4, single.mean(0), atol=1e-5)
        assert np.abs(single[0] - single.mean(0)).max() > 1e-3  # the views do differ
        np.testing.assert_allclose(p4.sum(1), 1.0, atol=1e-5)


def test_predict_torch_backend_views_batches_and_activations(caches):
    c37 = CachedImageDataset(caches / "c37")
    t = _trainer(c37)
    single = _cpu_views(t.model, c37, [(0, False), (1, False), (0, True)])
    for tta in (1, 2, 3):
        np.testing.assert_allclose(t.predict(c37, tta=tta, batch_size=5), single[:tta].mean(0), atol=1e-5)
    raw = t.predict(c37, activation=None, batch_size=64)
    np.testing.assert_allclose(torch.softmax(torch.from_numpy(raw), 1).numpy(), single[0], atol=1e-5)
    sig = t.predict(c37, activation="sigmoid")
    np.testing.assert_allclose(sig, 1 / (1 + np.exp(-raw)), atol=1e-5)
    with pytest.raises(ValueError, match="tta=5 but data offers 4 distinct view"):
        t.predict(c37, tta=5)
    t_noflip = _trainer(c37, flip=False)
    with pytest.raises(ValueError, match="flip=False"):
        t_noflip.predict(c37, tta=3)


def test_predict_any_map_style_dataset_and_multilabel_sigmoid():
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.tensor(d.data[:50], dtype=torch.float32) / 16
    y = torch.tensor(d.target[:50])
    torch.manual_seed(0)
    model = nn.Linear(64, 10)
    with torch.no_grad():
        ref = model(x)
    t = OneCycleTrainer(model, nn.CrossEntropyLoss(), torch.utils.data.TensorDataset(x, y), batch_size=8)
    bare = torch.utils.data.TensorDataset(x)  # items are (x,): no target
    np.testing.assert_allclose(t.predict(bare), torch.softmax(ref, 1).numpy(), atol=1e-5)
    plain = [row for row in x]  # items are bare tensors
    np.testing.assert_allclose(t.predict(plain, activation=None), ref.numpy(), atol=1e-5)
    multi = OneCycleTrainer(model, nn.BCEWithLogitsLoss(), plain, batch_size=8)
    np.testing.assert_allclose(multi.predict(plain), torch.sigmoid(ref).numpy(), atol=1e-5)
    with pytest.raises(ValueError, match="tta=2 but data offers 1 distinct view"):
        t.predict(plain, tta=2)  # 1-D inputs cannot be mirrored


def test_evaluate_matches_fit_validation_and_predict(caches):
    c64, c37 = CachedImageDataset(caches / "c64"), CachedImageDataset(caches / "c37")
    # one epoch: fit validates epoch e on variant e % 2 of c37, evaluate() on variant 0
    t = _trainer(c64, epochs=1, max_lr=1e-2, optimizer="adam")
    t.val_data = c37
    h = t.fit()
    ev = t.evaluate(c37)
    assert ev["samples"] == len(c37)
    assert ev["loss"] == pytest.approx(h[-1]["val_loss"], rel=1e-4)
    assert ev["accuracy"] == pytest.approx(h[-1]["accuracy"])
    for tta in (1, 3):
        p = t.predict(c37, tta=tta)
        ev = t.evaluate(c37, tta=tta, batch_size=3)
        assert ev["accuracy"] == pytest.approx(float((p.argmax(1) == c37.labels).mean()))
        nll = float(-np.log(p[np.arange(len(c37)), c37.labels]).mean())
        assert ev["loss"] == pytest.approx(nll, rel=1e-4)


def test_weights_from_final_and_epoch_checkpoints(caches, tmp_path):
    c37 = CachedImageDataset(caches / "c37")
    t = _trainer(c37, epochs=2, max_lr=1e-2, checkpoint_dir=tmp_path / "ck")
    before = t.predict(c37)
    t.fit()
    after = t.predict(c37)
    assert np.abs(after - before).max() > 1e-4
    np.testing.assert_allclose(t.predict(c37, weights=tmp_path / "ck" / "final.pt"), after, atol=1e-6)
    fresh = _trainer(c37)
    np.testing.assert_allclose(fresh.predict(c37, weights=tmp_path / "ck" / "epoch_002.pt"), after, atol=1e-6)
    np.testing.assert_allclose(fresh.predict(c37), before, atol=1e-6)  # self.model unchanged
    (tmp_path / "bad.pt").write_bytes(b"PK\x03\x04 truncated")
    with pytest.raises(ValueError, match="bad.pt.*corrupt or truncated"):
        fresh.predict(c37, weights=tmp_path / "bad.pt")
    with pytest.raises(FileNotFoundError, match="nothing.pt"):
        fresh.predict(c37, weights=tmp_path / "nothing.pt")
    torch.save(nn.Linear(2, 2).state_dict(), tmp_path / "other.pt")
    with pytest.raises(ValueError, match="do not fit this trainer's model"):
        fresh.predict(c37, weights=tmp_path / "other.pt")


def test_bad_input_fails_before_any_device_time(caches, tmp_path, monkeypatch):
    from xla_utils import runtime

    c64, u37 = CachedImageDataset(caches / "c64"), CachedImageDataset(caches / "u37")
    items = [(np.zeros((20, 20, 3), np.uint8), 0)] * 4
    build_cache(items, tmp_path / "big", size=16, verbose=False)

    def no_launch(*a, **k):
        raise AssertionError("launched")

    monkeypatch.setattr(runtime, "launch", no_launch)
    t = _trainer(c64)
    with pytest.raises(ValueError, match=r"shape \(16, 16, 3\).*\(12, 12, 3\).*size=\(12, 12\)"):
        t.predict(CachedImageDataset(tmp_path / "big"))
    for bad in (dict(tta=0), dict(batch_size=0), dict(activation="relu")):
        with pytest.raises(ValueError):
            t.predict(c64, **bad)
    with pytest.raises(ValueError, match="unlabelled cache.*labels="):
        t.evaluate(u37)
    for fn in (lambda tr: tr.fit(), lambda tr: tr.find_lr(), lambda tr: tr.debug()):
        with pytest.raises(ValueError, match="train_data .*u37 is an unlabelled cache.*labels="):
            fn(_trainer(u37))
    tv = _trainer(c64)
    tv.val_data = u37
    with pytest.raises(ValueError, match="val_data .*unlabelled.*labels="):
        tv.fit()


@pytest.mark.timeout(300)
def test_building_a_trainer_starts_the_simulation_interpreter():
    # Without a TPU the trainer starts the zygote when it is built, so that the first
    # predict(simulate=N) reuses it instead of paying an interpreter start.
    import os
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent("""
        import time, torch
        from xla_utils import OneCycleTrainer
        from xla_utils.simulate import caller as simulate
        data = [(torch.randn(4), i % 3) for i in range(8)]
        t = OneCycleTrainer(torch.nn.Linear(4, 3), torch.nn.CrossEntropyLoss(), data, batch_size=4)
        end = time.monotonic() + 240
        while not (simulate._ZYGOTE is not None and simulate._ZYGOTE.alive()):
            assert time.monotonic() < end, "no zygote 240 s after OneCycleTrainer(...)"
            time.sleep(0.1)
        pid = simulate._ZYGOTE.proc.pid
        p = t.predict(data, simulate=1)
        print("RESULT", p.shape, simulate._ZYGOTE.proc.pid == pid)
    """)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=280,
                       env=dict(os.environ, PJRT_DEVICE="CPU"))
    assert p.returncode == 0, p.stderr[-3000:]
    assert "RESULT (8, 3) True" in p.stdout, p.stdout[-2000:]


# ----------------------------------------------------------------------------- regression
@pytest.fixture(scope="module")
def scores(tmp_path_factory):
    """A regression task from a CSV of numbers (a digit's value + noise per image), its cache
    and a test cache built from a sample submission of ``id,score`` rows."""
    from helpers import digit_score_csv

    root = tmp_path_factory.mktemp("scores")
    csv_path, _ = digit_score_csv(root, 64)
    build_cache(csv_path, root / "train", size=8, verbose=False)
    (root / "sample.csv").write_text("id,score\n" + "".join(f"img/{k}.png,0\n" for k in (5, 2, 7)))
    build_cache(root / "sample.csv", root / "test", size=8, unlabeled=True, verbose=False)
    return root


def _raw(model, ds):
    x = images_to_float(torch.from_numpy(np.stack([ds.image(i) for i in range(len(ds))])),
                        (0.5,) * 3, (0.25,) * 3)
    with torch.no_grad():
        return model.eval()(x).numpy()


def _regressor(train, **kw):
    return OneCycleTrainer(tiny_cnn(1, size=8, seed=0), nn.MSELoss(), train, train, batch_size=8,
                           max_lr=1e-2, mean=(0.5,) * 3, std=(0.25,) * 3, flip=False, **kw)


def test_regression_from_a_csv_of_numbers_on_the_cpu(scores, tmp_path):
    """A 1-output model with MSELoss trains on a regression cache: the validation loss is the
    MSE of what predict returns, the model's raw outputs; the submission holds those values."""
    import csv

    from xla_utils import write_submission

    train, test = CachedImageDataset(scores / "train"), CachedImageDataset(scores / "test")
    t = _regressor(train, epochs=2)
    assert t.task == "regression"
    h = t.fit(cores=1)
    assert h.epochs[1]["train_loss"] < h.epochs[0]["train_loss"]
    p = t.predict(train, batch_size=5)
    assert p.shape == (64, 1) and p.dtype == np.float32
    np.testing.assert_allclose(p, _raw(t.model, train), atol=1e-5)  # no activation
    mse = float(((p - train.labels) ** 2).mean())
    assert h.epochs[-1]["val_loss"] == pytest.approx(mse, rel=1e-4)
    # the regression default metric: RMSE, the square root of that MSE (and no class metric)
    assert h.epochs[-1]["rmse"] == pytest.approx(mse ** 0.5, rel=1e-4)
    assert not {"accuracy", "f1", "top5"} & set(h.epochs[-1])
    assert t.evaluate(train)["loss"] == pytest.approx(mse, rel=1e-4)
    np.testing.assert_allclose(t.predict(train, activation="sigmoid"), 1 / (1 + np.exp(-p)), atol=1e-5)
    out = write_submission(t.predict(test), test, tmp_path / "s.csv", train=t,
                           sample=scores / "sample.csv")
    with open(out, newline="") as f:
        rows = list(csv.reader(f))
    raw = _raw(t.model, test)[:, 0]
    assert rows[0] == ["id", "score"] and [r[0] for r in rows[1:]] == ["img/5.png", "img/2.png", "img/7.png"]
    np.testing.assert_allclose([float(r[1]) for r in rows[1:]], raw, rtol=1e-5)
    with pytest.raises(ValueError, match="regression model's predictions.*kind='values'"):
        write_submission(p, train, tmp_path / "l.csv", train=t, kind="label")


@pytest.mark.multicore
def test_regression_on_2_simulated_cores_predicts_the_raw_outputs(scores):
    train = CachedImageDataset(scores / "train")
    t = _regressor(train, epochs=1)
    h = t.fit(simulate=2)
    assert np.isfinite(h.epochs[-1]["val_loss"])
    p = t.predict(train, simulate=2)
    assert p.shape == (64, 1)
    np.testing.assert_allclose(p, _raw(t.model, train), atol=1e-4)
    assert h.epochs[-1]["val_loss"] == pytest.approx(float(((p - train.labels) ** 2).mean()), rel=1e-3)
    assert h.epochs[-1]["rmse"] == pytest.approx(float(((p - train.labels) ** 2).mean()) ** 0.5,
                                                 rel=1e-3)
