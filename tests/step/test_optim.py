"""make_optimizer / set_hparams."""
from __future__ import annotations

import functools
import numpy as np
import pytest
import torch

from xla_utils.step.optim import (Adam, avoid_special, avoid_special_momentum, get_hparams, make_optimizer,
                                  set_hparams)


def _model():
    return torch.nn.Linear(3, 2)


def test_named_optimizers():
    sgd = make_optimizer("sgd", _model().parameters(), lr=0.1, weight_decay=1e-4)
    assert isinstance(sgd, torch.optim.SGD)
    g = sgd.param_groups[0]
    assert (g["lr"], g["momentum"], g["nesterov"], g["weight_decay"]) == (0.1, 0.9, False, 1e-4)

    adam = make_optimizer("Adam", _model(), lr=1e-3)  # a module and any case work
    assert isinstance(adam, Adam) and adam.param_groups[0]["decoupled"] is False
    assert adam.param_groups[0]["betas"] == (0.9, 0.999)
    assert adam.param_groups[0]["weight_decay"] == 0.0

    adamw = make_optimizer("adamw", _model().parameters(), lr=1e-3)
    assert isinstance(adamw, Adam) and adamw.param_groups[0]["decoupled"] is True
    assert adamw.param_groups[0]["weight_decay"] == 0.0  # ours, not torch's 0.01

    with pytest.raises(ValueError, match="unknown optimizer"):
        make_optimizer("lion", _model().parameters(), lr=1e-3)
    with pytest.raises(TypeError):
        make_optimizer(42, _model().parameters(), lr=1e-3)


def test_callable_specs():
    # a class that takes lr and weight_decay
    opt = make_optimizer(torch.optim.RMSprop, _model().parameters(), lr=0.01, weight_decay=0.1)
    assert isinstance(opt, torch.optim.RMSprop)
    assert opt.param_groups[0]["lr"] == 0.01 and opt.param_groups[0]["weight_decay"] == 0.1

    # a partial keeps its own settings
    opt = make_optimizer(functools.partial(torch.optim.SGD, momentum=0.5, nesterov=True),
                         _model().parameters(), lr=0.2)
    assert opt.param_groups[0]["momentum"] == 0.5 and opt.param_groups[0]["nesterov"]
    assert opt.param_groups[0]["lr"] == 0.2

    # callable(params): lr (and weight decay) are written into the groups afterwards
    def only_params(params):
        return torch.optim.SGD(params, lr=123.0, momentum=0.9)

    opt = make_optimizer(only_params, _model().parameters(), lr=0.03, weight_decay=0.01)
    assert opt.param_groups[0]["lr"] == 0.03 and opt.param_groups[0]["weight_decay"] == 0.01

    # **kwargs receives both
    seen = {}

    def kwargs_fn(params, **kw):
        seen.update(kw)
        return torch.optim.Adam(params, **kw)

    make_optimizer(kwargs_fn, _model().parameters(), lr=0.004, weight_decay=0.2)
    assert seen == {"lr": 0.004, "weight_decay": 0.2}

    with pytest.raises(TypeError, match="not a torch.optim.Optimizer"):
        make_optimizer(lambda params: None, _model().parameters(), lr=0.1)


def test_set_hparams_sgd_adam_and_groups():
    m = _model()
    sgd = torch.optim.SGD([{"params": [m.weight]}, {"params": [m.bias], "lr": 5.0}],
                          lr=0.1, momentum=0.9)
    set_hparams(sgd, 0.02, 0.8)
    assert all(g["lr"] == 0.02 and g["momentum"] == 0.8 for g in sgd.param_groups)
    set_hparams(sgd, 0.03)  # momentum None: untouched
    assert all(g["lr"] == 0.03 and g["momentum"] == 0.8 for g in sgd.param_groups)
    assert get_hparams(sgd) == (0.03, 0.8)

    adam = torch.optim.Adam(m.parameters(), lr=1e-3, betas=(0.9, 0.99))
    set_hparams(adam, 2e-3, 0.85)
    assert adam.param_groups[0]["betas"] == (0.85, 0.99)
    assert get_hparams(adam) == (2e-3, 0.85)

    adagrad = torch.optim.Adagrad(m.parameters(), lr=0.1)  # no momentum: lr only
    set_hparams(adagrad, 0.2, 0.9)
    assert get_hparams(adagrad) == (0.2, None)


def test_special_scalars_are_nudged():
    assert avoid_special(1.0) == 1.0 - 2.0**-24
    assert avoid_special(1.0 + 1e-9) == 1.0 - 2.0**-24  # 1.0 in float32
    assert avoid_special(-1.0) == -(1.0 - 2.0**-24)
    assert avoid_special(0.0) == 2.0**-126
    assert avoid_special(1e-300) == 2.0**-126  # 0.0 in float32
    assert avoid_special(0.5) == 0.5
    assert avoid_special(1.0 - 2.0**-24) == 1.0 - 2.0**-24
    for m in (0.0, 1e-12, 1.0, 1.0 - 1e-12):
        v = avoid_special_momentum(m)
        assert float(np.float32(v)) not in (0.0, 1.0)
        assert float(np.float32(1.0 - v)) not in (0.0, 1.0)
    assert avoid_special_momentum(0.9) == 0.9
    opt = make_optimizer("adam", _model().parameters(), lr=1.0)
    assert opt.param_groups[0]["lr"] != 1.0
    set_hparams(opt, 1.0, 0.0)
    lr, beta1 = get_hparams(opt)
    assert lr == 1.0 - 2.0**-24 and beta1 == 2.0**-24


@pytest.mark.parametrize("decoupled", [False, True])
def test_xla_safe_adam_matches_torch(decoupled):
    """Same trajectory as torch.optim.Adam / AdamW (cycling beta1 and LR included)."""
    torch.manual_seed(0)
    a, b = torch.nn.Linear(5, 3), torch.nn.Linear(5, 3)
    b.load_state_dict(a.state_dict())
    ours = Adam(a.parameters(), lr=1e-2, weight_decay=0.05, decoupled=decoupled)
    ref_cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    ref = ref_cls(b.parameters(), lr=1e-2, weight_decay=0.05, foreach=False)
    x, y = torch.randn(64, 5), torch.randn(64, 3)
    for step in range(200):
        lr, beta1 = 1e-2 * (1 + step % 7) / 7, 0.85 + 0.1 * (step % 5) / 5
        for opt, m in ((ours, a), (ref, b)):
            set_hparams(opt, lr, beta1)
            opt.zero_grad()
            torch.nn.functional.mse_loss(m(x), y).backward()
            opt.step()
    for pa, pb in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(pa, pb, rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(120)
def test_adam_no_recompile_on_xla_over_long_run():
    """Past step ~160, torch's 1 - 0.9**t is exactly 1.0 in float32 (a new graph on XLA)."""
    from xla_utils import runtime
    from xla_utils.train.schedule import OneCycleSchedule

    def job():
        dev = runtime.device()
        m = torch.nn.Linear(4, 2).to(dev)
        opt = make_optimizer("adamw", m.parameters(), lr=1e-3, weight_decay=1e-2)
        sched = OneCycleSchedule(total_steps=300, max_lr=1e-3)  # ends at lr 4e-9
        x, y = runtime.to_device((torch.randn(8, 4), torch.randn(8, 2)), dev)
        counts = []
        for step in range(300):
            sched.apply(opt, step)
            opt.zero_grad(set_to_none=True)
            torch.nn.functional.mse_loss(m(x), y).backward()
            opt.step()
            runtime.sync()
            counts.append(runtime.xla_counters()["compiles"])
        return counts

    counts = runtime.launch(job, simulate=1)
    assert counts[-1] == counts[2], [i for i in range(1, 300) if counts[i] != counts[i - 1]]


def test_one_name_for_each_optimizer():
    """The name every message uses (a run's first line, resume, check(), debug())."""
    from xla_utils.step.optim import optimizer_label

    assert [optimizer_label(n) for n in ("sgd", " AdamW", "ADAM")] == ["SGD", "AdamW", "Adam"]
    made = [make_optimizer(n, _model(), lr=1e-3) for n in ("sgd", "adam", "adamw")]
    assert [optimizer_label(o) for o in made] == ["SGD", "Adam", "AdamW"]
    assert optimizer_label(torch.optim.RMSprop) == "RMSprop"
    assert optimizer_label(functools.partial(torch.optim.RMSprop, alpha=0.9)) == "RMSprop"
