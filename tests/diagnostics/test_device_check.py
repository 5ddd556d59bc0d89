"""trainer.check() on a notebook without a TPU and without torch_xla (a GPU notebook's stack;
here the CPU): the device's own report, the TPU part skipped with how to get it, nothing raised."""
from __future__ import annotations

import re
import subprocess
import sys
import textwrap

import pytest

NOTEBOOK = textwrap.dedent("""
    import torch
    from torch import nn
    import xla_utils
    from xla_utils import OneCycleTrainer

    torch.manual_seed(0)
    images = torch.randint(0, 256, (64, 16, 16, 3), dtype=torch.uint8)
    data = torch.utils.data.TensorDataset(images, torch.randint(0, 3, (64,)))

    def make_model():
        return nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                             nn.Linear(8, 3))

    def reads_the_loss(model, batch, loss_fn):  # a habit that stalls a GPU every step
        x, y = batch
        loss = loss_fn(model(x), y)
        if loss.item() > 1e9:
            print("diverged")
        return loss

    trainer = OneCycleTrainer(make_model, nn.CrossEntropyLoss(), data, batch_size=8, epochs=1,
                              max_lr=1e-2)
    report = trainer.check()
    print("RESULT", type(report).__name__, report.batch_size, report.step_s > 0,
          report.ceiling_s > 0, report.loader_samples_per_s > 0, report.host_reads_per_step)
    history = trainer.fit(check=True)
    print("TRAINED", len(history))
    other = OneCycleTrainer(make_model, nn.CrossEntropyLoss(), data, batch_size=8, epochs=1,
                            max_lr=1e-2, train_step=reads_the_loss)
    print("READS", other.check().host_reads_per_step)
""")


@pytest.mark.timeout(300)
def test_check_without_torch_xla_answers_for_this_device(tmp_path, no_torch_xla_env):
    p = subprocess.run([sys.executable, "-c", NOTEBOOK], cwd=tmp_path, capture_output=True,
                       text=True, env=no_torch_xla_env, timeout=280)
    out = p.stdout
    assert p.returncode == 0, (out[-3000:], p.stderr[-3000:])
    title = re.findall(r"^xla_utils\.check for the CPU \(torch\), 1 process: (GOOD|could be faster.*)$",
                       out, re.M)
    assert len(title) == 3, out  # check(), fit(check=True), the second trainer's check()
    assert re.search(r"step: [\d.]+ ms as fit feeds it, [\d.]+ ms on a batch already on the device "
                     r"\(the no-loader ceiling; fed/ceiling [\d.]+x\), batch 8 per process", out)
    assert re.search(r"loader: [\d,.]+ samples/s alone; the step takes [\d,.e+]+", out)
    assert "plan: cpu: fp32 (auto)" in out
    assert out.count("xla_utils.check for a TPU: skipped, torch_xla is not installed here "
                     "(xla_utils.setup(install=True)") == 3
    assert "XLAUnavailableError" not in p.stderr
    assert "RESULT DeviceCheckReport 8 True True True 0.0" in out
    assert "TRAINED 1" in out
    # the loss read in the step is counted (one .item() per step): a GPU would wait there
    assert "READS 1.0" in out


def test_xla_utils_check_without_torch_xla_says_what_it_needs(tmp_path, no_torch_xla_env):
    """The function form (a TPU measurement on XLA:CPU) cannot run without torch_xla: its
    error says why, the fix, and what answers on a GPU instead."""
    code = ("import torch, xla_utils\n"
            "try:\n"
            "    xla_utils.check(torch.nn.Linear(4, 2), (torch.randn(8, 4), torch.randint(0, 2, (8,))))\n"
            "except xla_utils.runtime.XLAUnavailableError as e:\n"
            "    print('REFUSED', e)\n")
    p = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                       env=no_torch_xla_env, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "REFUSED xla_utils.check measures a TPU run on an XLA:CPU device, so it needs torch_xla" in p.stdout
    assert "xla_utils.setup(install=True)" in p.stdout and "trainer.check() reports on the GPU" in p.stdout


def test_findings_of_a_t4_run_that_waits_on_its_loader_host_and_memory():
    """The report's rules on numbers a T4 x2 notebook could measure (no GPU needed to judge
    them): a step held back by its loader, a step that reads the loss on the host beyond the
    fp16 scaler's one read, and memory nearly full; each finding with its fix."""
    from xla_utils.diagnostics import device_check

    plan = ("cuda Tesla T4 (sm_75, 15 GiB): fp16 autocast + GradScaler (auto), channels_last "
            "(auto), pinned host buffers, copied on a side stream")
    meas = {"step_s": 0.30, "ceiling_s": 0.10, "loader_samples_per_s": 250.0, "plan": plan,
            "host_reads": 2.0, "device": "Tesla T4 (cuda:0)", "device_type": "cuda",
            "peak_memory": 15 * 2**30, "total_memory": 16 * 2**30}
    r = device_check._report(meas, batch_size=64, replicas=2)
    assert str(r) == "xla_utils.check for Tesla T4 (cuda:0) x2: could be faster (3 suggestions)"
    text = r.report
    assert "step: 300.0 ms as fit feeds it, 100.0 ms on a batch already on the device" in text
    assert "fed/ceiling 3.00x), batch 64 per GPU" in text and "loader: 250 samples/s alone; the step takes 640" in text
    assert "input-bound: " in text and "num_workers=" in text
    assert "host reads: 2 per step (.item()" in text
    assert "memory: the step peaks at 15.00 GiB of 16.00 GiB (94%)" in text and "(6% headroom)" in text
    fine = dict(meas, step_s=0.105, host_reads=1.0, peak_memory=8 * 2**30)  # the scaler's one read
    assert device_check._report(fine, batch_size=64, replicas=2).verdict == "GOOD"
