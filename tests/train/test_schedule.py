"""OneCycleSchedule: equality with torch's OneCycleLR, no special scalars, apply()."""
from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from xla_utils.train.schedule import OneCycleSchedule


def _torch_reference(total_steps, max_lr, opt_name, **kw):
    """(lrs, momentums) that torch's OneCycleLR feeds each optimizer step."""
    p = torch.nn.Parameter(torch.zeros(1))
    opt = (torch.optim.SGD([p], lr=0.1, momentum=0.9) if opt_name == "sgd"
           else torch.optim.Adam([p], lr=0.1))
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=max_lr, total_steps=total_steps, **kw)
    lrs, moms = [], []
    for _ in range(total_steps):
        g = opt.param_groups[0]
        lrs.append(g["lr"])
        moms.append(g["momentum"] if opt_name == "sgd" else g["betas"][0])
        opt.step()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            sched.step()
    return np.array(lrs), np.array(moms)


@pytest.mark.parametrize("opt_name", ["sgd", "adam"])
@pytest.mark.parametrize("total_steps,max_lr,pct_start,div,final_div,anneal", [
    (1000, 0.1, 0.3, 25.0, 1e4, "cos"),
    (97, 3e-3, 0.25, 10.0, 1e5, "cos"),
    (50, 1.0, 0.5, 25.0, 1e4, "linear"),
    (7, 0.02, 0.3, 25.0, 1e4, "cos"),
    (2, 0.5, 0.3, 25.0, 1e4, "cos"),
])
def test_matches_torch_one_cycle(opt_name, total_steps, max_lr, pct_start, div, final_div, anneal):
    ref_lr, ref_mom = _torch_reference(
        total_steps, max_lr, opt_name, pct_start=pct_start, div_factor=div,
        final_div_factor=final_div, anneal_strategy=anneal, base_momentum=0.85,
        max_momentum=0.95)
    s = OneCycleSchedule(total_steps, max_lr, pct_start=pct_start, div_factor=div,
                         final_div_factor=final_div, moms=(0.95, 0.85, 0.95), anneal=anneal)
    np.testing.assert_allclose(s.lrs(), ref_lr, rtol=1e-6, atol=0)
    np.testing.assert_allclose(s.momentums(), ref_mom, rtol=1e-6, atol=0)

    # apply() writes the same values into a real optimizer, step by step
    p = torch.nn.Parameter(torch.zeros(1))
    opt = (torch.optim.SGD([p, torch.nn.Parameter(torch.zeros(2))], lr=1.0, momentum=0.5)
           if opt_name == "sgd" else torch.optim.AdamW([p], lr=1.0))
    for step in range(total_steps):
        s.apply(opt, step)
        for g in opt.param_groups:
            m = g["momentum"] if opt_name == "sgd" else g["betas"][0]
            assert g["lr"] == pytest.approx(ref_lr[step], rel=1e-6)
            assert m == pytest.approx(ref_mom[step], rel=1e-6)
        if opt_name == "adam":
            assert opt.param_groups[0]["betas"][1] == 0.999


def test_shape_of_the_cycle():
    s = OneCycleSchedule(100, 0.4)
    lrs, moms = s.lrs(), s.momentums()
    peak = int(np.argmax(lrs))
    assert peak == 29  # pct_start * total_steps - 1
    assert lrs[peak] == pytest.approx(0.4)
    assert lrs[0] == pytest.approx(0.4 / 25)
    assert lrs[-1] == pytest.approx(0.4 / 25 / 1e4)
    assert np.all(np.diff(lrs[: peak + 1]) > 0) and np.all(np.diff(lrs[peak:]) < 0)
    assert moms[0] == pytest.approx(0.95) and moms[peak] == pytest.approx(0.85)
    assert moms[-1] == pytest.approx(0.95)
    # past the end the final values hold
    assert s.lr(500) == s.lr(99) and s.momentum(500) == s.momentum(99)


def test_asymmetric_moms_and_no_moms():
    s = OneCycleSchedule(20, 0.1, pct_start=0.5, moms=(0.9, 0.8, 0.99))
    assert s.momentum(0) == pytest.approx(0.9)
    assert s.momentum(9) == pytest.approx(0.8)
    assert s.momentum(19) == pytest.approx(0.99)
    none = OneCycleSchedule(20, 0.1, moms=None)
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=0.5, momentum=0.7)
    none.apply(opt, 3)
    assert opt.param_groups[0]["momentum"] == 0.7
    assert opt.param_groups[0]["lr"] == pytest.approx(none.lr(3))
    assert np.isnan(none.momentums()).all()


def _special_f32(x: float) -> bool:
    return float(np.float32(x)) in (0.0, 1.0, -1.0)


def test_never_zero_or_one_in_float32():
    # Chosen so that the exact arithmetic lands on 1.0 (peak LR at step 2,
    # momentum at both ends) and 0.0 (momentum at the peak).
    s = OneCycleSchedule(10, 1.0, pct_start=0.3, moms=(1.0, 0.0, 1.0))
    for step in range(10):
        lr, m = s.lr(step), s.momentum(step)
        assert not _special_f32(lr) and lr > 0.0
        assert not _special_f32(m) and 0.0 < m < 1.0
        assert not _special_f32(1.0 - m)  # Adam's lerp weight
    assert s.lr(2) == pytest.approx(1.0, rel=1e-6)
    assert s.momentum(2) == pytest.approx(0.0, abs=1e-6)
    # a final LR that underflows float32 is nudged too
    tiny = OneCycleSchedule(10, 1e-30, div_factor=1e10, final_div_factor=1e10)
    assert not _special_f32(tiny.lr(9))
    # apply() on a real optimizer gets the nudged values
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1, momentum=0.9)
    s.apply(opt, 2)
    assert opt.param_groups[0]["lr"] == 1.0 - 2.0**-24
    assert opt.param_groups[0]["momentum"] == 2.0**-24


def _xla_compiles_per_step(opt_name):
    from xla_utils import runtime
    from xla_utils.step.optim import make_optimizer

    dev = runtime.device()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2)).to(dev)
    opt = make_optimizer(opt_name, model.parameters(), lr=0.1)
    x, y = torch.randn(4, 8).to(dev), torch.randint(0, 2, (4,)).to(dev)
    s = OneCycleSchedule(10, 1.0, moms=(1.0, 0.0, 1.0))
    compiles = []
    for step in range(s.total_steps):
        before = runtime.xla_counters()["compiles"]
        s.apply(opt, step)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        runtime.sync()
        compiles.append(runtime.xla_counters()["compiles"] - before)
    return compiles


@pytest.mark.parametrize("opt_name", ["sgd", "adam"])
def test_no_recompile_on_xla_cpu(opt_name):
    """Raw, this schedule sets LR 1.0 at step 2 and momentum 1.0 at the last
    step; each would compile a new graph. Nudged, only the first two steps compile."""
    from xla_utils import runtime

    if not runtime.xla_available():
        pytest.skip("torch_xla not installed")
    compiles = runtime.launch(_xla_compiles_per_step, opt_name, cores=1, simulate=1, timeout=300)
    assert sum(compiles[2:]) == 0, compiles


@pytest.mark.parametrize("kw", [
    dict(total_steps=0, max_lr=0.1),
    dict(total_steps=10, max_lr=0.0),
    dict(total_steps=10, max_lr=float("nan")),
    dict(total_steps=10, max_lr=0.1, pct_start=1.5),
    dict(total_steps=10, max_lr=0.1, anneal="exp"),
    dict(total_steps=10, max_lr=0.1, moms=(0.9, 0.8)),
])
def test_rejects_bad_config(kw):
    with pytest.raises(ValueError):
        OneCycleSchedule(**kw)


def test_negative_step_rejected():
    with pytest.raises(ValueError):
        OneCycleSchedule(10, 0.1).lr(-1)
