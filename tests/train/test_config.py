"""xla_utils.train.config: the trainer's settings in groups, given flat."""
from __future__ import annotations

import ast
import dataclasses
import inspect
import warnings
from pathlib import Path

import pytest
from torch import nn

from xla_utils.train.config import (GROUPS, OPTION_GROUPS, AugmentSettings, CheckpointSettings,
                                    DataSettings, DeviceSettings, DiagnosticsSettings,
                                    OptimSettings, ScheduleSettings, TrainerConfig)
from xla_utils import runtime
from xla_utils.train.trainer import OneCycleTrainer

# Every keyword of OneCycleTrainer before the groups (the flat TrainerConfig of 37 fields),
# with a value that is not its default, and where it lands: (group, field, value stored).
OLD_OPTIONS = {
    "batch_size": (dict(batch_size=64), "data", "batch_size", 64),
    "eval_batch_size": (dict(eval_batch_size=16), "data", "eval_batch_size", 16),
    "num_workers": (dict(num_workers=2), "data", "num_workers", 2),
    "flip": (dict(flip=False), "data", "flip", False),
    "mean": (dict(mean=(0.5, 0.5, 0.5)), "data", "mean", (0.5, 0.5, 0.5)),
    "std": (dict(std=(0.25, 0.25, 0.25)), "data", "std", (0.25, 0.25, 0.25)),
    "seed": (dict(seed=7), "data", "seed", 7),
    "epochs": (dict(epochs=3), "schedule", "epochs", 3),
    "max_lr": (dict(max_lr="Find "), "schedule", "max_lr", "find"),
    "lr_scaling": (dict(lr_scaling="SQRT"), "schedule", "lr_scaling", "sqrt"),
    "pct_start": (dict(pct_start=0.25), "schedule", "pct_start", 0.25),
    "div_factor": (dict(div_factor=10.0), "schedule", "div_factor", 10.0),
    "final_div_factor": (dict(final_div_factor=100.0), "schedule", "final_div_factor", 100.0),
    "moms": (dict(moms=(0.9, 0.8, 0.9)), "schedule", "moms", (0.9, 0.8, 0.9)),
    "optimizer": (dict(optimizer="SGD"), "optim", "optimizer", "sgd"),
    "weight_decay": (dict(weight_decay=0.01), "optim", "weight_decay", 0.01),
    "accum_steps": (dict(accum_steps=2), "optim", "accum_steps", 2),
    "precision": (dict(precision=" FP32"), "optim", "precision", "fp32"),
    "bf16": (dict(bf16=True), "optim", "precision", "bf16"),  # the deprecated alias
    "channels_last": (dict(channels_last=False), "optim", "channels_last", False),
    "mixup": (dict(mixup=0.2), "augment", "mixup", 0.2),
    "cutmix": (dict(cutmix=1.0), "augment", "cutmix", 1.0),
    "label_smoothing": (dict(label_smoothing=0.1), "augment", "label_smoothing", 0.1),
    "ema": (dict(ema=0.99), "augment", "ema", 0.99),
    "checkpoint_dir": (dict(checkpoint_dir="ckpt"), "checkpoints", "checkpoint_dir", "ckpt"),
    "keep_checkpoints": (dict(keep_checkpoints=3), "checkpoints", "keep_checkpoints", 3),
    "keep_runs": (dict(keep_runs=2), "checkpoints", "keep_runs", 2),
    "monitor": (dict(monitor="Val_Loss"), "checkpoints", "monitor", "val_loss"),
    "patience": (dict(patience=2, monitor="val_loss"), "checkpoints", "patience", 2),
    "strategy": (dict(strategy="SPMD"), "devices", "strategy", "spmd"),
    "fsdp_wrap": (dict(fsdp_wrap="Block", strategy="fsdp"), "devices", "fsdp_wrap", "Block"),
    "activation_checkpointing": (dict(activation_checkpointing=True, strategy="fsdp"), "devices",
                                 "activation_checkpointing", True),
    "lr_find_on_mesh": (dict(lr_find_on_mesh=True, strategy="spmd"), "devices",
                        "lr_find_on_mesh", True),
    "compile_cache": (dict(compile_cache=None), "devices", "compile_cache", None),
    "metrics": (dict(metrics=["F1", "top3"]), "diagnostics", "metrics", ["f1", "top3"]),
    "log_every": (dict(log_every=5), "diagnostics", "log_every", 5),
    "on_nan": (dict(on_nan="Continue"), "diagnostics", "on_nan", "continue"),
}


def test_trainer_config_has_its_groups_at_the_top():
    names = [f.name for f in dataclasses.fields(TrainerConfig)]
    assert len(names) <= 15
    assert names == list(GROUPS) == ["data", "schedule", "optim", "augment", "checkpoints",
                                     "devices", "diagnostics"]
    cfg = TrainerConfig()
    assert all(isinstance(getattr(cfg, n), GROUPS[n]) for n in names)


def test_the_table_covers_every_old_option():
    assert len(OLD_OPTIONS) == 37
    assert set(OLD_OPTIONS) - {"bf16"} <= set(OPTION_GROUPS)  # new options may join the groups


@pytest.mark.parametrize("name", list(OLD_OPTIONS))
def test_every_old_flat_keyword_lands_in_its_group(name):
    kwargs, group, fld, stored = OLD_OPTIONS[name]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # only the deprecated alias may warn
        if name == "bf16":
            with pytest.warns(DeprecationWarning, match="bf16=True is deprecated"):
                cfg = TrainerConfig(**kwargs)
        else:
            cfg = TrainerConfig(**kwargs)
    assert getattr(getattr(cfg, group), fld) == stored
    assert getattr(cfg, fld) == stored  # the flat read is the group's attribute
    untouched = TrainerConfig()
    for other in GROUPS:
        if other != group:
            assert getattr(cfg, other) == getattr(untouched, other), other


def test_the_trainer_takes_the_old_keywords_flat():
    """All of them at once (strategy "fsdp", which every devices option allows)."""
    every = {k: v for kwargs, *_ in OLD_OPTIONS.values() for k, v in kwargs.items()}
    every.pop("bf16")
    every["strategy"] = "fsdp"
    t = OneCycleTrainer(nn.Linear(2, 2), nn.CrossEntropyLoss(), None, **every)
    for name, (_, group, fld, stored) in OLD_OPTIONS.items():
        if name not in ("bf16", "strategy"):
            assert getattr(getattr(t.config, group), fld) == stored, name
    assert t.config.devices.strategy == "fsdp"


@pytest.mark.parametrize("typo, near, group", [("batchsize", "batch_size", "data"),
                                               ("epoch", "epochs", "schedule"),
                                               ("max_lrr", "max_lr", "schedule"),
                                               ("label_smoothin", "label_smoothing", "augment"),
                                               ("checkpointdir", "checkpoint_dir", "checkpoints"),
                                               ("on_nans", "on_nan", "diagnostics")])
def test_a_typo_names_the_keyword_and_its_group(typo, near, group):
    with pytest.raises(TypeError) as err:
        OneCycleTrainer(nn.Linear(2, 2), nn.CrossEntropyLoss(), None, **{typo: 1})
    msg = str(err.value)
    assert msg.startswith(f"OneCycleTrainer() got unexpected keyword argument {typo!r} "
                          f"(did you mean {near!r}?) in the {group} group "
                          f"(config.{group}.{near})"), msg
    assert "data: batch_size, eval_batch_size" in msg  # then every option by group
    with pytest.raises(TypeError, match=rf"TrainerConfig\(\) got unexpected .*{near!r}"):
        TrainerConfig(**{typo: 1})


BAD = [
    (DataSettings, dict(batch_size=0), "batch_size must be a positive int"),
    (DataSettings, dict(eval_batch_size=0), "eval_batch_size must be a positive int"),
    (ScheduleSettings, dict(epochs=0), "epochs must be a positive int"),
    (ScheduleSettings, dict(max_lr=-1.0), "max_lr must be a positive number or 'find'"),
    (ScheduleSettings, dict(max_lr="fnd"), "did you mean 'find'"),
    (ScheduleSettings, dict(lr_scaling="cubic"), "lr_scaling must be one of"),
    (ScheduleSettings, dict(pct_start=1.5), r"pct_start must be in \[0, 1\]"),
    (ScheduleSettings, dict(moms=(0.9, 0.8)), r"moms must be \(start, peak, end\)"),
    (OptimSettings, dict(optimizer="sgdd"), "did you mean 'sgd'"),
    (OptimSettings, dict(accum_steps=0), "accum_steps must be an int >= 1"),
    (OptimSettings, dict(precision="mixed"), "precision must be one of"),
    (OptimSettings, dict(channels_last=1), "channels_last must be 'auto', True or False"),
    (AugmentSettings, dict(mixup=-0.2), "mixup must be a Beta alpha >= 0"),
    (AugmentSettings, dict(label_smoothing=1.0), r"label_smoothing must be in \[0, 1\)"),
    (AugmentSettings, dict(ema=1.5), "ema is the EMA decay per optimizer step"),
    (CheckpointSettings, dict(keep_checkpoints=0), "keep_checkpoints must be an int >= 1"),
    (CheckpointSettings, dict(keep_runs=0), "keep_runs must be None"),
    (CheckpointSettings, dict(monitor=3), "monitor must be None or the name of a value"),
    (CheckpointSettings, dict(patience=2), "patience= needs monitor="),
    (DeviceSettings, dict(strategy="ddp"), "strategy must be one of"),
    (DeviceSettings, dict(strategy="fsdp", fsdp_wrap=0), "fsdp_wrap must be None"),
    (DeviceSettings, dict(activation_checkpointing=True), "applies to FSDP units"),
    (DeviceSettings, dict(lr_find_on_mesh=True), "lr_find_on_mesh=True sweeps as a mesh run"),
    (DeviceSettings, dict(compile_cache=3), "compile_cache must be"),
    (DiagnosticsSettings, dict(log_every=0), "log_every must be >= 1"),
    (DiagnosticsSettings, dict(on_nan="ignore"), "on_nan must be one of"),
]


@pytest.mark.parametrize("group, kwargs, match", BAD,
                         ids=[f"{g.__name__}-{next(iter(k))}" for g, k, _ in BAD])
def test_each_group_refuses_its_own_bad_values(group, kwargs, match):
    with pytest.raises(ValueError, match=match):
        group(**kwargs)
    with pytest.raises(ValueError, match=match):  # the same check, given flat
        TrainerConfig(**kwargs)


def test_rules_across_groups_and_whole_groups():
    with pytest.raises(ValueError, match="need an even batch_size"):
        TrainerConfig(cutmix=1.0, batch_size=15)
    with pytest.raises(ValueError, match="need an even batch_size"):
        TrainerConfig(data=DataSettings(batch_size=15), augment=AugmentSettings(mixup=0.2))
    cfg = TrainerConfig(schedule=ScheduleSettings(epochs=4), max_lr=0.1)  # options over a group
    assert (cfg.schedule.epochs, cfg.schedule.max_lr) == (4, 0.1)
    with pytest.raises(TypeError, match="schedule must be a ScheduleSettings, got dict"):
        TrainerConfig(schedule={"epochs": 4})
    # monitor= names a value of the run: a callable metric's name counts (the diagnostics
    # group's), so the name is checked across the two groups, with the nearest one
    assert CheckpointSettings(monitor="acc").monitor == "acc"
    with pytest.raises(ValueError, match=r"monitor='acuracy' \(did you mean 'accuracy'\?\) is not "
                                         "a value fit records"):
        TrainerConfig(checkpoints=CheckpointSettings(monitor="acuracy"))

    def kappa(p, t):
        return 0.0

    assert TrainerConfig(monitor="Kappa", metrics=[kappa]).monitor == "kappa"
    with pytest.raises(ValueError, match=r"monitor='auc' is not among this run's validation "
                                         r"metrics \['kappa'\]"):
        TrainerConfig(monitor="auc", metrics=[kappa])


def test_replace_checks_and_flat_writes_reach_the_group():
    cfg = TrainerConfig(batch_size=16, epochs=2)
    again = cfg.replace(epochs=5, max_lr=0.01)
    assert (again.epochs, again.max_lr, again.batch_size) == (5, 0.01, 16)
    assert cfg.epochs == 2  # a copy
    with pytest.raises(ValueError, match="epochs must be a positive int"):
        cfg.replace(epochs=0)
    cfg.epochs = 1
    assert cfg.schedule.epochs == 1
    assert TrainerConfig(**cfg.options()) == cfg
    assert set(cfg.options()) == set(OPTION_GROUPS)


def test_fit_overrides_are_exactly_the_schedule_group():
    """fit's setting keywords: the schedule group's fields, and compile= (issue 45: a run may
    compile or not, the devices group's setting for that run)."""
    params = set(inspect.signature(OneCycleTrainer.fit).parameters)
    schedule = {f.name for f in dataclasses.fields(ScheduleSettings)}
    assert params & set(OPTION_GROUPS) == schedule | {"compile"}
    t = OneCycleTrainer(nn.Linear(2, 2), nn.CrossEntropyLoss(), None, epochs=2)
    with pytest.raises(ValueError, match=r"fit\(pct_start=1\.5\): pct_start must be in \[0, 1\]"):
        t.fit(pct_start=1.5)
    with pytest.raises(ValueError, match=r"fit\(lr_scaling='cubic'\): lr_scaling must be one of"):
        t.fit(lr_scaling="cubic")
    with pytest.raises(ValueError, match=r"fit\(epochs=0\): epochs must be a positive int"):
        t.fit(epochs=0)
    run = t._run_config(runtime.resolve(), epochs=3, moms=(0.9, 0.85, 0.9), max_lr=None)
    assert (run.schedule.epochs, run.schedule.moms) == (3, (0.9, 0.85, 0.9))
    assert t.config.schedule.epochs == 2 and run.data == t.config.data


def test_deprecations_share_one_message_pointed_at_the_caller():
    with pytest.warns(DeprecationWarning) as rec:
        OneCycleTrainer(nn.Linear(2, 2), nn.CrossEntropyLoss(), None, bf16=True)
    assert [str(w.message) for w in rec] == ["bf16=True is deprecated: use precision='bf16'"]
    assert rec[0].filename == __file__  # the user's line, not xla_utils'
    with pytest.raises(ValueError, match="bf16 must be True or False"):
        TrainerConfig(bf16="yes")


def test_config_imports_none_of_the_parts_that_read_it():
    """The groups are checked in config.py itself: it imports none of the trainer's parts
    that are handed the settings (not even for annotations), so no import loop is left."""
    import xla_utils.train.config as config

    tree = ast.parse(Path(config.__file__).read_text())
    imported = {(n.module or "").lstrip(".") for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    for part in ("checkpoint", "history", "mixup", "strategy", "loop", "trainer", "inference",
                 "replica_loops", "mesh_tasks", "steps"):
        assert part not in imported, part
