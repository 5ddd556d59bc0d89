"""CachedImageDataset on gs:// (xla_utils.cache.fetch: the bounded local copy) against a real
GCS emulator started by tests/conftest.py: exactly the local samples, a bounded folder, named errors."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from xla_utils.cache import build_cache
from xla_utils.cache.storage import Store, StorageError
from xla_utils.data import CachedImageDataset, ShardWindowSampler, iterate_batches


class Blobs:
    """40 small images whose pixels encode their index; label = index % 4."""

    def __len__(self):
        return 40

    def __getitem__(self, i):
        rng = np.random.default_rng(i)
        return rng.integers(0, 256, (12, 14, 3), dtype=np.uint8), i % 4


@pytest.fixture(scope="module")
def caches(gcs_emulator, tmp_path_factory):
    """(local folder, gs:// URL) of the same cache: 2 variants, 14 shards of 3 images (1 in the last)."""
    local = tmp_path_factory.mktemp("local") / "c"
    url = gcs_emulator()
    kw = dict(size=8, variants=2, shard_size=4 * 2 * 8 * 8 * 3, workers=1, verbose=False)
    build_cache(Blobs(), local, **kw)
    build_cache(Blobs(), url, **kw)
    return local, url


def folder_bytes(path) -> int:
    return sum(p.stat().st_size for p in path.iterdir() if p.is_file() and not p.name.startswith("."))


def test_gs_dataset_returns_exactly_the_local_samples_and_order(caches, tmp_path):
    local, url = caches
    a = CachedImageDataset(local)
    b = CachedImageDataset(url, local_cache=tmp_path / "copy")
    assert b.is_remote and not b.shard_aware and len(a) == len(b) == 40 and b.path == url
    assert b.ids == a.ids and np.array_equal(a.labels, b.labels) and b.classes == a.classes
    for i in (0, 17, 39):
        for v in (0, 1):
            assert np.array_equal(a.image(i, v), b.image(i, v))
    for epoch in (0, 1):
        pa = [(x.clone(), y.clone()) for x, y, _ in iterate_batches(a, 8, epoch=epoch, seed=3)]
        pb = [(x.clone(), y.clone()) for x, y, _ in iterate_batches(b, 8, epoch=epoch, seed=3)]
        assert len(pa) == len(pb) == 5
        for (xa, ya), (xb, yb) in zip(pa, pb):
            assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert b._remote.downloaded == a.manifest["num_shards"] == 14  # each shard once
    # a second dataset on the same folder reuses the downloaded shards
    c = CachedImageDataset(url, local_cache=tmp_path / "copy")
    assert np.array_equal(c.image(5, 1), a.image(5, 1)) and c._remote.downloaded == 0


def test_quarter_budget_reads_every_sample_within_the_budget(caches, tmp_path):
    local, url = caches
    a = CachedImageDataset(local)
    total = sum(s["bytes"] for s in a.manifest["shards"])
    budget = total // 4
    b = CachedImageDataset(url, local_cache=tmp_path / "copy", max_local_bytes=budget)
    assert b.shard_aware and b.shards_per_window == 1  # room for 3.5 shards: one window + the next
    for epoch in (0, 1):
        it = iterate_batches(b, 4, epoch=epoch, seed=1, drop_last=False)
        assert isinstance(it.sampler, ShardWindowSampler)
        seen = []
        for (x, y, valid), (idx, _) in zip(it, it.sampler.batches(epoch)):
            assert folder_bytes(tmp_path / "copy") <= budget
            for k in np.flatnonzero(valid.numpy()):
                assert np.array_equal(x[k].numpy(), a.image(int(idx[k]), epoch))
                assert int(y[k]) == int(a.labels[idx[k]])
                seen.append(int(idx[k]))
        assert sorted(seen) == list(range(40))  # every sample once
    assert b._remote.downloaded > 14  # shards were evicted and fetched again
    assert sorted(str(p.name) for p in (tmp_path / "copy").iterdir() if ".part" in p.name) == []


def test_window_sampler_keeps_windows_and_is_the_same_on_every_rank():
    shard_ids = np.repeat(np.arange(6), 5)
    s0 = ShardWindowSampler(shard_ids, 2, 5, world_size=2, rank=0, seed=4)
    s1 = ShardWindowSampler(shard_ids, 2, 5, world_size=2, rank=1, seed=4)
    o = s0.order(3)
    assert np.array_equal(o, s1.order(3)) and sorted(o) == list(range(30))
    windows = [set(shard_ids[o[k:k + 10]].tolist()) for k in range(0, 30, 10)]
    assert all(len(w) == 2 for w in windows) and set().union(*windows) == set(range(6))
    assert not np.array_equal(o, s0.order(4))


def test_corrupt_object_missing_cache_and_bucket_are_named(caches, gcs_emulator, tmp_path):
    _, url = caches
    with pytest.raises(FileNotFoundError, match=r"gs://.*holds no xla_utils image cache.*build_cache"):
        CachedImageDataset(gcs_emulator())
    with pytest.raises(StorageError, match=r"gs://no-such-bucket-q.*does not exist"):
        CachedImageDataset("gs://no-such-bucket-q/cache")
    # a copy of the cache whose shard 2 is damaged in the bucket
    src, dst = Store(url), Store(gcs_emulator())
    for name in src.listdir():
        data = bytearray(src.read_bytes(name))
        if name == "shard-00002.npy":
            data[-1] ^= 0xFF
        dst.write(name, [bytes(data)])
    import xla_utils.cache.storage as storage
    old = storage.retry.__defaults__
    storage.retry.__defaults__ = (2, 0.01)
    try:
        ds = CachedImageDataset(dst.root, local_cache=tmp_path / "copy")
        assert ds.image(0, 0).shape == (8, 8, 3)  # other shards read fine
        with pytest.raises(StorageError, match=r"shard-00002.npy.*crc32.*tpu_cache_ds verify"):
            ds.image(7, 0)  # shard 2 holds images 6-8
    finally:
        storage.retry.__defaults__ = old
    assert not (tmp_path / "copy" / "shard-00002.npy").exists()  # nothing half-written under the final name


def test_training_from_gs_gives_the_local_losses(caches, tmp_path):
    from xla_utils import OneCycleTrainer

    local, url = caches

    def model():
        torch.manual_seed(0)
        return nn.Sequential(nn.Flatten(), nn.Linear(8 * 8 * 3, 4))

    losses = []
    for data in (CachedImageDataset(local), CachedImageDataset(url, local_cache=tmp_path / "copy")):
        t = OneCycleTrainer(model, nn.CrossEntropyLoss(), data, batch_size=8, epochs=2, max_lr=1e-2, seed=5)
        h = t.fit()
        losses.append([e["train_loss"] for e in h])
    assert losses[0] == losses[1] and len(losses[0]) == 2


def test_two_readers_sharing_one_local_folder_read_exact_samples(caches, tmp_path):
    """As the processes of one host do (one per core): one folder, concurrent passes."""
    import threading

    local, url = caches
    a = CachedImageDataset(local)
    readers = [CachedImageDataset(url, local_cache=tmp_path / "shared") for _ in range(2)]
    errors, got = [], {}

    def run(k):
        try:
            got[k] = [x.clone() for x, _, _ in iterate_batches(readers[k], 8, epoch=1, seed=k)]
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    for k in range(2):
        want = [x.clone() for x, _, _ in iterate_batches(a, 8, epoch=1, seed=k)]
        assert all(torch.equal(x, y) for x, y in zip(got[k], want)) and len(got[k]) == len(want) == 5
    assert not [p for p in (tmp_path / "shared").iterdir() if ".part-" in p.name]
