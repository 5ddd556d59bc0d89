"""Where a run happens, decided once: :class:`Placement` (what accelerate's ``PartialState`` is).

The public entry points (``fit``, ``predict``, ``evaluate``, ``find_lr`` / ``lr_find``,
``debug``, ``launch``, ``cross_validate``, the simulate runners, the demo) turn the user's
``cores=`` and ``simulate=`` into one :class:`Placement` with :func:`resolve` and pass it
down: the launcher, the strategies' plans, the precision check and the trainer's parts
read the backend, the device kind and the world size from it and never work them out again.

:func:`resolve` reads the environment once, without initialising CUDA or the XLA runtime:
whether a TPU is present and torch_xla usable, the TPU's devices
(:func:`xla_utils.env.detect`), or the torch backend's replicas (``nvidia-smi`` or
``XLA_UTILS_CPU_REPLICAS``: :func:`xla_utils.env.gpu.torch_devices`); under ``torchrun`` the
world torchrun started, over its hosts (:func:`xla_utils.runtime.hosts.torchrun_world`),
which a launch joins instead of starting replicas of its own.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..env.gpu import torch_devices
from ..utils.suggest import choice
from .hosts import simulated_pod, slice_host, torchrun_world
from .xla import tpu_present, xla_available

__all__ = ["Placement", "resolve", "KINDS"]

KINDS = ("tpu", "xla_cpu", "cuda", "cpu")


@dataclass(frozen=True)
class Placement:
    """Where a run happens: its backend, devices and world size.

    Attributes:
        backend: ``"xla"`` (a TPU, or simulated XLA:CPU devices) or ``"torch"``.
        kind: The devices: ``"tpu"``, ``"xla_cpu"`` (simulated), ``"cuda"`` or ``"cpu"``.
        replicas: The world size of a launch (a mesh strategy's device count).
        one_core: The user asked for one core (``cores=1``).
        simulated: N simulated XLA:CPU devices (``simulate=N``), or None: real devices.
        host_devices: Devices of ``kind`` on this host (a torch launch's replica
            processes when all are used; a TPU's devices; the simulated count; under
            torchrun, its processes on this host).
        hosts: Hosts the run spans (torchrun's nodes, a TPU pod slice's workers listed in
            ``TPU_WORKER_HOSTNAMES``, a rehearsed slice's hosts; 1 otherwise).
        host: This host's index among them (``GROUP_RANK``, ``TPU_WORKER_ID``, the rehearsed
            host's; 0 otherwise).
        joined: ``"torchrun"``: the replicas are the processes torchrun started, which a
            launch joins (:func:`xla_utils.runtime.hosts.run_joined`); ``"pod"``: a host of a
            rehearsed pod slice, whose launches start this host's share of the world
            (:func:`xla_utils.runtime.hosts.simulated_pod`); None: a launch starts its own.
    """

    backend: str
    kind: str
    replicas: int
    one_core: bool = False
    simulated: int | None = None
    host_devices: int = 1
    hosts: int = 1
    host: int = 0
    joined: str | None = None

    @property
    def is_simulated(self) -> bool:
        """Whether the run's devices are simulated XLA:CPU devices."""
        return self.simulated is not None

    @property
    def world_known(self) -> bool:
        """Whether :attr:`replicas` is the run's world size for sure: on a TPU with every core
        it is detected on this host, and a pod slice's replicas span hosts."""
        return self.one_core or self.kind != "tpu"

    def one(self) -> Placement:
        """The same devices, one of them (``cores=1``)."""
        return dataclasses.replace(self, one_core=True, replicas=1)


def resolve(cores: int | str = "all", simulate: int | None = None) -> Placement:
    """The placement of a run from the user's ``cores=`` and ``simulate=``.

    Args:
        cores: ``"all"`` (any case) or 1.
        simulate: N simulated XLA:CPU devices, or None: this machine's TPU, GPUs or CPU.

    Raises:
        ValueError: ``cores`` or ``simulate`` is not one of those, naming the setting and
            what it takes; ``XLA_UTILS_CPU_REPLICAS`` is not a positive integer; torchrun's
            variables disagree.
    """
    cores = choice(cores, ("all",), "cores", "1")
    if cores not in ("all", 1):
        raise ValueError(f"cores must be 'all' or 1, got {cores!r} (TPUs and GPUs run 1 or all "
                         "devices)")
    if simulate is not None and (not isinstance(simulate, int) or simulate < 1):
        raise ValueError(f"simulate must be a positive int (number of XLA:CPU devices), got {simulate!r}")
    one = cores == 1
    pod = simulated_pod()
    if pod is not None:  # a host of a rehearsed pod slice: its world, whatever simulate says
        if simulate not in (None, pod.world_size):
            raise ValueError(
                f"simulate={simulate} on host {pod.host} of a rehearsed pod slice of "
                f"{pod.hosts} hosts x {pod.cores} cores: the world is {pod.world_size} cores. "
                f"Fix: simulate={pod.world_size} or no simulate (as fit() on a real slice)")
        return Placement("xla", "xla_cpu", 1 if one else pod.world_size, one, pod.world_size,
                         pod.cores, pod.hosts, pod.host, "pod")
    if simulate is not None:
        return Placement("xla", "xla_cpu", 1 if one else simulate, one, simulate, simulate)
    if tpu_present() and xla_available():
        from .. import env

        count = max(env.detect().num_devices or 1, 1)
        host, hosts = slice_host() or (0, 1)  # a pod slice: TPU_WORKER_ID of TPU_WORKER_HOSTNAMES
        return Placement("xla", "tpu", 1 if one else count, one, None, count, hosts, host)
    devices = torch_devices()
    world = torchrun_world()
    if world is not None:  # each torchrun process is one replica; its device is its LOCAL_RANK's
        kind = "cuda" if devices.kind == "cuda" else "cpu"
        return Placement("torch", kind, 1 if one else world.world_size, one, None,
                         world.local_world_size, world.hosts, world.host, "torchrun")
    return Placement("torch", devices.kind, 1 if one else devices.count, one, None, devices.count)
