"""Mixup / cutmix / label smoothing on the device (xla_utils.train.mixup) against timm's ``Mixup``."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from helpers import digits_dataset

from xla_utils import OneCycleTrainer, runtime
from xla_utils.train.mixup import beta_logit_johnk, mix_batch, sample_beta, sample_gamma, soft_targets
from xla_utils.train.trainer import TrainerConfig

timm_mixup = pytest.importorskip("timm.data.mixup")

H, W, B, C = 16, 20, 8, 5  # H != W catches a swapped box


def _timm_cases():
    """Inputs, timm's outputs and timm's own random draws, replayed from numpy's seed."""
    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(B, 3, H, W, generator=g)
    y_idx = torch.randint(0, C, (B,), generator=g)
    y_hot = (torch.rand(B, C, generator=g) < 0.4).float()
    cases = []
    settings = [dict(mixup_alpha=0.2, cutmix_alpha=1.0), dict(mixup_alpha=0.8, cutmix_alpha=0.0),
                dict(mixup_alpha=0.0, cutmix_alpha=1.0)]
    for k, opts in enumerate(settings):
        for multi in (False, True):
            for seed in range(6):
                m = timm_mixup.Mixup(**opts, label_smoothing=0.1, num_classes=C, multi_label=multi)
                y = y_hot if multi else y_idx
                np.random.seed(100 * k + seed)
                xt, yt = m(x0.clone(), y.clone())
                np.random.seed(100 * k + seed)  # replay timm's draws
                lam, use_cutmix = m._params_per_batch()
                cy = cx = 0
                if use_cutmix:
                    cy, cx = np.random.randint(0, H), np.random.randint(0, W)
                cases.append(dict(x=x0, y=y, multi=multi, lam=lam, cut=bool(use_cutmix), cy=int(cy),
                                  cx=int(cx), x_timm=xt, y_timm=yt))
    return cases


def _ours_on_xla(cases):
    """Our mixing of every case, on an XLA:CPU device (one replica)."""
    def job(cases):
        dev = runtime.device()
        out = []
        for c in cases:
            y = runtime.to_device(c["y"], dev)
            ys = soft_targets(y, C, 0.1, c["multi"])
            lam = runtime.to_device(torch.tensor(c["lam"], dtype=torch.float32), dev)
            cut = runtime.to_device(torch.tensor(c["cut"]), dev)
            centre = runtime.to_device(torch.tensor([float(c["cy"]), float(c["cx"])]), dev)
            xm, ym = mix_batch(runtime.to_device(c["x"], dev), ys, lam, cut, centre)
            runtime.sync()
            out.append((xm.cpu(), ym.cpu()))
        draws = _beta_f64(runtime.to_device(torch.full((4000,), 0.4), dev))
        return out, draws
    slim = [{k: v for k, v in c.items() if not k.endswith("_timm")} for c in cases]
    return runtime.launch(job, slim, simulate=1, timeout=600)


@pytest.mark.timeout(600)
def test_mixup_cutmix_smoothing_equal_timm_on_the_same_draws():
    cases = _timm_cases()
    assert any(c["cut"] for c in cases) and any(not c["cut"] and c["lam"] < 1 for c in cases)
    ours, draws = _ours_on_xla(cases)
    for c, (xm, ym) in zip(cases, ours):
        torch.testing.assert_close(xm, c["x_timm"], rtol=0, atol=1e-6)
        torch.testing.assert_close(ym, c["y_timm"], rtol=0, atol=1e-6)
    # The device Beta sampler: timm draws lam from Beta(alpha, alpha)
    from scipy import stats

    assert _ks_pvalue(draws, 0.4) > 1e-3


def _beta_f64(alpha: torch.Tensor) -> np.ndarray:
    """sample_beta's draws with the last step (sigmoid of the log-Gamma difference) in
    float64: in float32 the 1.9% of Beta(0.2, 0.2) within 6e-8 of 1 round to exactly 1,
    a jump that the KS test sees but mixing does not care about."""
    lg = sample_gamma(torch.stack([alpha, alpha]), log=True).cpu().double()
    return torch.sigmoid(lg[0] - lg[1]).numpy()


def _ks_pvalue(d: np.ndarray, alpha: float) -> float:
    """KS test of draws against Beta(alpha, alpha)."""
    from scipy import stats

    return stats.kstest(d, stats.beta(alpha, alpha).cdf).pvalue


@pytest.mark.parametrize("alpha", [0.2, 1.0, 3.0])
def test_beta_sampler_distribution(alpha):
    from scipy import stats

    torch.manual_seed(1)
    assert _ks_pvalue(_beta_f64(torch.full((20000,), alpha)), alpha) > 1e-3
    d = sample_beta(torch.full((2000,), alpha))  # the float32 draws the trainer uses
    assert torch.isfinite(d).all() and d.min() >= 0 and d.max() <= 1
    if alpha <= 1:  # Johnk's method, what the trainer uses for alphas <= 1
        logit = beta_logit_johnk(torch.full((20000,), alpha))
        assert _ks_pvalue(torch.sigmoid(logit.double()).numpy(), alpha) > 1e-3


def test_label_smoothing_alone_equals_timm_targets():
    y = torch.tensor([0, 3, 1, 4])
    ours = soft_targets(y, 5, 0.1, False)
    torch.testing.assert_close(ours, timm_mixup.mixup_target(y, 5, 1.0, 0.1), rtol=0, atol=1e-7)
    hot = torch.tensor([[1.0, 0, 1], [0, 0, 1]])
    torch.testing.assert_close(soft_targets(hot, 3, 0.2, True),
                               timm_mixup.mixup_target(hot, 3, 1.0, 0.2, multi_label=True))


def _net():
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 10))


def test_bad_values_refused_before_any_device_time():
    with pytest.raises(ValueError, match="mixup must be a Beta alpha"):
        TrainerConfig(mixup=-0.2)
    with pytest.raises(ValueError, match="label_smoothing must be in"):
        TrainerConfig(label_smoothing=1.0)
    with pytest.raises(ValueError, match="even batch_size"):
        TrainerConfig(cutmix=1.0, batch_size=15)
    data = digits_dataset(64, shape=(1, 8, 8))
    with pytest.raises(ValueError, match="does not take"):
        OneCycleTrainer(_net(), nn.NLLLoss(), data, batch_size=8, mixup=0.2).fit()
    reg = torch.utils.data.TensorDataset(data.tensors[0], data.tensors[1].float())
    with pytest.raises(ValueError, match="regression"):
        OneCycleTrainer(_net(), nn.MSELoss(), reg, batch_size=8, mixup=0.2).fit()
    flat = torch.utils.data.TensorDataset(data.tensors[0].view(-1, 64), data.tensors[1])
    with pytest.raises(ValueError, match="cutmix=0"):
        OneCycleTrainer(nn.Linear(64, 10), nn.CrossEntropyLoss(), flat, batch_size=8,
                        cutmix=1.0).fit()


def _chunked_job(chunk, steps):
    """DeviceMix as the trainer's loop drives it, over three 'epochs' of ``steps`` steps
    with ``chunk`` draws per chunk; the third replays the second's seed (a resume)."""
    from xla_utils.train.mixup import DeviceMix, MixConfig

    dev = runtime.device()
    mix = DeviceMix(MixConfig(0.2, 1.0, 0.1, C, image_hw=(H, W)), dev, chunk=chunk)
    x = runtime.to_device(torch.arange(B * 3 * H * W, dtype=torch.float32).view(B, 3, H, W), dev)
    y = runtime.to_device(torch.arange(B) % C, dev)
    out = []
    for seed in (11, 12, 12):
        runtime.set_seed(seed)
        mix.start_epoch()
        before = runtime.xla_counters()
        got = []
        for _ in range(steps):
            mix.prepare()
            xm, ym = mix(x, y)
            runtime.sync()
            got.append((xm, ym))
        after = runtime.xla_counters()
        out.append(dict(compiles=after["compiles"] - before["compiles"],
                        to_device=after["to_device"] - before["to_device"],
                        to_host=after["to_host"] - before["to_host"],
                        mixed=[(a.cpu(), b.cpu()) for a, b in got]))
    # multi-label, mixup alone, on flat inputs (no image size): chunks of 2
    ml = DeviceMix(MixConfig(0.8, 0.0, 0.1, C, multilabel=True), dev, chunk=2)
    xf, yh = x.view(B, -1), (y.view(-1, 1) == runtime.to_device(torch.tensor([[0, 2, 3]]), dev))
    multi = []
    for _ in range(3):
        ml.prepare()
        a, b = ml(xf, yh.float())
        runtime.sync()
        multi.append((a.cpu(), b.cpu()))
    return x.cpu(), out, yh.float().cpu(), multi


@pytest.mark.timeout(600)
def test_draws_come_in_chunks_new_per_step_and_epoch_same_graph_exact_on_resume():
    steps, chunk = 11, 4  # three chunks per epoch, the last one partly used
    x, epochs, yh, multi = runtime.launch(_chunked_job, chunk, steps, simulate=1, timeout=600)
    first, second, replay = epochs
    assert first["compiles"] > 0 and second["compiles"] == 0 and replay["compiles"] == 0
    for e in epochs[1:]:  # no per-step copies: the device RNG's seed once per chunk, no reads
        assert e["to_host"] == 0 and e["to_device"] == -(-steps // chunk), e["to_device"]
    flat = [xm for e in epochs[:2] for xm, _ in e["mixed"]]
    for i in range(len(flat)):  # a new draw every step, chunk and epoch
        for j in range(i):
            assert not torch.equal(flat[i], flat[j]), (i, j)
    for (a, b), (c, d) in zip(second["mixed"], replay["mixed"]):  # same seed, same draws
        assert torch.equal(a, c) and torch.equal(b, d)
    # cutmix steps copy pixels (each one of x or x.flip(0)); mixup steps blend them all
    cut = [bool(((xm == x) | (xm == x.flip(0))).all()) for e in epochs[:2] for xm, _ in e["mixed"]]
    assert any(cut) and not all(cut), cut
    for e in epochs:
        for xm, ym in e["mixed"]:
            assert torch.allclose(ym.sum(1), torch.ones(B)) and torch.isfinite(xm).all()
    xf, ys, lams = x.view(B, -1), soft_targets(yh, C, 0.1, True), []
    for xm, ym in multi:  # one lam per step blends inputs and multi-hot targets alike
        lam = float((xm[0, 1] - xf[-1, 1]) / (xf[0, 1] - xf[-1, 1]))
        torch.testing.assert_close(xm, lam * xf + (1 - lam) * xf.flip(0), rtol=1e-4, atol=1e-3)
        torch.testing.assert_close(ym, lam * ys + (1 - lam) * ys.flip(0), rtol=0, atol=1e-4)
        lams.append(lam)
    assert len(set(lams)) == 3, lams


def _noise(x, y):
    """A ``batch_transform=`` hook: device random noise, in the step's graph. (Its scale is no
    value a step's scalars take: torch_xla gives equal scalars one input, another graph.)"""
    return x + 0.3 * torch.randn_like(x), y


@pytest.mark.timeout(600)
def test_trainer_mix_over_chunks_compiles_once_and_resumes_exactly(tmp_path):
    """80 steps an epoch, more than one chunk of draws (64), with a batch_transform= hook
    drawing device noise too: no compile after epoch 1, and a run resumed from epoch 1's
    checkpoint ends with the same weights."""
    import copy

    data = digits_dataset(320, shape=(1, 8, 8))
    torch.manual_seed(0)
    init = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.Flatten(),
                         nn.Linear(4 * 64, 10))
    kw = dict(batch_size=4, epochs=2, max_lr=5e-3, seed=6, mixup=0.2, cutmix=1.0,
              label_smoothing=0.1, checkpoint_dir=str(tmp_path / "full"), keep_checkpoints=3,
              batch_transform=_noise)
    full = OneCycleTrainer(copy.deepcopy(init), nn.CrossEntropyLoss(), data, **kw).fit(simulate=1)
    compiles = [e["compiles"] for e in full.epochs]
    assert compiles[0] > 0 and compiles[1] == compiles[0], compiles
    assert all(e["host_reads_per_step"] < 1 for e in full.epochs), full.epochs
    kw["checkpoint_dir"] = str(tmp_path / "resumed")
    resumed = OneCycleTrainer(copy.deepcopy(init), nn.CrossEntropyLoss(), data, **kw).fit(
        simulate=1, resume=tmp_path / "full" / f"epoch_001-{full.run_id}.pt")
    assert [e["epoch"] for e in resumed.epochs] == [1, 2]
    for k, v in full.state_dict.items():
        torch.testing.assert_close(resumed.state_dict[k], v, rtol=0, atol=0)
