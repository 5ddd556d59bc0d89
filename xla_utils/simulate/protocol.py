"""The simulated job's protocol: store keys, events, payload files, reports.

The caller (:mod:`.caller`), the job and its replicas (:mod:`.job`) and the host
collectives (:mod:`.collectives`) meet only through what this module defines.

* The caller's ``TCPStore`` (:func:`serve_store`, listening on the loopback address
  only) carries keys and small events only: the append-only
  ``events`` key (lines ``kind rank value``), arrivals at collectives, ``finished/r``
  and ``abort``. A store value is limited to 8 MiB (c10d's libuv backend), so
* every payload (rank 0's result, error reports with their tracebacks, tensors of
  a collective, ``rendezvous`` / ``mesh_reduce`` bytes) is a file in the job's
  folder on ``/dev/shm`` (:func:`write_payload`: written to a temporary name,
  then renamed, so a reader sees all of it or nothing), limited only by the
  host's memory. The caller removes the folder when the job is over, however it
  ended; the zygote writes the job's exit status there (:data:`JOB_STATUS`).
* :class:`Reporter` is the one implementation of a replica's reports
  (``result``, ``finished``, ``error``, ``done``), for process and thread jobs.
"""
from __future__ import annotations

import contextlib
import errno
import os
import pickle
import signal
import socket
import struct
from typing import Any, Iterator

from ..utils.atomic import atomic_write

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

# Payload files in the job's folder.
RESULT = "result"  # rank 0's return value (runtime.replica.dumps_cpu)
JOB_STATUS = "job.status"  # the job process's exit status, written by the zygote
FOLDER_PREFIX = "xla_utils-sim-"  # the job folders: xla_utils-sim-<caller pid>-<random>
# An error report that cannot be written as a file goes into the store, cut to this.
STORE_REPORT_MAX = 64 * 1024


def error_name(rank: int) -> str:
    return f"error.{rank}"


def lost_name(rank: int) -> str:
    """A report that could not reach the store (its connection failed)."""
    return f"lost.{rank}"


def tensor_name(seq: int, rank: int, i: int) -> str:
    return f"{seq}.{rank}.{i}"


def rendezvous_name(seq: int, rank: int) -> str:
    return f"rdv.{seq}.{rank}"


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


class TransportError(RuntimeError):
    """A payload could not be handed over: its file could not be written or read."""


def write_payload(folder: str, name: str, data: bytes) -> str:
    """Write ``data`` as ``folder/name`` (all or nothing); returns the path.

    Raises:
        TransportError: The file could not be written (folder gone, ``/dev/shm`` full).
    """
    path = os.path.join(folder, name)
    try:  # the job's own file on /dev/shm: a crash loses the job, so no fsync; a
        # deleted job folder is a transport error, not recreated
        atomic_write(path, data, durable=False, parents=False)
    except OSError as exc:
        hint = (" /dev/shm is full: free it (`df -h /dev/shm`) or simulate fewer cores"
                if exc.errno == errno.ENOSPC else "")
        raise TransportError(f"could not write {len(data):,} bytes to {path}: "
                             f"{type(exc).__name__}: {exc}.{hint}") from exc
    return path


def read_payload(folder: str, name: str) -> bytes:
    """The bytes of ``folder/name``.

    Raises:
        TransportError: The file is missing or unreadable.
    """
    path = os.path.join(folder, name)
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise TransportError(f"could not read {path}: {type(exc).__name__}: {exc}") from exc


def td(seconds: float):
    """``seconds`` as the ``timedelta`` that c10d stores take."""
    from datetime import timedelta

    return timedelta(seconds=seconds)


def serve_store():
    """The caller's ``TCPStore`` (the server; its ``port`` goes to the job), listening
    on the loopback address only.

    c10d's store server binds every interface when it opens its own socket (``ss
    -ltn`` shows ``*:port``), which would let any host that reaches this one set a
    job's keys and events. So the listening socket is made here, bound to
    ``127.0.0.1`` (every replica lives on this host), and handed to the store
    (``master_listen_fd``), which owns and closes it.
    """
    import torch.distributed as dist

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind(("127.0.0.1", 0))
        sock.listen(1024)
        store = dist.TCPStore("127.0.0.1", sock.getsockname()[1], is_master=True,
                              wait_for_workers=False, timeout=td(STORE_TIMEOUT_S),
                              master_listen_fd=sock.fileno())
    except BaseException:
        sock.close()
        raise
    sock.detach()  # the store closes the descriptor
    return store


def connect(port: int):
    """A client of the caller's store on ``127.0.0.1:port`` (:func:`serve_store`)."""
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


class Reporter:
    """A replica's (or its job's) reports to the caller: the one implementation for
    process replicas (:mod:`.job`) and thread jobs (``runtime.replica``'s
    ``results`` queue). Payloads are files in ``folder``, the store gets events."""

    def __init__(self, store, folder: str, n: int, why: str = "") -> None:
        # store None: the connection failed (``why``); every report raises ConnectionError
        self.store, self.folder, self.n, self.why = store, folder, n, why

    def report(self, kind: str, rank: int, payload: Any = None) -> None:
        """``result`` (pickled bytes), ``finished``, ``error`` (``(traceback,
        exception type name, secondary)``) or ``done`` (every replica has exited).

        Raises:
            TransportError: A result could not be written (an error report falls
                back to the store, cut to :data:`STORE_REPORT_MAX`).
        """
        store = self.store
        if store is None:
            raise ConnectionError(f"no connection to the caller's store: {self.why}")
        if kind == "result":
            write_payload(self.folder, RESULT, payload)
            event(store, "result", rank)
        elif kind == "finished":
            store.set(finished_key(rank), "1")
            event(store, "finished", rank)
        elif kind == "error":
            event(store, "error", rank, self._error(rank, payload))
        elif kind == "done":
            for i in range(self.n):
                event(store, "exit", i, 0)
        else:
            raise ValueError(f"unknown report kind {kind!r}")

    def _error(self, rank: int, payload: tuple) -> int:
        """Hand over an error report; 0: as a file, 1: in the store (the file failed)."""
        try:
            write_payload(self.folder, error_name(rank), pickle.dumps(payload))
            return 0
        except TransportError as exc:
            tb, exc_type, secondary = payload
            cut = len(tb) > STORE_REPORT_MAX // 2
            tb = (f"{'...' if cut else ''}{tb[-STORE_REPORT_MAX // 2:]}\n(this report came "
                  f"through the store{', cut' if cut else ''}: {exc})")
            self.store.set(f"error/{rank}", pickle.dumps((tb, exc_type, secondary)))
            return 1

    def lost(self, rank: int, text: str) -> None:
        """Last resort when the store itself failed: leave ``text`` as a file."""
        with contextlib.suppress(Exception):
            write_payload(self.folder, lost_name(rank), text.encode("utf-8", "replace"))


def read_error(store, folder: str, rank: int, value: int) -> tuple[str, str, bool]:
    """The ``(traceback, exception type, secondary)`` that rank ``rank`` reported
    (``value``: 0 as a file, 1 in the store).

    Raises:
        TransportError: The report could not be read.
    """
    if value == 1:
        return pickle.loads(store.get(f"error/{rank}"))
    data = read_payload(folder, error_name(rank))
    try:
        return pickle.loads(data)
    except Exception as exc:
        raise TransportError(f"the error report {os.path.join(folder, error_name(rank))} "
                             f"({len(data):,} bytes) is corrupt: {type(exc).__name__}: "
                             f"{exc}") from exc
