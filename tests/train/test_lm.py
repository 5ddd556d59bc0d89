"""A decoder-only language model (tests/fixtures/tiny_gpt.py) trained by OneCycleTrainer on
byte-level tokens of the standard library's sources: tuple and dict batches of int64 token
tensors, the loss computed by the model itself through ``train_step``, on one XLA:CPU device
and on 8 simulated cores (the "spawn" strategy)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from xla_utils import OneCycleTrainer
from xla_utils.step.inputs import InputRefused, inspect_inputs

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures"))
from tiny_gpt import GPT, TokenWindows, lm_step, stdlib_bytes  # noqa: E402

BLOCK = 32


def _data(as_dict: bool, n: int = 24_000):
    return TokenWindows(stdlib_bytes(n), BLOCK, as_dict=as_dict)


def _model():
    return GPT(block=BLOCK, d=32, layers=1, heads=2)


def test_token_samples_are_fed_unchanged():
    for as_dict in (False, True):
        spec = inspect_inputs(_data(as_dict, 12_000), "train_data")
        assert spec.layout is None and spec.dtype == "int64" and spec.shape == (BLOCK,), spec
        assert spec.keys == (("input_ids", "labels") if as_dict else None), spec
        assert "passed to the model unchanged" in spec.describe(flip=True)


def test_dict_without_known_input_key_is_refused_with_the_keys():
    class Odd(torch.utils.data.Dataset):
        def __len__(self):
            return 4

        def __getitem__(self, i):
            return {"ids": torch.zeros(4, dtype=torch.int64), "labels": torch.zeros(4)}

    with pytest.raises(InputRefused, match=r"\['ids', 'labels'\].*input_ids"):
        inspect_inputs(Odd(), "train_data")


@pytest.mark.parametrize("as_dict,simulate", [(False, 1), (True, 8)])
def test_gpt_trains_on_token_batches(as_dict, simulate):
    data = _data(as_dict)
    first = data[0]
    x0 = first["input_ids"] if as_dict else first[0]
    with torch.no_grad():
        torch.manual_seed(0)
        start = float(_model()(x0[None], (first["labels"] if as_dict else first[1])[None]))
    t = OneCycleTrainer(_model, torch.nn.CrossEntropyLoss(), data, train_step=lm_step,
                        batch_size=8, epochs=1, max_lr=3e-3, log_every=4)
    h = t.fit(simulate=simulate)
    assert h.world_size == simulate and h.global_batch == 8 * simulate, h
    loss = h[-1]["train_loss"]
    # untrained: ln(256) = 5.55 per byte; one short epoch of bytes of Python source gets well below
    assert start > 5.0 and loss < start - 0.5, (start, loss)
    # the trained weights came back into the trainer's model
    with torch.no_grad():
        after = float(t.model(x0[None], (first["labels"] if as_dict else first[1])[None]))
    assert after < start - 0.5, (start, after)
