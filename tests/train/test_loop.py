"""xla_utils.train.loop: the trainer's replica functions, called directly with explicit arguments."""
from __future__ import annotations

import math

import torch
from torch import nn

from xla_utils.train import loop
from xla_utils import runtime
from xla_utils.step.inputs import inspect_inputs
from xla_utils.step.plain import default_eval_step, default_train_step
from xla_utils.train.trainer import TrainerConfig


def _data(n: int = 64):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 8, generator=g)
    return torch.utils.data.TensorDataset(x, (x[:, 0] > 0).long())


def test_set_up_train_one_epoch_and_evaluate_on_the_torch_backend():
    cfg = TrainerConfig(batch_size=16, epochs=2, max_lr=1e-2, log_every=2)
    data = _data()
    model = nn.Linear(8, 2)
    before = model.weight.detach().clone()
    spec = inspect_inputs(data, "data")  # decided once, on the host
    assert spec.layout is None  # float inputs: passed to the model unchanged

    def job():
        s = loop.set_up(model, cfg, data, base_lr=1e-2, lr_world=1, ckpt=None)
        state = loop.TrainState(step=0, initial_loss=None)
        batches = loop.loader(data, cfg.data, world_size=s.world_size, rank=s.rank, epoch=0, train=True)
        res = loop.train_one_epoch(0, s, state, batches, cfg=cfg,
                                   train_step=default_train_step, loss_fn=nn.CrossEntropyLoss(),
                                   inputs=spec)
        val = loop.evaluate(s.model, loop.loader(data, cfg.data, world_size=1, rank=0, epoch=0, train=False),
                            data=cfg.data, diag=cfg.diagnostics, loss_fn=nn.CrossEntropyLoss(),
                            eval_step=default_eval_step,
                            autocast=s.autocast, dev=s.device, inputs=spec)
        return s, state, res, val

    s, state, res, val = runtime.launch(job)  # no TPU, no simulate: in-process, plain torch
    assert s.steps_per_epoch == 4 and s.max_lr == 1e-2 and s.start_epoch == 0
    assert state.step == 4 and state.stop_reason is None and not state.warnings
    assert math.isfinite(res.train_loss) and math.isfinite(state.initial_loss)
    assert res.to_host == 0 and res.seconds > 0
    assert val["samples"] == 64 and math.isfinite(val["loss"]) and 0 <= val["accuracy"] <= 1
    assert torch.equal(model.weight, before)  # the replica trained its own copy
    assert not torch.equal(s.model.weight, before)


def test_scale_lr_and_exploded():
    assert loop.scale_lr(1e-3, 4, "linear") == 4e-3
    assert loop.scale_lr(1e-3, 4, "sqrt") == 2e-3
    assert loop.scale_lr(1e-3, 4, "none") == 1e-3
    assert loop.exploded("train_loss", float("nan"), 1.0, 1) is None  # divergence message covers it
    assert loop.exploded("val_loss", 50.0, 2.0, 3) == (
        "val_loss 50 at epoch 3 is 25x the untrained model's loss at the first step (2)")
    assert loop.exploded("val_loss", float("inf"), 2.0, 3) == "val_loss at epoch 3 is inf"
    assert loop.exploded("val_loss", 5.0, 2.0, 3) is None  # 2.5x: not beyond VAL_LOSS_EXPLODES
    assert loop.exploded("train_loss", 50.0, None, 3) is None  # no yardstick (an old checkpoint)
