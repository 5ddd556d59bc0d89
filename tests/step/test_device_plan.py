"""xla_utils.step.device_plan: precision, layout and host buffers per device, decided once per run.

On this CPU-only machine: precision resolution for the properties of a T4, P100, V100, A100
and H100; refusals before any device time; the real GradScaler on the CPU (fp16 autocast)
skipping and counting steps inside fit(); the first line; the scaler in checkpoints. The
tests marked for CUDA run on a GPU machine.
"""
from __future__ import annotations

import math
import os
import re
from functools import partial

import numpy as np
import pytest
import torch
from torch import nn

from helpers import pooled_cnn

from xla_utils import OneCycleTrainer, lr_find, runtime
from xla_utils.step.device_plan import (DevicePlan, DeviceRequest, PrecisionError, _forward_fails,
                                        check_before_launch, resolve_precision)
from xla_utils.env.gpu import cuda_available, parse_nvidia_smi
from xla_utils.train.trainer import TrainerConfig

# nvidia-smi rows of the GPUs users train on (Kaggle: T4 x2, P100; Colab: T4) and bigger ones
GPUS = {
    "T4": "0, GPU-1, Tesla T4, 7.5, 15360",
    "P100": "0, GPU-2, Tesla P100-PCIE-16GB, 6.0, 16384",
    "V100": "0, GPU-3, Tesla V100-SXM2-16GB, 7.0, 16384",
    "A100": "0, GPU-4, NVIDIA A100-SXM4-40GB, 8.0, 40960",
    "H100": "0, GPU-5, NVIDIA H100 80GB HBM3, 9.0, 81559",
}


@pytest.mark.parametrize("gpu,auto", [("T4", "fp16"), ("P100", "fp16"), ("V100", "fp16"),
                                      ("A100", "bf16"), ("H100", "bf16")])
def test_auto_precision_follows_the_compute_capability(gpu, auto):
    facts = parse_nvidia_smi(GPUS[gpu])[0]
    cc, name = facts.compute_capability, facts.describe()
    assert resolve_precision("auto", "cuda", cc, name) == auto
    assert resolve_precision("fp16", "cuda", cc, name) == "fp16"  # forced: kept
    assert resolve_precision("fp32", "cuda", cc, name) == "fp32"
    if auto == "bf16":
        assert resolve_precision("bf16", "cuda", cc, name) == "bf16"
    else:  # no bf16 matrix units: refused, with the GPU and the fix named
        with pytest.raises(PrecisionError, match=rf"{re.escape(name)}.*{cc[0]}\.{cc[1]}.*'auto'"):
            resolve_precision("bf16", "cuda", cc, name)


def test_precision_on_xla_and_cpu():
    # XLA: today's behaviour (float32 unless bf16 is asked); no fp16 on a TPU
    assert resolve_precision("auto", "xla") == "fp32"
    assert resolve_precision("bf16", "xla") == "bf16"
    assert resolve_precision("fp32", "xla") == "fp32"
    with pytest.raises(PrecisionError, match="TPU.*bfloat16"):
        resolve_precision("fp16", "xla")
    assert resolve_precision("auto", "cpu") == "fp32"
    assert resolve_precision("bf16", "cpu") == "bf16"  # precision="bf16" on the CPU autocasts
    with pytest.raises(ValueError, match="needs the compute capability"):
        resolve_precision("auto", "cuda")
    with pytest.raises(ValueError, match="precision must be one of"):
        resolve_precision("half", "cpu")


def test_config_precision_fields():
    assert TrainerConfig().precision == "auto" and TrainerConfig().channels_last == "auto"
    with pytest.warns(DeprecationWarning, match=r"bf16=True is deprecated: use precision='bf16'"):
        c = TrainerConfig(bf16=True)
    assert c.optim.precision == "bf16"  # bf16=True is precision="bf16"
    assert TrainerConfig(precision="fp16", channels_last=False).precision == "fp16"
    with pytest.raises(ValueError, match="bf16=True and precision='fp16' disagree"), \
            pytest.warns(DeprecationWarning):
        TrainerConfig(bf16=True, precision="fp16")
    with pytest.raises(ValueError, match="precision must be one of"):
        TrainerConfig(precision="mixed")
    with pytest.raises(ValueError, match="channels_last must be 'auto', True or False"):
        TrainerConfig(channels_last=1)
    with pytest.raises(ValueError, match="bf16 must be True or False"):
        TrainerConfig(bf16="yes")


class Counting(nn.Module):
    """A linear model that counts its forward calls (to show nothing ran)."""

    def __init__(self):
        super().__init__()
        self.fc, self.calls = nn.Linear(8, 2), 0

    def forward(self, x):
        self.calls += 1
        return self.fc(x)


def _pairs(n: int = 64):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 8, generator=g)
    return torch.utils.data.TensorDataset(x, (x[:, 0] > 0).long())


def test_fp16_on_xla_is_refused_before_any_device_time():
    data = _pairs()
    t = OneCycleTrainer(Counting(), nn.CrossEntropyLoss(), data, batch_size=16, precision="fp16")
    with pytest.raises(PrecisionError, match="precision='fp16' is for GPUs"):
        t.fit(simulate=1)
    with pytest.raises(PrecisionError, match="precision='fp16' is for GPUs"):
        t.predict(data, simulate=1)
    with pytest.raises(PrecisionError, match="precision='fp16' is for GPUs"):
        t.evaluate(data, simulate=1)
    with pytest.raises(PrecisionError, match="precision='fp16' is for GPUs"):
        lr_find(t.model, nn.CrossEntropyLoss(), data, 16, simulate=1, precision="fp16")
    assert t.model.calls == 0  # not even the host's label check ran a forward


def test_bf16_is_refused_on_a_t4_host_before_cuda_is_touched(tmp_path, monkeypatch):
    # A T4 host as the notebook process sees it: torch reports CUDA (without initialising
    # it) and nvidia-smi answers. This machine has no GPU, so both are stood in for.
    exe = tmp_path / "nvidia-smi"
    exe.write_text(f"#!/bin/sh\necho '{GPUS['T4']}'\necho '{GPUS['T4'].replace('0, GPU-1', '1, GPU-6')}'\n")
    exe.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(PrecisionError, match=r"Tesla T4 \(sm_75, 15 GiB\), compute capability 7\.5"):
        check_before_launch("bf16", runtime.resolve())
    for fine in ("auto", "fp16", "fp32"):
        check_before_launch(fine, runtime.resolve())  # nvidia-smi is not even asked: only bf16 can be refused
    t = OneCycleTrainer(Counting(), nn.CrossEntropyLoss(), _pairs(), batch_size=16,
                        precision="bf16")
    with pytest.raises(PrecisionError, match="precision='bf16' on"):
        t.fit()
    assert t.model.calls == 0


def _images(n: int = 32, size: int = 8):
    """uint8 HWC images whose class is the brighter half (learnable, real pixels)."""
    rng = np.random.default_rng(0)
    x = rng.integers(0, 128, (n, size, size, 3), dtype=np.uint8)
    y = np.arange(n) % 2
    x[y == 1, :, : size // 2] += 100
    return torch.utils.data.TensorDataset(torch.from_numpy(x), torch.from_numpy(y))


_cnn = partial(pooled_cnn, seed=0)


def test_first_line_reports_precision_layout_and_buffers(capsys):
    data = _images()
    t = OneCycleTrainer(_cnn(), nn.CrossEntropyLoss(), data, batch_size=8, max_lr=1e-2,
                        channels_last=True, log_every=2)
    h = t.fit()
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("1 process x 8 per process = 8 global batch; AdamW, max_lr")
    assert ("; cpu: fp32 (auto), channels_last (asked), pageable host buffers (no CUDA), "
            "DataLoader with 0 worker processes") in first
    # the replica's model ran channels_last (its weights come back in that format) ...
    assert h.state_dict["0.weight"].is_contiguous(memory_format=torch.channels_last)
    assert t.model[0].weight.is_contiguous()  # ... the trainer's model keeps its own
    assert all("skipped_steps" not in r for r in h.epochs)  # no scaler, no count
    t.predict(data)
    assert capsys.readouterr().out.splitlines()[0] == (
        "predict on cpu: fp32 (auto), channels_last (asked), pageable host buffers (no CUDA), "
        "DataLoader with 0 worker processes")
    OneCycleTrainer(_cnn(), nn.CrossEntropyLoss(), data, batch_size=8).evaluate(data)
    assert "NCHW (channels_last='auto' is for CUDA)" in capsys.readouterr().out.splitlines()[0]


def test_channels_last_auto_keeps_nchw_for_a_model_that_views_its_features():
    class Views(nn.Module):  # LeNet style: .view() of a convolution's output
        def __init__(self):
            super().__init__()
            self.conv, self.fc = nn.Conv2d(3, 4, 3), nn.Linear(4 * 6 * 6, 2)

        def forward(self, x):
            return self.fc(self.conv(x).view(x.shape[0], -1))

    m = Views().train().to(memory_format=torch.channels_last)
    why = _forward_fails(m, (3, 8, 8), torch.device("cpu"))
    assert why is not None and "view size is not compatible" in why
    assert m.training  # modes restored
    m = Views().to(memory_format=torch.channels_last)
    m.forward = lambda x: m.fc(torch.flatten(m.conv(x), 1))  # .flatten copies as needed
    assert _forward_fails(m, (3, 8, 8), torch.device("cpu")) is None


def _fp16_trainer(data, overflow, **kw):
    """A trainer whose train_step overflows the fp16 gradients when ``overflow()`` says so
    (the loss keeps its value: only the backward reaches inf)."""
    def step(model, batch, loss_fn):
        x, y = batch
        out = model(x)
        loss = loss_fn(out, y)
        if overflow():  # + 0.0, whose gradient 1e30 x the scale overflows in fp16
            loss = loss + (out.float() - out.float().detach()).sum() * 1e30
        return loss

    return OneCycleTrainer(nn.Linear(8, 2), nn.CrossEntropyLoss(), data, batch_size=16,
                           epochs=2, max_lr=1e-2, precision="fp16", train_step=step, **kw)


def test_fp16_scaler_skips_inf_steps_counts_them_and_keeps_the_schedule():
    data = _pairs()  # 4 steps per epoch
    calls = []

    def overflow():
        calls.append(1)
        return len(calls) == 2  # the second step of the run

    h = _fp16_trainer(data, overflow).fit()
    assert [r["skipped_steps"] for r in h.epochs] == [1, 0]
    assert all(math.isfinite(r["train_loss"]) for r in h.epochs) and not h.warnings
    # a skipped step still advances the one-cycle schedule: the same LRs as an fp32 run
    ref = OneCycleTrainer(nn.Linear(8, 2), nn.CrossEntropyLoss(), data, batch_size=16, epochs=2,
                          max_lr=1e-2, precision="fp32").fit()
    assert [r["lr_last"] for r in h.epochs] == [r["lr_last"] for r in ref.epochs]
    assert all("skipped_steps" not in r for r in ref.epochs)


def test_fp16_run_whose_every_step_overflows_is_not_silent():
    data = _pairs()
    t = _fp16_trainer(data, lambda: True)
    before = t.model.weight.detach().clone()
    with pytest.warns(RuntimeWarning, match=r"skipped 4 of 4 optimizer steps"):
        h = t.fit()
    assert [r["skipped_steps"] for r in h.epochs] == [4, 4]
    assert torch.equal(t.model.weight, before)  # no step was taken: the warning says so


def test_scaler_state_is_checkpointed_and_resumed(tmp_path):
    data = _pairs()
    first_epoch = {"on": True}

    t = _fp16_trainer(data, lambda: first_epoch["on"], checkpoint_dir=tmp_path / "a")
    with pytest.warns(RuntimeWarning, match="skipped"):
        t.fit()
    ckpts = sorted((tmp_path / "a").glob("epoch_*.pt"))
    one = torch.load(ckpts[0], weights_only=False)
    # 4 skipped steps halved the scale 4 times: 65536 -> 4096
    assert one["scaler"]["scale"] == 4096.0 and one["history"][0]["skipped_steps"] == 4
    first_epoch["on"] = False
    t2 = _fp16_trainer(data, lambda: first_epoch["on"], checkpoint_dir=tmp_path / "b")
    h = t2.fit(resume=ckpts[0])
    assert [r["skipped_steps"] for r in h.epochs] == [4, 0]
    two = torch.load(sorted((tmp_path / "b").glob("epoch_002-*.pt"))[0], weights_only=False)
    assert two["scaler"]["scale"] == 4096.0  # resumed (a fresh scaler would be at 65536)


@pytest.mark.filterwarnings("ignore:LR finder")
def test_lr_find_and_debug_on_the_torch_backend_use_the_plan():
    from xla_utils import runtime
    from xla_utils.diagnostics.debug import _debug_steps
    from xla_utils.step.inputs import inspect_inputs

    data = _images()
    seen = []
    m = _cnn()
    m[0].register_forward_hook(lambda mod, args, out: seen.append(
        (out.dtype, args[0].is_contiguous(memory_format=torch.channels_last))))
    w = m[0].weight.detach().clone()
    res = lr_find(m, nn.CrossEntropyLoss(), data, 8, num_it=6, precision="fp16",
                  channels_last=True, show_progress=False)
    assert res.backend == "torch" and len(res.lrs) == 6 and np.isfinite(res.losses).all()
    assert set(seen) == {(torch.float16, True)}  # fp16 autocast, channels_last batches
    assert m[0].weight.is_contiguous() and torch.equal(m[0].weight, w)  # the caller's model as it was
    spec = inspect_inputs(data, "data")
    rep = runtime.launch(lambda: _debug_steps(  # debug_run's steps on the torch backend, in-process
        _cnn(), nn.CrossEntropyLoss(), data, lambda net, b, f: f(net(b[0]), b[1]),
        lambda x: spec.prepare(x, (0.5,) * 3, (0.5,) * 3, flip=False), optimizer="sgd", lr=1e-3,
        batch_size=8, steps=3, device=DeviceRequest("fp16", True, spec)))
    assert rep.steps == 3 and all(math.isfinite(v) for v in rep.losses)
    assert "(cpu: fp16 autocast + GradScaler (asked), channels_last (asked)" in rep.report


def test_plan_on_the_cpu_is_plain_fp32():
    model = _cnn()
    plan = DevicePlan.build(DeviceRequest(), torch.device("cpu"), model)
    assert (plan.precision, plan.channels_last, plan.pinned, plan.scaler) == ("fp32", False, False, None)
    assert plan.take_skipped() is None and plan.scaler_state() is None
    assert plan.memory_format == torch.contiguous_format and model[0].weight.is_contiguous()
    x = torch.zeros(2, 3, 4, 4)
    assert plan.layout(x) is x


@pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU")
def test_plan_on_this_gpu():
    from xla_utils.env.gpu import cuda_facts

    dev = torch.device("cuda")
    facts = cuda_facts(dev)
    model = _cnn().to(dev)
    spec = __import__("xla_utils.step.inputs", fromlist=["inspect_inputs"]).inspect_inputs(_images(), "d")
    plan = DevicePlan.build(DeviceRequest(inputs=spec), dev, model)
    assert plan.precision == ("bf16" if facts.compute_capability >= (8, 0) else "fp16")
    assert plan.channels_last and plan.pinned and model[0].weight.is_contiguous(
        memory_format=torch.channels_last)
    assert (plan.scaler is not None) == (plan.precision == "fp16")
    assert plan.words.startswith(f"cuda {facts.describe()}: ")
