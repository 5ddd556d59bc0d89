"""The runtime's state: one object, :data:`STATE`, with a :meth:`~RuntimeState.reset` for tests.

Most of it is per process (what torch_xla import gave, whether this host has a
TPU, the thread-simulated job's shared barrier, the launched job). What a replica
*is* (its backend) is per thread, because a TPU v2/v3 process runs one replica
thread per core and thread simulation runs N replica threads in one process;
that part lives in :attr:`RuntimeState.local`, a ``threading.local``.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

__all__ = ["RuntimeState", "STATE"]


@dataclass
class SimGroup:
    """Shared by the N replica threads of a thread-simulated job.

    Attributes:
        n: Number of replica threads.
        barrier: Where the replicas meet at every step boundary.
        lock: Held while one replica compiles/launches its graph.
        values: ``rank -> number`` exchanged by a host-side sum.
        token_devices: The devices whose collective token slot was created, and
            the autograd engine started, before any replica thread ran
            (``runtime.replica._prepare_thread_job``; empty until then).
    """

    n: int
    barrier: threading.Barrier
    lock: threading.Lock = field(default_factory=threading.Lock)
    values: dict = field(default_factory=dict)
    token_devices: tuple = ()


class ReplicaLocal(threading.local):
    """Per-thread part of the state, filled in by ``launch`` inside each replica.

    Attributes:
        backend: ``"xla"``, ``"torch"`` or ``None`` (outside a replica).
        in_replica: Whether this thread runs a replica.
    """

    backend: str | None = None
    in_replica: bool = False


@dataclass
class RuntimeState:
    """Everything :mod:`xla_utils.runtime` remembers between calls.

    Attributes:
        xla: The imported torch_xla modules (``torch_xla``, ``xm``, ``xr``,
            ``xmp``, ``met``), once imported.
        xla_error: Why torch_xla cannot be imported, once that is known.
        tpu_present: Whether this host has a TPU (``None``: not probed yet).
        simulated_process: True in a simulated replica *process* (every thread of
            the process, e.g. a loader's, belongs to that one replica).
        sim: The thread-simulated job's shared group (process-global: its
            replica threads share it), or ``None``.
        job: ``(fn, args, results queue)`` inside a launched job; replicas forked
            by ``xmp.spawn`` find it here (it cannot be pickled).
        job_pid: The pid of the launched job process.
        host_sum_calls: How many host sums went through ``xm.mesh_reduce`` (each
            needs a distinct tag).
        torch_device: In a replica process of a torch-backend launch
            (:mod:`~xla_utils.runtime.torch_launch`), its device (``cuda:<rank>`` or
            the CPU); None elsewhere.
        local: The per-thread part (:class:`ReplicaLocal`).
    """

    xla: dict[str, Any] | None = None
    xla_error: str | None = None
    tpu_present: bool | None = None
    simulated_process: bool = False
    sim: SimGroup | None = None
    job: tuple | None = None
    job_pid: int | None = None
    host_sum_calls: int = 0
    torch_device: Any = None
    local: ReplicaLocal = field(default_factory=ReplicaLocal)

    def reset(self) -> None:
        """Forget everything (tests only): as in a fresh process, for every thread."""
        fresh = RuntimeState()
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(fresh, name))


STATE = RuntimeState()
