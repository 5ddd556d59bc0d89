"""xla_utils.simulate.resident: what a live job keeps between calls, and the keys that
make a changed object travel again (host only: pickling and unpickling, no device)."""
from __future__ import annotations

import os
import pickle

import numpy as np
import pytest
import torch
from torch import nn

from helpers import digit_gray_images

from xla_utils import CachedImageDataset, build_cache
from xla_utils.simulate.resident import MIN_BYTES, CallPickler, load_call, resident_key


def _roundtrip(obj, store, held=()):
    payload, used = CallPickler.dumps(obj)
    new = {k: o for k, o in used.items() if k not in held}
    import cloudpickle

    return load_call(store, payload, cloudpickle.dumps(new) if new else None, tuple(used)), used


def test_weights_travel_once_and_every_change_gets_a_new_key():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 2))
    store: dict = {}
    got, used = _roundtrip(net, store)
    assert [k[0] for k in used] == ["tensor"]  # only the 32x64 weight (8 KB); the rest is small
    assert isinstance(got[0].weight, nn.Parameter) and got[0].weight.requires_grad
    torch.testing.assert_close(got[0].weight, net[0].weight)
    got2, used2 = _roundtrip(net, store, held=set(used))
    assert list(used2) == list(used)
    assert got2[0].weight is got[0].weight  # the job's object, not a new copy
    assert got2 is not got  # the structure is new every call

    key = resident_key(net[0].weight)
    assert resident_key(net[0].weight) == key
    net[0].weight.data[0, 0] += 1  # through .data: torch's version counter stays
    assert resident_key(net[0].weight) != key
    with torch.no_grad():
        net[0].weight.sub_(0)  # version bumped, content equal: same key
    assert resident_key(net[0].weight)[-1] == resident_key(net[0].weight.detach().clone())[-1]
    twin = net[0].weight.detach().clone()  # equal content, another tensor: another key
    assert resident_key(twin) != resident_key(net[0].weight)
    assert resident_key(torch.zeros(MIN_BYTES // 4 - 1)) is None  # small
    assert resident_key(torch.zeros(64, 64).t()) is None  # not contiguous: pickled as is


def test_tied_weights_stay_tied_and_the_store_keeps_only_the_last_call():
    big = nn.Parameter(torch.randn(40, 40))
    a, b = nn.Linear(40, 40), nn.Linear(40, 40)
    a.weight = b.weight = big
    store: dict = {}
    (ga, gb), used = _roundtrip((a, b), store)
    assert ga.weight is gb.weight and len(store) == 1
    other = torch.randn(50, 50)
    (g,), used2 = _roundtrip((other,), store, held=set(used))
    assert list(store) == list(used2)  # the first call's weight was dropped
    torch.testing.assert_close(g, other)
    payload, _ = CallPickler.dumps((big,))
    with pytest.raises(RuntimeError, match="does not hold the resident object"):
        load_call({}, payload, None, ())


def test_a_cache_is_kept_until_its_files_or_state_change(tmp_path):
    items = digit_gray_images(20)
    build_cache(items, tmp_path / "c", size=8, verbose=False)
    ds = CachedImageDataset(tmp_path / "c")
    key = resident_key(ds)
    assert key is not None and resident_key(ds) == key
    store: dict = {}
    (got,), used = _roundtrip((ds,), store)
    assert len(got) == 20 and store[key] is got
    (again,), _ = _roundtrip((ds,), store, held=set(used))
    assert again is got  # not reopened
    ds.epoch = 1
    assert resident_key(ds) != key
    ds.epoch = 0
    build_cache(items[:10], tmp_path / "c", size=8, verbose=False, overwrite=True)  # rebuilt
    assert resident_key(ds) != key
    assert len(pickle.loads(pickle.dumps(ds))) == 10
    os.remove(tmp_path / "c" / "labels.npy")
    assert resident_key(ds) is None  # unreadable: pickled with the call, the job names the problem


def test_loading_a_call_does_not_make_this_process_a_live_job():
    # Device copies are reused by host identity only in a live job, whose host tensors are
    # snapshots; here (in-process predict) the user's tensors change in place.
    from xla_utils.simulate.resident import in_live_job

    _roundtrip(nn.Linear(64, 32), {})
    assert not in_live_job()
