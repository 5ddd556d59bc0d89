"""LR finder: suggestion rules, exact restore, divergence/NaN stop, XLA compiles, digits quality."""
from __future__ import annotations

import copy
import importlib.util
import math
import random
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import xla_utils
from xla_utils import runtime
from xla_utils.train import lr_finder
from xla_utils.train.lr_finder import (DEFAULT_RULE, RULES, LRFinderResult, assess, lr_find, smooth_losses,
                                 suggest, suggest_between, suggest_budget, suggest_descent,
                                 suggest_minimum, suggest_slide, suggest_steep, suggest_valley)

ROOT = Path(__file__).resolve().parents[2]


def _tensor_ds(n=256, d=8, classes=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long() * (classes > 2)
    return torch.utils.data.TensorDataset(x, y)


def _mlp(d=8, classes=3, dropout=0.0, bn=False):
    layers = [nn.Linear(d, 16)]
    if bn:
        layers.append(nn.BatchNorm1d(16))
    layers += [nn.ReLU(), nn.Dropout(dropout), nn.Linear(16, classes)]
    return nn.Sequential(*layers)


# ---------------------------------------------------------------- rules
LRS = np.logspace(-6, 1, 100)


def test_minimum_rule():
    losses = (np.log10(LRS) - np.log10(LRS[60])) ** 2 + 1.0
    assert suggest_minimum(LRS, losses) == pytest.approx(LRS[60] / 10)


def test_steep_rule():
    # A tanh-shaped drop centred half way between points 50 and 51 (in log LR):
    # the steepest segment is 50 -> 51, and the rule reports its left end.
    x = np.log(LRS)
    centre = (x[50] + x[51]) / 2
    losses = 5.0 - 2.0 * np.tanh((x - centre) / 1.5)
    assert suggest_steep(LRS, losses) == LRS[50]
    # the steepest fall wins over a longer but gentler one
    losses2 = losses - 0.5 * np.tanh((x - x[20]) / 8.0)
    assert suggest_steep(LRS, losses2) == LRS[50]


def test_between_rule():
    # steepest fall starting at point 50 (as above), minimum at point 80
    x = np.log(LRS)
    losses = 5.0 - 2.0 * np.tanh((x - (x[50] + x[51]) / 2) / 1.5) + 3.0 * np.clip(x - x[80], 0, None) ** 2
    assert suggest_minimum(LRS, losses) == pytest.approx(LRS[80] / 10)
    assert suggest_steep(LRS, losses) == LRS[50]
    assert suggest_between(LRS, losses) == pytest.approx(math.sqrt(LRS[80] / 10 * LRS[50]))


def test_valley_rule():
    # rising 0.5 -> 0.9 over points 0-19, strictly falling 3.0 -> 0.1 over 20-79,
    # rising above 3.0 afterwards. The longest decreasing run is points 20-79
    # (60 long); fastai's valley takes start-1 + int(60/3) + int(60/6) = 49.
    losses = np.concatenate([np.linspace(0.5, 0.9, 20), np.linspace(3.0, 0.1, 60),
                             np.linspace(3.5, 9.0, 20)])
    assert suggest_valley(LRS, losses) == LRS[49]


def test_descent_rule_ignores_the_tail_after_the_minimum():
    # steepest fall at 50 -> 51, minimum at 80, then a rise with a steep dip at
    # 90 (a wobble of the diverging tail) that fastai's steep picks
    x = np.log(LRS)
    losses = 5.0 - 2.0 * np.tanh((x - (x[50] + x[51]) / 2) / 1.5) + 3.0 * np.clip(x - x[80], 0, None) ** 2
    losses[91:] -= 5.0
    assert int(np.argmin(losses)) == 80
    assert suggest_steep(LRS, losses) == LRS[90]
    assert suggest_descent(LRS, losses) == pytest.approx(
        lr_finder.DESCENT_FACTOR * math.sqrt(LRS[80] / 10 * LRS[50]))
    assert DEFAULT_RULE == "descent"
    # minimum at the first point: no fall to measure, the minimum's LR is used
    rising = np.linspace(1.0, 2.0, 100)
    assert suggest_descent(LRS, rising) == pytest.approx(
        lr_finder.DESCENT_FACTOR * math.sqrt(LRS[0] / 10 * LRS[0]))


def test_budget_rule_scales_between_for_short_runs():
    x = np.log(LRS)
    losses = 5.0 - 2.0 * np.tanh((x - (x[50] + x[51]) / 2) / 1.5) + 3.0 * np.clip(x - x[80], 0, None) ** 2
    between = suggest_between(LRS, losses)
    long_run = lr_finder.BUDGET_STEPS
    assert suggest_budget(LRS, losses) == between  # budget unknown: no scaling
    assert suggest_budget(LRS, losses, planned_steps=long_run) == pytest.approx(between)
    assert suggest_budget(LRS, losses, planned_steps=10 * long_run) == pytest.approx(between)
    short = suggest_budget(LRS, losses, planned_steps=long_run // 4)
    assert short == pytest.approx(between * 0.25 ** lr_finder.BUDGET_POWER)
    assert short < between
    out = suggest(LRS, losses, num_it=100, planned_steps=long_run // 4)
    assert list(out) == list(RULES) and out["budget"] < out["between"]
    with pytest.raises(ValueError, match="planned_steps"):
        suggest_budget(LRS, losses, planned_steps=0)


def test_smooth_losses_is_the_sweeps_smoothing():
    res = lr_find(_mlp(), nn.functional.cross_entropy, _tensor_ds(), 32, num_it=30,
                  show_progress=False)
    np.testing.assert_allclose(smooth_losses(res.losses), res.smoothed, rtol=1e-12)
    raw = np.array([1.0, 2.0, np.nan, 1.0])
    sm = smooth_losses(raw, beta=0.5)
    assert sm[0] == 1.0 and sm[1] == pytest.approx((0.25 * 1 + 0.5 * 2) / 0.75)
    assert np.isnan(sm[2:]).all()


def _valley_curve(noise=0.0, seed=0):
    """A clean range-test shape: flat at 2.3, falls to 0.3 over LRs 1e-4..1e-1, blows up."""
    x = np.log10(LRS)
    loss = 1.3 - 1.0 * np.tanh((x + 2.5) / 0.6) + 4.0 * np.clip(x + 0.5, 0, None) ** 2
    raw = loss + np.random.default_rng(seed).normal(0, noise, len(x))
    return raw, smooth_losses(raw)


def test_assess_passes_a_clean_curve_and_flags_flat_and_noisy_ones():
    raw, sm = _valley_curve(noise=0.05)
    assert assess(LRS, raw, sm, num_it=100) is None
    flat = 2.3 + np.random.default_rng(0).normal(0, 0.01, 100)
    why = assess(LRS, flat, smooth_losses(flat), num_it=100)
    assert why is not None and "flat" in why
    # the same fall, buried in per-batch scatter larger than the fall itself
    noisy, _ = _valley_curve(noise=3.0)
    noisy = np.abs(noisy)
    why = assess(LRS, noisy, smooth_losses(noisy), num_it=100)
    assert why is not None and ("noisy" in why or "flat" in why)


def test_flat_curve_warns_and_is_not_confident():
    # random labels and a zero-initialised linear model: nothing to learn, the
    # loss stays at log(3) until the LR is large enough to make it worse
    g = torch.Generator().manual_seed(0)
    ds = torch.utils.data.TensorDataset(torch.randn(4096, 8, generator=g),
                                        torch.randint(0, 3, (4096,), generator=g))

    def make():
        m = nn.Linear(8, 3)
        nn.init.zeros_(m.weight)
        nn.init.zeros_(m.bias)
        return m

    with pytest.warns(RuntimeWarning, match="flat") as seen:
        res = lr_find(make, nn.functional.cross_entropy, ds, 64, show_progress=False)
    assert seen[0].filename == __file__  # the warning names the caller's line, not a wrapper's
    assert not res.confident and "flat" in res.warning
    assert "NOT CONFIDENT" in repr(res)
    # a learnable problem: no warning, confident
    import warnings as _w

    with _w.catch_warnings():
        _w.simplefilter("error", RuntimeWarning)
        ok = lr_find(_mlp(), nn.functional.cross_entropy, _tensor_ds(n=2048), 32,
                     show_progress=False)
    assert ok.confident and ok.warning is None


def test_planned_budget_is_recorded_and_used():
    ds = _tensor_ds(n=512)
    kw = dict(show_progress=False, num_it=60, rule="budget")
    unknown = lr_find(_mlp(), nn.functional.cross_entropy, ds, 32, **kw)
    by_epochs = lr_find(_mlp(), nn.functional.cross_entropy, ds, 32, epochs=3, **kw)
    by_steps = lr_find(_mlp(), nn.functional.cross_entropy, ds, 16, accum_steps=2,
                       planned_steps=48, **kw)
    assert unknown.planned_steps is None and unknown.rule == "budget"
    assert by_epochs.planned_steps == 3 * (512 // 32) == 48 == by_steps.planned_steps
    assert lr_finder.BUDGET_STEPS > 48
    assert unknown.suggestion == unknown.suggestions["between"]  # no budget: no scaling
    assert by_epochs.suggestion == pytest.approx(
        by_epochs.suggestions["between"] * (48 / lr_finder.BUDGET_STEPS) ** lr_finder.BUDGET_POWER)
    assert "planned run 48 steps" in repr(by_epochs)
    with pytest.raises(ValueError, match="not both"):
        lr_find(_mlp(), nn.functional.cross_entropy, ds, 32, epochs=2, planned_steps=5, **kw)
    with pytest.raises(ValueError, match="epochs"):
        lr_find(_mlp(), nn.functional.cross_entropy, ds, 32, epochs=0, **kw)


def test_fit_find_passes_its_budget_and_warns_on_a_flat_curve(capsys):
    from xla_utils import OneCycleTrainer

    g = torch.Generator().manual_seed(0)
    n = 2048
    x = torch.randn(n, 8, generator=g)
    flat = torch.utils.data.TensorDataset(x, torch.randint(0, 3, (n,), generator=g))

    def make():
        m = nn.Linear(8, 3)
        nn.init.zeros_(m.weight)
        nn.init.zeros_(m.bias)
        return m

    t = OneCycleTrainer(make, nn.CrossEntropyLoss(), flat, batch_size=64, epochs=2,
                        optimizer="sgd", max_lr="find")
    with pytest.warns(RuntimeWarning, match=r"LR finder: the loss curve is flat") as record:
        h = t.fit()
    assert len([w for w in record if w.category is RuntimeWarning]) == 1  # said once
    out = capsys.readouterr().out
    res = t.lr_finder_result
    assert res.planned_steps == 2 * (n // 64) and f"run of {res.planned_steps} steps" in out
    assert re.search(r"lr_find suggests max_lr \S+ for the global batch 64 .*: NOT confident: the "
                     r"loss curve is flat", out), out
    assert h.base_lr == pytest.approx(res.suggestion)


def test_fit_find_keeps_the_sweep_in_proportion_to_a_short_run(capsys):
    """fit(max_lr="find") before a run of 12 steps: a 100-step sweep would cost 8x the run.
    It says so, sweeps the fewest steps it shortens to (75) from LR 1e-5 (a titled bar with
    its time left), says that the answer is less precise and how to sweep the whole range,
    and the suggestion's line says it is not confident, and why."""
    from xla_utils import OneCycleTrainer

    t = OneCycleTrainer(_mlp(), nn.CrossEntropyLoss(), _tensor_ds(n=200), batch_size=32,
                        epochs=2, optimizer="sgd", max_lr="find")
    with pytest.warns(RuntimeWarning, match="only 12 optimizer steps"):
        h = t.fit()
    out = capsys.readouterr().out
    res = t.lr_finder_result
    assert res.planned_steps == 12 and res.num_it == lr_finder.MIN_NUM_IT == 75
    assert len(res.lrs) == 75 or res.stop_reason == "diverged", (len(res.lrs), res.stop_reason)
    assert res.note in out and "a sweep of 100 steps would take about 8.3x as long as the " \
        "planned run (12 steps on one core); sweeping 75 steps from LR 1e-05 instead of 100 " \
        "(about 6.2x the run, the fewest it shortens to): the suggestion is less precise" in res.note
    assert res.lrs[0] == pytest.approx(1e-5)  # a shortened sweep skips the decades below
    assert "Pass num_it=100 to sweep the whole range: trainer.find_lr(num_it=100)" in res.note
    assert res.note.endswith("For a run this short a fixed max_lr may serve as well.")
    lines = out.splitlines()
    bar = [ln for ln in lines if ln.startswith("lr_find: 75 steps x 1 micro-batch on one core |")]
    assert bar[0].endswith("[0/75 00:00<?]") and re.search(r"\[\d+/75 \d\d:\d\d<", bar[-1]), bar
    line = next(ln for ln in lines if ln.startswith("lr_find suggests max_lr"))
    assert f"run of 12 steps, {len(res.lrs)} sweep steps): NOT confident: the planned run " \
        "has only 12 optimizer steps" in line, line
    assert h.base_lr == pytest.approx(res.suggestion) and not res.confident


def test_sweep_length_rule():
    """No limit without a planned run or a share; a user's num_it is kept as given."""
    assert lr_finder.sweep_length(None, None, 8, 0.25) == (100, None)
    assert lr_finder.sweep_length(None, 5000, 8, None) == (100, None)
    assert lr_finder.sweep_length(60, 10, 8, 0.25) == (60, None)
    assert lr_finder.sweep_length(None, 3200, 8, 0.25) == (100, None)  # exactly 25%
    n, note = lr_finder.sweep_length(None, 2800, 8, 0.25)  # 29%: 87 steps keep it at 25%
    assert n == 87 and "sweeping 87 steps from LR 1e-05 instead of 100 (at most 25% of the " \
        "run): the suggestion is less precise" in note and "run this short" not in note
    n, note = lr_finder.sweep_length(None, 16, 8, 0.25)  # the run: 16 steps on 8 cores
    assert n == 75 and "about 50x as long" in note and "(about 38x the run, the fewest" in note
    assert "For a run this short" in note
    n, note = lr_finder.sweep_length(None, 470, 8, 0.25)  # the README's run
    assert n == 75 and "(about 1.3x the run, the fewest it shortens to)" in note


def test_slide_rule():
    # flat until point 59, then a parabola. np.gradient is 0 up to point 58 and
    # grows after, so the walk from the right stops once the right probe reaches
    # 58; the last left probe (15 points left of the right one at 59) is 44.
    i = np.arange(100)
    losses = 2.0 + 0.05 * np.clip(i - 59, 0, None) ** 2
    assert suggest_slide(LRS, losses) == LRS[44]


def test_suggest_trims_and_stops_at_nan():
    losses = (np.log10(LRS) - np.log10(LRS[60])) ** 2 + 1.0
    losses[:10] = 0.0  # inside the skipped first num_it // 10 points
    out = suggest(LRS, losses, num_it=100)
    assert set(out) == set(RULES)
    assert out["minimum"] == pytest.approx(LRS[60] / 10)
    # a NaN at point 40 cuts everything after it: the minimum is now at 39
    with_nan = losses.copy()
    with_nan[40] = np.nan
    assert suggest(LRS, with_nan, num_it=100)["minimum"] == pytest.approx(LRS[39] / 10)
    # too short: NaN everywhere
    short = suggest(LRS[:7], losses[:7], num_it=100)
    assert all(math.isnan(v) for v in short.values())


# ---------------------------------------------------------------- restore
def _rng_states():
    return (random.getstate(), np.random.get_state(), torch.get_rng_state().clone())


def _same_rng(a, b):
    na, nb = a[1], b[1]
    return (a[0] == b[0] and np.array_equal(na[1], nb[1]) and na[2:] == nb[2:]
            and torch.equal(a[2], b[2]))


def _train(model, opt, ds, steps):
    """A few steps that use every RNG (shuffle: torch; dropout: torch; noise: numpy, python)."""
    model.train()
    x_all, y_all = ds.tensors
    for _ in range(steps):
        idx = torch.randperm(len(y_all))[:32]
        noise = torch.from_numpy(np.random.randn(32, x_all.shape[1]).astype(np.float32)) * random.random()
        loss = nn.functional.cross_entropy(model(x_all[idx] + 0.01 * noise), y_all[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_in_process_restores_everything(optimizer):
    ds = _tensor_ds()
    torch.manual_seed(1)
    model = _mlp(dropout=0.2, bn=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    _train(model, opt, ds, 3)  # non-trivial optimizer state, BN stats and grads
    model.eval()  # a train/eval flag to restore
    model[0].weight.grad = torch.full_like(model[0].weight, 0.5)
    twin_model, twin_opt = copy.deepcopy((model, opt))
    rng = _rng_states()
    params_before = list(model.parameters())
    grads_before = {k: (None if p.grad is None else p.grad.clone()) for k, p in model.named_parameters()}

    res = lr_find(model, nn.functional.cross_entropy, ds, 32, optimizer=optimizer, num_it=30,
                  show_progress=False)
    assert isinstance(res, LRFinderResult) and len(res.lrs) > 10

    assert _same_rng(rng, _rng_states())
    for (k, a), b in zip(model.state_dict().items(), twin_model.state_dict().values()):
        assert torch.equal(a, b), k
    assert all(p is q for p, q in zip(model.parameters(), params_before))
    for k, p in model.named_parameters():
        g = grads_before[k]
        assert (p.grad is None and g is None) or torch.equal(p.grad, g), k
    assert not model.training and not any(m.training for m in model.modules())
    assert str(opt.state_dict()) == str(twin_opt.state_dict())

    # training after lr_find equals training without it, bit for bit
    _set_rng(rng)
    _train(twin_model, twin_opt, ds, 5)
    _set_rng(rng)
    _train(model, opt, ds, 5)
    for (k, a), b in zip(model.state_dict().items(), twin_model.state_dict().values()):
        assert torch.equal(a, b), k


def _set_rng(state):
    random.setstate(state[0])
    np.random.set_state(state[1])
    torch.set_rng_state(state[2])


def test_restore_after_an_exception():
    ds = _tensor_ds()
    model = _mlp()
    before = copy.deepcopy(model.state_dict())
    rng = _rng_states()
    calls = []

    def bad_loss(out, y):
        calls.append(1)
        if len(calls) == 5:
            raise RuntimeError("boom")
        return nn.functional.cross_entropy(out, y)

    with pytest.raises(RuntimeError, match="boom"):
        lr_find(model, bad_loss, ds, 32, num_it=20, show_progress=False)
    assert _same_rng(rng, _rng_states())
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), before.values()))


# ---------------------------------------------------------------- stopping
def test_divergence_stop_on_blow_up():
    # Least squares with SGD: beyond lr ~ 2/L the iterates grow geometrically.
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 4, generator=g) * 3
    ds = torch.utils.data.TensorDataset(x, x @ torch.tensor([1.0, -2.0, 0.5, 3.0]))
    res = lr_find(lambda: nn.Linear(4, 1), lambda out, y: ((out.squeeze(1) - y) ** 2).mean(), ds, 64,
                  start_lr=1e-5, end_lr=1e3, num_it=200, show_progress=False)
    assert res.stop_reason == "diverged"
    assert len(res.lrs) < 200 and res.lrs[-1] < 1e3
    sm = res.smoothed
    best = np.minimum.accumulate(sm)
    # the loss read lags one step: the sweep ends one step after the crossing
    assert sm[-2] > 4 * best[-2]
    assert np.all(sm[:-2] <= 4 * best[:-2])
    assert len(res.losses) == len(res.smoothed) == len(res.lrs) == len(res.compiles)
    assert math.isfinite(res.suggestion) and res.suggestion < res.lrs[-1]


class _NanAfter(nn.Module):
    """Output turns NaN (or inf) from the k-th forward pass on."""

    def __init__(self, k, value=float("nan")):
        super().__init__()
        self.lin, self.k, self.calls, self.value = nn.Linear(8, 3), k, 0, value

    def forward(self, x):
        self.calls += 1
        out = self.lin(x)
        return out * self.value if self.calls >= self.k else out


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_nan_or_inf_stops(value):
    model = _NanAfter(40, value)
    res = lr_find(model, nn.functional.cross_entropy, _tensor_ds(), 32, num_it=100,
                  show_progress=False)
    assert res.stop_reason == "nan"
    assert len(res.lrs) == 41  # step 39 (the 40th) read one step late
    assert np.all(np.isfinite(res.losses[:39])) and not np.isfinite(res.losses[39])
    assert np.all(np.isfinite(res.smoothed[:39])) and np.isnan(res.smoothed[39:]).all()
    assert math.isfinite(res.suggestion)


def test_too_short_sweep_warns_and_gives_nan():
    with pytest.warns(RuntimeWarning, match="too early"):
        res = lr_find(_NanAfter(3), nn.functional.cross_entropy, _tensor_ds(), 32, num_it=100,
                      show_progress=False)
    assert math.isnan(res.suggestion) and res.stop_reason == "nan"


# ---------------------------------------------------------------- options
def test_accumulation_equals_the_big_batch():
    """Without BatchNorm, 2 micro-batches of 32 make the same step as one of 64."""
    ds = _tensor_ds(n=512)
    kw = dict(num_it=25, shuffle=False, show_progress=False, optimizer="adam")
    big = lr_find(lambda: _mlp(), nn.functional.cross_entropy, ds, 64, **kw)
    acc = lr_find(lambda: _mlp(), nn.functional.cross_entropy, ds, 32, accum_steps=2, **kw)
    assert (big.batch_size, acc.batch_size, acc.micro_batch_size, acc.accum_steps) == (64, 64, 32, 2)
    np.testing.assert_allclose(acc.lrs, big.lrs, rtol=1e-12)
    np.testing.assert_allclose(acc.losses, big.losses, rtol=1e-4)
    small = lr_find(lambda: _mlp(), nn.functional.cross_entropy, ds, 32, **kw)
    assert not np.allclose(small.losses[5:], big.losses[5:], rtol=1e-3)


def test_uint8_images_are_normalised_on_device():
    class Images(torch.utils.data.Dataset):
        def __init__(self):
            g = np.random.default_rng(0)
            self.x = g.integers(0, 256, size=(96, 6, 6, 3), dtype=np.uint8)
            self.y = (self.x[:, :3].mean(axis=(1, 2, 3)) > 127).astype(np.int64)

        def __len__(self):
            return len(self.y)

        def __getitem__(self, i):
            return self.x[i], int(self.y[i])

    seen = []

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3)
            self.fc = nn.Linear(4 * 4 * 4, 2)

        def forward(self, x):
            seen.append((x.dtype, tuple(x.shape), float(x.mean())))
            return self.fc(torch.relu(self.conv(x)).flatten(1))

    res = lr_find(Net(), nn.functional.cross_entropy, Images(), 16, num_it=12, show_progress=False)
    assert len(res.lrs) == 12
    dtype, shape, mean = seen[0]
    assert dtype == torch.float32 and shape == (16, 3, 6, 6) and -3 < mean < 3


def test_argument_errors():
    ds = _tensor_ds()
    model = _mlp()
    with pytest.raises(TypeError, match="dataset, not a DataLoader"):
        lr_find(model, nn.functional.cross_entropy, torch.utils.data.DataLoader(ds), 32)
    with pytest.raises(TypeError, match="optimizer spec"):
        lr_find(model, nn.functional.cross_entropy, ds, 32,
                optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="rule"):
        lr_find(model, nn.functional.cross_entropy, ds, 32, rule="median")
    with pytest.raises(ValueError, match="start_lr"):
        lr_find(model, nn.functional.cross_entropy, ds, 32, start_lr=1.0, end_lr=0.1)
    with pytest.raises(ValueError):  # no full batch
        lr_find(model, nn.functional.cross_entropy, ds, 1000, show_progress=False)


def test_lazy_exports_and_progress_bar(capsys):
    assert xla_utils.lr_find is lr_find and xla_utils.LRFinderResult is LRFinderResult
    res = xla_utils.lr_find(_mlp(), nn.CrossEntropyLoss(), _tensor_ds(), 32, num_it=15,
                            rule="steep", show_progress=True)
    assert res.rule == "steep" and res.suggestion == res.suggestions["steep"]
    assert res.backend == "torch" and res.optimizer == "SGD"
    assert "batch 32" in repr(res)


# ---------------------------------------------------------------- plot
def test_plot_writes_png(tmp_path):
    pytest.importorskip("matplotlib")
    res = lr_find(_mlp(), nn.functional.cross_entropy, _tensor_ds(), 32, num_it=40, show_progress=False)
    fig = res.plot(tmp_path / "lr.png")
    assert (tmp_path / "lr.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert any("(suggestion)" in t and t.startswith(res.rule) for t in labels)


def test_plot_without_matplotlib(monkeypatch, tmp_path):
    res = LRFinderResult(lrs=LRS[:3], losses=np.ones(3), smoothed=np.ones(3),
                         suggestions={r: 0.1 for r in RULES}, rule=DEFAULT_RULE, suggestion=0.1,
                         batch_size=8, micro_batch_size=8, accum_steps=1, optimizer="SGD",
                         stop_reason="num_it", backend="torch", device="cpu")
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match=r"xla_utils\[plot\]"):
        res.plot(tmp_path / "x.png")


# ---------------------------------------------------------------- XLA:CPU
def _make_image_net():
    torch.manual_seed(3)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(),
                         nn.Linear(4 * 4 * 4, 2))


class _UInt8Images(torch.utils.data.Dataset):
    def __len__(self):
        return 128

    def __getitem__(self, i):
        g = np.random.default_rng(i)
        return g.integers(0, 256, size=(6, 6, 3), dtype=np.uint8), i % 2


@pytest.mark.parametrize("optimizer,accum", [("sgd", 1), ("adam", 2)])
def test_xla_cpu_no_recompile_and_caller_untouched(optimizer, accum):
    if not runtime.xla_available():
        pytest.skip("torch_xla not installed")
    # the caller's process has used autograd: the forked child must still work
    _train(_mlp(), torch.optim.SGD(_mlp().parameters(), lr=0.1), _tensor_ds(), 1)
    model = _make_image_net()
    before = copy.deepcopy(model.state_dict())
    rng = _rng_states()
    res = lr_find(model, nn.functional.cross_entropy, _UInt8Images(), 16, optimizer=optimizer,
                  num_it=12, accum_steps=accum, simulate=1, show_progress=True, timeout=300)
    assert res.backend == "xla" and res.device.startswith("xla")
    assert len(res.compiles) == len(res.lrs) >= 10
    assert res.compiles[:2].sum() >= 1
    assert res.compiles[2:].sum() == 0, res.compiles
    assert res.batch_size == 16 * accum
    assert np.all(np.isfinite(res.losses[:5]))
    assert _same_rng(rng, _rng_states())
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), before.values()))


# ---------------------------------------------------------------- benchmark slice
def _load_script(name):
    path = ROOT / "scripts" / f"{name}.py"
    sys.path.insert(0, str(path.parent))
    try:
        spec = importlib.util.spec_from_file_location(name, path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod  # dataclasses look their module up there
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(str(path.parent))
    return mod


CI_PROBLEMS = ("iris100_mlp_adam_b16_e4", "wine118_mlp_adam_b16_e4", "bc120_mlp_adam_b16_e5",
               "bc400_linear_sgd_b64_e20", "wine124_mlp_sgd_b16_e4")


@pytest.mark.slow
def test_default_rule_within_2x_on_a_benchmark_slice():
    """A CI-sized slice of scripts/bench_lr_rules.py, measured from scratch (the
    cached results are not read): on its 5 cheapest problems (100-120 samples
    and 24-35 steps with Adam, the regime where the old default failed; a
    linear model with SGD whose loss still falls at the end of the sweep; the
    short SGD run of issue 19, 124 rows at batch 16 for 28 steps), with
    the benchmark's 3 seeds and 9-point grid, the default rule's one-cycle
    validation loss (mean over the seeds' sweeps, as in the benchmark) is
    within 2x of the grid's best."""
    pytest.importorskip("sklearn")
    bench = _load_script("bench_lr_rules")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        failures = []
        for name in CI_PROBLEMS:
            p = bench.lp.BY_NAME[name]
            entry = bench.measure(p, verbose=False)
            curve = bench.grid_curve(entry)
            best = min(curve.values())
            ratios, lrs_used = [], []
            for sw in entry["sweeps"].values():
                raw = np.array([np.nan if v is None else v for v in sw["losses"]])
                lr = suggest(sw["lrs"], smooth_losses(raw), num_it=100,
                             planned_steps=entry["steps"])[DEFAULT_RULE]
                lrs_used.append(lr)
                ratios.append(bench.loss_at(curve, lr) / best)
            # the benchmark's score: the mean over the seeds' sweeps
            if not np.mean(ratios) <= 2.0:
                failures.append(f"{name}: lrs {lrs_used} -> {ratios} x the best (grid {curve})")
    finally:
        torch.set_num_threads(threads)
    assert not failures, failures


def test_optimizer_name_is_validated_before_any_launch():
    model = torch.nn.Linear(4, 2)
    data = torch.utils.data.TensorDataset(torch.randn(32, 4), torch.randint(0, 2, (32,)))
    with pytest.raises(ValueError, match="did you mean 'sgd'"):
        lr_find(model, torch.nn.CrossEntropyLoss(), data, 8, optimizer="sgdd", simulate=1)


@pytest.mark.filterwarnings("ignore:LR finder:RuntimeWarning")  # 12 steps of a tiny model
def test_a_notebook_sweep_leaves_cores_to_the_loader_and_says_what_it_will_take(tmp_path, capsys):
    """lr_find in the notebook process (torch on the CPU) on a cache: torch's intra-op threads are
    the cores left after the loader's threads while it sweeps (every core on top of the loader
    oversubscribed a small host: 268 s against 53 s), the notebook's own setting is back after,
    and a line measured after warm-up says what the whole sweep will take."""
    import os

    from xla_utils import CachedImageDataset, build_cache
    from xla_utils.data import default_loader_threads
    from xla_utils.train.lr_finder import sweep_threads

    class Pics:
        def __len__(self):
            return 64

        def __getitem__(self, i):
            return np.full((8, 8, 3), 4 * i, np.uint8), i % 2

    build_cache(Pics(), tmp_path / "c", size=8, verbose=False)
    cache = CachedImageDataset(tmp_path / "c")
    cores = len(os.sched_getaffinity(0))
    assert sweep_threads(cache, None) == max(1, cores - default_loader_threads())
    assert sweep_threads(cache, 0) == cores and sweep_threads(_tensor_ds(), None) == cores
    seen = []

    def loss(out, y):
        seen.append(torch.get_num_threads())
        return nn.functional.cross_entropy(out, y)

    model = nn.Sequential(nn.Flatten(), nn.Linear(8 * 8 * 3, 2))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(cores)  # a notebook's default: every core
        lr_find(model, loss, cache, batch_size=8, num_it=12)
        assert set(seen) == {sweep_threads(cache, None)}, seen
        assert torch.get_num_threads() == cores
    finally:
        torch.set_num_threads(before)
    out = capsys.readouterr().out
    assert re.search(r"lr_find: [\d.e+-]+ s per step after 3 warm-up steps: about \d+ s for all 12 "
                     r"steps \(less if the loss diverges first\)\n", out), out
