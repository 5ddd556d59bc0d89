"""fit / predict / evaluate / resume on the torch backend's replica processes
(``XLA_UTILS_CPU_REPLICAS=2``: two CPU processes over gloo, the path two GPUs take)."""
from __future__ import annotations

import copy
from functools import partial

import numpy as np
import pytest
import torch
from torch import nn

from helpers import digits_split, tiny_mlp

from xla_utils import OneCycleTrainer, runtime
from xla_utils.train.trainer import ResumeError

# the first 64 digits to train on, the next 45 to validate (not a multiple of 2 replicas)
_digits = partial(digits_split, n_val=45, n_train=64, shuffle=False, val_first=False)
_mlp = partial(tiny_mlp, seed=0)


@pytest.fixture
def two_cpu_replicas(monkeypatch):
    monkeypatch.setenv("XLA_UTILS_CPU_REPLICAS", "2")


@pytest.mark.multicore
@pytest.mark.timeout(180)
def test_two_replicas_train_as_one_with_the_global_batch(two_cpu_replicas, capfd):
    """20 steps (one per epoch: the history is the loss curve), validation on 45 samples.
    With grad_clip=: DDP averages the gradients in backward, and the clip comes after."""
    train, val = _digits()
    init = _mlp()
    runs = {}
    for cores, bs in (("all", 32), (1, 64)):
        t = OneCycleTrainer(copy.deepcopy(init), nn.CrossEntropyLoss(), train, val,
                            batch_size=bs, epochs=20, max_lr=0.5, optimizer="sgd",
                            lr_scaling="none", seed=3, grad_clip=0.3)
        runs[cores] = t.fit(cores=cores, timeout=120)
    two, one = runs["all"], runs[1]
    out, err = capfd.readouterr()
    assert "find_unused_parameters" not in err  # DDP's advice is not for a trainer's users
    assert "2 processes x 32 per process = 64 global batch; SGD, max_lr" in out
    assert "1 process x 64 per process = 64 global batch" in out
    assert (two.world_size, one.world_size, two.global_batch) == (2, 1, 64)
    curve2, curve1 = [e["train_loss"] for e in two], [e["train_loss"] for e in one]
    assert len(curve2) == 20 and curve2[-1] < 0.5 * curve2[0]  # it really trained
    np.testing.assert_allclose(curve2, curve1, rtol=1e-5, atol=1e-6)
    for key in ("val_loss", "accuracy"):
        np.testing.assert_allclose([e[key] for e in two], [e[key] for e in one], rtol=1e-5)
    assert two[-1]["samples"] == len(val)  # every validation sample once over both replicas
    assert [e["clipped_steps"] for e in two] == [e["clipped_steps"] for e in one]
    assert 0 < sum(e["clipped_steps"] for e in two) < 20  # some steps clipped, not all
    for k, v in one.state_dict.items():
        torch.testing.assert_close(two.state_dict[k], v, rtol=1e-5, atol=1e-6)


@pytest.mark.multicore
@pytest.mark.timeout(180)
def test_predict_and_evaluate_on_two_replicas(two_cpu_replicas):
    _, val = _digits(n_val=45)  # 45: not a multiple of 2 replicas
    model = _mlp()
    world = {"expected": 2}

    def eval_step(model, batch):
        assert runtime.world_size() == world["expected"], runtime.world_size()
        return model(batch[0])

    t = OneCycleTrainer(model, nn.CrossEntropyLoss(), val, batch_size=8, eval_step=eval_step)
    preds = t.predict(val, batch_size=8)
    x = torch.stack([val[i][0] for i in range(len(val))])
    with torch.no_grad():
        want = torch.softmax(model(x), dim=1).numpy()
    assert preds.shape == (45, 10)
    np.testing.assert_allclose(preds, want, rtol=1e-5, atol=1e-6)  # each item once, in order
    both = t.evaluate(val)
    world["expected"] = 1  # the replicas above saw 2: they are forked when launched
    here = t.evaluate(val, cores=1)
    assert both["samples"] == here["samples"] == 45
    assert both["loss"] == pytest.approx(here["loss"], rel=1e-6)
    assert both["accuracy"] == here["accuracy"]


@pytest.mark.multicore
@pytest.mark.timeout(180)
def test_a_replica_raising_mid_epoch_ends_fit_with_its_traceback(two_cpu_replicas):
    train, _ = _digits(n_train=128)
    calls = {"n": 0}

    def step(model, batch, loss_fn):
        calls["n"] += 1
        if runtime.rank() == 1 and calls["n"] == 3:
            raise ArithmeticError("bad batch on replica one")
        x, y = batch
        return loss_fn(model(x), y)

    t = OneCycleTrainer(_mlp(), nn.CrossEntropyLoss(), train, batch_size=8, epochs=1,
                        max_lr=0.1, train_step=step)
    with pytest.raises(runtime.ReplicaError) as info:
        t.fit(timeout=60)
    assert info.value.rank == 1 and info.value.exc_type == "ArithmeticError"
    assert "bad batch on replica one" in info.value.remote_traceback
    assert calls["n"] == 0  # the steps ran in the replicas, not here


@pytest.mark.multicore
@pytest.mark.timeout(240)
def test_checkpoint_of_two_replicas_resumes_on_two_and_is_refused_on_one(two_cpu_replicas,
                                                                          tmp_path):
    train, val = _digits()
    init = _mlp()
    kw = dict(batch_size=16, epochs=3, max_lr=0.1, optimizer="adamw", seed=5)
    full = OneCycleTrainer(copy.deepcopy(init), nn.CrossEntropyLoss(), train, val,
                           checkpoint_dir=str(tmp_path / "full"), **kw).fit(timeout=120)
    ckpt = tmp_path / "full" / f"epoch_002-{full.run_id}.pt"
    assert torch.load(ckpt)["world_size"] == 2
    resumed = OneCycleTrainer(copy.deepcopy(init), nn.CrossEntropyLoss(), train, val,
                              checkpoint_dir=str(tmp_path / "resumed"), **kw)
    h = resumed.fit(resume=ckpt, timeout=120)
    assert [e["epoch"] for e in h] == [1, 2, 3] and h.epochs[:2] == full.epochs[:2]
    for k, v in full.state_dict.items():
        torch.testing.assert_close(h.state_dict[k], v, rtol=1e-6, atol=1e-7)
    one = OneCycleTrainer(copy.deepcopy(init), nn.CrossEntropyLoss(), train, val, **kw)
    with pytest.raises(ResumeError, match="cores: 2 in the checkpoint, 1 now"):
        one.fit(resume=ckpt, cores=1)


@pytest.mark.multicore
@pytest.mark.timeout(180)
def test_fp16_step_skipped_on_every_replica_when_one_overflows(two_cpu_replicas):
    """The gradients are averaged before the gradient scaler steps: an inf on replica 1
    alone makes replica 0 (whose history is returned) skip that step too."""
    train, _ = _digits(n_train=128)  # 4 steps per epoch at 2 x 16
    calls = {"n": 0}

    def step(model, batch, loss_fn):
        x, y = batch
        out = model(x)
        loss = loss_fn(out, y)
        calls["n"] += 1
        if runtime.rank() == 1 and calls["n"] == 2:  # + 0.0 whose gradient overflows fp16
            loss = loss + (out.float() - out.float().detach()).sum() * 1e30
        return loss

    t = OneCycleTrainer(_mlp(), nn.CrossEntropyLoss(), train, batch_size=16, epochs=2,
                        max_lr=1e-2, precision="fp16", train_step=step)
    h = t.fit(timeout=120)
    assert h.world_size == 2
    assert [r["skipped_steps"] for r in h.epochs] == [1, 0]


class _Headed(nn.Module):
    """An MLP without batch norm, with a torchvision-style ``fc`` head for fine_tune."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(64, 32), nn.ReLU())
        self.fc = nn.Linear(32, 10)

    def forward(self, x):
        return self.fc(self.body(x))


@pytest.mark.multicore
@pytest.mark.timeout(180)
def test_fine_tune_on_two_replicas_as_on_one(two_cpu_replicas):
    """The frozen phase (body parameters without gradients on every replica), then the
    unfrozen one with discriminative LRs: the same weights as one replica, global batch."""
    train, _ = _digits(n_train=128)
    out = {}
    for cores, bs in (("all", 16), (1, 32)):
        t = OneCycleTrainer(_Headed(), nn.CrossEntropyLoss(), train, batch_size=bs, epochs=1,
                            max_lr=0.05, optimizer="sgd", lr_scaling="none", seed=2)
        h = t.fine_tune(1, freeze_epochs=1, cores=cores, timeout=120)
        assert [e["phase"] for e in h.epochs] == ["frozen", "unfrozen"]
        out[cores] = h
    assert out["all"].world_size == 2
    for k, v in out[1].state_dict.items():
        torch.testing.assert_close(out["all"].state_dict[k], v, rtol=1e-5, atol=1e-6)


@pytest.mark.multicore
@pytest.mark.timeout(180)
def test_accumulated_steps_reduce_gradients_once_per_optimizer_step(two_cpu_replicas, tmp_path):
    """accum_steps=4 on two replicas: DistributedDataParallel's bucket all-reduces, counted
    in each replica before every micro-batch, happen once per optimizer step (not per
    micro-batch); the weights equal one replica's at the same global batch."""
    train, _ = _digits(n_train=128)  # 2 x 8 x 4 = 64: 2 optimizer steps per epoch
    log = tmp_path / "reductions"

    def step(model, batch, loss_fn):
        with open(log / f"rank{runtime.rank()}", "a") as f:
            f.write(f"{runtime.gradient_reductions()}\n")
        x, y = batch
        return loss_fn(model(x), y)

    out = {}
    for cores, bs in (("all", 8), (1, 16)):
        log.mkdir(exist_ok=True)
        t = OneCycleTrainer(_mlp(), nn.CrossEntropyLoss(), train, batch_size=bs, epochs=2,
                            max_lr=0.1, optimizer="sgd", lr_scaling="none", accum_steps=4,
                            train_step=step, seed=4)
        out[cores] = t.fit(cores=cores, timeout=120)
        if cores == "all":
            counts = {r: [int(v) for v in (log / f"rank{r}").read_text().split()] for r in (0, 1)}
    assert out["all"].world_size == 2 and out["all"].global_batch == 64
    for r in (0, 1):  # 4 optimizer steps of 4 micro-batches; the small model is one bucket
        assert counts[r] == [m // 4 for m in range(16)], (r, counts[r])
    for k, v in out[1].state_dict.items():
        torch.testing.assert_close(out["all"].state_dict[k], v, rtol=1e-5, atol=1e-6)


class _Branchy(nn.Module):
    """A trunk, and a branch that only some batches use."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.trunk, self.branch = nn.Linear(64, 10), nn.Linear(64, 10)

    def forward(self, x):
        return self.trunk(x)


@pytest.mark.multicore
@pytest.mark.timeout(180)
def test_a_branch_one_replica_skips_trains_without_a_hang(two_cpu_replicas):
    """Replica 1 skips the branch on every other step, so at those steps only replica 0 has
    its gradients: the reduction still matches (no hang, no size mismatch) and the branch
    trains; the custom train_step reaches the model's attributes (it gets the plain model)."""
    train, _ = _digits(n_train=128)
    calls = {"n": 0}

    def step(model, batch, loss_fn):
        x, y = batch
        calls["n"] += 1
        out = model.trunk(x)
        if runtime.rank() == 0 or calls["n"] % 2:
            out = out + model.branch(x)
        return loss_fn(out, y)

    init = _Branchy()
    t = OneCycleTrainer(copy.deepcopy(init), nn.CrossEntropyLoss(), train, batch_size=16,
                        epochs=2, max_lr=0.1, optimizer="adamw", train_step=step)
    h = t.fit(timeout=120)
    assert h.world_size == 2 and len(h.epochs) == 2
    for name in ("trunk.weight", "branch.weight"):
        moved = (h.state_dict[name] - init.state_dict()[name]).abs().max()
        assert torch.isfinite(moved) and moved > 1e-4, name
