"""OneCycleTrainer and debug_run on real XLA:CPU (simulated cores) and plain torch."""
from __future__ import annotations

from functools import partial

import numpy as np
import pytest
import torch
from torch import nn

from helpers import digits_split, tiny_mlp

from xla_utils import OneCycleSchedule, OneCycleTrainer, debug_run, runtime
from xla_utils.train.trainer import ResumeError, TrainerConfig, scale_lr

_mlp = partial(tiny_mlp, hidden=64)  # 64-64-10


def test_config_validation_and_scaling():
    with pytest.raises(ValueError, match="batch_size"):
        TrainerConfig(batch_size=0)
    with pytest.raises(ValueError, match="lr_scaling"):
        TrainerConfig(lr_scaling="cubic")
    with pytest.raises(TypeError, match="options, by group: data: batch_size"):
        OneCycleTrainer(_mlp(), nn.CrossEntropyLoss(), [], batchsize=3)
    assert scale_lr(1e-3, 8, "linear") == pytest.approx(8e-3)
    assert scale_lr(1e-3, 4, "sqrt") == pytest.approx(2e-3)
    assert scale_lr(1e-3, 8, "none") == 1e-3
    assert TrainerConfig(optimizer="sgd").scaling_rule == "linear"
    assert TrainerConfig(optimizer="adam").scaling_rule == "sqrt"


def test_torch_backend_fit_learns_and_reports(capsys):
    train, val = digits_split()
    t = OneCycleTrainer(_mlp, nn.CrossEntropyLoss(), train, val, batch_size=32, epochs=3,
                        max_lr=1e-2, optimizer="adam", seed=1)
    before = {k: v.clone() for k, v in t.model.state_dict().items()}
    h = t.fit()
    out = capsys.readouterr().out
    assert "1 process x 32 per process = 32 global batch; Adam, max_lr 0.01 x 1 = 0.01 (sqrt scaling)" in out
    assert h.backend == "torch" and len(h) == 3
    # the torch backend's words: processes, no XLA compile counts in the lines or the history
    assert "compiles" not in out and not {"compiles", "host_reads_per_step"} & set(h[-1])
    assert str(h).startswith("1 process x 32 = 32 global batch") and "compiles" not in str(h)
    assert h[-1]["accuracy"] > 0.9
    assert h[-1]["samples"] == len(val)  # every validation sample counted once
    assert h[0]["train_loss"] > h[-1]["train_loss"]
    # the trained weights land in the caller's model and in the history
    assert not torch.equal(before["0.weight"], t.model.state_dict()["0.weight"])
    assert torch.equal(h.state_dict["0.weight"], t.model.state_dict()["0.weight"])
    steps = 3 * (len(train) // 32)
    sched = OneCycleSchedule(steps, 1e-2)
    assert h[-1]["lr_last"] == pytest.approx(sched.lr(steps - 1), rel=1e-12)


def test_a_model_in_data_parallel_is_unwrapped_and_said(capsys):
    """A GPU habit: the model wrapped in nn.DataParallel (here on the CPU, as on a GPU). The
    trainer keeps the plain module, says so in the run's first line, and the weights it hands
    back carry no ``module.`` prefix."""
    train, _ = digits_split()
    torch.manual_seed(0)
    net = _mlp()
    t = OneCycleTrainer(nn.DataParallel(net), nn.CrossEntropyLoss(), train, batch_size=64,
                        epochs=1, max_lr=1e-2, optimizer="sgd")
    assert t.model is net
    h = t.fit()
    first = [ln for ln in capsys.readouterr().out.splitlines() if "global batch" in ln][0]
    assert first.startswith("1 process x 64 per process = 64 global batch; SGD, max_lr")
    assert first.endswith("; the model was unwrapped from DataParallel: fit places it on every "
                          "replica's device itself, so pass it as built (a factory, or a model "
                          "on the CPU)"), first
    assert list(h.state_dict) == list(net.state_dict()) == ["0.weight", "0.bias", "2.weight", "2.bias"]
    t.fit(warn_if_trained=False)  # said once: the next run's first line is plain
    assert "unwrapped" not in capsys.readouterr().out


@pytest.mark.multicore
@pytest.mark.timeout(300)
def test_simulated_8_cores_equal_one_core_with_8x_batch():
    """Gradient averaging over 8 replicas of batch b == one replica with batch 8b."""
    train, _ = digits_split()
    torch.manual_seed(0)
    init = _mlp()
    results = []
    for cores, bs in ((8, 8), (1, 64)):
        t = OneCycleTrainer(_copy(init), nn.CrossEntropyLoss(), train, batch_size=bs, epochs=1,
                            max_lr=0.05, optimizer="sgd", lr_scaling="none", seed=3)
        h = t.fit(simulate=8, cores="all" if cores == 8 else 1)
        assert h.world_size == cores and h.global_batch == 64
        results.append(h.state_dict)
    a, b = results
    moved = (a["0.weight"] - init.state_dict()["0.weight"]).abs().max()
    assert moved > 1e-3  # the run really trained
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-5)


def test_validation_batch_is_eval_batch_size():
    """Per-epoch validation runs at max(batch_size, 64) by default (or eval_batch_size),
    padded and masked: the same metrics as at the training batch size."""
    train, val = digits_split()
    with pytest.raises(ValueError, match="eval_batch_size must be a positive int"):
        TrainerConfig(eval_batch_size=0)
    assert TrainerConfig(batch_size=128).data.val_batch_size(1000, 1) == 128
    assert TrainerConfig(batch_size=8).data.val_batch_size(1000, 8) == 64
    assert TrainerConfig(batch_size=8).data.val_batch_size(100, 8) == 13  # one batch per core covers it
    assert TrainerConfig(batch_size=8).data.val_batch_size(20, 8) == 8  # never below batch_size
    assert TrainerConfig(batch_size=8, eval_batch_size=4).data.val_batch_size(1000, 8) == 4
    torch.manual_seed(0)
    init = _mlp()
    runs = {}
    for ebs in (None, 32):
        sizes = []

        def eval_step(model, batch):
            sizes.append(batch[0].shape[0])
            return model(batch[0])

        t = OneCycleTrainer(_copy(init), nn.CrossEntropyLoss(), train, val, batch_size=32,
                            eval_batch_size=ebs, epochs=1, max_lr=1e-2, seed=1, eval_step=eval_step)
        runs[ebs] = (t.fit(), sizes)
    (h64, s64), (h32, s32) = runs[None], runs[32]
    assert s64.count(64) == -(-len(val) // 64) and 32 not in s64  # 360 -> 6 padded batches
    assert s32.count(32) == -(-len(val) // 32) and 64 not in s32
    assert h64[0]["samples"] == h32[0]["samples"] == len(val)
    assert h64[0]["accuracy"] == h32[0]["accuracy"]
    assert h64[0]["val_loss"] == pytest.approx(h32[0]["val_loss"], rel=1e-6)


def _copy(m):
    import copy

    return copy.deepcopy(m)


@pytest.mark.multicore
@pytest.mark.timeout(300)
def test_compiles_constant_after_first_epoch_and_resume_exact(tmp_path):
    train, val = digits_split()
    torch.manual_seed(0)
    init = _mlp()
    kw = dict(batch_size=16, epochs=3, max_lr=5e-3, optimizer="adamw", weight_decay=1e-4,
              seed=5, checkpoint_dir=str(tmp_path / "full"), keep_checkpoints=3)
    full = OneCycleTrainer(_copy(init), nn.CrossEntropyLoss(), train, val, **kw).fit(simulate=4)
    compiles = [e["compiles"] for e in full.epochs]
    assert compiles[0] > 0 and compiles[1] == compiles[0] and compiles[2] == compiles[0], compiles
    assert (tmp_path / "full" / "final.pt").exists()
    assert sorted(p.name for p in (tmp_path / "full").glob("epoch_*.pt")) == [
        f"epoch_{e:03d}-{full.run_id}.pt" for e in (1, 2, 3)]

    kw["checkpoint_dir"] = str(tmp_path / "resumed")
    resumed_t = OneCycleTrainer(_copy(init), nn.CrossEntropyLoss(), train, val, **kw)
    resumed = resumed_t.fit(simulate=4, resume=tmp_path / "full" / f"epoch_002-{full.run_id}.pt")
    assert [e["epoch"] for e in resumed.epochs] == [1, 2, 3]
    assert resumed.epochs[:2] == full.epochs[:2]  # history carried over
    for k, v in full.state_dict.items():
        torch.testing.assert_close(resumed.state_dict[k], v, rtol=1e-5, atol=1e-6)
    final = torch.load(tmp_path / "resumed" / "final.pt")
    torch.testing.assert_close(final["0.weight"], full.state_dict["0.weight"], rtol=1e-5, atol=1e-6)


def test_resume_refuses_other_world_size(tmp_path):
    train, _ = digits_split()
    t = OneCycleTrainer(_mlp(), nn.CrossEntropyLoss(), train, batch_size=64, epochs=2,
                        checkpoint_dir=str(tmp_path))
    h = t.fit()
    with pytest.raises(ResumeError, match="cores: 1 in the checkpoint, 2 now"):
        OneCycleTrainer(_mlp(), nn.CrossEntropyLoss(), train, batch_size=64, epochs=2).fit(
            simulate=2, resume=tmp_path / f"epoch_001-{h.run_id}.pt")
    with pytest.raises(ValueError, match="final.pt holds weights only"):
        t.fit(resume=tmp_path / "final.pt")


@pytest.mark.multicore
@pytest.mark.timeout(120)
def test_exception_in_step_reaches_caller():
    train, _ = digits_split()
    calls = {"n": 0}

    def bad_step(model, batch, loss_fn):
        calls["n"] += 1
        if runtime.rank() == 2 and calls["n"] > 3:
            raise RuntimeError("bad batch in custom train_step")
        x, y = batch
        return loss_fn(model(x), y)

    t = OneCycleTrainer(_mlp(), nn.CrossEntropyLoss(), train, batch_size=16, epochs=1,
                        train_step=bad_step)
    with pytest.raises(runtime.ReplicaError, match="bad batch in custom train_step") as info:
        t.fit(simulate=4)
    assert info.value.rank == 2 and "bad_step" in info.value.remote_traceback


@pytest.mark.timeout(120)
def test_debug_run_one_execution_per_step():
    train, _ = digits_split()
    rep = debug_run(_mlp(), nn.CrossEntropyLoss(), train, batch_size=16, steps=5,
                    print_report=False)
    assert rep.backend == "xla" and rep.steps == 5
    assert [s["executions"] for s in rep.per_step] == [1] * 5
    assert rep.per_step[0]["compiles"] >= 1
    assert all(s["compiles"] == 0 for s in rep.per_step[2:])
    assert "No CPU-fallback ops" in rep.report and "no recompilation" in rep.report
    assert all(np.isfinite(rep.losses))


def test_bf16_autocast_runs():
    train, val = digits_split()
    h = OneCycleTrainer(_mlp(), nn.CrossEntropyLoss(), train, val, batch_size=64, epochs=1,
                        max_lr=1e-2, precision="bf16").fit()
    assert np.isfinite(h[0]["train_loss"]) and np.isfinite(h[0]["val_loss"])


@pytest.mark.timeout(300)
def test_debug_run_after_in_process_fit_does_not_hang(tmp_path):
    """GNU OpenMP is not fork-safe: after the caller trained a conv net in-process
    (cached uint8 data), a forked replica's deepcopy(model) used to hang forever."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(f"""
        import numpy as np, torch
        from xla_utils import build_cache, CachedImageDataset, OneCycleTrainer
        rng = np.random.default_rng(0)
        items = [(rng.integers(0, 255, (40, 40, 3), dtype=np.uint8), i % 3) for i in range(18)]
        build_cache(items, {str(tmp_path / 'cache')!r}, size=32, variants=2, verbose=False)
        ds = CachedImageDataset({str(tmp_path / 'cache')!r})
        net = torch.nn.Sequential(torch.nn.Conv2d(3, 64, 3, padding=1), torch.nn.ReLU(),
                                  torch.nn.Conv2d(64, 64, 3, padding=1), torch.nn.AdaptiveAvgPool2d(1),
                                  torch.nn.Flatten(), torch.nn.Linear(64, 3))
        t = OneCycleTrainer(net, torch.nn.CrossEntropyLoss(), ds, batch_size=4, epochs=1)
        t.fit()                       # in-process, plain torch: uses the OpenMP pool
        rep = t.debug()               # forks an XLA:CPU child that deep-copies the model
        print("DEBUG-STEPS", rep.steps)
    """)
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=240)
    # 4 batches of 4 in 18 images: the 5 steps pass over the data twice
    assert "DEBUG-STEPS 5" in p.stdout, (p.stdout[-1500:], p.stderr[-1500:])


# ----------------------------------------------- issue 18a: accum_steps, ema, mixup/cutmix
def _digit_images(n_train: int = 320, n_val: int = 64):
    """Digits as float [1, 8, 8] images (cutmix needs images)."""
    train, val = digits_split()
    tx, ty = train.tensors
    vx, vy = val.tensors
    return (torch.utils.data.TensorDataset(tx[:n_train].view(-1, 1, 8, 8), ty[:n_train]),
            torch.utils.data.TensorDataset(vx[:n_val].view(-1, 1, 8, 8), vy[:n_val]))


def _small_conv():
    return nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.Flatten(), nn.Linear(8 * 64, 10))


def test_accum_steps_refused_when_bad():
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="accum_steps must be an int >= 1"):
            TrainerConfig(accum_steps=bad)


@pytest.mark.timeout(600)
def test_accum_steps_equals_k_times_batch_on_one_core(capsys):
    """SGD without BatchNorm: 4 accumulated micro-batches of 16 == one batch of 64, and the
    LR is scaled by the global batch (linear rule: x4 for the accumulated run)."""
    train, _ = digits_split()
    torch.manual_seed(0)
    init = _mlp()
    out = []
    for bs, k, lr in ((16, 4, 0.0125), (64, 1, 0.05)):
        t = OneCycleTrainer(_copy(init), nn.CrossEntropyLoss(), train, batch_size=bs,
                            accum_steps=k, epochs=1, max_lr=lr, optimizer="sgd", seed=3)
        h = t.fit(simulate=1)
        assert h.global_batch == 64 and h.max_lr == pytest.approx(0.05)
        out.append(h)
    assert "1 core x 16 per core x 4 accumulated = 64 global batch" in capsys.readouterr().out
    a, b = out
    assert a[0]["lr_last"] == pytest.approx(b[0]["lr_last"], rel=1e-9)  # same optimizer steps
    assert (a.state_dict["0.weight"] - init.state_dict()["0.weight"]).abs().max() > 1e-3
    for k in a.state_dict:
        torch.testing.assert_close(a.state_dict[k], b.state_dict[k], rtol=0, atol=1e-4)
    assert a[0]["train_loss"] == pytest.approx(b[0]["train_loss"], rel=1e-4)


_OPTIONS = {
    "accum": dict(accum_steps=3),
    "ema": dict(ema=0.99),
    "mixup": dict(mixup=0.2, cutmix=1.0, label_smoothing=0.1),
    "all_bf16": dict(accum_steps=2, ema=0.99, mixup=0.2, cutmix=1.0, label_smoothing=0.1,
                     precision="bf16"),
}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", list(_OPTIONS))
def test_no_compiles_after_first_epoch_with_each_option(name):
    train, val = _digit_images()
    t = OneCycleTrainer(_small_conv, nn.CrossEntropyLoss(), train, val, batch_size=16,
                        epochs=3, max_lr=5e-3, seed=4, **_OPTIONS[name])
    h = t.fit(simulate=1)
    compiles = [e["compiles"] for e in h.epochs]
    assert compiles[0] > 0 and compiles[1] == compiles[0] and compiles[2] == compiles[0], compiles
    assert all(np.isfinite(e["train_loss"]) and np.isfinite(e["val_loss"]) for e in h.epochs)
    assert h[-1]["accuracy"] > 0.3  # it learns (10 classes, chance 0.1)
    assert bool(h.ema_state_dict) == ("ema" in _OPTIONS[name])


@pytest.mark.multicore
@pytest.mark.timeout(600)
def test_all_options_on_8_simulated_cores_compile_once():
    train, val = _digit_images(n_train=640)
    t = OneCycleTrainer(_small_conv, nn.CrossEntropyLoss(), train, val, batch_size=8,
                        accum_steps=2, ema=0.99, mixup=0.2, cutmix=1.0, label_smoothing=0.1,
                        epochs=2, max_lr=5e-3, seed=4)
    h = t.fit(simulate=8)
    assert h.world_size == 8 and h.global_batch == 128
    compiles = [e["compiles"] for e in h.epochs]
    assert compiles[0] > 0 and compiles[1] == compiles[0], compiles
    assert all(np.isfinite(e["train_loss"]) and np.isfinite(e["val_loss"]) for e in h.epochs)
    assert set(h.ema_state_dict) == set(h.state_dict)
