"""Several hosts: a world that another launcher started, which a run joins instead of
starting its own replicas.

Under ``torchrun`` (one process per GPU or CPU replica on each node, several nodes meeting
through a c10d rendezvous) every process runs the user's whole script: ``fit()``,
``predict()`` and the LR finder must not start replicas of their own inside each torchrun
process, but run as that process's replica of torchrun's world. :func:`torchrun_world`
reads torchrun's variables once (:func:`xla_utils.runtime.resolve` puts them in the
:class:`~xla_utils.runtime.placement.Placement`: its hosts, this host's index, the replicas
of this host); :func:`run_joined` runs a launch there:

* every replica of the world: this process joins torchrun's process group (once, through
  torchrun's own store: ``init_method="env://"``), runs ``fn`` as a replica of the torch
  backend on ``cuda:LOCAL_RANK`` or the CPU, and every process gets global rank 0's result
  (so that the script's next line, a ``predict`` or a submission, sees the same values on
  every host);
* one core (the LR finder, a ``cores=1`` call): global rank 0 runs ``fn`` alone, as a world
  of one, and every process gets its result (one sweep, one answer used by every host).

The ranks are torchrun's: ``RANK`` (global), ``LOCAL_RANK`` (on this host), ``GROUP_RANK``
(this host's index); the global master is global rank 0, wherever torchrun put it.

A rehearsed pod slice (``python -m xla_utils.simulate --hosts H --cores C script.py``) runs
the script once per simulated host, each with :data:`POD_ENV` describing its place:
:func:`simulated_pod` reads it (a :class:`PodWorld`), ``resolve`` makes it the placement's
hosts, and a launch there runs this host's C simulated cores as replicas of the H x C world
(:mod:`xla_utils.simulate`); decisions made on each host before a launch are made once, by
the host holding global ordinal 0 (:func:`pod_agreed`). As on a real pod, that host need not be
the first one (``--master-host``).
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
import pickle
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from . import torch_world
from ..utils.atomic import atomic_write
from .replica import dumps_cpu
from .state import STATE

__all__ = ["TorchrunWorld", "torchrun_world", "run_joined", "agreed", "JOIN_TIMEOUT_S",
           "PodWorld", "simulated_pod", "pod_agreed", "pod_lost", "slice_host", "POD_ENV",
           "HostLost"]

# Seconds the processes of a joined world wait for each other in a collective (a host
# that died is named by torchrun's agent long before; torch's default is 30 minutes).
JOIN_TIMEOUT_S = float(os.environ.get("XLA_UTILS_COLLECTIVE_TIMEOUT", "1800"))

_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")

# The environment variable that makes a process one host of a rehearsed pod slice (JSON,
# written by ``python -m xla_utils.simulate --hosts``).
POD_ENV = "XLA_UTILS_SIM_POD"
# Store key set when a host of a rehearsed pod is lost (its text names the host).
POD_LOST = "pod/lost"


@dataclass(frozen=True)
class TorchrunWorld:
    """The world torchrun started, as its variables give it.

    Attributes:
        rank: This process's global rank (``RANK``).
        world_size: Processes over all hosts (``WORLD_SIZE``).
        local_rank: This process's rank on its host (``LOCAL_RANK``).
        local_world_size: Processes on this host (``LOCAL_WORLD_SIZE``).
        host: This host's index (``GROUP_RANK``, torchrun's node rank).
        hosts: Hosts in the world (``WORLD_SIZE / LOCAL_WORLD_SIZE``; torchrun starts the
            same number of processes on every node).
    """

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    host: int
    hosts: int


def torchrun_world(environ: Mapping[str, str] | None = None) -> TorchrunWorld | None:
    """The torchrun world this process belongs to, or None: not started by torchrun
    (``TORCHELASTIC_RUN_ID`` and the rank variables unset).

    Raises:
        ValueError: torchrun's variables are set but not consistent (named).
    """
    env = os.environ if environ is None else environ
    if "TORCHELASTIC_RUN_ID" not in env or not all(v in env for v in _TORCHRUN_VARS):
        return None
    try:
        rank, world, local, local_world = (int(env[v]) for v in _TORCHRUN_VARS)
        host = int(env.get("GROUP_RANK", rank // max(local_world, 1)))
    except ValueError as exc:
        raise ValueError(f"torchrun's variables are not integers ({exc}): "
                         + ", ".join(f"{v}={env.get(v)!r}" for v in _TORCHRUN_VARS)) from None
    if not (0 <= rank < world and 0 <= local < local_world <= world and world % local_world == 0):
        raise ValueError("torchrun's variables disagree: " + ", ".join(
            f"{v}={env[v]}" for v in _TORCHRUN_VARS) + ". Start the script with torchrun "
            "--nproc-per-node K on every node (the same K everywhere)")
    return TorchrunWorld(rank, world, local, local_world, host, world // local_world)


def _join(kind: str, world: TorchrunWorld) -> Any:
    """Join torchrun's process group (once per process); this replica's device."""
    import torch
    import torch.distributed as dist

    if kind == "cuda":
        torch.cuda.set_device(world.local_rank)
        device = torch.device("cuda", world.local_rank)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        dist.init_process_group("nccl" if kind == "cuda" else "gloo", init_method="env://",
                                rank=world.rank, world_size=world.world_size,
                                timeout=datetime.timedelta(seconds=JOIN_TIMEOUT_S))
    elif dist.get_world_size() != world.world_size:
        raise RuntimeError(f"this process's torch.distributed group has "
                           f"{dist.get_world_size()} ranks but torchrun's world has "
                           f"{world.world_size}: destroy it (dist.destroy_process_group()) or "
                           "start it with torchrun's variables (init_method='env://')")
    return device


def run_joined(fn: Callable[..., Any], args: tuple, *, kind: str, one_core: bool,
               world: TorchrunWorld) -> Any:
    """``fn(*args)`` in torchrun's world (see the module's docstring): every process calls
    it and gets global rank 0's result.

    Args:
        fn, args: The launch's replica function and its arguments.
        kind: The devices: ``"cuda"`` (NCCL, ``cuda:LOCAL_RANK``) or ``"cpu"`` (gloo).
        one_core: Run on global rank 0 alone, as a world of one.
        world: :func:`torchrun_world`'s answer for this process.
    """
    device = _join(kind, world)
    prev = STATE.local.backend, STATE.local.in_replica, STATE.torch_device
    STATE.local.backend, STATE.local.in_replica, STATE.torch_device = "torch", True, device
    try:
        if one_core:
            return _on_rank_0(fn, args, world)
        out = fn(*args)  # a replica that raises ends its process; torchrun ends the others
        return _from_rank_0(dumps_cpu(("result", out)) if world.rank == 0 else None)
    finally:
        STATE.local.backend, STATE.local.in_replica, STATE.torch_device = prev


def agreed(value: Any, *, kind: str, world: TorchrunWorld) -> Any:
    """``value`` as global rank 0 has it, on every process of torchrun's world (a decision
    made on each host before a launch, such as a new run's id, made once). Every process
    must call it.

    Args:
        value: This process's value (picklable).
        kind: The devices (``"cuda"``: NCCL, or ``"cpu"``: gloo).
        world: :func:`torchrun_world`'s answer for this process.
    """
    _join(kind, world)
    return pickle.loads(torch_world.broadcast_object(pickle.dumps(value) if world.rank == 0
                                                     else None))


def _on_rank_0(fn: Callable[..., Any], args: tuple, world: TorchrunWorld) -> Any:
    """``fn(*args)`` on global rank 0 as a world of one; its result (or its error, named)
    on every process."""
    payload = None
    if world.rank == 0:
        try:
            with torch_world.solo():
                payload = dumps_cpu(("result", fn(*args)))
        except BaseException as exc:
            torch_world.broadcast_object(pickle.dumps(("error", f"{type(exc).__name__}: {exc}")))
            raise
    return _from_rank_0(payload)


def _from_rank_0(payload: bytes | None) -> Any:
    what, value = pickle.loads(torch_world.broadcast_object(payload))
    if what == "error":
        raise RuntimeError(f"global rank 0 of torchrun's world failed ({value}); its traceback "
                           "is in its own output")
    return value


class HostLost(RuntimeError):
    """Another host of the (rehearsed) pod slice died or failed: this host stops too."""


@dataclass(frozen=True)
class PodWorld:
    """This host's place in a rehearsed pod slice (:data:`POD_ENV`).

    Attributes:
        hosts: Hosts in the slice.
        host: This host's index (its worker id), 0 .. hosts-1.
        cores: Simulated cores (replica processes) per host.
        master_host: The host holding global ordinal 0 (the global master).
        port: The slice's store on ``127.0.0.1`` (the rehearsal's interconnect).
        folder: The interconnect's payload folder (collective inputs, results).
    """

    hosts: int
    host: int
    cores: int
    master_host: int
    port: int
    folder: str

    @property
    def world_size(self) -> int:
        """Replicas over all hosts."""
        return self.hosts * self.cores

    @property
    def is_master_host(self) -> bool:
        """Whether this host holds global ordinal 0."""
        return self.host == self.master_host

    def ordinal(self, local: int, host: int | None = None) -> int:
        """The global ordinal of core ``local`` of ``host`` (default: this host). Hosts are
        numbered from the master host on, so ``ordinal(0, master_host) == 0``."""
        host = self.host if host is None else host
        return ((host - self.master_host) % self.hosts) * self.cores + local

    def host_of(self, ordinal: int) -> int:
        """The host holding global ordinal ``ordinal``."""
        return (ordinal // self.cores + self.master_host) % self.hosts

    def env_value(self) -> str:
        """This world as :data:`POD_ENV`'s value."""
        import json

        return json.dumps(dataclasses.asdict(self))


def simulated_pod(environ: Mapping[str, str] | None = None) -> PodWorld | None:
    """This process's host of a rehearsed pod slice, or None (:data:`POD_ENV` unset).

    Raises:
        ValueError: :data:`POD_ENV` is set but not a pod's description (named).
    """
    import json

    env = os.environ if environ is None else environ
    text = env.get(POD_ENV)
    if not text:
        return None
    try:
        pod = PodWorld(**json.loads(text))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{POD_ENV}={text!r} is not a pod slice's description ({exc}); it is "
                         "set by `python -m xla_utils.simulate --hosts H`: unset it") from None
    if not (pod.hosts >= 1 and 0 <= pod.host < pod.hosts and 0 <= pod.master_host < pod.hosts
            and pod.cores >= 1):
        raise ValueError(f"{POD_ENV}={text!r}: host and master_host must be below hosts, "
                         "cores positive")
    return pod


def slice_host(environ: Mapping[str, str] | None = None) -> tuple[int, int] | None:
    """``(host, hosts)`` when this process runs on one host of several (a rehearsed slice,
    or a TPU pod slice whose ``TPU_WORKER_HOSTNAMES`` lists more than one worker, this one
    ``TPU_WORKER_ID``; torchrun's nodes), else None."""
    env = os.environ if environ is None else environ
    pod = simulated_pod(env)
    if pod is not None:
        return (pod.host, pod.hosts) if pod.hosts > 1 else None
    names = [n for n in env.get("TPU_WORKER_HOSTNAMES", "").split(",") if n.strip()]
    if len(names) > 1:
        with contextlib.suppress(ValueError):
            return int(env.get("TPU_WORKER_ID", "0")), len(names)
    world = torchrun_world(env)
    if world is not None and world.hosts > 1:
        return world.host, world.hosts
    return None


_POD_STORE: dict = {}
_AGREED: list = [0]  # how many values this process agreed on (each has its key)


def pod_store(pod: PodWorld):
    """This process's client of the slice's store (one per process)."""
    key = (os.getpid(), pod.port)
    if key not in _POD_STORE:
        import torch.distributed as dist

        _POD_STORE[key] = dist.TCPStore("127.0.0.1", pod.port, is_master=False,
                                        timeout=datetime.timedelta(seconds=60))
    return _POD_STORE[key]


def pod_lost(pod: PodWorld) -> str | None:
    """Why the slice's rehearsal marked a host lost (naming it), or None."""
    store = pod_store(pod)
    return store.get(POD_LOST).decode() if store.check([POD_LOST]) else None


def pod_wait(pod: PodWorld, key: str, what: str, timeout_s: float = JOIN_TIMEOUT_S) -> bytes:
    """``key``'s value in the slice's store once some host set it; :class:`HostLost` when a
    host was lost first, ``TimeoutError`` (naming ``what``) after ``timeout_s`` seconds."""
    import time

    store, end = pod_store(pod), time.monotonic() + timeout_s
    while not store.check([key]):
        lost = pod_lost(pod)
        if lost is not None:
            raise HostLost(lost)
        if time.monotonic() > end:
            raise TimeoutError(f"no host set {what} within {timeout_s:.0f} s")
        time.sleep(0.05)
    return store.get(key)


def pod_agreed(value: Any, pod: PodWorld) -> Any:
    """``value`` as the master host (global ordinal 0's) has it, on every host of the
    rehearsed slice: what each host's script decides before a launch (a new run's id, the
    LR finder's answer), decided once. Every host must call it, in the same order. The
    value travels as a file in the slice's folder (any size), its key says it is there.

    Raises:
        HostLost: a host of the slice was lost meanwhile.
    """
    store = pod_store(pod)
    _AGREED[0] += 1
    key, path = f"agreed/{_AGREED[0]}", os.path.join(pod.folder, f"agreed.{_AGREED[0]}")
    if pod.is_master_host:
        atomic_write(path, pickle.dumps(value), durable=False)
        store.set(key, "1")
        return value
    pod_wait(pod, key, f"agreed value {_AGREED[0]} (the master host's)")
    with open(path, "rb") as f:
        return pickle.loads(f.read())
