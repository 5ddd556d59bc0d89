"""xla_utils.step.clip: grad_clip= on the torch CPU path (fp32 and the fp16 GradScaler's),
its checks and its resume rule; on 2 simulated XLA cores, no compile and one host read more.

The norm after clipping is read where the optimizer sees the gradients: a global optimizer
step pre-hook in this process (the torch backend's fit runs in-process), and, on XLA, the
history's measured ``grad_norm_clipped_max``.
"""
from __future__ import annotations

import contextlib
import math

import pytest
import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from helpers import digits_split, tiny_mlp

from xla_utils import OneCycleTrainer
from xla_utils.step.clip import check_grad_clip
from xla_utils.train.checkpoint import ResumeError
from xla_utils.train.config import TrainerConfig


@contextlib.contextmanager
def _norms_at_step():
    """The total gradient norm each optimizer step sees (a list filled as steps run)."""
    seen: list[float] = []

    def hook(opt, args, kwargs):
        grads = [p.grad for g in opt.param_groups for p in g["params"] if p.grad is not None]
        seen.append(float(torch.linalg.vector_norm(
            torch.stack([torch.linalg.vector_norm(g.float()) for g in grads]))))

    handle = register_optimizer_step_pre_hook(hook)
    try:
        yield seen
    finally:
        handle.remove()


MAX = 0.25  # the tiny MLP's gradients have norms of about 0.4 at the start


def _fit(train, **kw):
    t = OneCycleTrainer(tiny_mlp(seed=0), nn.CrossEntropyLoss(), train, batch_size=32, epochs=2,
                        max_lr=3e-2, optimizer="sgd", seed=1, **kw)
    with _norms_at_step() as seen:
        h = t.fit()
    return h, seen


def test_grad_clip_is_checked():
    assert TrainerConfig(grad_clip=1).grad_clip == 1.0 and TrainerConfig().grad_clip is None
    for bad in (0, -1.0, math.inf, math.nan, True, "1"):
        with pytest.raises(ValueError, match="grad_clip must be None"):
            TrainerConfig(grad_clip=bad)
    assert check_grad_clip(None) is None
    for theirs in ("gradient_clip_val", "max_grad_norm", "clip_grad", "clip_grad_norm"):
        with pytest.raises(TypeError, match=rf"'{theirs}' \(did you mean 'grad_clip'\?\) in the "
                                            r"optim group"):
            OneCycleTrainer(tiny_mlp(), nn.CrossEntropyLoss(), [], **{theirs: 1.0})


@pytest.fixture(scope="module")
def train():
    return digits_split(n_train=320)[0]


def test_every_step_is_clipped_to_max_norm_and_the_norms_are_recorded(train):
    free, free_seen = _fit(train)
    h, seen = _fit(train, grad_clip=MAX)
    assert max(free_seen) > 1.4 * MAX  # without clipping the steps see larger norms
    assert len(seen) == 2 * 10 and max(seen) <= MAX + 1e-6, seen
    assert all("grad_norm" not in r for r in free.epochs)
    first = h.epochs[0]
    # the first step is the same model on the same batch in both runs: the norm before clipping
    assert first["grad_norm_max"] >= free_seen[0] - 1e-4
    assert first["grad_norm_max"] > 1.4 * MAX and 0 < first["clipped_steps"] <= 10
    assert first["grad_norm_clipped_max"] <= MAX + 1e-6
    assert first["grad_norm_clipped_max"] == pytest.approx(max(seen[:10]), rel=1e-4)
    assert first["grad_norm"] <= first["grad_norm_max"]


def test_fp16_clips_the_unscaled_gradients_and_leaves_skipped_steps_out(train):
    """The GradScaler's gradients are 65536x the true ones until ``unscale_``: clipped before
    it, the norm recorded would be that large and the step would see a tiny gradient."""
    calls = []

    def step(model, batch, loss_fn):
        x, y = batch
        out = model(x)
        loss = loss_fn(out, y)
        calls.append(1)
        if len(calls) == 3:  # one step's backward overflows: the scaler skips it
            loss = loss + (out.float() - out.float().detach()).sum() * 1e30
        return loss

    ref, _ = _fit(train, grad_clip=MAX)
    h, seen = _fit(train, grad_clip=MAX, precision="fp16", train_step=step)
    assert h.epochs[0]["skipped_steps"] == 1
    assert len(seen) == 2 * 10 - 1 and max(seen) <= MAX * 1.001, seen  # the skipped step: no step
    assert 0.9 * MAX < min(seen[:3])  # clipped to about MAX, not MAX / 65536
    for key in ("grad_norm", "grad_norm_max"):  # the true norm, as in fp32 (fp16 rounding)
        assert math.isfinite(h.epochs[0][key])
        assert h.epochs[0][key] == pytest.approx(ref.epochs[0][key], rel=0.1)


def test_resume_keeps_grad_clip(tmp_path, train):
    t = OneCycleTrainer(tiny_mlp(seed=0), nn.CrossEntropyLoss(), train, batch_size=64, epochs=2,
                        grad_clip=0.5, checkpoint_dir=tmp_path)
    h = t.fit()
    ckpt = tmp_path / f"epoch_001-{h.run_id}.pt"
    assert torch.load(ckpt, weights_only=False)["config"]["grad_clip"] == 0.5
    other = OneCycleTrainer(tiny_mlp(seed=0), nn.CrossEntropyLoss(), train, batch_size=64,
                            epochs=2, grad_clip=MAX)
    with pytest.raises(ResumeError, match="grad_clip: 0.5 in the checkpoint, 0.25 now"):
        other.fit(resume=ckpt)


@pytest.mark.multicore
@pytest.mark.timeout(300)
def test_clipping_on_two_simulated_cores_compiles_nothing_more():
    """The clip is more ops of the step's graph: the same compiles as without it, and no
    host read per step (the norms are read once per epoch in each replica)."""
    train = digits_split(n_train=512)[0]
    runs = []
    for clip in (None, MAX):
        t = OneCycleTrainer(tiny_mlp(seed=0), nn.CrossEntropyLoss(), train, batch_size=32,
                            epochs=2, max_lr=3e-2, optimizer="sgd", seed=1, grad_clip=clip)
        runs.append(t.fit(simulate=2))
    free, clipped = runs
    steps = 512 // 64
    assert [r["compiles"] for r in clipped.epochs] == [r["compiles"] for r in free.epochs]
    assert clipped.epochs[1]["compiles"] == clipped.epochs[0]["compiles"]
    for a, b in zip(free.epochs, clipped.epochs):
        # the count is this process's (both replicas' threads, each over its own epoch, so a
        # read of the other replica may fall in or out): a read per step would add >= steps
        assert round((b["host_reads_per_step"] - a["host_reads_per_step"]) * steps) <= 2
    assert clipped.epochs[0]["grad_norm_max"] > MAX and clipped.epochs[0]["clipped_steps"] > 0
    assert all(r["grad_norm_clipped_max"] <= MAX + 1e-6 for r in clipped.epochs)
