"""The output relay of a child process: its pipes re-printed on this process's streams.

The zygote (:mod:`xla_utils.simulate.caller`) and every fresh process
(:mod:`.fresh`) write to pipes; :func:`forward_output` copies them to
``sys.stdout`` / ``sys.stderr`` here, so that their output reaches a notebook, and
keeps their last bytes for an error message.
"""
from __future__ import annotations

import contextlib
import os
import sys
import threading
from typing import Sequence

__all__ = ["forward_output", "OutputTail"]


class OutputTail:
    """The last ``limit`` bytes (default 64 KiB) a child wrote, for an error message."""

    def __init__(self, limit: int = 65536) -> None:
        self.limit = limit
        self.data = bytearray()

    def add(self, data: bytes) -> None:
        self.data += data
        del self.data[:-self.limit]

    def lines(self, n: int = 25) -> str:
        """The last ``n`` lines, as text."""
        return "\n".join(self.data.decode("utf-8", "replace").strip().splitlines()[-n:])


def _drop_lines(data: bytes, drop: Sequence[str]) -> bytes:
    if not drop:
        return data
    marks = [d.encode() for d in drop]
    return b"".join(ln for ln in data.splitlines(keepends=True)
                    if not any(m in ln for m in marks))


def forward_output(stream, name: str, lock: threading.Lock, *, echo: bool = True,
                   tail: OutputTail | None = None, drop: Sequence[str] = (),
                   label: bytes | None = None) -> None:
    """Re-print everything a child process writes to ``stream`` (its stdout or stderr pipe)
    on this process's ``sys.<name>`` (a notebook's, which is not file descriptor 1),
    one chunk at a time under ``lock``, until the pipe closes.

    Args:
        stream: the child's pipe (a binary file object).
        name: ``"stdout"`` or ``"stderr"``: where to print it here.
        lock: shared by the relays of one child, so chunks never interleave.
        echo: print the output (default True); False only keeps ``tail``.
        tail: where the last bytes are kept (default: nowhere).
        drop: lines containing any of these strings are not printed (runtime noise).
        label: print whole lines only, each behind ``label`` (``b""``: none), so that the
            relays of several children sharing ``lock`` never cut into each other's lines
            (default None: chunks as they come).
    """
    import select

    fd, pending = stream.fileno(), b""
    while True:
        with contextlib.suppress(OSError, ValueError):
            select.select([fd], [], [])
        with lock:
            try:
                data = os.read(fd, 65536)
            except OSError:
                data = b""
            if not data and not pending:
                return
            if tail is not None:
                tail.add(data)
            if label is not None:  # whole lines; what is left at the end, as a line
                pending += data
                *lines, pending = pending.split(b"\n") if data else (pending, b"")
                data = b"".join(label + ln + b"\n" for ln in lines)
            data = _drop_lines(data, drop)
            if echo and data:
                _write(name, data)


def _write(name: str, data: bytes) -> None:
    """``data`` on this process's ``sys.<name>``, or its file descriptor when that fails."""
    target = getattr(sys, name)
    try:
        target.write(data.decode("utf-8", "replace"))
        target.flush()
    except Exception:  # a closed or replaced stream must not kill forwarding
        with contextlib.suppress(Exception):
            os.write(1 if name == "stdout" else 2, data)
