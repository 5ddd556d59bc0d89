"""The output relay of a child process: its pipes re-printed on this process's streams.

The zygote (:mod:`.caller`) and the SPMD process of a function (:mod:`.spmd_fn`) write
to pipes; :func:`forward_output` copies them to ``sys.stdout`` / ``sys.stderr`` here, so
that their output reaches a notebook.
"""
from __future__ import annotations

import contextlib
import os
import sys
import threading

__all__ = ["forward_output"]


def forward_output(stream, name: str, lock: threading.Lock) -> None:
    """Re-print everything a child process writes to ``stream`` (its stdout or stderr pipe)
    on this process's ``sys.<name>`` (a notebook's, which is not file descriptor 1),
    one chunk at a time under ``lock``, until the pipe closes."""
    import select

    fd = stream.fileno()
    while True:
        with contextlib.suppress(OSError, ValueError):
            select.select([fd], [], [])
        with lock:
            try:
                data = os.read(fd, 65536)
            except OSError:
                return
            if not data:
                return
            target = getattr(sys, name)
            try:
                target.write(data.decode("utf-8", "replace"))
                target.flush()
            except Exception:  # a closed or replaced stream must not kill forwarding
                with contextlib.suppress(Exception):
                    os.write(1 if name == "stdout" else 2, data)
