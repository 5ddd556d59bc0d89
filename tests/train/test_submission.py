"""write_submission, and a Kaggle competition in miniature on real XLA:CPU."""
from __future__ import annotations

import csv

import numpy as np
import pytest
from PIL import Image

from xla_utils import CachedImageDataset, build_cache, write_submission

CLASSES = ["healthy", "rust", "scab"]


def _read(path):
    with open(path, newline="") as f:
        return list(csv.reader(f))


def test_labels_single_and_multi_label(tmp_path, capsys):
    ids = ["a.jpg", "b.jpg", "c.jpg"]
    soft = np.array([[0.7, 0.2, 0.1], [0.1, 0.1, 0.8], [0.2, 0.5, 0.3]])
    out = write_submission(soft, ids, tmp_path / "sub.csv", classes=CLASSES)
    assert _read(out) == [["image_id", "label"], ["a.jpg", "healthy"], ["b.jpg", "scab"], ["c.jpg", "rust"]]
    said = capsys.readouterr().out
    assert "3 rows x 2 columns" in said and "a.jpg,healthy" in said
    sig = np.array([[0.9, 0.1, 0.6], [0.1, 0.2, 0.3], [0.4, 0.7, 0.8]])
    write_submission(sig, ids, tmp_path / "multi.csv", classes=CLASSES, id_column="id",
                     label_column="labels", threshold=0.5, multilabel=True)
    assert _read(tmp_path / "multi.csv") == [["id", "labels"], ["a.jpg", "healthy scab"], ["b.jpg", ""],
                                              ["c.jpg", "rust scab"]]
    assert "1 row(s) have no class above threshold 0.5" in capsys.readouterr().out
    # rows that are not distributions, and nothing says which: refused, not guessed from their sums
    with pytest.raises(ValueError, match="single- or multi-label.*train=trainer.*multilabel=False"):
        write_submission(sig, ids, tmp_path / "guess.csv", classes=CLASSES)
    assert not (tmp_path / "guess.csv").exists()
    # forced single-label on sigmoid outputs: argmax
    write_submission(sig, ids, tmp_path / "single.csv", classes=CLASSES, multilabel=False)
    assert [r[1] for r in _read(tmp_path / "single.csv")[1:]] == ["healthy", "scab", "scab"]


def test_probabilities_plant_pathology_format(tmp_path):
    p = np.array([[0.25, 0.25, 0.125, 0.375], [1.0, 0.0, 0.0, 0.0]], np.float32)
    classes = ["healthy", "multiple_diseases", "rust", "scab"]
    write_submission(p, ["Test_0", "Test_1"], tmp_path / "s.csv", classes=classes, kind="probabilities")
    rows = _read(tmp_path / "s.csv")
    assert rows[0] == ["image_id", "healthy", "multiple_diseases", "rust", "scab"]
    assert rows[1][0] == "Test_0" and [float(v) for v in rows[1][1:]] == [0.25, 0.25, 0.125, 0.375]
    assert len(rows) == 3


def test_checks_ids_classes_and_overwrite(tmp_path):
    p = np.full((2, 3), 1 / 3)
    with pytest.raises(ValueError, match="appears twice"):
        write_submission(p, ["x", "x"], tmp_path / "s.csv", classes=CLASSES)
    with pytest.raises(ValueError, match="2 predictions for 3 ids"):
        write_submission(p, ["x", "y", "z"], tmp_path / "s.csv", classes=CLASSES)
    with pytest.raises(ValueError, match="2 classes .* 3 columns"):
        write_submission(p, ["x", "y"], tmp_path / "s.csv", classes=CLASSES[:2])
    with pytest.raises(ValueError, match="classes=train.classes"):
        write_submission(p, ["x", "y"], tmp_path / "s.csv")
    with pytest.raises(ValueError, match="non-finite"):
        write_submission(np.array([[np.nan, 0, 1], [0, 1, 0]]), ["x", "y"], tmp_path / "s.csv", classes=CLASSES)
    with pytest.raises(ValueError, match="kind"):
        write_submission(p, ["x", "y"], tmp_path / "s.csv", classes=CLASSES, kind="probs")
    assert not (tmp_path / "s.csv").exists()  # nothing written by a refused call
    notes = tmp_path / "notes.csv"
    notes.write_text("my,precious,data\n1,2,3\n")
    with pytest.raises(FileExistsError, match="notes.csv.*overwrite=True"):
        write_submission(p, ["x", "y"], notes, classes=CLASSES)
    assert notes.read_text() == "my,precious,data\n1,2,3\n"
    write_submission(p, ["x", "y"], notes, classes=CLASSES, overwrite=True)
    assert _read(notes)[0] == ["image_id", "label"]
    # rerunning the cell replaces its own submission without overwrite=True
    write_submission(np.eye(3)[[2, 1]], ["x", "y"], notes, classes=CLASSES)
    assert _read(notes)[1:] == [["x", "scab"], ["y", "rust"]]


def _image(path, cls, rng, size=(20, 20)):
    arr = rng.integers(0, 120, (*size, 3), dtype=np.uint8)
    arr[..., cls] = rng.integers(150, 256, size, dtype=np.uint8)
    Image.fromarray(arr).save(path)


def _truncated_jpeg(path, rng):
    buf = path.with_suffix(".full.jpg")
    _image(buf, 0, rng, (40, 48))
    data = buf.read_bytes()
    buf.unlink()
    path.write_bytes(data[: len(data) * 6 // 10])  # an upload that did not finish


def _class_folders(root, counts, rng):
    """root/<class>/<i>.png, counts[c] images of class c (dominant colour channel c)."""
    for c, n in enumerate(counts):
        (root / CLASSES[c]).mkdir(parents=True)
        for i in range(n):
            _image(root / CLASSES[c] / f"{i}.png", c, rng)


def _tiny_trainer(train):
    import torch
    from torch import nn

    from xla_utils import OneCycleTrainer

    def make_model():
        return nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                             nn.Linear(4, 3))

    t = OneCycleTrainer(make_model, nn.CrossEntropyLoss(), train, batch_size=4, epochs=1, max_lr=1e-2)
    t.fit(cores=1)  # plain torch on the CPU: the point is the rows, not the device
    assert isinstance(t.model, torch.nn.Module)
    return t


def test_a_corrupt_test_image_never_loses_a_row(tmp_path, capsys):
    """One truncated JPEG among the test images: build -> predict -> write_submission."""
    rng = np.random.default_rng(0)
    _class_folders(tmp_path / "train", (6, 3, 3), rng)  # 'healthy' is the most frequent class
    test_dir = tmp_path / "test"
    test_dir.mkdir()
    for i in (0, 1, 2, 4, 5, 6):
        _image(test_dir / f"img_{i}.png", i % 3, rng)
    _truncated_jpeg(test_dir / "img_3.jpg", rng)
    build_cache(tmp_path / "train", tmp_path / "c" / "train", size=16)
    build_cache(test_dir, tmp_path / "c" / "test", size=16, unlabeled=True)
    said = capsys.readouterr().out
    assert "WARNING: 1 test image(s) were skipped (img_3.jpg) and will be MISSING from a submission" in said
    assert "missing='fill'" in said
    train, test = CachedImageDataset(tmp_path / "c" / "train"), CachedImageDataset(tmp_path / "c" / "test")
    order = ["img_0.png", "img_1.png", "img_2.png", "img_3.jpg", "img_4.png", "img_5.png", "img_6.png"]
    assert len(test) == 6 and test.requested_ids == order
    assert [e["id"] for e in test.skipped] == ["img_3.jpg"] and "truncated" in test.skipped[0]["reason"]

    trainer = _tiny_trainer(train)
    capsys.readouterr()
    preds = trainer.predict(test)
    said = capsys.readouterr().out
    assert preds.shape == (6, 3)
    assert "1 of the 7 images" in said and "img_3.jpg (" in said and "missing='fill'" in said

    sub = tmp_path / "submission.csv"
    sub.write_text("image_id,label\nkeep,me\n")  # an earlier, good submission
    with pytest.raises(ValueError) as err:
        write_submission(preds, test, sub, train=trainer)
    msg = str(err.value)
    assert "1 of the 7 ids" in msg and "6 rows instead of 7" in msg
    assert "img_3.jpg (skipped at build: " in msg and "missing='fill'" in msg and "Nothing was written" in msg
    assert sub.read_text() == "image_id,label\nkeep,me\n"

    write_submission(preds, test, sub, train=trainer, missing="fill")
    said = capsys.readouterr().out
    rows = _read(sub)
    assert [r[0] for r in rows[1:]] == order  # every id, in the test set's order
    assert rows[4] == ["img_3.jpg", "healthy"]  # the training set's most frequent class
    assert "filled 1 missing row(s) with 'healthy' (fill='prior'): img_3.jpg" in said
    names = [train.classes[k] for k in preds.argmax(1)]
    assert [r[1] for r in rows[1:] if r[0] != "img_3.jpg"] == names
    write_submission(preds, test, sub, classes=train.classes, missing="fill", fill="scab")
    assert _read(sub)[4] == ["img_3.jpg", "scab"]
    with pytest.raises(ValueError, match="fill='prior' needs the training labels"):
        write_submission(preds, test, sub, classes=train.classes, missing="fill")
    with pytest.raises(ValueError, match="'mould'.*not among the classes"):
        write_submission(preds, test, sub, train=train, missing="fill", fill="mould")


def test_raw_outputs_of_a_single_label_model(tmp_path, capsys):
    """Raw outputs (activation=None): the argmax for a single-label model, refused with the
    fix for a multi-label one; a refused write leaves the good submission.csv alone."""
    rng = np.random.default_rng(1)
    _class_folders(tmp_path / "train", (4, 4, 4), rng)
    (tmp_path / "test").mkdir()
    for i in range(5):
        _image(tmp_path / "test" / f"t{i}.png", i % 3, rng)
    build_cache(tmp_path / "train", tmp_path / "c" / "train", size=16, verbose=False)
    build_cache(tmp_path / "test", tmp_path / "c" / "test", size=16, unlabeled=True, verbose=False)
    train, test = CachedImageDataset(tmp_path / "c" / "train"), CachedImageDataset(tmp_path / "c" / "test")
    trainer = _tiny_trainer(train)
    probs, raw = trainer.predict(test), trainer.predict(test, activation=None)
    assert not np.allclose(raw.sum(1), 1.0)  # logits: the rows do not sum to 1
    sub = tmp_path / "submission.csv"
    write_submission(probs, test, sub, classes=train.classes)
    good = sub.read_text()
    with pytest.raises(ValueError, match="single- or multi-label.*train=trainer"):
        write_submission(raw, test, sub, classes=train.classes)
    assert sub.read_text() == good
    for source in (trainer, train):  # the trainer, or the training cache, says single-label
        write_submission(raw, test, sub, train=source)
        assert sub.read_text() == good  # argmax of the logits = argmax of the probabilities
    write_submission(raw * 100.0, test, sub, classes=train.classes, multilabel=False)
    assert sub.read_text() == good
    with pytest.raises(ValueError, match=r"multi-label predictions must be probabilities in \[0, 1\].*"
                                         r"activation='auto'"):
        write_submission(raw, test, sub, classes=train.classes, multilabel=True)
    with pytest.raises(ValueError, match="kind='probabilities' must be probabilities"):
        write_submission(raw, test, sub, train=trainer, kind="probabilities", overwrite=True)
    assert sub.read_text() == good


def test_sample_submission_ids_in_its_order(tmp_path, capsys):
    """sample_submission.csv lists the ids (without extension, in its own order): the file
    written has exactly them; a cache built from the sample itself records exactly them."""
    rng = np.random.default_rng(2)
    (tmp_path / "test").mkdir()
    for name in ("t0", "t1", "t2", "t4"):
        _image(tmp_path / "test" / f"{name}.png", 0, rng)
    _truncated_jpeg(tmp_path / "test" / "t3.jpg", rng)
    sample = tmp_path / "test" / "sample_submission.csv"
    wanted = ["t3", "t0", "t4", "t1", "t2"]
    sample.write_text("id,disease\n" + "".join(f"{x},healthy\n" for x in wanted))
    build_cache(tmp_path / "test", tmp_path / "c" / "folder", size=16, unlabeled=True, verbose=False)
    folder = CachedImageDataset(tmp_path / "c" / "folder")
    assert folder.ids == ["t0.png", "t1.png", "t2.png", "t4.png"]
    preds = np.eye(3)[[0, 1, 2, 1]]
    out = tmp_path / "submission.csv"
    with pytest.raises(ValueError, match=r"1 of the 5 ids of .*sample_submission.csv.*t3 \(skipped at build: .*truncated"):
        write_submission(preds, folder, out, classes=CLASSES, sample=sample)
    write_submission(preds, folder, out, classes=CLASSES, sample=sample, missing="fill", fill="rust")
    assert _read(out) == [["id", "disease"], ["t3", "rust"], ["t0", "healthy"], ["t4", "rust"],
                          ["t1", "rust"], ["t2", "scab"]]
    # probabilities in the sample's column order
    (tmp_path / "probs.csv").write_text("id,scab,healthy,rust\n" + "".join(f"{x},0,0,0\n" for x in wanted))
    write_submission(preds, folder, out, classes=CLASSES, sample=tmp_path / "probs.csv", kind="probabilities",
                     missing="fill", fill="healthy", overwrite=True)
    rows = _read(out)
    assert rows[0] == ["id", "scab", "healthy", "rust"] and rows[1] == ["t3", "0", "1", "0"]
    assert rows[5] == ["t2", "1", "0", "0"]
    with pytest.raises(ValueError, match="one per class, so write kind='probabilities'"):
        write_submission(preds, folder, out, classes=CLASSES, sample=tmp_path / "probs.csv")
    # a prediction the sample does not list would invent a row
    (tmp_path / "short.csv").write_text("id,label\nt0\nt1\nt2\nnot_there\n")
    with pytest.raises(ValueError, match=r"do not match .*short.csv: 1 prediction\(s\) have ids it does not "
                                         r"list \(t4.png\) and 1 of its ids have no prediction \(not_there\)"):
        write_submission(preds, folder, out, classes=CLASSES, sample=tmp_path / "short.csv")
    # an id the sample lists but the test set lacks is missing, and said so
    with pytest.raises(ValueError, match=r"not_there \(no prediction\)"):
        write_submission(np.eye(3)[[0, 1, 2]], ["t0.png", "t1.png", "t2.png"], out, classes=CLASSES,
                         sample=tmp_path / "short.csv")

    # the test cache built from the sample itself: its ids, its order, the skipped one included,
    # and (the sample being next to it) its header
    capsys.readouterr()
    build_cache(sample, tmp_path / "c" / "sample", size=16, unlabeled=True)
    assert "WARNING: 1 test image(s) were skipped (t3)" in capsys.readouterr().out
    from_sample = CachedImageDataset(tmp_path / "c" / "sample")
    assert from_sample.ids == ["t0", "t4", "t1", "t2"] and from_sample.requested_ids == wanted
    write_submission(np.eye(3)[[0, 1, 1, 2]], from_sample, out, classes=CLASSES, missing="fill", fill="scab",
                     overwrite=True)
    assert _read(out) == [["id", "disease"], ["t3", "scab"], ["t0", "healthy"], ["t4", "rust"],
                          ["t1", "rust"], ["t2", "scab"]]


def test_kaggle_layout_follows_the_competitions_sample(tmp_path, capsys):
    """/kaggle/input/<comp>/{test/, sample_submission.csv}: the README's call, with no sample=,
    writes the sample's ids (no extension), header and order and says which file it followed;
    sample=None writes the test set's own ids; ids that differ are refused, both sides shown."""
    rng = np.random.default_rng(5)
    comp = tmp_path / "input" / "comp"
    (comp / "test").mkdir(parents=True)
    for i in range(5):
        _image(comp / "test" / f"img_{i}.jpg", i % 3, rng)
    wanted = ["img_3", "img_0", "img_4", "img_2", "img_1"]  # the sample's own order
    (comp / "sample_submission.csv").write_text("id,label\n" + "".join(f"{x},healthy\n" for x in wanted))
    build_cache(comp / "test", tmp_path / "cache" / "test", size=16, unlabeled=True, verbose=False)
    test = CachedImageDataset(tmp_path / "cache" / "test")
    preds = np.eye(3)[[0, 1, 2, 0, 1]]  # test order: img_0 .. img_4
    capsys.readouterr()
    out = write_submission(preds, test, tmp_path / "submission.csv", classes=CLASSES)
    said = capsys.readouterr().out
    assert f"ids, order and header from {comp / 'sample_submission.csv'}" in said and "sample=None" in said
    assert _read(out) == [["id", "label"], ["img_3", "healthy"], ["img_0", "healthy"], ["img_4", "rust"],
                          ["img_2", "scab"], ["img_1", "rust"]]
    own = write_submission(preds, test, tmp_path / "own.csv", classes=CLASSES, sample=None)
    assert [r[0] for r in _read(own)] == ["image_id"] + [f"img_{i}.jpg" for i in range(5)]
    assert "sample" not in capsys.readouterr().out.split("wrote")[0]  # no sample named
    # the sample of another test set: refused with the first ids of each side, nothing written
    (comp / "sample_submission.csv").write_text("id,label\n" + "".join(f"other_{i},a\n" for i in range(7)))
    with pytest.raises(ValueError, match=r"do not match .*sample_submission.csv: 5 prediction\(s\) have ids it "
                                         r"does not list \(img_0.jpg, img_1.jpg.*\) and 7 of its ids have no "
                                         r"prediction \(other_0, other_1.* and 2 more\).*Nothing was written.*sample=None"):
        write_submission(preds, test, tmp_path / "refused.csv", classes=CLASSES)
    assert not (tmp_path / "refused.csv").exists()


def _render(folder, n, seed):
    """n 20x20 PNGs whose dominant colour channel is the class; returns {name: class}."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True)
    truth = {}
    for i in range(n):
        c = int(rng.integers(0, 3))
        arr = rng.integers(0, 120, (20, 20, 3), dtype=np.uint8)
        arr[..., c] = rng.integers(150, 256, (20, 20), dtype=np.uint8)
        arr[:5, :5] = 0  # a corner mark: mirror views differ
        name = f"{folder.name[:-7]}_{i}"
        Image.fromarray(arr).save(folder / f"{name}.png")
        truth[name] = CLASSES[c]
    return truth


@pytest.mark.multicore
@pytest.mark.timeout(900)
def test_competition_in_miniature(tmp_path, capsys):
    """train_images/ + train.csv and a flat test_images/, like a Kaggle competition:
    train, predict with TTA on 2 simulated cores, write submission.csv, score it."""
    import torch
    from torch import nn

    from xla_utils import OneCycleTrainer

    train_truth = _render(tmp_path / "train_images", 60, 0)
    test_truth = _render(tmp_path / "test_images", 21, 1)  # 21: not a multiple of 2 cores x 4
    (tmp_path / "train.csv").write_text(
        "image_id,label\n" + "".join(f"{k},{v}\n" for k, v in train_truth.items()))

    # The forgotten CSV: an unlabelled cache, said loudly, refused by the trainer.
    build_cache(tmp_path / "train_images", tmp_path / "c" / "oops", size=16)
    assert "UNLABELLED" in capsys.readouterr().out
    with pytest.raises(ValueError, match="labels="):
        OneCycleTrainer(nn.Linear(2, 2), nn.CrossEntropyLoss(),
                        CachedImageDataset(tmp_path / "c" / "oops")).fit()

    build_cache(tmp_path / "train_images", tmp_path / "c" / "train", labels=tmp_path / "train.csv", size=16)
    build_cache(tmp_path / "test_images", tmp_path / "c" / "test", size=16, unlabeled=True)
    train, test = CachedImageDataset(tmp_path / "c" / "train"), CachedImageDataset(tmp_path / "c" / "test")
    assert train.classes == CLASSES and test.unlabeled and len(test) == 21

    def make_model():
        return nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                             nn.Linear(8, 3))

    trainer = OneCycleTrainer(make_model, nn.CrossEntropyLoss(), train, batch_size=4, epochs=4,
                              max_lr=3e-2, optimizer="adam")
    trainer.fit(simulate=1, cores=1)
    preds = trainer.predict(test, tta=2, simulate=2)  # image + mirror image
    assert preds.shape == (21, 3)
    sub = write_submission(preds, test, tmp_path / "submission.csv", classes=train.classes)
    rows = _read(sub)
    assert rows[0] == ["image_id", "label"]
    ids = [r[0] for r in rows[1:]]
    assert ids == sorted(p.name for p in (tmp_path / "test_images").iterdir())
    assert len(set(ids)) == len(ids) == 21
    score = np.mean([label == test_truth[i[:-4]] for i, label in rows[1:]])
    assert score > 0.6, (score, rows)  # the model learned (chance: 1/3)

    # the hidden labels as a labelled copy of the same test images
    (tmp_path / "hidden.csv").write_text(  # in file-name order, like the unlabelled cache
        "".join(f"{k},{test_truth[k]}\n" for k in sorted(test_truth, key=lambda k: k + ".png")))
    build_cache(tmp_path / "test_images", tmp_path / "c" / "test_labelled", labels=tmp_path / "hidden.csv",
                classes=train.classes, size=16)
    labelled = CachedImageDataset(tmp_path / "c" / "test_labelled")
    assert [i + ".png" for i in labelled.ids] == ids
    ev = trainer.evaluate(labelled, tta=2, simulate=2)
    assert ev["samples"] == 21
    assert ev["accuracy"] == pytest.approx(score, abs=1e-9)


def test_one_logit_binary_model_fills_the_samples_target_column(tmp_path):
    """A 10%-positive binary task with a one-output model and BCEWithLogitsLoss trains; predict
    gives the positive class's probability; the submission follows the sample's id,target."""
    import torch
    from torch import nn

    from helpers import digit_images, tiny_cnn

    from xla_utils import OneCycleTrainer

    items = [(img, int(y == 3)) for img, y in digit_images(160, classes=10)]
    assert 0.05 < np.mean([y for _, y in items]) < 0.15
    build_cache(items[:128], tmp_path / "train", size=8, verbose=False)
    build_cache([x for x, _ in items[128:]], tmp_path / "test", size=8, unlabeled=True, verbose=False)
    train, test = CachedImageDataset(tmp_path / "train"), CachedImageDataset(tmp_path / "test")
    t = OneCycleTrainer(tiny_cnn(1, size=8, seed=0), nn.BCEWithLogitsLoss(), train, train,
                        batch_size=8, epochs=1, max_lr=1e-2, mean=(0.5,) * 3, std=(0.25,) * 3,
                        label_smoothing=0.1)  # soft 0/1 targets of one logit
    assert t.task == "binary"
    h = t.fit(cores=1)
    assert np.isfinite(h.epochs[-1]["val_loss"])
    p = t.predict(test)
    assert p.shape == (32, 1) and 0.0 <= p.min() and p.max() <= 1.0
    ids = test.ids
    sample = tmp_path / "sample_submission.csv"
    sample.write_text("id,target\n" + "".join(f"{x},0.5\n" for x in reversed(ids)))
    write_submission(p, test, tmp_path / "s.csv", train=t, sample=sample)
    rows = _read(tmp_path / "s.csv")
    assert rows[0] == ["id", "target"] and [r[0] for r in rows[1:]] == ids[::-1]
    np.testing.assert_allclose([float(r[1]) for r in rows[1:]], p[::-1, 0], rtol=1e-5)
    write_submission(p, test, tmp_path / "l.csv", train=t, kind="label", threshold=0.3)
    assert [r[1] for r in _read(tmp_path / "l.csv")[1:]] == ["1" if v > 0.3 else "0" for v in p[:, 0]]
    raw = t.predict(test, activation=None)
    with pytest.raises(ValueError, match=r"one-logit binary.*probabilities in \[0, 1\].*activation='auto'"):
        write_submission(raw - 5.0, test, tmp_path / "r.csv", train=t, sample=sample)
    torch.testing.assert_close(torch.from_numpy(p), torch.sigmoid(torch.from_numpy(raw)))


def test_values_and_the_advice_of_one_column_samples(tmp_path):
    ids = ["a", "b"]
    write_submission(np.array([[2.5, -1.0], [0.25, 3.0]]), ids, tmp_path / "v.csv", kind="values")
    assert _read(tmp_path / "v.csv") == [["image_id", "target_0", "target_1"], ["a", "2.5", "-1"],
                                         ["b", "0.25", "3"]]
    sample = tmp_path / "sample.csv"
    sample.write_text("id,target\na,0\nb,0\n")
    soft = np.array([[0.8, 0.2], [0.3, 0.7]])
    with pytest.raises(ValueError, match=r"2 column\(s\).*write_submission\(preds\[:, 1:\]"):
        write_submission(soft, ids, tmp_path / "x.csv", sample=sample, kind="values")
    with pytest.raises(ValueError, match=r"'target'.*kind='values' with preds\[:, 1:\]"):
        write_submission(soft, ids, tmp_path / "x.csv", sample=sample, classes=["0", "1"],
                         kind="probabilities")
    write_submission(soft[:, 1:], ids, tmp_path / "p.csv", sample=sample)  # one column: values
    assert _read(tmp_path / "p.csv") == [["id", "target"], ["a", "0.2"], ["b", "0.7"]]
