"""Checkpoints in a bucket: ``checkpoint_dir="gs://bucket/run"`` (any fsspec URL).

A run writes its checkpoints as it always does, into a local folder (:func:`staging_folder`),
and the master replica mirrors that folder's files to the URL after every checkpoint it
writes (:meth:`CheckpointMirror.push`): each file is uploaded as one object through the cache's
storage layer (:class:`xla_utils.cache.storage.Store`: written under a temporary name and
published whole, retried on transient errors), new files first, and only then are the objects
of files the run rotated away deleted, so a kill during an upload leaves every object that was
there before as it was. Before the run, the trainer pulls the bucket's files into the local
folder (:meth:`CheckpointMirror.pull`), so ``resume="last"``, ``keep_runs`` and the listings of
earlier runs see what another session (or another machine) wrote. Only the folder's own files
are mirrored (``epoch_*.pt``, ``final.pt``, ``best.pt``, ``history.csv``, ``steps.csv``), not
its sub-folders (``tensorboard/``, the ``.dcp`` twins of ``"spmd"``/``"fsdp"``), which stay local.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

from ..cache.fetch import local_folder
from ..cache.storage import Store, is_url

if TYPE_CHECKING:
    from .config import TrainerConfig

__all__ = ["CheckpointMirror", "staging_folder", "staged", "CHUNK_BYTES"]

# Bytes read from a checkpoint file per chunk of its upload.
CHUNK_BYTES = 8 * 2**20
# Files of a checkpoint folder that are not mirrored: atomic writers' temporary files.
_TEMPORARY = re.compile(r"\.(tmp|part)-")


def staging_folder(url: str) -> Path:
    """The local folder a run on ``url`` writes its checkpoints into: under ``/kaggle/working``
    on Kaggle, ``/content`` on Colab, else ``~/.cache/xla_utils``; then
    ``checkpoints/<bucket>_<prefix>-<hash>`` (:func:`xla_utils.cache.fetch.local_folder`)."""
    return local_folder(url, "checkpoints")


def _chunks(path: Path) -> Iterator[bytes]:
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK_BYTES):
            yield chunk


@dataclass
class CheckpointMirror:
    """A checkpoint folder at a URL, written through a local folder.

    Attributes:
        url: Where the checkpoints live (``gs://bucket/run``).
        folder: The local folder the run writes (:func:`staging_folder`).
        pushed: ``{file name: (bytes, mtime in ns)}`` as last uploaded or pulled (what
            :meth:`push` need not send again).
    """

    url: str
    folder: Path
    pushed: dict[str, tuple[int, int]] = field(default_factory=dict)

    @classmethod
    def of(cls, checkpoint_dir: Any) -> CheckpointMirror | None:
        """The mirror of ``checkpoint_dir`` when it is a URL, else None (a local folder)."""
        if checkpoint_dir is None or not is_url(checkpoint_dir):
            return None
        url = str(checkpoint_dir).rstrip("/")
        return cls(url, staging_folder(url))

    def _local_files(self) -> dict[str, os.stat_result]:
        if not self.folder.is_dir():
            return {}
        return {p.name: p.stat() for p in self.folder.iterdir()
                if p.is_file() and not _TEMPORARY.search(p.name)}

    def pull(self) -> int:
        """Make the local folder's files those of the URL: each object the folder lacks, or
        holds at another size, is downloaded; a local file the URL lacks is removed (the URL
        is the truth: a file this machine wrote but never uploaded is not a checkpoint).
        Returns the number of objects downloaded.

        Raises:
            xla_utils.cache.storage.StorageError: a missing bucket or credentials (named).
        """
        store = Store(self.url)
        store.check()
        remote = {n: s for n, s in store.sizes().items() if s >= 0 and not _TEMPORARY.search(n)}
        self.folder.mkdir(parents=True, exist_ok=True)
        local = self._local_files()
        for name in set(local) - set(remote):
            (self.folder / name).unlink()
        got = 0
        for name, size in sorted(remote.items()):
            if name not in local or local[name].st_size != size:
                store.download(name, self.folder / name, nbytes=size)
                got += 1
        self.pushed = {n: (st.st_size, st.st_mtime_ns) for n, st in self._local_files().items()}
        return got

    def push(self) -> list[str]:
        """Upload the local folder's new and changed files, then delete the objects of files
        it no longer has (rotated checkpoints). Returns the names uploaded."""
        store = Store(self.url)
        local = self._local_files()
        sent = []
        # epoch files first (the newest checkpoint is up before anything else changes)
        for name in sorted(local, key=lambda n: (not n.startswith("epoch_"), n)):
            stamp = (local[name].st_size, local[name].st_mtime_ns)
            if self.pushed.get(name) != stamp:
                store.write(name, _chunks(self.folder / name))
                self.pushed[name] = stamp
                sent.append(name)
        for name in sorted(set(self.pushed) - set(local)):
            store.remove(name)
            del self.pushed[name]
        return sent


def staged(cfg: TrainerConfig) -> tuple[TrainerConfig, CheckpointMirror | None]:
    """A fit run's configuration with a ``checkpoint_dir`` URL replaced by its local folder,
    pulled from the URL first (said in one line), and the mirror the run pushes through;
    ``(cfg, None)`` for a local ``checkpoint_dir``.

    Raises:
        xla_utils.cache.storage.StorageError: a missing bucket or credentials (named),
            before any device time.
    """
    mirror = CheckpointMirror.of(cfg.checkpoint_dir)
    if mirror is None:
        return cfg, None
    got = mirror.pull()
    print(f"checkpoint_dir {mirror.url}: written through {mirror.folder} and uploaded after "
          f"every checkpoint ({got} file(s) downloaded from it)", flush=True)
    return cfg.replace(checkpoint_dir=mirror.folder), mirror
