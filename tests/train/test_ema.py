"""Weight EMA on the device (xla_utils.train.ema) against timm's ``ModelEmaV3(use_warmup=True)``."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from helpers import digits_split, tiny_mlp

from xla_utils import OneCycleTrainer, runtime
from xla_utils.train.ema import DeviceEMA, ema_decay
from xla_utils.train.trainer import TrainerConfig

model_ema = pytest.importorskip("timm.utils.model_ema")

DECAY, STEPS = 0.9, 40  # the warm-up reaches 0.9 at step 32: both regimes are covered


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))


def test_decay_schedule_equals_timm():
    timm_ema = model_ema.ModelEmaV3(_net(), decay=0.999, use_warmup=True)
    for step in range(0, 3000, 7):
        assert ema_decay(0.999, step) == pytest.approx(timm_ema.get_decay(step), abs=1e-12)


def _train_with_ema(net):
    """SGD steps on XLA:CPU with the device EMA; the model and EMA states after each step."""
    def job(net):
        dev = runtime.device()
        ema = DeviceEMA(net, DECAY, 0, dev)
        model = net.to(dev)
        opt = torch.optim.SGD(model.parameters(), lr=0.3, momentum=0.9)
        g = torch.Generator().manual_seed(1)
        models, emas = [], []
        for _ in range(STEPS):
            x = runtime.to_device(torch.randn(16, 6, generator=g), dev)
            y = runtime.to_device(torch.randint(0, 3, (16,), generator=g), dev)
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            runtime.optimizer_step(opt)
            ema.update(model)
            runtime.sync()
            models.append({k: v.cpu() for k, v in model.state_dict().items()})
            emas.append({k: v.cpu() for k, v in ema.state_dict().items()})
        c = runtime.xla_counters()
        return models, emas, (c["compiles"], c["fallback_ops"])
    return runtime.launch(job, net, simulate=1, timeout=600)


@pytest.mark.timeout(600)
def test_device_ema_equals_timm_model_ema_v3():
    net = _net()
    models, emas, (compiles, fallbacks) = _train_with_ema(copy.deepcopy(net))
    assert not fallbacks, fallbacks  # the fused (torch._foreach_*) update stays on the device
    assert compiles <= 4, compiles  # first steps only: the decay is device data
    follower = copy.deepcopy(net)  # replays the XLA run's weights into timm's EMA
    timm_ema = model_ema.ModelEmaV3(follower, decay=DECAY, use_warmup=True)
    worst = 0.0
    for step, (m, e) in enumerate(zip(models, emas), 1):
        follower.load_state_dict(m)
        timm_ema.update(follower, step=step)
        for k, v in timm_ema.module.state_dict().items():
            if v.is_floating_point():
                worst = max(worst, float((e[k] - v).abs().max()))
            else:
                assert torch.equal(e[k], v), k
    assert worst < 1e-6, worst
    moved = float((models[-1]["0.weight"] - net.state_dict()["0.weight"]).abs().max())
    lag = float((emas[-1]["0.weight"] - models[-1]["0.weight"]).abs().max())
    assert moved > 1e-2 and lag > 1e-4  # it trained, and the EMA is not just the weights


def test_bad_decay_refused():
    for bad in (-0.1, 0.0, 1.0, 1.5, True, "0.99"):
        with pytest.raises(ValueError, match="ema is the EMA decay"):
            TrainerConfig(ema=bad)
    assert TrainerConfig(ema=0.999).ema == 0.999


@pytest.mark.multicore
@pytest.mark.timeout(600)
def test_trainer_ema_used_by_evaluate_saved_and_exact_on_resume(tmp_path):
    train, val = digits_split(n_val=200, n_train=600, shuffle=False)
    init = tiny_mlp(seed=0)
    kw = dict(batch_size=16, epochs=3, max_lr=5e-3, ema=0.99, seed=2,
              checkpoint_dir=str(tmp_path / "full"), keep_checkpoints=3)
    t = OneCycleTrainer(copy.deepcopy(init), nn.CrossEntropyLoss(), train, val, **kw)
    full = t.fit(simulate=2)
    assert set(full.ema_state_dict) == set(full.state_dict)
    assert not torch.equal(full.ema_state_dict["0.weight"], full.state_dict["0.weight"])
    # validation, evaluate and eval_weights() use the EMA weights
    assert t.eval_weights() is t.ema_state
    assert t.evaluate(val, simulate=2)["loss"] == pytest.approx(full[-1]["val_loss"], rel=1e-5)
    ckpt = torch.load(tmp_path / "full" / f"epoch_003-{full.run_id}.pt", weights_only=False)
    torch.testing.assert_close(ckpt["ema"]["0.weight"], full.ema_state_dict["0.weight"])
    # final.pt holds the weights predict uses (EMA); final_raw.pt the trained ones
    final = torch.load(tmp_path / "full" / "final.pt", weights_only=False)
    raw = torch.load(tmp_path / "full" / "final_raw.pt", weights_only=False)
    torch.testing.assert_close(final["0.weight"], full.ema_state_dict["0.weight"])
    torch.testing.assert_close(raw["0.weight"], full.state_dict["0.weight"])
    from xla_utils.train.checkpoint import model_with_weights  # predict(weights=<epoch file>)

    path = tmp_path / "full" / f"epoch_003-{full.run_id}.pt"
    assert torch.equal(model_with_weights(init, path).state_dict()["0.weight"],
                       ckpt["ema"]["0.weight"])
    kw["checkpoint_dir"] = str(tmp_path / "resumed")
    r = OneCycleTrainer(copy.deepcopy(init), nn.CrossEntropyLoss(), train, val, **kw)
    resumed = r.fit(simulate=2, resume=tmp_path / "full" / f"epoch_002-{full.run_id}.pt")
    for k, v in full.ema_state_dict.items():
        torch.testing.assert_close(resumed.ema_state_dict[k], v, rtol=1e-5, atol=1e-6)
    assert resumed[-1]["val_loss"] == pytest.approx(full[-1]["val_loss"], rel=1e-5)


_COPIES_SCRIPT = """
import sys
import torch
from torch import nn
from xla_utils import runtime
from xla_utils.train.ema import DeviceEMA

def job(with_ema):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    dev = runtime.device()
    ema = DeviceEMA(net, 0.9, 0, dev) if with_ema else None
    model = net.to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)  # as optimizer="sgd"
    x = runtime.to_device(torch.ones(4, 6), dev)
    for _ in range(3):  # the graph of the later steps: with the momentum buffers
        opt.zero_grad()
        model(x).sum().backward()
        runtime.optimizer_step(opt)
        if ema is not None:
            ema.update(model)
        runtime.sync()
    return runtime.backend()

print(runtime.launch(job, sys.argv[1] == "ema", simulate=1, timeout=200))
"""


def _step_parameter_copies(tmp_path, variant: str) -> int:
    """Copies of the step graph's inputs in the compiled training step (XLA:CPU, dumped
    HLO after optimizations) of a two-layer network, with or without its EMA."""
    import os
    import re
    import subprocess
    import sys

    from xla_utils.runtime.xla import fast_cpu_compile_flags

    folder = tmp_path / variant
    flags = fast_cpu_compile_flags(os.environ.get("XLA_FLAGS")) + f" --xla_dump_to={folder}"
    env = dict(os.environ, PJRT_DEVICE="CPU", XLA_FLAGS=flags)
    p = subprocess.run([sys.executable, "-c", _COPIES_SCRIPT, variant], env=env,
                       capture_output=True, text=True, timeout=240)
    assert p.returncode == 0 and p.stdout.split()[-1] == "xla", p.stderr[-3000:]
    modules = [f.read_text() for f in folder.glob("*cpu_after_optimizations.txt")]
    step = max(modules, key=lambda text: text.count(" parameter("))  # the step with momentum
    return len(re.findall(r" copy\(%p", step))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ema_update_adds_no_copies_to_the_step_graph(tmp_path):
    """The EMA's new values go to new buffers, with nothing aliased to its old ones: the
    compiled step copies no more of its inputs than the plain step. (Updated in place, or
    out of place with its old buffers donated, the EMA is aliased to an output of the
    same shape that is not its own, and XLA copies each EMA tensor twice per step.)"""
    plain = _step_parameter_copies(tmp_path, "plain")
    assert plain > 0  # the parameters and momentum buffers updated in place are copied
    assert _step_parameter_copies(tmp_path, "ema") == plain
