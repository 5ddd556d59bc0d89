"""One atomic write: a file appears whole under its name or not at all.

Every writer of xla_utils (checkpoints, ``history.csv``, submissions, cross-validation
folds, the cache's shards and manifest, the footprint record, a simulated job's
payloads, a fresh process's result) goes through :func:`atomic_writer`: the data goes
to a temporary file in the destination's folder (same file system, so the rename is
atomic), is flushed and fsynced, and is renamed over the destination. If the writer
raises (or the disk fills), the temporary file is removed and the destination keeps
its previous content; a crash leaves at most a ``NAME.tmp-PID-RANDOM`` file beside it.
Imports nothing of xla_utils.
"""
from __future__ import annotations

import contextlib
import os
import secrets
from pathlib import Path
from typing import IO, Iterator

__all__ = ["atomic_writer", "atomic_write"]


@contextlib.contextmanager
def atomic_writer(path: str | os.PathLike, *, durable: bool = True,
                  parents: bool = True) -> Iterator[IO[bytes]]:
    """A binary file to write ``path``'s new content to; renamed over ``path`` on success.

    Args:
        path: the destination.
        durable: fsync the file before the rename (default True). False only for files
            that die with the run that wrote them (a job's payloads on ``/dev/shm``), where
            a crash loses the run anyway and an fsync per collective would cost time.
        parents: create the destination's missing folders (default True); False where a
            missing folder is an error to report (a job's folder that was deleted).

    Yields:
        The open temporary file (``"wb"``): ``torch.save(obj, f)``, ``np.savez(f, ...)``,
        ``f.write(...)``.

    Raises:
        Whatever the writer raised, after removing the temporary file (``path`` untouched).
    """
    path = Path(path)
    if parents:
        path.parent.mkdir(parents=True, exist_ok=True)
    # NAME.tmp-PID-RANDOM: unique per writer; the cache builder sweeps "*.tmp-*" leftovers.
    # Opened like open(..., "xb"), so the file gets the usual permissions (umask).
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        with open(tmp, "xb") as f:
            yield f
            f.flush()
            if durable:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def atomic_write(path: str | os.PathLike, data: bytes | str, *, durable: bool = True,
                 parents: bool = True) -> None:
    """Write ``data`` (bytes, or text as UTF-8) to ``path`` atomically (see :func:`atomic_writer`)."""
    with atomic_writer(path, durable=durable, parents=parents) as f:
        f.write(data.encode("utf-8") if isinstance(data, str) else data)
