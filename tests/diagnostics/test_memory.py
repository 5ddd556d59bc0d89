"""Per-device memory under "spawn", "spmd" and "fsdp": read from real XLA shardings on 8
XLA:CPU devices (FSDPv2 really wraps the model), the same sharding rules on paper, and the
check(tpu="v5e-8") memory line."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import xla_utils
from xla_utils.diagnostics.memory import llama_shapes, measure_memory, paper_memory
from xla_utils.diagnostics.findings import memory_finding
from xla_utils.env.tpus import TPUChip, tpu_devices

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures"))
from tiny_gpt import GPT, lm_step  # noqa: E402


def _tokens(rows: int, block: int):
    g = torch.Generator().manual_seed(0)
    return (torch.randint(0, 256, (rows, block), generator=g),
            torch.randint(0, 256, (rows, block), generator=g))


def _gpt50m():
    # 50.9M parameters: 4 blocks of width 1024
    return GPT(block=16, d=1024, layers=4, heads=8)


def test_paper_rules_for_1b_and_7b_on_v5e_8():
    one, seven = paper_memory(llama_shapes("1b"), 8), paper_memory(llama_shapes("7b"), 8)
    assert 1.23e9 < one.n_params < 1.24e9 and 6.73e9 < seven.n_params < 6.75e9
    for r in (one, seven):
        assert r["spawn"].states == r["spmd"].states == r.replicated_states
        assert r.replicated_states / 8 <= r["fsdp"].states <= r.replicated_states / 8 * 1.01
    v5e = 16 * 2**30 * 0.9
    assert one["spawn"].states > v5e > one["fsdp"].states      # 1B: only fsdp fits a v5e core
    assert seven["fsdp"].states < v5e < seven["spawn"].states  # 7B states fit under fsdp only
    assert "| fsdp | 8 |" in one.table()
    assert tpu_devices("v5e-8") == 8 and tpu_devices("v3-8") == 8 and tpu_devices("v4-8") == 4
    assert tpu_devices("v5e") is None


def test_bad_input_is_refused_before_any_process():
    x = _tokens(2, 8)
    with pytest.raises(ValueError, match="strategies"):
        measure_memory(GPT, x, strategies=["ddp"], train_step=lm_step)
    with pytest.raises(ValueError, match="fsdp_wrap"):
        measure_memory(GPT, x, fsdp_wrap=3.5, train_step=lm_step)
    with pytest.raises(ValueError, match="loss= .*train_step="):
        measure_memory(GPT, x)
    with pytest.raises(ValueError, match=r"fsdp_wrap=\['Layer'\] matches no module.*'Block'"):
        measure_memory(GPT(block=8, d=8, layers=1, heads=2), x, fsdp_wrap=["Layer"],
                       train_step=lm_step)
    with pytest.raises(ValueError, match="devices"):
        measure_memory(GPT, x, devices=0, train_step=lm_step)


@pytest.mark.slow
def test_small_gpt_under_each_strategy_read_from_shardings():
    block = 32

    def model():
        return GPT(block=block, d=64, layers=2, heads=4)

    r = measure_memory(model, _tokens(4, block), train_step=lm_step, fsdp_wrap=["Block"])
    shapes = [p.shape for p in model().parameters()]
    paper = paper_memory(shapes, 8)
    spawn, fsdp = r["spawn"], r["fsdp"]
    assert spawn.states == r.replicated_states == paper["spawn"].states      # nothing sharded
    spmd = r["spmd"]
    assert spmd.params == spmd.grads == spawn.params and spmd.optimizer == spawn.optimizer
    assert fsdp.params == fsdp.grads == paper["fsdp"].params < spawn.params / 7
    assert fsdp.optimizer == 2 * fsdp.params
    assert all(r.details[s]["shardings"] != ["replicated"] for s in ("fsdp",))
    # activations: the saved tensors of a real forward, per device (per-core batch 4 each)
    for s in ("spawn", "spmd", "fsdp"):
        assert r[s].activations > 0 and r.details[s]["activation_tensors"] > 10, r.details[s]
    # the same model, seed and global batch: the same first loss under every strategy
    losses = [r.details[s]["loss"] for s in ("spawn", "spmd", "fsdp")]
    assert max(losses) - min(losses) < 1e-4, losses
    assert "fsdp" in str(r) and "measured" in r.table()


@pytest.mark.slow
def test_fsdp_50m_states_per_device_at_most_an_eighth_plus_5_percent():
    r = measure_memory(_gpt50m, _tokens(1, 16), strategies=["fsdp"], train_step=lm_step,
                       fsdp_wrap=["Block"], timeout=1200)
    f = r["fsdp"]
    assert r.n_params >= 50_000_000, r.n_params
    assert f.states <= r.replicated_states / 8 * 1.05, (f, r.replicated_states)
    assert f.params == paper_memory([p.shape for p in _gpt50m().parameters()], 8)["fsdp"].params
    assert f.activations > 0


def test_check_names_fsdp_when_one_core_is_too_small():
    model = nn.Sequential(nn.Linear(64, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
                          nn.Linear(1024, 10))  # 1.1 M parameters: 4.3 MiB of weights
    from sklearn.datasets import load_digits

    d = load_digits()
    batch = (torch.tensor(d.data[:16], dtype=torch.float32) / 16, torch.tensor(d.target[:16]))
    r = xla_utils.check(model, batch, tpu="v5e-8", optimizer="adamw", verbose=False)
    f = next(f for f in r.findings if f.code == "memory")
    assert "Per device on 8 v5e devices" in f.message and 'strategy="fsdp"' in f.message, f
    assert f.severity == "info"
    # the same measured step against a chip with 4 MiB per core: fsdp is the fix, with its figure
    tiny = TPUChip("tiny", bf16_tflops=1, hbm_gib=4 / 1024, mxu=128, devices_per_chip=1)
    g = memory_finding(r.measurements, tiny)
    assert g.severity == "error" and "do not fit one core" in g.message, g
    assert g.fix.startswith('train with strategy="fsdp"') and "per device" in g.fix, g.fix
    one = memory_finding(dict(r.measurements, tpu_devices=None), tiny)
    assert "strategy" not in one.fix and "bfloat16" in one.fix


def test_state_and_activation_bytes_of_one_core_leave_the_model_as_it_was():
    from xla_utils.diagnostics.memory import activation_bytes, state_bytes

    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.BatchNorm1d(32), torch.nn.ReLU(),
                              torch.nn.Dropout(0.5), torch.nn.Linear(32, 4))
    net[0].weight.requires_grad_(False)  # frozen: no gradient, no optimizer state
    n, frozen = sum(p.numel() for p in net.parameters()), 16 * 32
    assert state_bytes(net, "adamw") == 4 * n + 3 * 4 * (n - frozen)
    assert state_bytes(net, "sgd") == 4 * n + 2 * 4 * (n - frozen)
    net.eval()
    x, y = torch.randn(2, 16), torch.tensor([0, 3])
    stats, rng = [b.clone() for b in net.buffers()], torch.get_rng_state()

    def step(m, batch, loss):
        return loss(m(batch[0]), batch[1])

    act = activation_bytes(net, x, y, step=step, loss=torch.nn.functional.cross_entropy,
                           batch_size=64)
    # saved for backward at 2 rows, scaled to 64: at least the [64, 32] activations kept
    # by BatchNorm, ReLU and Dropout (mask) and the [64, 16] input of nothing trainable
    assert 3 * 64 * 32 * 4 <= act <= 10 * 64 * 32 * 4
    assert all(torch.equal(a, b) for a, b in zip(stats, net.buffers()))  # BN stats restored
    assert not net.training and torch.equal(torch.get_rng_state(), rng)
    assert all(p.grad is None for p in net.parameters())
