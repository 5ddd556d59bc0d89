"""The one package that talks to torch_xla.

Everything else in xla_utils asks this package for the device, world size, rank,
step boundary (``sync``), gradient-averaging optimizer step, reductions, saving
and launching. Keeping every torch_xla call here means one place to adapt when
the API moves (``xm.xla_device`` -> ``torch_xla.device``, ``xm.mark_step`` ->
``torch_xla.sync``, and the announced TorchTPU successor).

Backends
--------
``"xla"``   torch_xla devices: TPU cores, or ``simulate=N`` XLA:CPU devices.
``"torch"`` plain PyTorch: one CUDA device or the CPU in-process (world size 1), or,
            on a machine with several GPUs, one forked replica process per GPU over
            torch.distributed (NCCL); ``XLA_UTILS_CPU_REPLICAS=N`` makes it N CPU
            processes over gloo. Used when no TPU is present and no simulation was
            asked for, and whenever torch_xla is missing.

Inside :func:`launch` each replica knows its backend. Outside it, the backend is
``"xla"`` on a TPU machine (calling :func:`device` then initialises the XLA
runtime in this process, after which :func:`launch` can no longer spawn) and
``"torch"`` elsewhere.

Simulated cores
---------------
Simulated jobs start from a clean interpreter (see :mod:`xla_utils.simulate`), in
one of two ways:

- ``launch(fn, simulate=N)`` runs N replica *processes*, each with one XLA:CPU
  device. Inside them torch_xla's world queries and collectives are the
  simulated world's, so any torch_xla idiom works and this module calls
  torch_xla exactly as on a TPU.
- xla_utils' own loops (``fit``, ``predict``, ``evaluate``, ``lr_find``, ``check``)
  run N replica *threads* of one process on N XLA:CPU devices
  (``CPU_NUM_DEVICES=N``): one compilation instead of N, so much faster on a
  small host (docs/BENCHMARKS.md). That only works because these loops
  synchronise solely through :func:`sync`: threads compiling the same graph
  concurrently would get different collective op ids ("Expected N threads to
  join the rendezvous"), so in thread simulation every :func:`sync` first meets
  the other replicas at a ``threading.Barrier`` and then compiles/launches the
  graph under one lock (execution stays asynchronous, so the collective itself
  still runs concurrently and cannot deadlock on the lock).

Layout
------
``state``     :data:`~.state.STATE`, the one state object (per-thread backend
              inside), with ``reset()`` for tests.
``xla``       the lazy torch_xla import and its error message; TPU probe.
``gpu``       the host's NVIDIA GPUs from ``nvidia-smi`` (no CUDA initialised), a replica's
              from torch; ``torch_devices``: how many replicas the torch backend runs.
``torch_world``  the torch backend's ranks and collectives over a torch.distributed
              process group (the only caller of its collectives).
``world``     backend, device, ranks, ``sync``, collectives, ``save``, seeding.
``transfer``  ``to_device``, ``host_copy``, ``device_prefetch`` (on CUDA: copies on a side stream, ``overlapped``).
``counters``  XLA counters (``xla_counters``, ``xla_counters_report``).
``forksafe``  which forks may inherit an OpenMP team (the zygote's check before
              every fork; a fresh thread for TPU jobs) and the one-thread guard.
``compile_cache``  torch_xla's persistent compilation cache, initialised first
              thing in every replica of the entry points (``compile_cache=``).
``placement``  :class:`Placement`: where a run happens (backend, device kind, world
              size, simulated or real), resolved once by the entry points (``resolve``).
``replica``   the replica side of a launch: the job's and replicas' entry
              points, which :mod:`xla_utils.simulate` calls into.
``relay``     a child process's output re-printed here (a notebook's streams), its tail kept.
``fresh``     ``run_fresh``: a callable in a fresh interpreter (one environment,
              ``child_env``; result or ``ReplicaError``; timeout): SPMD functions and
              scripts, a strategy's mesh run, the memory measurement.
``shardinfo`` per-device bytes read from XLA shardings (in a fresh process).
``torch_launch``  the torch backend's job: one replica per GPU (or CPU device), forked or,
              after the notebook used CUDA, a fresh interpreter; a file-store
              rendezvous, NCCL/gloo bound to loopback.
``launcher``  ``launch``: TPU jobs, torch jobs, simulated jobs (through the launcher
              :mod:`xla_utils.simulate` registers, :func:`.launcher.register_simulator`),
              or in-process.
The names in :data:`INTERNAL_API` (``launch_job``, ``prestart_simulation``,
``enable_compile_cache``, ``tpu_present``, ...) are this package's API for the rest of
xla_utils: public, so no other module reaches for a private name, but not for users
(not in ``__all__``). Dependencies run down this list; :mod:`xla_utils.simulate` sits above
this package (it calls ``replica`` and registers itself with ``launcher``), and nothing here
imports it. Progress bars are :mod:`xla_utils.utils.progress`.
"""
from __future__ import annotations

from .compile_cache import (CompileCacheOption, check_compile_cache_option, compile_cache_summary,
                            default_compile_cache_root, enable_compile_cache)
from .counters import xla_counters, xla_counters_report
from .launcher import (launch, launch_job, prestart_if_simulation_likely, prestart_simulation,
                       register_simulator, same_everywhere)
from ..env.gpu import CPU_REPLICAS_ENV, TorchDevices, torch_devices
from .hosts import slice_host
from .placement import Placement, resolve
from .replica import ReplicaError
from .state import STATE, RuntimeState
from .torch_launch import NotSendableError
from .torch_world import gradient_reductions
from .transfer import device_prefetch, host_copy, to_device
from .world import (all_reduce, backend, data_parallel, device, graph_text, is_master, is_simulated,
                    local_rank, master_print, no_sync, optimizer_step, rank, reduce_gradients,
                    rendezvous, replica_noun, replicas_word, save, set_seed, sync, text_progress,
                    world_size)
from .world import progress_bars
from .xla import (RuntimeAlreadyInitializedError, XLAUnavailableError, fast_cpu_compile_flags,
                  load_xla, tpu_present, xla_available, xla_installed, xla_runtime_initialized)

__all__ = [
    "XLAUnavailableError",
    "RuntimeAlreadyInitializedError",
    "NotSendableError",
    "ReplicaError",
    "xla_available",
    "fast_cpu_compile_flags",
    "backend",
    "device",
    "world_size",
    "rank",
    "local_rank",
    "is_master",
    "is_simulated",
    "sync",
    "optimizer_step",
    "all_reduce",
    "master_print",
    "rendezvous",
    "save",
    "to_device",
    "device_prefetch",
    "xla_counters",
    "xla_counters_report",
    "default_compile_cache_root",
    "progress_bars",
    "set_seed",
    "launch",
    "graph_text",
    "STATE",
    "RuntimeState",
]

# The package's API for the rest of xla_utils (trainer, lr_finder, readiness, debug,
# strategy, simulate) and the tests: public names, but not for users, so neither in
# __all__ nor among the names `xla_utils` exports.
INTERNAL_API = (
    "launch_job",  # launch with sim_threads: xla_utils' own loops as replica threads
    "prestart_simulation",
    "prestart_if_simulation_likely",
    "enable_compile_cache",
    "check_compile_cache_option",
    "compile_cache_summary",
    "CompileCacheOption",
    "tpu_present",
    "xla_installed",
    "xla_runtime_initialized",
    "load_xla",
    "register_simulator",
    "reduce_gradients",  # a gradient scaler's step: average the gradients, then step it
    "data_parallel",  # the trainer's model in DistributedDataParallel on torch replicas
    "no_sync",  # its accumulation steps
    "gradient_reductions",  # gradient buckets all-reduced so far (tests count them)
    "text_progress",
    "replica_noun",
    "replicas_word",  # "8 cores", "2 GPUs", "2 processes": a run's replicas in its device's words
    "torch_devices",  # how many replicas the torch backend runs (no CUDA initialised)
    "TorchDevices",
    "CPU_REPLICAS_ENV",
    "host_copy",  # a CPU copy of a state dict (best weights, the last finite state)
    "resolve",  # the entry points' one placement of a run (cores=, simulate=, the host)
    "Placement",
    "same_everywhere",  # a host-side decision (a run's id) made once in a torchrun world
    "slice_host",  # (this host, hosts) on a pod slice or torchrun's nodes, else None
)
