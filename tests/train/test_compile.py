"""xla_utils.train.torch_compile: ``compile=`` on the torch backend (issue 45), on the CPU.

The fast tests run dynamo and AOTAutograd without inductor's code generation
(``XLA_UTILS_COMPILE_BACKEND=aot_eager``: the guards, graphs and recompiles the trainer's
promises are about, without a C++ compiler's minutes), one compiled fit shared through a
module fixture. The slow ones use inductor itself: the same losses as eager, and a second
fresh process that compiles from the persistent cache (its own hit counters). GPU figures
come from a GPU machine (scripts/bench_gpu.py --compile).
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters

from xla_utils import OneCycleTrainer
from xla_utils.train.torch_compile import (BACKEND_ENV, CompileError, graph_breaks,
                                           graph_breaks_report)
from xla_utils.train.trainer import TrainerConfig

ROOT = Path(__file__).resolve().parents[2]


class Images:
    """``n`` random uint8 8x8 RGB images in 3 classes (HWC, as a cache reader returns)."""

    def __init__(self, n: int, seed: int = 0):
        g = np.random.default_rng(seed)
        self.x = g.integers(0, 255, (n, 8, 8, 3), dtype=np.uint8)
        self.y = g.integers(0, 3, n)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return torch.from_numpy(self.x[i]), int(self.y[i])


def _cnn() -> nn.Module:
    torch.manual_seed(0)  # a few hundred parameters; batch norm: train and eval differ
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 3))


# 44 = 5 batches of 8 and a ragged 4 (dropped); 20 = 2 batches of 8 and a padded 4
TRAIN, VAL = Images(44), Images(20, seed=1)


def _fit(tmp: Path | None = None, resume: Path | None = None, cores: int | str = "all", **kw):
    kw = dict(dict(batch_size=8, eval_batch_size=8, epochs=3, max_lr=1e-2), **kw)
    t = OneCycleTrainer(_cnn(), nn.CrossEntropyLoss(), TRAIN, VAL, checkpoint_dir=tmp, **kw)
    return t, t.fit(resume=resume, cores=cores)


def _same(h, h0, keys=("train_loss", "val_loss", "accuracy", "lr_last"), rtol=1e-4):
    for key in keys:
        np.testing.assert_allclose([r[key] for r in h.epochs], [r[key] for r in h0.epochs],
                                   rtol=rtol, err_msg=key)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One eager and one compiled (aot_eager) 3-epoch fit, and their predictions."""
    saved = os.environ.get(BACKEND_ENV)
    os.environ[BACKEND_ENV] = "aot_eager"
    tmp = tmp_path_factory.mktemp("compiled")
    try:
        eager, h0 = _fit()
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            t, h = _fit(tmp / "ckpt", compile=True)
            graphs = counters["stats"]["unique_graphs"]
            preds = t.predict(VAL)  # batches of 8, the last padded: validation's graph
            graphs = counters["stats"]["unique_graphs"] - graphs
        yield dict(eager=eager, h0=h0, t=t, h=h, out=out.getvalue(), tmp=tmp, preds=preds,
                   predict_graphs=graphs,
                   eager_preds=eager.predict(VAL))
    finally:
        if saved is None:
            os.environ.pop(BACKEND_ENV, None)
        else:
            os.environ[BACKEND_ENV] = saved


def test_compile_option_is_checked_and_refused_on_xla():
    assert TrainerConfig().compile is False
    assert TrainerConfig(compile=" Max-Autotune").compile == "max-autotune"
    assert TrainerConfig(compile=None).compile is False
    with pytest.raises(ValueError, match="did you mean 'reduce-overhead'"):
        TrainerConfig(compile="reduce-overhed")
    with pytest.raises(ValueError, match="compile must be True, False or a torch.compile mode"):
        TrainerConfig(compile=1)
    t = OneCycleTrainer(_cnn(), nn.CrossEntropyLoss(), TRAIN, batch_size=8)
    # simulated XLA cores: refused in the calling process, before any interpreter starts
    with pytest.raises(CompileError, match="already one compiled XLA graph.*compile=False"):
        t.fit(simulate=2, compile=True)
    with pytest.raises(CompileError, match="XLA"):
        t.predict(VAL, simulate=2, compile="default")


def test_compiled_fit_equals_eager_with_a_ragged_tail(runs):
    h0, h = runs["h0"], runs["h"]
    _same(h, h0)
    for k, v in runs["eager"].model.state_dict().items():
        torch.testing.assert_close(runs["t"].model.state_dict()[k], v, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(runs["preds"], runs["eager_preds"], rtol=1e-4, atol=1e-6)


def test_compiles_do_not_grow_after_the_first_epoch(runs):
    h = runs["h"]
    compiles = [r["compiles"] for r in h.epochs]
    assert compiles[0] >= 2 and compiles == [compiles[0]] * 3  # train + validation graphs
    assert h.epochs[0]["compile_seconds"] > 0 and h.epochs[1]["compile_seconds"] < 0.5
    assert not h.warnings
    first = runs["out"].splitlines()[0]
    assert "torch.compile backend 'aot_eager'" in first, first
    assert f"{compiles[0]} compiles" in runs["out"] and "s compiling" in runs["out"]
    assert "torch.compile (default)" in str(h)
    assert all("compiles" not in r for r in runs["h0"].epochs)  # eager: nothing reported
    assert runs["predict_graphs"] == 0  # predict's padded batches reuse validation's graph


def test_checkpoints_load_into_an_uncompiled_model(runs):
    ckpt_dir = runs["tmp"] / "ckpt"
    (last,) = sorted(ckpt_dir.glob("epoch_003-*.pt"))
    state = torch.load(last, weights_only=False)["model"]
    assert not any("_orig_mod" in k for k in state)
    plain = _cnn()
    plain.load_state_dict(state)  # strict
    plain.load_state_dict(torch.load(ckpt_dir / "final.pt"))
    assert (ckpt_dir / "inductor_cache").is_dir()  # compile_cache="auto": beside the checkpoints


def test_a_recompile_after_the_first_epoch_is_warned_once_with_its_cause(monkeypatch):
    monkeypatch.setenv(BACKEND_ENV, "aot_eager")

    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.net, self.scale = _cnn(), 1.0

        def forward(self, x):
            return self.net(x) * self.scale  # a Python float dynamo guards on

    steps = []

    def step(model, batch, loss_fn):
        steps.append(1)
        if len(steps) == 6:  # the second epoch's first step
            model.scale = 2.0
        x, y = batch
        return loss_fn(model(x), y)

    t = OneCycleTrainer(Scaled(), nn.CrossEntropyLoss(), TRAIN, batch_size=8, epochs=2,
                        max_lr=1e-2, train_step=step, compile=True)
    with pytest.warns(RuntimeWarning, match=r"epoch 2 compiled 1 new graph\(s\).*scale"):
        h = t.fit()
    assert h.epochs[1]["compiles"] == h.epochs[0]["compiles"] + 1
    assert len([w for w in h.warnings if "compiled" in w]) == 1


def test_check_reports_graph_breaks():
    class Breaks(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 2)

        def forward(self, x):
            if x.sum().item() > 0:  # a host read: dynamo breaks the graph here
                x = x * 2
            return self.lin(x)

    # in a fresh interpreter, as check() runs it (the notebook's fork stays usable for CUDA)
    text = graph_breaks_report(Breaks(), torch.ones(2, 4))
    # where (the class is sent by value: cloudpickle names its file <dynamic-code>) and why
    assert "breaks into 2 graphs" in text and "(forward): " in text and "item()" in text, text
    assert "one graph" in graph_breaks(nn.Linear(4, 2), torch.ones(2, 4))


_CHILD = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, sys.argv[2])
    from test_compile import TRAIN, _cnn
    from torch import nn
    from torch._dynamo.utils import counters
    from xla_utils import OneCycleTrainer
    h = OneCycleTrainer(_cnn(), nn.CrossEntropyLoss(), TRAIN, batch_size=8, epochs=1,
                        max_lr=1e-2, compile=True, compile_cache=sys.argv[1]).fit()
    print("RESULT", json.dumps(dict(
        fx_hit=counters["inductor"]["fxgraph_cache_hit"],
        fx_miss=counters["inductor"]["fxgraph_cache_miss"],
        aot_hit=counters["aot_autograd"]["autograd_cache_hit"],
        aot_miss=counters["aot_autograd"]["autograd_cache_miss"],
        loss=h.epochs[0]["train_loss"], compiles=h.epochs[0]["compiles"],
        seconds=h.epochs[0]["compile_seconds"])))
""")


def _child(folder: Path) -> dict:
    env = dict(os.environ, PJRT_DEVICE="CPU", PYTHONPATH=str(ROOT))
    env.pop(BACKEND_ENV, None)
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    p = subprocess.run([sys.executable, "-c", _CHILD, str(folder), str(Path(__file__).parent)],
                       capture_output=True, text=True, env=env, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    (line,) = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    return json.loads(line[7:])


@pytest.mark.slow
def test_a_fresh_process_compiles_from_the_persistent_cache(tmp_path):
    """inductor, two fresh processes on one compile_cache folder: the first misses and fills
    it, the second hits it (the caches' own counters, not timings); the same loss. The fits
    train without validation: its graph's C++ kernels added 4.5 s to the cold compile and
    nothing to what the cache is tested for."""
    cold = _child(tmp_path / "cache")
    assert cold["fx_miss"] > 0 and cold["aot_miss"] > 0 and cold["aot_hit"] == 0
    assert any((tmp_path / "cache" / "inductor").iterdir())
    warm = _child(tmp_path / "cache")
    assert warm["aot_hit"] > 0 and warm["aot_miss"] == 0 and warm["fx_hit"] > 0, warm
    assert warm["compiles"] == cold["compiles"]
    assert warm["loss"] == pytest.approx(cold["loss"], rel=1e-5)
    print(f"compile seconds: cold {cold['seconds']:.1f}, warm {warm['seconds']:.1f}")


@pytest.mark.slow
def test_inductor_fit_equals_eager(tmp_path):
    with warnings.catch_warnings():
        _, h0 = _fit()
        _, h = _fit(compile=True, compile_cache=tmp_path / "cache")
    np.testing.assert_allclose([r["train_loss"] for r in h.epochs],
                               [r["train_loss"] for r in h0.epochs], rtol=1e-3)
    np.testing.assert_allclose([r["val_loss"] for r in h.epochs],
                               [r["val_loss"] for r in h0.epochs], rtol=1e-3)
    assert len({r["compiles"] for r in h.epochs}) == 1 and not h.warnings


@pytest.mark.slow
def test_compiled_options_and_resume_keep_the_eager_promises(tmp_path, monkeypatch):
    """Accumulation, EMA, mixup with label smoothing and fp16 with its GradScaler (the CPU's
    fp16 autocast): the compiled run's records and EMA weights are eager's; a compiled run
    resumed from its first epoch's checkpoint ends where the uninterrupted one did."""
    monkeypatch.setenv(BACKEND_ENV, "aot_eager")
    opts = dict(accum_steps=2, ema=0.9, mixup=0.2, label_smoothing=0.1, precision="fp16",
                epochs=2)
    _, h0 = _fit(**opts)
    _, h = _fit(tmp_path / "run", compile=True, **opts)
    _same(h, h0, keys=("train_loss", "val_loss", "lr_last", "skipped_steps"), rtol=1e-3)
    for k, v in h0.ema_state_dict.items():
        torch.testing.assert_close(h.ema_state_dict[k], v, rtol=1e-3, atol=1e-4)
    (one,) = sorted((tmp_path / "run").glob("epoch_001-*.pt"))
    _, h2 = _fit(tmp_path / "resumed", resume=one, compile=True, **opts)
    _same(h2, h, keys=("train_loss", "val_loss", "lr_last"), rtol=1e-5)


@pytest.mark.slow
@pytest.mark.multicore
@pytest.mark.timeout(900)
def test_compiled_fit_on_two_replicas_equals_eager(monkeypatch):
    """Two CPU replicas over gloo (the path two GPUs take): DistributedDataParallel around
    each replica's compiled module averages the same gradients as eager."""
    monkeypatch.setenv(BACKEND_ENV, "aot_eager")
    monkeypatch.setenv("XLA_UTILS_CPU_REPLICAS", "2")
    _, h0 = _fit(epochs=2, accum_steps=2, batch_size=4)
    _, h = _fit(epochs=2, accum_steps=2, batch_size=4, compile=True)
    assert h.world_size == 2
    _same(h, h0, rtol=1e-4)
    assert len({r["compiles"] for r in h.epochs}) == 1 and not h.warnings
