"""xla_utils.step.plain: the plain step check() and debug_run() measure by default, and the
trainer's default train_step / eval_step (on the torch backend's CPU, in this process)."""
from __future__ import annotations

import copy

import torch
from torch import nn

from xla_utils.step.optim import make_optimizer
from xla_utils.step.plain import PlainStep, default_eval_step, default_train_step


def test_default_steps_are_the_loss_of_the_outputs_and_the_outputs():
    torch.manual_seed(0)
    model, x, y = nn.Linear(4, 3), torch.randn(5, 4), torch.tensor([0, 1, 2, 0, 1])
    loss_fn = nn.CrossEntropyLoss()
    assert torch.equal(default_eval_step(model, (x, y)), model(x))
    assert torch.equal(default_train_step(model, (x, y), loss_fn), loss_fn(model(x), y))


def test_a_plain_step_updates_the_model_at_its_constant_lr():
    torch.manual_seed(0)
    model, x, y = nn.Linear(4, 3), torch.randn(8, 4), torch.randint(0, 3, (8,))
    before = copy.deepcopy(model)
    opt = make_optimizer("sgd", model.parameters(), lr=0.1)
    step = PlainStep(model, opt, loss_fn=nn.CrossEntropyLoss(), train_step=default_train_step,
                     prepare=lambda t: t * 2)
    assert step.accum_steps == 1 and step.plan.precision == "fp32"
    assert "constant LR 0.1" in step.description, step.description
    loss = step.micro_batch(x, y)
    assert torch.allclose(loss, nn.CrossEntropyLoss()(before(x * 2), y))  # the prepared input
    assert not torch.equal(model.weight, before.weight)  # one SGD step taken
    assert all(any(t is p for t in step.tensors()) for p in model.parameters())
