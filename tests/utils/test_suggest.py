"""xla_utils.utils.suggest: one "did you mean ...?" for every typo a user makes."""
from __future__ import annotations

import re

import numpy as np
import pytest
from PIL import Image

from xla_utils.utils.suggest import by_similarity, closest, did_you_mean, unknown_keywords


def test_helpers():
    assert closest("batchsize", ["epochs", "eval_batch_size", "batch_size"]) == ["batch_size", "eval_batch_size"]
    assert closest("SGDD", ["sgd", "adam"]) == ["sgd"]  # case-insensitive, spelled as the option
    assert closest("zzz", ["sgd", "adam"]) == []
    assert did_you_mean("varients", ["variants", "size"]) == " (did you mean 'variants'?)"
    assert did_you_mean("--varients", ["--variants"], quote=False) == " (did you mean --variants?)"
    assert did_you_mean("zzz", ["sgd"]) == ""
    assert by_similarity("trian", ["test", "test96", "test_nolab", "train", "val"])[0] == "train"
    err = unknown_keywords("f()", ["szie", "qq"], ["size", "seed"])
    assert isinstance(err, TypeError)
    assert str(err) == ("f() got unexpected keyword arguments 'szie' (did you mean 'size'?), 'qq'; "
                        "its options are: seed, size")


def test_three_typos_as_a_user_makes_them(tmp_path):
    """build_cache(varients=2), OneCycleTrainer(batchsize=4), CachedImageDataset("cache/trian"):
    each error starts with the intended name."""
    from torch import nn

    from xla_utils import CachedImageDataset, OneCycleTrainer, build_cache

    (tmp_path / "imgs" / "a").mkdir(parents=True)
    for i in range(2):
        Image.fromarray(np.full((12, 12, 3), 60 * i, np.uint8)).save(tmp_path / "imgs" / "a" / f"{i}.png")
    with pytest.raises(TypeError) as err:
        build_cache(tmp_path / "imgs", tmp_path / "cache" / "train", size=8, varients=2)
    assert str(err.value).startswith("build_cache() got unexpected keyword argument 'varients' "
                                     "(did you mean 'variants'?)")
    assert not (tmp_path / "cache").exists()  # refused before anything was written
    with pytest.raises(TypeError, match="'unlabelled' \\(did you mean 'unlabeled'\\?\\)"):
        build_cache(tmp_path / "imgs", tmp_path / "cache" / "test", unlabelled=True)
    build_cache(tmp_path / "imgs", tmp_path / "cache" / "train", size=8, verbose=False)
    train = CachedImageDataset(tmp_path / "cache" / "train")

    with pytest.raises(TypeError) as err:
        OneCycleTrainer(nn.Linear(2, 2), nn.CrossEntropyLoss(), train, batchsize=4)
    msg = str(err.value)
    assert msg.startswith("OneCycleTrainer() got unexpected keyword argument 'batchsize' "
                          "(did you mean 'batch_size'?)")
    assert "checkpoints: checkpoint_dir, keep_checkpoints, keep_runs" in \
        msg.split("its options, by group: ")[1]  # and then every option

    with pytest.raises(FileNotFoundError) as err:
        CachedImageDataset(tmp_path / "cache" / "trian")
    assert re.match(rf"{re.escape(str(tmp_path / 'cache' / 'trian'))} does not exist; did you mean "
                    rf"{re.escape(str(tmp_path / 'cache' / 'train'))}\?", str(err.value))


def test_every_name_a_user_types_gets_the_same_help(tmp_path):
    """fit(epoch=2), build_cache("comp/Train") and string options typed with a slip of case or
    space: keywords and paths get a did-you-mean, every string option is read after
    .strip().lower() (accepted so) and a near miss is refused with its suggestion."""
    from torch import nn

    from xla_utils import CacheConfig, CachedImageDataset, OneCycleTrainer, build_cache
    from xla_utils.cache import BuildError
    from xla_utils.train.trainer import TrainerConfig

    (tmp_path / "comp" / "train" / "a").mkdir(parents=True)
    for i in range(2):
        Image.fromarray(np.full((12, 12, 3), 60 * i, np.uint8)).save(
            tmp_path / "comp" / "train" / "a" / f"{i}.png")
    with pytest.raises(BuildError) as err:  # a case slip in the path
        build_cache(tmp_path / "comp" / "Train", tmp_path / "cache", size=8)
    assert f"did you mean {tmp_path / 'comp' / 'train'}?" in str(err.value)
    with pytest.raises(BuildError, match=r"did you mean .*comp/train\?"):  # a near miss
        build_cache(tmp_path / "comp" / "trian", tmp_path / "cache", size=8)
    report = build_cache(tmp_path / "comp" / "train", tmp_path / "cache", size=8, verbose=False,
                         engine=" Local", codec="RAW ", resize="Crop")
    assert report.num_images == 2
    assert CacheConfig(codec="JPEG ", small=" Skip", resample="Bicubic").codec == "jpeg"
    with pytest.raises(ValueError, match=r"codec must be one of .* got 'jpg' \(did you mean 'jpeg'\?\)"):
        CacheConfig(codec="jpg")

    trainer = OneCycleTrainer(nn.Linear(2, 2), nn.CrossEntropyLoss(),
                              CachedImageDataset(tmp_path / "cache"), batch_size=2)
    with pytest.raises(TypeError) as err:
        trainer.fit(epoch=2)
    assert str(err.value).startswith("OneCycleTrainer.fit() got unexpected keyword argument "
                                     "'epoch' (did you mean 'epochs'?)")
    with pytest.raises(TypeError, match=r"'batchsize' \(did you mean 'batch_size'\?\)"):
        trainer.predict(trainer.train_data, batchsize=2)

    cfg = TrainerConfig(optimizer="adamW ", max_lr="Find", precision=" FP32", strategy="Spawn",
                        on_nan="STOP", lr_scaling="Sqrt ", channels_last="AUTO",
                        monitor="Val_Loss", metrics=["Accuracy"])
    assert (cfg.optimizer, cfg.max_lr, cfg.precision, cfg.strategy, cfg.on_nan, cfg.lr_scaling,
            cfg.channels_last, cfg.monitor, cfg.metrics) == (
        "adamw", "find", "fp32", "spawn", "stop", "sqrt", "auto", "val_loss", ["accuracy"])
    for kw, near in (({"max_lr": "fnd"}, "find"), ({"precision": "bf61"}, "bf16"),
                     ({"strategy": "fsdp2"}, "fsdp"), ({"optimizer": "adamm"}, "adam")):
        with pytest.raises(ValueError, match=rf"did you mean '{near}'\?"):
            TrainerConfig(**kw)
