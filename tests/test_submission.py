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
                     label_column="labels", threshold=0.5)
    assert _read(tmp_path / "multi.csv") == [["id", "labels"], ["a.jpg", "healthy scab"], ["b.jpg", ""],
                                              ["c.jpg", "rust scab"]]
    assert "1 row(s) have no class above threshold 0.5" in capsys.readouterr().out
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
