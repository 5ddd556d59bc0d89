"""The augmentation hooks of the trainer: ``transform=`` (per sample, in the loader threads,
after the cache's variant is read), a user's dataset around a cache (its variants keep
rotating, on the loader threads) and ``batch_transform=`` (on the device, in the step's graph)."""
from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from torch import nn

from helpers import digit_images, tiny_cnn

from xla_utils import CachedImageDataset, OneCycleTrainer, build_cache

SIZE, CLASSES, VARIANTS, N = 12, 5, 3, 24
v2 = pytest.importorskip("torchvision.transforms.v2")


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    out = tmp_path_factory.mktemp("augment") / "c"
    build_cache(digit_images(N, classes=CLASSES), out, size=SIZE, variants=VARIANTS,
                scale=(0.6, 1.0), verbose=False)
    return CachedImageDataset(out)


def _variants_of_0(cache) -> set[bytes]:
    """Sample 0's stored variants (all distinct: the build augmented them)."""
    got = {cache.image(0, v).tobytes() for v in range(VARIANTS)}
    assert len(got) == VARIANTS
    return got


class Aug(torch.utils.data.Dataset):
    """A user's augmenting wrapper, as in the issue: no set_epoch of its own. It records the
    pixels of sample 0 it was given (before its flip)."""

    def __init__(self, ds, tf):
        self.base, self.tf, self.seen, self.lock = ds, tf, set(), threading.Lock()

    def __len__(self):
        return len(self.base)

    def __getitem__(self, i):
        x, y = self.base[i]
        if i == 0:
            with self.lock:
                self.seen.add(x.tobytes())
        return self.tf(torch.from_numpy(x).permute(2, 0, 1)), y


def _trainer(data, **kw):
    kw = dict(batch_size=8, epochs=VARIANTS, max_lr=1e-3, mean=(0.5,) * 3, std=(0.25,) * 3) | kw
    return OneCycleTrainer(tiny_cnn(CLASSES, size=SIZE, seed=0), nn.CrossEntropyLoss(), data, **kw)


def test_transform_sees_every_variant_on_the_loader_threads(cache, capsys, tmp_path):
    """fit(transform=...) on the torch CPU path: the transform is given sample 0's three
    stored variants over three epochs (a uint8 [C, H, W] tensor), and the first line says
    the batches come from the loader threads, not a DataLoader. Checkpoints store the
    (unpicklable, local) function by name, and a run resumes with another one."""
    seen, lock = set(), threading.Lock()

    def record(t: torch.Tensor) -> torch.Tensor:
        assert t.dtype == torch.uint8 and tuple(t.shape) == (3, SIZE, SIZE)
        with lock:
            seen.add(t.permute(1, 2, 0).contiguous().numpy().tobytes())
        return t.flip(2)

    h = _trainer(cache, transform=record, checkpoint_dir=tmp_path).fit()
    assert len(h.epochs) == VARIANTS
    assert _variants_of_0(cache) <= seen
    first = capsys.readouterr().out.splitlines()[0]
    assert "loader threads, transform=test_transform_sees_every_variant_on_the_loader_threads" \
           ".<locals>.record per sample" in first and "DataLoader" not in first, first
    last = tmp_path / f"epoch_{VARIANTS:03d}-{h.run_id}.pt"
    assert torch.load(last, weights_only=False)["config"]["transform"] == (
        f"callable {__name__}.test_transform_sees_every_variant_on_the_loader_threads.<locals>.record")
    resumed = _trainer(cache, transform=lambda t: t, checkpoint_dir=tmp_path).fit(
        resume=tmp_path / f"epoch_002-{h.run_id}.pt")
    assert [e["epoch"] for e in resumed.epochs] == [1, 2, 3]


def test_wrapper_around_the_cache_rotates_its_variants_on_the_loader_threads(cache, capsys):
    """The issue's wrapper (no set_epoch): sample 0 shows a different stored variant in each
    of the three epochs, and the batches come from the loader threads."""
    cache.set_epoch(0)
    aug = Aug(cache, v2.RandomHorizontalFlip())
    _trainer(aug).fit()
    assert _variants_of_0(cache) <= aug.seen
    first = capsys.readouterr().out.splitlines()[0]
    assert "loader threads reading Aug per sample (around a cache: its variants rotate)" in first \
        and "DataLoader" not in first, first


def test_transform_of_another_shape_is_refused_before_any_device_time(cache):
    with pytest.raises(ValueError, match=r"train_data sample 0: transform= must return a uint8 "
                       r"\[C, H, W\] tensor of the shape it is given, \(3, 12, 12\).*RandomResizedCrop"):
        _trainer(cache, transform=v2.RandomCrop(8)).fit()
    with pytest.raises(ValueError, match="keep uint8: leave out ToDtype"):
        _trainer(cache, transform=v2.ToDtype(torch.float32, scale=True)).fit()
    tensors = torch.utils.data.TensorDataset(torch.zeros(16, 3, SIZE, SIZE, dtype=torch.uint8),
                                             torch.zeros(16, dtype=torch.int64))
    with pytest.raises(ValueError, match="transform= runs per sample in the loader threads.*"
                       "TensorDataset.*Fix: apply it in the dataset's __getitem__"):
        _trainer(tensors, transform=v2.RandomHorizontalFlip()).fit()
    with pytest.raises(TypeError, match="transform must be a callable"):
        _trainer(cache, transform="flip")


def test_batch_transform_runs_every_step_and_keeps_its_shapes(cache):
    calls = []

    def noise(x, y):
        calls.append(tuple(x.shape))
        return x + 0.1 * torch.randn_like(x), y

    h = _trainer(cache, epochs=1, batch_transform=noise).fit()
    # once on two samples on the host (the shape check), then at every step
    assert calls == [(2, 3, SIZE, SIZE)] + [(8, 3, SIZE, SIZE)] * (N // 8)
    assert np.isfinite(h.epochs[0]["train_loss"])
    with pytest.raises(ValueError, match=r"batch_transform= must return \(x, y\) of the shapes it is "
                       r"given, \(\(2, 3, 12, 12\), \(2,\)\), but it returned \(\(2, 3, 12, 8\), \(2,\)\)"):
        _trainer(cache, epochs=1, batch_transform=lambda x, y: (x[..., :8], y)).fit()  # on the host
    from xla_utils.data import apply_batch_transform  # every step checks it too

    with pytest.raises(ValueError, match=r"returned \(\(8, 3, 12, 12\), \(1,\)\)"):
        apply_batch_transform(lambda x, y: (x, y[:1]), torch.zeros(8, 3, SIZE, SIZE), torch.zeros(8))
