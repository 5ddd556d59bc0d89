"""CachedImageDataset, DistributedBatchSampler, iterate_batches and images_to_float."""
from __future__ import annotations

import json
import pickle
import shutil
import threading
import time

import numpy as np
import pytest
import torch

from xla_utils.env.gpu import cuda_available
from xla_utils.cache import build_cache
from xla_utils.data import (IMAGENET_MEAN, IMAGENET_STD, RING_VALID_FOR, CachedImageDataset,
                            DistributedBatchSampler, caches_inside, images_to_float, iterate_batches,
                            plan_loading)

N_IMAGES, SIZE, VARIANTS = 45, 20, 3


class Arrays:
    """Map-style source: distinct textured 32x32 images, labels i % 5."""

    def __init__(self, n: int, multilabel: bool = False):
        self.n, self.multilabel = n, multilabel

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        rng = np.random.default_rng(i)
        img = np.clip(rng.normal(128, 50, (32, 32, 3)), 0, 255).astype(np.uint8)
        label = np.array([i % 2, i % 3 == 0, 1], np.float32) if self.multilabel else i % 5
        return img, label


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("cache") / "c"
    # several shards (a small build is one by default): batches read across shard boundaries
    build_cache(Arrays(N_IMAGES), out, size=SIZE, variants=VARIANTS, verbose=False,
                shard_size=-(-N_IMAGES // 16) * VARIANTS * SIZE * SIZE * 3)
    return out


@pytest.fixture(scope="module")
def ds(cache_dir):
    return CachedImageDataset(cache_dir)


# ----------------------------------------------------------------------------- sampler


@pytest.mark.parametrize("world", [1, 2, 3, 8])
@pytest.mark.parametrize("n", [1000, 1003])
def test_sampler_equal_full_batches_and_exact_coverage(world, n):
    bs = 16
    for epoch in (0, 1):
        padded = [DistributedBatchSampler(n, bs, world, r, seed=3, drop_last=False) for r in range(world)]
        lens = {len(s) for s in padded}
        assert lens == {-(-n // (bs * world))}
        seen = []
        for s in padded:
            batches = list(s.batches(epoch))
            assert len(batches) == len(s)
            for idx, valid in batches:
                assert idx.shape == (bs,) and idx.dtype == np.int64 and valid.dtype == np.bool_
                seen.extend(idx[valid].tolist())
            assert all(0 <= i < n for idx, _ in batches for i in idx)  # padded slots hold real indices
        assert sorted(seen) == list(range(n))  # every sample exactly once among the valid slots
        invalid = sum((~v).sum() for s in padded for _, v in s.batches(epoch))
        assert invalid == len(padded[0]) * bs * world - n

        dropped = [DistributedBatchSampler(n, bs, world, r, seed=3) for r in range(world)]
        assert {len(s) for s in dropped} == {n // (bs * world)}
        got = [i for s in dropped for idx, valid in s.batches(epoch) for i in idx.tolist() if valid.all()]
        assert len(got) == len(set(got)) == len(dropped[0]) * bs * world


def test_sampler_shuffles_per_epoch_identically_on_every_rank():
    a = DistributedBatchSampler(100, 5, 4, 0, seed=1)
    b = DistributedBatchSampler(100, 5, 4, 2, seed=1)
    assert np.array_equal(a.order(0), b.order(0))
    assert not np.array_equal(a.order(0), a.order(1))
    assert not np.array_equal(a.order(0), DistributedBatchSampler(100, 5, 4, 0, seed=2).order(0))
    # the global order does not depend on the world size
    one = np.concatenate(list(DistributedBatchSampler(100, 20, 1, 0, seed=1)))
    four = np.concatenate([np.concatenate(g) for g in zip(*[list(DistributedBatchSampler(100, 5, 4, r, seed=1))
                                                            for r in range(4)])])
    assert np.array_equal(one, four)
    a.set_epoch(5)
    assert np.array_equal(np.concatenate(list(a)), np.concatenate([i for i, _ in a.batches(5)]))
    assert np.array_equal(np.concatenate(list(DistributedBatchSampler(10, 5, shuffle=False))), np.arange(10))


def test_sampler_rejects_bad_arguments():
    with pytest.raises(ValueError, match="no full batch"):
        DistributedBatchSampler(10, 8, world_size=2)
    with pytest.raises(ValueError, match="rank"):
        DistributedBatchSampler(10, 2, world_size=2, rank=2)
    assert len(DistributedBatchSampler(10, 8, world_size=2, drop_last=False)) == 1


# ----------------------------------------------------------------------------- dataset


def test_dataset_attributes_and_variants_per_epoch(ds):
    assert len(ds) == N_IMAGES and ds.image_size == (SIZE, SIZE) and ds.num_variants == VARIANTS
    assert ds.classes == ["0", "1", "2", "3", "4"] and ds.num_classes == 5 and not ds.multilabel
    img, label = ds[7]
    assert img.shape == (SIZE, SIZE, 3) and img.dtype == np.uint8 and label == 2 and isinstance(label, int)
    per_epoch = []
    for e in range(VARIANTS + 1):
        ds.set_epoch(e)
        per_epoch.append(np.stack([ds[i][0] for i in range(len(ds))]))
    ds.set_epoch(0)
    for a in range(VARIANTS):
        for b in range(a + 1, VARIANTS):
            differ = [not np.array_equal(per_epoch[a][i], per_epoch[b][i]) for i in range(len(ds))]
            assert all(differ)
    np.testing.assert_array_equal(per_epoch[0], per_epoch[VARIANTS])  # epoch e shows variant e % V
    with pytest.raises(IndexError):
        ds[len(ds)]
    np.testing.assert_array_equal(ds[-1][0], ds[len(ds) - 1][0])


def test_dataset_pickles_and_refuses_incomplete_cache(ds, cache_dir, tmp_path):
    clone = pickle.loads(pickle.dumps(ds))
    np.testing.assert_array_equal(clone.image(3, 1), ds.image(3, 1))
    bad = tmp_path / "bad"
    bad.mkdir()
    m = json.loads((cache_dir / "manifest.json").read_text())
    m["complete"] = False
    (bad / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ValueError, match="incomplete"):
        CachedImageDataset(bad)


def test_a_misspelled_cache_path_suggests_the_nearest_folders(cache_dir, tmp_path):
    root = tmp_path / "cache"
    for name in ("test", "test96", "test_nolab", "train", "val"):
        shutil.copytree(cache_dir, root / name)
    with pytest.raises(FileNotFoundError) as err:
        CachedImageDataset(root / "trian")
    msg = str(err.value)
    assert msg.startswith(f"{root / 'trian'} does not exist; did you mean {root / 'train'}?")
    assert f"caches inside it: {root / 'train'}, " in msg  # the nearest first, not alphabetical
    with pytest.raises(FileNotFoundError, match=f"did you mean {root / 'train'}\\?"):
        CachedImageDataset(tmp_path / "cahce" / "train")  # the typo one folder up
    with pytest.raises(FileNotFoundError) as err:
        CachedImageDataset(root / "zzzzzz")
    assert "did you mean" not in str(err.value)


def test_missing_cache_path_is_named_with_the_fix(cache_dir, tmp_path):
    missing = tmp_path / "x" / "nothing"
    with pytest.raises(FileNotFoundError) as err:
        CachedImageDataset(missing)
    msg = str(err.value)
    assert msg.startswith(f"{missing} does not exist") and f"nearest existing folder is {tmp_path}" in msg
    assert "build_cache(SRC" in msg and "tpu_cache_ds build SRC" in msg and "/kaggle/input/" in msg
    # the folder above a cache (e.g. an attached Kaggle data set): point at the cache inside it
    with pytest.raises(FileNotFoundError) as err:
        CachedImageDataset(cache_dir.parent)
    msg = str(err.value)
    assert f"{cache_dir.parent} is not an xla_utils image cache" in msg and f"caches inside it: {cache_dir}" in msg


def test_missing_or_cut_short_shard_names_the_fix(cache_dir, tmp_path):
    import shutil

    broken = tmp_path / "c"
    shutil.copytree(cache_dir, broken)
    shard = broken / "shard-00001.npy"
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(ValueError, match=r"cache in .*/c is damaged .*tpu_cache_ds verify .*--overwrite"):
        CachedImageDataset(broken)
    shard.unlink()
    with pytest.raises(ValueError, match=r"damaged \(FileNotFoundError.*shard-00001.npy"):
        CachedImageDataset(broken)
    (broken / "labels.npy").unlink()
    with pytest.raises(ValueError, match=r"damaged \(FileNotFoundError.*labels.npy"):
        CachedImageDataset(broken)


# ----------------------------------------------------------------------------- batches


@pytest.mark.parametrize("workers", [0, 2])
def test_iterate_batches_match_dataset_and_sampler(ds, workers):
    for epoch in range(3):
        it = iterate_batches(ds, 4, world_size=3, rank=1, seed=9, epoch=epoch, drop_last=False, num_workers=workers)
        expected = list(DistributedBatchSampler(len(ds), 4, 3, 1, seed=9, drop_last=False).batches(epoch))
        assert len(it) == len(expected) == 4
        n = 0
        for (x, y, valid), (idx, ok) in zip(it, expected):
            assert x.dtype == torch.uint8 and x.shape == (4, SIZE, SIZE, 3)
            assert y.dtype == torch.int64 and valid.dtype == torch.bool
            np.testing.assert_array_equal(valid.numpy(), ok)
            np.testing.assert_array_equal(y.numpy(), ds.labels[idx])
            for k, i in enumerate(idx):
                np.testing.assert_array_equal(x[k].numpy(), ds.image(i, epoch))
            n += 1
        assert n == 4


def test_ring_keeps_each_batch_for_two_further_requests(ds):
    for passes in range(2):  # the second pass reuses the first pass's ring
        held = []
        for m, (x, y, _) in enumerate(iterate_batches(ds, 2, epoch=passes, num_workers=3)):
            held.append((x, y, x.clone(), y.clone()))
            for old_x, old_y, copy_x, copy_y in held[-3:]:
                assert torch.equal(old_x, copy_x) and torch.equal(old_y, copy_y)
            time.sleep(0.002)  # let the threads run ahead
        assert m == len(ds) // 2 - 1


def test_replicas_as_threads_share_one_dataset(ds):
    world = 4
    expected = {}
    for r in range(world):
        expected[r] = [(x.clone(), y.clone()) for x, y, _ in iterate_batches(ds, 3, world_size=world, rank=r,
                                                                              epoch=1, num_workers=0)]
    got, errors = {}, []

    def replica(r):
        try:
            got[r] = [(x.clone(), y.clone()) for x, y, _ in iterate_batches(ds, 3, world_size=world, rank=r,
                                                                             epoch=1, num_workers=1)]
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=replica, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for r in range(world):
        assert len(got[r]) == len(expected[r]) == N_IMAGES // (3 * world)
        for (a, b), (c, d) in zip(got[r], expected[r]):
            assert torch.equal(a, c) and torch.equal(b, d)


def test_multilabel_batches(tmp_path):
    build_cache(Arrays(12, multilabel=True), tmp_path / "m", size=8, verbose=False)
    ds = CachedImageDataset(tmp_path / "m")
    assert ds.multilabel and ds.num_classes == 3
    x, y, valid = next(iter(iterate_batches(ds, 4, shuffle=False)))
    assert y.dtype == torch.float32 and y.shape == (4, 3)
    np.testing.assert_array_equal(y.numpy(), [[0, 1, 1], [1, 0, 1], [0, 0, 1], [1, 1, 1]])
    assert ds[1][1].dtype == np.float32


def test_plain_dataloader_over_the_cache(ds):
    from torch.utils.data import DataLoader

    sampler = DistributedBatchSampler(len(ds), 5, world_size=2, rank=1, seed=4)
    sampler.set_epoch(2)
    ds.set_epoch(2)
    try:
        for workers in (0, 2):
            loader = DataLoader(ds, batch_sampler=sampler, num_workers=workers)
            batches = list(loader)
            assert len(batches) == len(sampler) == 4
            for (x, y), idx in zip(batches, sampler):
                assert x.dtype == torch.uint8 and x.shape == (5, SIZE, SIZE, 3)
                np.testing.assert_array_equal(y.numpy(), ds.labels[idx])
                np.testing.assert_array_equal(x[0].numpy(), ds.image(idx[0], 2))
    finally:
        ds.set_epoch(0)


def test_iterate_batches_over_any_map_style_dataset():
    data = [(torch.full((2,), float(i)), i) for i in range(10)]
    it = iterate_batches(data, 4, shuffle=False, drop_last=False)
    got = list(it)
    assert len(it) == len(got) == 3
    x, y, valid = got[-1]
    assert x.shape == (4, 2) and y.tolist() == [8, 9, 0, 1] and valid.tolist() == [True, True, False, False]


# ----------------------------------------------------------------------------- augmentation


class Wrapped:
    """A user's dataset around a cache (attribute name chosen freely, no set_epoch): uint8
    [C, H, W] tensors, mirrored, or float ones (``as_float``: not the ring's samples)."""

    def __init__(self, cache, as_float: bool = False):
        self.inner_data, self.as_float = cache, as_float

    def __len__(self) -> int:
        return len(self.inner_data)

    def __getitem__(self, i):
        x, y = self.inner_data[i]
        x = torch.from_numpy(x).permute(2, 0, 1).flip(2)
        return (x.float() / 255 if self.as_float else x), y


def test_transform_runs_on_the_ring_after_the_variant_is_read(ds):
    invert = lambda t: 255 - t  # noqa: E731
    b = iterate_batches(ds, 8, shuffle=False, epoch=0, transform=invert)
    assert b.plan.kind == "cache" and b.valid_for == RING_VALID_FOR
    firsts = []
    for epoch in range(VARIANTS):
        b.set_epoch(epoch)
        x, y, _ = next(iter(b))
        want = np.stack([255 - ds.image(i, epoch) for i in range(8)])
        np.testing.assert_array_equal(x.numpy(), want)
        firsts.append(x[0].numpy().tobytes())
    assert len(set(firsts)) == VARIANTS  # sample 0 differs in every epoch: the variants rotate
    with pytest.raises(ValueError, match=r"transform= must return a uint8 \[C, H, W\] tensor.*"
                       r"\(3, 20, 20\).*returned a torch.Tensor of shape \(3, 10, 20\)"):
        list(iterate_batches(ds, 8, transform=lambda t: t[:, :10]))


def test_a_wrapper_around_the_cache_is_read_on_the_ring_and_its_variants_rotate(ds):
    ds.set_epoch(0)
    w = Wrapped(ds)
    assert caches_inside(w) == [ds] and caches_inside(torch.utils.data.ConcatDataset([w, ds])) == [ds]
    assert caches_inside(torch.utils.data.TensorDataset(torch.zeros(3, 2))) == []
    plan = plan_loading(w)
    assert (plan.kind, plan.x_shape, plan.channels_first) == ("wrapper", (3, SIZE, SIZE), True)
    assert plan.words(2) == "2 loader threads reading Wrapped per sample (around a cache: its variants rotate)"
    b = iterate_batches(w, 8, shuffle=False, num_workers=2)
    assert b.valid_for == RING_VALID_FOR
    firsts = []
    for epoch in range(VARIANTS):
        b.set_epoch(epoch)
        x, y, _ = next(iter(b))
        want = np.stack([ds.image(i, epoch).transpose(2, 0, 1)[:, :, ::-1] for i in range(8)])
        np.testing.assert_array_equal(x.numpy(), want)
        assert y.tolist() == ds.labels[:8].tolist() and ds.epoch == epoch
        firsts.append(x[0].numpy().tobytes())
    assert len(set(firsts)) == VARIANTS


def test_a_wrapper_off_the_ring_still_rotates_and_says_why(ds):
    ds.set_epoch(0)
    w = Wrapped(ds, as_float=True)
    plan = plan_loading(w)
    assert plan.kind == "dataloader" and plan.caches == (ds,)
    assert "its inputs are a torch.Tensor of shape (3, 20, 20) and dtype float32" in plan.words(None)
    assert "pass the augmentation as transform=" in plan.words(None)
    b = iterate_batches(w, 8, shuffle=False)
    firsts = []
    for epoch in range(VARIANTS):
        b.set_epoch(epoch)
        firsts.append(next(iter(b))[0][0].numpy().tobytes())
    assert len(set(firsts)) == VARIANTS
    with pytest.raises(ValueError, match="transform= runs per sample in the loader threads.*Wrapped wraps "
                       "a cache, but its inputs are"):
        iterate_batches(w, 8, transform=lambda t: t)


# ----------------------------------------------------------------------------- device side


def test_images_to_float_normalises_and_flips():
    torch.manual_seed(0)
    x = torch.randint(0, 256, (64, 6, 5, 3), dtype=torch.uint8)
    y = images_to_float(x)
    assert y.shape == (64, 3, 6, 5) and y.dtype == torch.float32 and y.is_contiguous()
    mean = torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)
    ref = (x.permute(0, 3, 1, 2).float() / 255 - mean) / std
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    b = images_to_float(x, dtype=torch.bfloat16)
    assert b.dtype == torch.bfloat16
    torch.testing.assert_close(b.float(), ref, rtol=1e-2, atol=2e-2)
    f = images_to_float(x, flip=True)
    flipped = [torch.equal(f[i], y[i].flip(2)) for i in range(64)]
    kept = [torch.equal(f[i], y[i]) for i in range(64)]
    assert all(a or b for a, b in zip(flipped, kept)) and 10 < sum(flipped) < 54
    g = images_to_float(x[..., :1], mean=(0.5,), std=(0.5,))
    torch.testing.assert_close(g, x[..., :1].permute(0, 3, 1, 2).float() / 127.5 - 1)
    with pytest.raises(ValueError, match="channels"):
        images_to_float(x[..., :1])


def test_images_to_float_into_channels_last_memory():
    # What a channels_last model on a GPU wants: the same numbers, NHWC in memory.
    torch.manual_seed(0)
    x = torch.randint(0, 256, (8, 6, 5, 3), dtype=torch.uint8)
    ref = images_to_float(x)
    for flip in (False, True):
        torch.manual_seed(1)
        a = images_to_float(x, flip=flip)
        torch.manual_seed(1)
        c = images_to_float(x, flip=flip, memory_format=torch.channels_last)
        assert torch.equal(a, c) and c.shape == (8, 3, 6, 5)
        assert c.is_contiguous(memory_format=torch.channels_last) and not c.is_contiguous()
    # from a channels-first batch too (one layout copy there)
    c = images_to_float(x.permute(0, 3, 1, 2).contiguous(), channels_first=True,
                        memory_format=torch.channels_last)
    assert torch.equal(c, ref) and c.is_contiguous(memory_format=torch.channels_last)
    assert images_to_float(x, dtype=torch.bfloat16, memory_format=torch.channels_last).is_contiguous(
        memory_format=torch.channels_last)


def test_batches_say_how_long_they_stay_valid(ds):
    from xla_utils.data import RING_VALID_FOR

    assert iterate_batches(ds, 4).valid_for == RING_VALID_FOR == 2  # the ring refills slots
    pairs = torch.utils.data.TensorDataset(torch.zeros(8, 2), torch.zeros(8))
    assert iterate_batches(pairs, 4).valid_for is None  # a DataLoader's batches are fresh tensors
    x, y, v = next(iter(iterate_batches(ds, 4, num_workers=0)))  # pin_memory=False: pageable
    assert not x.is_pinned() and x.dtype == torch.uint8 and y.dtype == torch.int64 and v.dtype == torch.bool


@pytest.mark.skipif(not cuda_available(), reason="pinned memory needs CUDA")
def test_pinned_ring_batches_on_a_gpu_machine(ds):
    plain = [tuple(t.clone() for t in b) for b in iterate_batches(ds, 4, seed=3, num_workers=2)]
    pinned = [tuple(t.clone() for t in b) + (b[0].is_pinned(),)
              for b in iterate_batches(ds, 4, seed=3, num_workers=2, pin_memory=True)]
    assert all(p[3] for p in pinned)
    assert all(all(torch.equal(a, b) for a, b in zip(p[:3], q)) for p, q in zip(pinned, plain))


XLA_CHECK = """
import json, torch, torch_xla, torch_xla.debug.metrics as met
from xla_utils.data import images_to_float
dev = torch_xla.device()
out = []
for step in range(3):
    x = torch.randint(0, 256, (8, 16, 16, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(step))
    y = images_to_float(x.to(dev), flip=step > 0, dtype=torch.bfloat16)
    torch_xla.sync()
    if step == 0:
        ref = images_to_float(x, dtype=torch.bfloat16)
        out.append(float((y.cpu().float() - ref.float()).abs().max()))
    assert y.shape == (8, 3, 16, 16) and y.dtype == torch.bfloat16
print(json.dumps({"max_err": out[0], "compiles": met.metric_data("CompileTime")[0],
                  "fallbacks": [c for c in met.counter_names() if c.startswith("aten::")]}))
"""


@pytest.mark.slow
def test_images_to_float_on_an_xla_device_compiles_once():
    import os
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("torch_xla")
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PJRT_DEVICE": "CPU", "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, "-c", XLA_CHECK], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    # flip=True and flip=False are two graphs; later batches reuse them
    assert res["compiles"] <= 2 and res["fallbacks"] == [] and res["max_err"] < 0.02, res


def test_image_layout_rule_and_channels_first_batches():
    from xla_utils.data import image_layout

    assert image_layout((8, 8, 3), channels_first_on_tie=True) == "channels_last"
    assert image_layout((3, 8, 8), channels_first_on_tie=False) == "channels_first"
    assert image_layout((1, 28, 28), channels_first_on_tie=False) == "channels_first"
    assert image_layout((8, 8, 4), channels_first_on_tie=True) == "channels_last"
    # a 3-pixel-wide CHW image is also a 3-pixel-high HWC one: the tie-breaker decides
    assert image_layout((3, 32, 3), channels_first_on_tie=True) == "channels_first"
    assert image_layout((3, 32, 3), channels_first_on_tie=False) == "channels_last"
    assert image_layout((5, 7, 9), channels_first_on_tie=True) is None
    assert image_layout((8, 8), channels_first_on_tie=True) is None
    assert image_layout((2, 8, 8, 3), channels_first_on_tie=True) is None  # a batch, not one image
    x = torch.randint(0, 256, (16, 6, 5, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    chw = x.permute(0, 3, 1, 2).contiguous()
    assert torch.equal(images_to_float(x), images_to_float(chw, channels_first=True))
    torch.manual_seed(5)
    a = images_to_float(x, flip=True)
    torch.manual_seed(5)
    b = images_to_float(chw, flip=True, channels_first=True)
    assert torch.equal(a, b) and not torch.equal(a, images_to_float(x))  # the same flips, along W
    with pytest.raises(ValueError, match=r"\[B, C, H, W\] batch"):
        images_to_float(chw[0], channels_first=True)


def test_ids_and_unlabeled_attributes(ds):
    assert ds.ids == [str(i) for i in range(N_IMAGES)] and not ds.unlabeled
    ids = ds.ids
    ids.append("x")  # a copy: the dataset's ids cannot be changed by accident
    assert len(ds.ids) == N_IMAGES


def test_skipped_ids_and_requested_ids(tmp_path):
    """A cache remembers every id it was asked for, skipped ones included; a cache written
    before skipped ids were recorded derives them (folders: the path; datasets: the index)."""
    from PIL import Image

    src = tmp_path / "test"
    src.mkdir()
    for i in range(4):
        Image.fromarray(np.full((20, 20, 3), 50 * i, np.uint8)).save(src / f"{i}.png")
    (src / "2.png").write_bytes(b"not an image")
    build_cache(src, tmp_path / "c", size=8, unlabeled=True, verbose=False)
    ds = CachedImageDataset(tmp_path / "c")
    assert ds.ids == ["0.png", "1.png", "3.png"] and ds.requested_ids == ["0.png", "1.png", "2.png", "3.png"]
    assert [(e["id"], e["source_index"]) for e in ds.skipped] == [("2.png", 2)]
    m = json.loads((tmp_path / "c" / "manifest.json").read_text())
    for e in m["skipped"]:
        del e["id"]  # an older cache
    (tmp_path / "c" / "manifest.json").write_text(json.dumps(m))
    old = CachedImageDataset(tmp_path / "c")
    assert old.requested_ids == ds.requested_ids and old.skipped[0]["id"] == "2.png"

    class WithBad(Arrays):
        def __getitem__(self, i):
            if i == 1:
                raise OSError("unreadable")
            return super().__getitem__(i)

    build_cache(WithBad(3), tmp_path / "d", size=8, verbose=False)
    d = CachedImageDataset(tmp_path / "d")
    assert d.ids == ["0", "2"] and d.requested_ids == ["0", "1", "2"] and d.skipped[0]["id"] == "1"
