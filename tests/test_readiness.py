"""xla_utils.check (xla_utils/readiness.py) on real XLA:CPU: every code from a model that has exactly that problem."""
from __future__ import annotations

import inspect
import random
import time

import numpy as np
import pytest
import torch
from torch import nn

import xla_utils
from xla_utils import Finding, ReadinessReport, runtime
from xla_utils.readiness import (CODES, TPU_CHIPS, ReadinessError, TPUChip, _auto_loss,
                             _padding_finding, resolve_tpu)

STATIC_CODES = {"recompile", "host_sync", "cpu_fallback", "dynamic_shape", "f64", "f16", "padding"}


def _digits(n: int = 16):
    """The first n scikit-learn digits: float32 [n, 64] in 0..1 and int64 labels."""
    from sklearn.datasets import load_digits

    d = load_digits()
    return (torch.tensor(d.data[:n], dtype=torch.float32) / 16.0,
            torch.tensor(d.target[:n], dtype=torch.int64))


def _clean():
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 256), nn.ReLU(),
                         nn.Linear(256, 10))


class _Base(nn.Module):
    def __init__(self, width: int = 128):
        super().__init__()
        self.a = nn.Linear(64, width)
        self.b = nn.Linear(width, 10)


class ShapeEveryStep(_Base):
    """Keeps a different number of rows every step (a step counter in forward)."""

    calls = 0

    def forward(self, x):
        self.calls += 1
        h = self.a(x[: 4 + self.calls])
        return self.b(h.relu()).mean(0, keepdim=True).expand(x.shape[0], 10)


class ItemInForward(_Base):
    def forward(self, x):
        h = self.a(x).relu()
        if h.mean().item() > 1e6:  # a divergence check that reads the device
            h = h * 0.5
        return self.b(h)


class NoLowering(_Base):
    def forward(self, x):
        return self.b(torch.lgamma(self.a(x).abs() + 1.0))  # aten::lgamma has no XLA lowering


class MaskSelect(_Base):
    def forward(self, x):
        h = self.a(x)
        positive_mean = h[h > 0].mean()  # boolean-mask indexing: data-dependent shape
        return self.b(h.relu()) + positive_mean


class HalfInside(_Base):
    def forward(self, x):
        return self.b(self.a(x).half().relu().float())


def _wide130():
    return nn.Sequential(nn.Linear(64, 130), nn.ReLU(), nn.Linear(130, 130), nn.ReLU(),
                         nn.Linear(130, 10))


def _codes(report: ReadinessReport) -> set[str]:
    return set(report.codes)


def _finding(report: ReadinessReport, code: str) -> Finding:
    found = [f for f in report.findings if f.code == code]
    assert len(found) == 1, (code, str(report))
    return found[0]


# ---------------------------------------------------------------------------
# Pure parts (no XLA)
# ---------------------------------------------------------------------------
def test_public_names():
    from xla_utils import readiness

    assert xla_utils.check is readiness.check  # the function, not a module
    assert list(inspect.signature(xla_utils.check).parameters)[:7] == [
        "model", "batch", "loss", "optimizer", "steps", "data", "tpu"]
    sig = inspect.signature(xla_utils.check)
    assert sig.parameters["optimizer"].default == "sgd" and sig.parameters["steps"].default == 4
    assert xla_utils.ReadinessReport is ReadinessReport and xla_utils.Finding is Finding
    assert {"check", "ReadinessReport", "Finding"} <= set(dir(xla_utils))


def test_resolve_tpu_and_finding_validation():
    assert resolve_tpu("v5e").name == "v5e" and resolve_tpu("V3-8").name == "v3"
    assert resolve_tpu(None).name == "v5e"  # no TPU on this machine
    assert set(TPU_CHIPS) == {"v2", "v3", "v4", "v5e", "v5p", "v6e"}
    assert TPU_CHIPS["v3"].hbm_per_device == 16 * 2**30 and TPU_CHIPS["v6e"].mxu == 256
    with pytest.raises(ValueError, match="known generations: v2, v3, v4, v5e, v5p, v6e"):
        resolve_tpu("v9x")
    with pytest.raises(ValueError, match="severity"):
        Finding("padding", "fatal", "m", "f")
    with pytest.raises(ValueError, match="steps must be an int >= 3"):
        xla_utils.check(_clean(), _digits(), steps=2)


def test_report_ok_and_text():
    r = ReadinessReport([Finding("memory", "info", "fits", "")], tpu="v5e", batch_size=16, steps=4)
    assert r.ok and "READY" in str(r) and "NOT READY" not in str(r)
    r = ReadinessReport([Finding("recompile", "error", "every step compiles", "fix shapes"),
                         Finding("padding", "warning", "130 wide", "use 128")], tpu="v5e")
    text = str(r)
    assert not r.ok and "NOT READY (1 error, 1 warning)" in text
    assert "[error] recompile: every step compiles" in text and "fix: fix shapes" in text
    assert [f.code for f in r.errors] == ["recompile"]


def test_default_loss_by_target_kind():
    out = torch.randn(4, 3)
    fn, name = _auto_loss(torch.tensor([0, 2, 1, 0]))
    assert "cross-entropy" in name
    assert torch.allclose(fn(out, torch.tensor([0, 2, 1, 0])),
                          nn.functional.cross_entropy(out, torch.tensor([0, 2, 1, 0])))
    y01 = torch.tensor([[0.0, 1.0, 1.0]] * 4)
    fn, name = _auto_loss(y01)
    assert "binary" in name
    assert torch.allclose(fn(out, y01), nn.functional.binary_cross_entropy_with_logits(out, y01))
    fn, name = _auto_loss(torch.rand(4, 3) + 2)
    assert "squared" in name
    fn, name = _auto_loss(None)
    assert "sum" in name and torch.allclose(fn(out), out.sum())


def test_padding_math_per_generation():
    """A 128-wide layer fills v5e's 128x128 unit but half of v6e's 256x256."""
    mm = {"module": "fc", "kind": "Linear", "op": "addmm", "m": 16, "k": 128, "n": 128, "width_in": 128,
          "groups": 1, "depthwise": False, "k_fixed": False, "n_fixed": False, "where": ""}
    assert _padding_finding([mm], 16, TPU_CHIPS["v5e"]) is None
    f = _padding_finding([mm], 16, TPU_CHIPS["v6e"])
    assert f.severity == "warning" and "75%" in f.message and "256" in f.message
    odd = dict(mm, n=130, m=12)
    conv = dict(mm, kind="Conv2d", m=8 * 56 * 56, k=64 * 9, n=64, width_in=64)
    f = _padding_finding([dict(conv, module=f"layer1.{i}") for i in range(4)], 8, TPU_CHIPS["v5e"])
    # 576 of 640 inputs per output, 64 of 128 output channels: 1 - 576*64 / (640*128) = 55%
    assert "`layer1.0` and 3 more like it (Conv2d 64->64): 55% padding" in f.message, f.message
    assert "576 inputs per output (64 channels x 9 taps) fill 576 of 640" in f.message
    f = _padding_finding([odd], 12, TPU_CHIPS["v5e"])
    # 12 rows -> 16, 130 features -> 256: 1 - (12*128*130) / (16*128*256) = 62%
    assert "62%" in f.message and "nearest efficient: 128" in f.message
    assert "per-core batch 12 is not a multiple of 8" in f.message


# ---------------------------------------------------------------------------
# One code per broken model, on XLA:CPU
# ---------------------------------------------------------------------------
def test_clean_model_gets_none_of_the_static_codes():
    x, y = _digits()
    r = xla_utils.check(_clean(), (x, y), verbose=False)
    assert not (_codes(r) & STATIC_CODES), str(r)
    assert r.ok, str(r)
    assert r.steps == 4 and len(r.per_step) == 4 and len(r.losses) == 4
    assert all(np.isfinite(r.losses))
    assert r.per_step[0]["compiles"] >= 1 and all(s["compiles"] == 0 for s in r.per_step[1:])
    assert all(s["to_host"] == 0 for s in r.per_step)
    mem = _finding(r, "memory")
    assert mem.severity == "info" and "v5e" in mem.message
    m = r.measurements
    n_params = sum(p.numel() for p in _clean().parameters())
    assert m["param_bytes"] == m["grad_bytes"] == m["optimizer_state_bytes"] == 4 * n_params
    # fwd + bwd FLOPs of the three Linear layers (bwd = 2x fwd, minus the input gradient of layer 1)
    fwd = 2 * 16 * (64 * 128 + 128 * 256 + 256 * 10)
    assert m["flops"] == 3 * fwd - 2 * 16 * 64 * 128
    assert m["activation_bytes"] >= 4 * 16 * (128 + 256)  # at least the two hidden activations
    assert "READY" in str(r)


def test_recompile_names_the_changing_shape():
    r = xla_utils.check(ShapeEveryStep(), _digits(), verbose=False)
    f = _finding(r, "recompile")
    assert f.severity == "error" and not r.ok
    assert all(s["compiles"] >= 1 for s in r.per_step)
    assert "a (Linear) input [" in f.message and "fixed" in f.fix
    assert "host_sync" not in r.codes


def test_host_sync_from_item_in_forward():
    r = xla_utils.check(ItemInForward(), _digits(), verbose=False)
    f = _finding(r, "host_sync")
    assert f.severity == "warning" and f.message.startswith("1 device-to-host transfer(s) per step")
    assert "test_readiness.py" in f.message and "in forward" in f.message
    assert "recompile" not in r.codes and "cpu_fallback" not in r.codes


def test_cpu_fallback_is_named():
    r = xla_utils.check(NoLowering(), _digits(), verbose=False)
    f = _finding(r, "cpu_fallback")
    assert "aten::lgamma" in f.message and "test_readiness.py" in f.message
    assert "host_sync" not in r.codes and "dynamic_shape" not in r.codes


def test_dynamic_shape_from_boolean_mask():
    r = xla_utils.check(MaskSelect(), _digits(), verbose=False)
    f = _finding(r, "dynamic_shape")
    assert "boolean-mask indexing" in f.message and "aten::nonzero" in f.message
    assert "torch.where" in f.fix
    assert "cpu_fallback" not in r.codes  # nonzero's fallback is reported as the dynamic shape


def test_f64_parameters_inputs_and_intermediates():
    x, y = _digits()
    r = xla_utils.check(_clean().double(), (x.double(), y), verbose=False)
    f = _finding(r, "f64")
    assert "6 parameter tensor(s)" in f.message and "the input batch" in f.message
    assert "intermediate" in f.message and "float32" in f.fix and "bfloat16" in f.fix
    assert "f16" not in r.codes


def test_f16_intermediate():
    r = xla_utils.check(HalfInside(), _digits(), verbose=False)
    f = _finding(r, "f16")
    assert "intermediate result(s)" in f.message and "test_readiness.py" in f.message
    assert "bfloat16" in f.fix and "f64" not in r.codes


def test_padding_names_the_130_wide_layers():
    r = xla_utils.check(_wide130(), _digits(), verbose=False)
    f = _finding(r, "padding")
    assert f.severity == "warning"
    assert "130 output features fill 130 of 256 lanes (nearest efficient: 128)" in f.message
    assert "`2` (Linear 130->130)" in f.message
    assert not (_codes(r) & (STATIC_CODES - {"padding"}))


def test_memory_error_and_largest_batch_on_a_small_chip():
    """The same measured step against a made-up chip with 4 MiB of HBM per core."""
    tiny = TPUChip("tiny", bf16_tflops=1, hbm_gib=4 / 1024, mxu=128, devices_per_chip=1)
    model = nn.Sequential(nn.Linear(64, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
                          nn.Linear(1024, 10))  # 1.1 M parameters: 4.3 MiB of weights alone
    r = xla_utils.check(model, _digits(), tpu=tiny, verbose=False)
    f = _finding(r, "memory")
    assert f.severity == "error" and "alone do not fit" in f.message
    small = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    r = xla_utils.check(small, _digits(), tpu=tiny, verbose=False)
    f = _finding(r, "memory")
    m = r.measurements
    fixed = m["param_bytes"] + m["grad_bytes"] + m["optimizer_state_bytes"]
    per_sample = m["activation_bytes"] / 16
    expect = int((0.9 * 4 * 2**20 - fixed) // per_sample)
    expect -= expect % 8
    assert f"Largest per-core batch that fits: about {expect:,}" in f.message, f.message
    assert f.severity == "info"


def test_input_bound_with_a_slow_dataset():
    """A map-style dataset that decodes real photos per sample cannot feed a TPU core
    running a small MLP."""
    from skimage import data as skdata

    photos = [skdata.astronaut(), skdata.coffee(), skdata.chelsea()]

    class Photos(torch.utils.data.Dataset):
        def __len__(self):
            return 64

        def __getitem__(self, i):
            img = torch.from_numpy(photos[i % 3][:256, :256]).float().mean(-1)
            small = nn.functional.adaptive_avg_pool2d(img[None, None], 8).flatten() / 255.0
            return small, i % 10

    r = xla_utils.check(_clean(), _digits(), data=Photos(), verbose=False)
    f = _finding(r, "input_bound")
    assert f.severity == "warning" and "The TPU would wait for the host" in f.message
    assert r.measurements["loader"]["samples_per_s"] > 0
    assert "kFLOPs per sample" in f.message and "40%" in f.message


# ---------------------------------------------------------------------------
# The caller is left alone
# ---------------------------------------------------------------------------
def test_caller_model_optimizer_and_rng_unchanged():
    model = _clean().eval()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for p in model.parameters():  # optimizer state without running autograd in this process
        p.grad = torch.full_like(p, 0.01)
    opt.step()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    grads = [p.grad.clone() for p in model.parameters()]
    opt_state = [s["momentum_buffer"].clone() for s in opt.state.values()]
    random.seed(3)
    np.random.seed(3)
    torch.manual_seed(3)
    rng = (random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state().clone())

    r = xla_utils.check(model, _digits(), optimizer=opt, verbose=False)

    assert len(r.losses) == 4 and np.isfinite(r.losses).all()
    assert r.measurements["optimizer_state_bytes"] == 4 * sum(p.numel() for p in model.parameters())
    assert not model.training
    for k, v in model.state_dict().items():
        assert torch.equal(v, state[k]), k
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))
    assert all(torch.equal(s["momentum_buffer"], b) for s, b in zip(opt.state.values(), opt_state))
    assert opt.param_groups[0]["lr"] == 0.1
    assert random.getstate() == rng[0]
    assert np.array_equal(np.random.get_state()[1], rng[1])
    assert torch.equal(torch.get_rng_state(), rng[2])
    assert not runtime.xla_runtime_initialized()


def test_optimizer_over_other_parameters_is_refused():
    other = torch.optim.SGD(_clean().parameters(), lr=0.1)
    with pytest.raises(ValueError, match="not the model's"):
        xla_utils.check(_clean(), _digits(), optimizer=other)


@pytest.mark.multicore
def test_all_cores_can_launch_after_check():
    r = xla_utils.check(ItemInForward(), _digits(), verbose=False)
    assert "host_sync" in r.codes
    assert not runtime.xla_runtime_initialized()

    def job():
        t = runtime.all_reduce(torch.ones(()).to(runtime.device()))
        runtime.sync()
        return runtime.world_size(), float(t.cpu())

    assert runtime.launch(job, simulate=2) == (2, 2.0)


# ---------------------------------------------------------------------------
# Trainer integration
# ---------------------------------------------------------------------------
def _digits_dataset(n: int = 256):
    x, y = _digits(n)
    return torch.utils.data.TensorDataset(x, y)


def test_trainer_check_uses_its_batch_loss_and_loader():
    from xla_utils import OneCycleTrainer

    t = OneCycleTrainer(_wide130(), nn.CrossEntropyLoss(), _digits_dataset(), batch_size=12,
                        optimizer="adam")
    r = t.check()
    assert r.batch_size == 12 and "padding" in r.codes
    assert "per-core batch 12 is not a multiple of 8" in _finding(r, "padding").message
    assert "input_bound" in r.codes and r.measurements["loader"]["samples_per_s"] > 0
    assert r.measurements["loss"] == "your loss"
    # Adam: two moments per parameter
    assert r.measurements["optimizer_state_bytes"] >= 2 * r.measurements["param_bytes"]


def test_fit_check_stops_before_training_on_errors(capsys):
    from xla_utils import OneCycleTrainer

    t = OneCycleTrainer(ShapeEveryStep(), nn.CrossEntropyLoss(), _digits_dataset(), batch_size=16)
    before = {k: v.clone() for k, v in t.model.state_dict().items()}
    with pytest.raises(ReadinessError, match="recompile") as info:
        t.fit(check=True, simulate=1)
    assert "recompile" in info.value.report.codes
    assert "xla_utils.check for TPU v5e: NOT READY" in capsys.readouterr().out
    assert all(torch.equal(v, before[k]) for k, v in t.model.state_dict().items())


def test_fit_check_passes_a_clean_model(capsys):
    from xla_utils import OneCycleTrainer

    t = OneCycleTrainer(_clean(), nn.CrossEntropyLoss(), _digits_dataset(), batch_size=16,
                        max_lr=1e-2, optimizer="sgd")
    h = t.fit(check=True, simulate=1)
    out = capsys.readouterr().out
    assert "xla_utils.check for TPU v5e:" in out and len(h) == 1


# ---------------------------------------------------------------------------
# A real model
# ---------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_resnet18_batch8_report():
    torchvision = pytest.importorskip("torchvision")
    from skimage import data as skdata

    photos = [skdata.astronaut(), skdata.coffee(), skdata.chelsea(), skdata.rocket()]
    x = torch.stack([torch.from_numpy(p[:224, :224].copy()) for p in photos * 2])  # uint8 NHWC
    y = torch.arange(8) % 4
    t0 = time.perf_counter()
    r = xla_utils.check(torchvision.models.resnet18(num_classes=4), (x, y), verbose=False)
    seconds = time.perf_counter() - t0
    print(f"resnet18 batch 8 at 224x224: check took {seconds:.0f} s")
    assert r.batch_size == 8 and len(r.per_step) == 4
    assert not (_codes(r) & {"recompile", "host_sync", "cpu_fallback", "dynamic_shape", "f64", "f16"}), str(r)
    m = r.measurements
    # ResNet-18: ~1.8 GFLOPs (multiply-adds x 2 = 3.6 GFLOPs) forward per 224x224 image
    assert 8e9 < m["flops"] / 8 < 13e9, m["flops"]
    assert 11_000_000 < m["param_bytes"] / 4 < 12_000_000
    assert _finding(r, "memory").severity == "info"
    assert set(r.codes) <= set(CODES)
