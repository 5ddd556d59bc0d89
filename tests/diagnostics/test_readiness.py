"""xla_utils.check (xla_utils/diagnostics/readiness.py) on real XLA:CPU: every code from a model
that has exactly that problem."""
from __future__ import annotations

import inspect
import random
import time
from functools import partial

import numpy as np
import pytest
import torch
from torch import nn

from helpers import digits_dataset, digits_tensors, tiny_mlp

import xla_utils
from xla_utils import Finding, ReadinessReport, runtime
from xla_utils.diagnostics.findings import padding_finding
from xla_utils.diagnostics.readiness import (CODES, TPU_CHIPS, ReadinessError, TPUChip, _auto_loss,
                                 resolve_tpu)

STATIC_CODES = {"recompile", "host_sync", "cpu_fallback", "dynamic_shape", "f64", "f16", "padding"}

_digits = partial(digits_tensors, 16)  # the first 16 digits: float32 [16, 64] in 0..1, int64 labels
_clean = partial(tiny_mlp, hidden=(128, 256))  # a model with none of the problems


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


class NewLengthEveryCall(_Base):
    """Adds a sum over a tensor one element longer at every call: a new graph every step."""

    calls = 0

    def forward(self, x):
        self.calls += 1
        return self.b(self.a(x).relu()) + x.new_zeros(self.calls).sum()


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
    assert len(found) == 1, (code, report.report)
    return found[0]


# ---------------------------------------------------------------------------
# Pure parts (no XLA)
# ---------------------------------------------------------------------------
def test_public_names():
    from xla_utils.diagnostics import readiness

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
    assert r.ok and r.verdict == "READY" and "NOT READY" not in str(r)
    # performance hints are suggestions: it runs, it could run faster
    r = ReadinessReport([Finding("padding", "suggestion", "64 wide", "use 128"),
                         Finding("input_bound", "suggestion", "slow loader", "more workers"),
                         Finding("memory", "info", "fits", "")], tpu="v5e")
    assert r.ok and r.verdict == "READY, could be faster (2 suggestions)"
    assert str(r).startswith("xla_utils.check for TPU v5e: READY, could be faster (2 suggestions)")
    assert [f.code for f in r.suggestions] == ["padding", "input_bound"]
    assert "READY, could be faster" in repr(r) and "print(report.report)" in repr(r)
    r = ReadinessReport([Finding("recompile", "error", "every step compiles", "fix shapes"),
                         Finding("padding", "warning", "130 wide", "use 128")], tpu="v5e")
    text = r.report
    assert str(r) == "xla_utils.check for TPU v5e: NOT READY (1 error, 1 warning)"
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
    assert padding_finding([mm], 16, TPU_CHIPS["v5e"]) is None
    f = padding_finding([mm], 16, TPU_CHIPS["v6e"])
    assert f.severity == "suggestion" and "75%" in f.message and "256" in f.message
    odd = dict(mm, n=130, m=12)
    conv = dict(mm, kind="Conv2d", m=8 * 56 * 56, k=64 * 9, n=64, width_in=64)
    f = padding_finding([dict(conv, module=f"layer1.{i}") for i in range(4)], 8, TPU_CHIPS["v5e"])
    # 576 of 640 inputs per output, 64 of 128 output channels: 1 - 576*64 / (640*128) = 55%
    assert "`layer1.0` and 3 more like it (Conv2d 64->64): 55% padding" in f.message, f.message
    assert "576 inputs per output (64 channels x 9 taps) fill 576 of 640" in f.message
    f = padding_finding([odd], 12, TPU_CHIPS["v5e"])
    # 12 rows -> 16, 130 features -> 256: 1 - (12*128*130) / (16*128*256) = 62%
    assert "62%" in f.message and "nearest efficient: 128" in f.message
    assert "per-core batch 12 is not a multiple of 8" in f.message


def test_input_bound_fix_fits_the_data_it_saw():
    """A slow loader of a cache or of in-memory tensors gets a suggestion that fits it (more
    workers, or nothing), never "build a uint8 cache"; per-sample decoding gets the cache."""
    from xla_utils.diagnostics.findings import input_finding

    def finding(kind, workers, rate=1_000.0):
        loader = {"samples_per_s": rate, "source": "X", "host_cpus": 4, "kind": kind,
                  "workers": workers}
        return input_finding({"loader": loader, "flops": 6e8, "batch_rows": 8}, TPU_CHIPS["v5e"])

    for kind in ("cache", "tensors"):
        f = finding(kind, 2)
        assert f.severity == "suggestion" and "build a uint8 cache" not in f.fix, f
        assert f.fix.startswith("more loader workers: num_workers=4 (now 2)"), f.fix
        f = finding(kind, 4)
        assert f.fix.startswith("nothing to change in the data or the loader (4 workers on 4 "), f
    f = finding("dataset", None)
    assert f.severity == "warning" and "build a uint8 cache" in f.fix  # the chip waits > 50%
    assert finding("dataset", None, rate=7e5).severity == "suggestion"  # waits about 33%
    assert finding("cache", 2, rate=2e6).severity == "info"  # the host keeps up


# ---------------------------------------------------------------------------
# One code per broken model, on XLA:CPU
# ---------------------------------------------------------------------------
def test_clean_model_gets_none_of_the_static_codes():
    x, y = _digits()
    r = xla_utils.check(_clean(), (x, y), verbose=False)
    assert not (_codes(r) & STATIC_CODES), r.report
    assert r.ok, r.report
    assert r.steps == 4 and len(r.per_step) == 4 and len(r.losses) == 4
    assert all(np.isfinite(r.losses))
    # steps 1-2 warm up (SGD's momentum buffers appear in step 1's outputs), as in fit
    assert r.per_step[0]["compiles"] >= 1 and all(s["compiles"] == 0 for s in r.per_step[2:])
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
    assert r.verdict == "READY" and "steps 3.. reused the compiled graph" in r.report
    assert "constant LR 0.001" in r.step


def test_recompile_names_the_changing_shape():
    r = xla_utils.check(ShapeEveryStep(), _digits(), verbose=False)
    f = _finding(r, "recompile")
    assert f.severity == "error" and not r.ok and r.verdict == "NOT READY (1 error)"
    assert all(s["compiles"] >= 1 for s in r.per_step)
    assert f.message.startswith("every step from 3 on compiled a new XLA graph"), f.message
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
    assert f.severity == "suggestion" and r.ok and r.verdict.startswith("READY, could be faster")
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
def test_trainer_check_uses_its_batch_loss_and_loader():
    from xla_utils import OneCycleTrainer

    t = OneCycleTrainer(_wide130(), nn.CrossEntropyLoss(), digits_dataset(256), batch_size=12,
                        optimizer="adam")
    r = t.check()
    assert r.batch_size == 12 and "padding" in r.codes
    assert "per-core batch 12 is not a multiple of 8" in _finding(r, "padding").message
    assert "input_bound" in r.codes and r.measurements["loader"]["samples_per_s"] > 0
    assert r.measurements["loss"] == "your loss"
    # Adam: two moments per parameter
    assert r.measurements["optimizer_state_bytes"] >= 2 * r.measurements["param_bytes"]


def test_trainer_check_and_debug_run_the_same_step_and_print_once(capsys):
    """check() and debug() both run the trainer's own step (its Adam with the one-cycle LR
    and momentum, 2 accumulated micro-batches): a graph that changes every step is flagged
    at the same steps by both, and each prints its report exactly once."""
    from xla_utils import OneCycleTrainer

    t = OneCycleTrainer(NewLengthEveryCall(), nn.CrossEntropyLoss(), digits_dataset(256),
                        batch_size=8, accum_steps=2)
    r = t.check(measure_loader=False)
    d = t.debug(steps=4)
    out = capsys.readouterr().out
    assert out.count("xla_utils.check for TPU v5e: NOT READY (1 error)") == 1, out
    assert out.count("debug_run on xla device") == 1, out
    print(r)  # the user's print(trainer.check()) / print(trainer.debug()): the verdict line only
    print(d)
    again = capsys.readouterr().out.splitlines()
    assert again == [str(r), str(d)] and "compiles per step" not in again[0], again
    assert again[1].startswith("xla_utils.debug on xla: 4 steps, compiles per step")
    assert "every step from 3 on compiled a new XLA graph" in _finding(r, "recompile").message
    assert "Steps [3, 4] compiled again after warm-up" in d.report
    assert r.step == d.step and r.step.startswith("the trainer's: AdamW, one-cycle LR")
    assert "2 micro-batches accumulated" in r.step
    late = [bool(s["compiles"]) for s in r.per_step[2:]]
    assert late == [bool(s["compiles"]) for s in d.per_step[2:]] == [True, True]
    assert repr(r).startswith("<ReadinessReport") and repr(d).startswith("<DebugReport")


def _rendered_cache(tmp_path, n: int = 24, size: int = 32):
    """A real uint8 cache built by build_cache from rendered images of three classes
    (a bright disc, a bright bar, noise), 40x48 before resizing."""
    from xla_utils import CachedImageDataset, build_cache

    rng = np.random.default_rng(0)
    yy, xx = np.mgrid[:40, :48]
    items = []
    for i in range(n):
        img = rng.integers(0, 90, (40, 48, 3), dtype=np.uint8)
        c = i % 3
        if c == 0:
            img[(yy - 20) ** 2 + (xx - 24) ** 2 < 120] = 250
        elif c == 1:
            img[:, 20:28] = 250
        items.append((img, c))
    build_cache(items, tmp_path / "cache", size=size, variants=1, verbose=False)
    return CachedImageDataset(tmp_path / "cache")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_stock_resnet18_on_a_cache_is_ready_and_check_agrees_with_debug(tmp_path, capsys):
    """The issue-36 newcomer: a stock torchvision ResNet-18 fed from a CachedImageDataset,
    trained once (its BatchNorm counters are no longer 0), then check() and debug(). The
    64-wide layers' padding is a suggestion, the loader's fix fits a cache, and check's
    compile counts per step are debug's: steps 1-2 warm up, steps 3.. reuse the graph."""
    torchvision = pytest.importorskip("torchvision")
    from xla_utils import OneCycleTrainer

    data = _rendered_cache(tmp_path)
    t = OneCycleTrainer(torchvision.models.resnet18(num_classes=3), nn.CrossEntropyLoss(), data,
                        batch_size=8)
    t.fit()  # on this CPU's plain torch: the quick first run a user makes
    assert all(int(m.num_batches_tracked) > 0 for m in t.model.modules()
               if isinstance(m, nn.BatchNorm2d))
    capsys.readouterr()
    r = t.check()
    d = t.debug(steps=4)
    out = capsys.readouterr().out
    assert "NOT READY" not in r.verdict and r.ok, r.report
    assert "recompile" not in r.codes and "Steps 3.. reused the compiled graph" in d.report
    assert [s["compiles"] for s in r.per_step] == [s["compiles"] for s in d.per_step], (
        r.per_step, d.per_step)
    assert not any(s["compiles"] for s in r.per_step[2:])
    assert _finding(r, "padding").severity == "suggestion"
    for f in r.findings:
        if f.code == "input_bound":
            assert f.severity in ("suggestion", "info") and "build a uint8 cache" not in f.fix, f
    assert r.measurements["loader"]["kind"] == "cache"
    assert out.count("xla_utils.check for TPU v5e: READY") == 1 and out.count("debug_run on") == 1


def test_fit_check_stops_before_training_on_errors(capsys):
    from xla_utils import OneCycleTrainer

    t = OneCycleTrainer(ShapeEveryStep(), nn.CrossEntropyLoss(), digits_dataset(256), batch_size=16)
    before = {k: v.clone() for k, v in t.model.state_dict().items()}
    with pytest.raises(ReadinessError, match="recompile") as info:
        t.fit(check=True, simulate=1)
    assert "recompile" in info.value.report.codes
    assert "xla_utils.check for TPU v5e: NOT READY" in capsys.readouterr().out
    assert all(torch.equal(v, before[k]) for k, v in t.model.state_dict().items())


def test_fit_check_passes_a_clean_model(capsys):
    from xla_utils import OneCycleTrainer

    t = OneCycleTrainer(_clean(), nn.CrossEntropyLoss(), digits_dataset(256), batch_size=16,
                        max_lr=1e-2, optimizer="sgd", epochs=2)
    h = t.fit(check=True, simulate=1)
    out = capsys.readouterr().out
    assert out.count("xla_utils.check for TPU v5e: READY") == 1 and len(h) == 2, out
    # check's "steps 3.. reused the compiled graph" is fit's: no compile after the first epoch
    assert "steps 3.. reused the compiled graph" in out and h[0]["compiles"] == h[1]["compiles"]


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
    assert not (_codes(r) & {"recompile", "host_sync", "cpu_fallback", "dynamic_shape", "f64", "f16"}), r.report
    m = r.measurements
    # ResNet-18: ~1.8 GFLOPs (multiply-adds x 2 = 3.6 GFLOPs) forward per 224x224 image
    assert 8e9 < m["flops"] / 8 < 13e9, m["flops"]
    assert 11_000_000 < m["param_bytes"] / 4 < 12_000_000
    assert _finding(r, "memory").severity == "info"
    assert set(r.codes) <= set(CODES)
