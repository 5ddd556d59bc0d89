"""CachedImageDataset on gs:// (xla_utils.cache.fetch: the bounded local copy) against a real
GCS emulator started by tests/conftest.py: exactly the local samples, a bounded folder, named errors,
downloads cut mid-body by a real TCP proxy in front of the emulator retried to exact bytes."""
from __future__ import annotations

import contextlib
import os
import socket
import stat
import subprocess
import sys
import threading
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from xla_utils.cache import build_cache
from xla_utils.cache.fetch import LocalBudgetError
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
    kw = dict(size=8, variants=2, shard_size=3 * 2 * 8 * 8 * 3, workers=1, verbose=False)
    build_cache(Blobs(), local, **kw)
    build_cache(Blobs(), url, **kw)
    return local, url


def folder_bytes(path) -> int:
    """Bytes of the files in ``path``, partial downloads included; a file renamed or
    removed by the reader's download threads between the listing and its stat counts 0
    (its bytes are counted under the new name, if it was listed after the rename)."""
    total = 0
    for p in path.iterdir():
        if p.name.startswith("."):
            continue
        try:
            st = p.stat()
        except FileNotFoundError:
            continue
        if stat.S_ISREG(st.st_mode):
            total += st.st_size
    return total


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


def test_a_budget_below_two_shards_is_refused_as_a_budget_not_a_damaged_cache(caches, tmp_path):
    local, url = caches
    shards = [s["bytes"] for s in CachedImageDataset(local).manifest["shards"] if s["num_images"]]
    least = 2 * max(shards)
    with pytest.raises(LocalBudgetError, match=rf"max_local_bytes={least - 1:,} is too small.*"
                       rf"largest shard is {max(shards):,} bytes.*max_local_bytes={least:,}") as e:
        CachedImageDataset(url, local_cache=tmp_path / "copy", max_local_bytes=least - 1)
    assert "damaged" not in str(e.value) and "verify" not in str(e.value)
    assert CachedImageDataset(url, local_cache=tmp_path / "copy", max_local_bytes=least).shard_aware


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


class CuttingProxy:
    """A real TCP proxy on 127.0.0.1 in front of the GCS emulator that cuts the first ``cuts`` downloads
    of shard objects (``GET .../shard-*?alt=media``) mid-body: it forwards the response head and half
    of the body, then closes the connection. One thread per connection; ``close()`` ends them all."""

    def __init__(self, upstream: str, cuts: int):
        host, port = upstream.rsplit("//", 1)[-1].split(":")
        self.upstream, self.cuts_left, self.cut = (host, int(port)), cuts, 0
        self.server = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.server.getsockname()[1]}"
        self.lock, self.socks, self.threads = threading.Lock(), [], []
        self._spawn(self._accept)

    def _spawn(self, fn, *args) -> None:
        t = threading.Thread(target=fn, args=args, daemon=True)
        self.threads.append(t)
        t.start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            with self.lock:
                self.socks.append(client)
            self._spawn(self._requests, client)

    def _requests(self, client: socket.socket) -> None:
        # the emulator serves one connection at a time: connect to it only once a request comes
        up, state = None, {"cut": False}
        while data := self._recv(client):
            if up is None:
                up = socket.create_connection(self.upstream)
                with self.lock:
                    self.socks.append(up)
                self._spawn(self._responses, up, client, state)
            if data[:4] in (b"GET ", b"POST", b"PUT ", b"DELE", b"HEAD", b"PATC"):
                line = data.split(b"\r\n", 1)[0]
                with self.lock:
                    if data.startswith(b"GET ") and b"alt=media" in line and b"shard-" in line and self.cuts_left:
                        self.cuts_left -= 1
                        state["cut"] = True
            up.sendall(data)
        if up is None:
            client.close()

    def _responses(self, up: socket.socket, client: socket.socket, state: dict) -> None:
        buf = b""
        while data := self._recv(up):
            if not state["cut"]:
                try:
                    client.sendall(data)
                except OSError:  # the client went away
                    break
                continue
            buf += data
            head, sep, body = buf.partition(b"\r\n\r\n")
            length = [int(v) for k, v in (h.split(b":", 1) for h in head.split(b"\r\n")[1:])
                      if k.strip().lower() == b"content-length"] if sep else []
            if body and (not length or len(body) >= length[0] // 2):  # a chunked body: half of what came
                with contextlib.suppress(OSError):
                    client.sendall(head + sep + body[:(length[0] if length else len(body)) // 2])
                with self.lock:
                    self.cut += 1
                break
        for s in (client, up):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()

    @staticmethod
    def _recv(s: socket.socket) -> bytes:
        try:
            return s.recv(1 << 16)
        except OSError:
            return b""

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.server.shutdown(socket.SHUT_RDWR)  # wakes the accept() (close() alone does not)
        self.server.close()
        with self.lock:
            for s in self.socks:
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
                s.close()
        for t in self.threads:
            t.join(5)


# The reader, in a process of its own (its gcsfs client connects through the proxy from the start).
READER = """
import sys, numpy as np
from xla_utils.data import CachedImageDataset
from xla_utils.cache.storage import StorageError
local, url, copy = sys.argv[1:4]
a, b = CachedImageDataset(local), CachedImageDataset(url, local_cache=copy)
try:
    same = all(np.array_equal(a.image(i, i % 2), b.image(i, i % 2)) for i in range(len(a)))
    print("SAME" if same else "DIFFERENT", b._remote.downloaded)
except StorageError as e:
    print("ERROR", e)
"""


def _no_partial_files(folder: Path, manifest: dict) -> None:
    """Nothing half-written under a final name: no partial download left, every shard complete."""
    crc = {s["file"]: s["crc32"] for s in manifest["shards"]}
    for p in folder.iterdir():
        assert ".part-" not in p.name and ".tmp" not in p.name, p.name
        if p.name in crc:
            assert zlib.crc32(p.read_bytes()) == crc[p.name], p.name


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_downloads_cut_mid_body_are_retried_to_exact_bytes(caches, tmp_path):
    local, url = caches
    proxy = CuttingProxy(os.environ["STORAGE_EMULATOR_HOST"], cuts=3)
    try:
        out = subprocess.run([sys.executable, "-c", READER, str(local), url, str(tmp_path / "copy")],
                             capture_output=True, text=True, timeout=240,
                             env={**os.environ, "STORAGE_EMULATOR_HOST": proxy.url})
    finally:
        proxy.close()
    assert out.stdout.startswith("SAME 14"), out.stdout + out.stderr[-2000:]  # exact samples, each shard once
    assert proxy.cut == 3
    _no_partial_files(tmp_path / "copy", CachedImageDataset(local).manifest)
