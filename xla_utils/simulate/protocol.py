"""The simulated job's protocol: constants, store keys, events, errors.

The caller (:mod:`.caller`), the job and its replicas (:mod:`.job`) and the host
collectives (:mod:`.collectives`) meet only through what this module defines:
the keys of the caller's ``TCPStore`` and the append-only ``events`` key, whose
lines are ``kind rank value``.
"""
from __future__ import annotations

import os
import pickle
import signal
import socket
import struct
from typing import Any, Iterator

# Seconds a replica waits in a collective for the others to arrive, when none of
# them has returned, died or reached a different collective (those end the wait
# at once). Override with the environment variable XLA_UTILS_COLLECTIVE_TIMEOUT.
COLLECTIVE_TIMEOUT_S = 30.0
# After the first replica error, how long the others get to report.
ERROR_GRACE_S = 3.0
POLL_S = 0.05
WAIT_SLICE_S = 0.25  # how often a replica waiting in a collective checks on its peers
SEP = "\x1f"  # between the fields of an arrival record
STORE_TIMEOUT_S = 60.0

# Store keys.
EVENTS = "events"  # append-only: "kind rank value\n" lines
ABORT = "abort"  # set by the first replica that fails: why the others stop


def finished_key(rank: int) -> str:
    return f"finished/{rank}"


def arrival_key(seq: int, rank: int) -> str:
    return f"arr/{seq}/{rank}"


class CollectiveError(RuntimeError):
    """Simulated replicas did not meet in the same collective (rank-dependent code,
    a peer that returned early or died, or a timeout). The message names the
    collective and where each rank is."""


class PeerFailed(RuntimeError):
    """This replica stopped because another replica failed first (secondary)."""


def td(seconds: float):
    """``seconds`` as the ``timedelta`` that c10d stores take."""
    from datetime import timedelta

    return timedelta(seconds=seconds)


def connect(port: int):
    """A client of the caller's store on ``127.0.0.1:port``."""
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=td(STORE_TIMEOUT_S))


def event(store, kind: str, rank: int, value: int = 0) -> None:
    """Append one event line for the caller."""
    store.append(EVENTS, f"{kind} {rank} {value}\n".encode())


class EventReader:
    """Reads the append-only ``events`` key: lines ``kind rank value``."""

    def __init__(self, store) -> None:
        self.store, self.offset = store, 0

    def poll(self) -> Iterator[tuple[str, int, int]]:
        if not self.store.check([EVENTS]):
            return
        data = self.store.get(EVENTS)
        new, self.offset = data[self.offset:], len(data)
        for line in new.decode().splitlines():
            kind, r, value = line.split()
            yield kind, int(r), int(value)


def describe_status(status: int) -> str:
    """A process's exit status (negative: the signal) in words."""
    if status < 0:
        name = signal.Signals(-status).name
        hint = (" (SIGKILL usually means the host ran out of memory)"
                if -status == signal.SIGKILL else "")
        return f"killed by signal {-status} ({name}){hint}"
    return f"exit code {status}"


def timeout_s() -> float:
    return float(os.environ.get("XLA_UTILS_COLLECTIVE_TIMEOUT", COLLECTIVE_TIMEOUT_S))


def send_msg(sock: socket.socket, obj: Any) -> None:
    """Send one pickled message over the caller-zygote socket."""
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    sock.sendall(struct.pack("!Q", len(data)) + data)


def recv_msg(sock: socket.socket) -> Any:
    """Receive one message sent by :func:`send_msg`."""
    def exact(n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            chunk = sock.recv(n - len(buf))
            if not chunk:
                raise EOFError("zygote connection closed")
            buf += chunk
        return bytes(buf)

    (n,) = struct.unpack("!Q", exact(8))
    return pickle.loads(exact(n))
