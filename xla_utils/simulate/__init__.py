"""Simulated TPU cores: N XLA:CPU replica processes with host collectives.

``launch(fn, simulate=N)`` and the runner below run N replicas, each a process of
its own with one XLA:CPU device. (xla_utils' own loops, ``fit``/``predict``/
``evaluate``/``lr_find``/``check``, run ``threads=True`` jobs instead: N replica
threads of one job process, see ``runtime.replica.simulate_threads``.) torch_xla's
collectives (``xm.all_reduce``, ``all_gather``, ``reduce_scatter``, ``rendezvous``,
``mesh_reduce``, ``collective_broadcast`` and, through them, ``optimizer_step``,
``reduce_gradients``, ``broadcast_master_param``) and its world queries
(``xr.world_size``, ``xr.global_ordinal``, ``xr.local_ordinal``,
``xm.is_master_ordinal``, ``xm.save``) are replaced *inside the replicas only* by
versions that report the simulated world and exchange CPU copies of the tensors
through shared memory (``/dev/shm``), synchronised by a ``TCPStore``. Every other
torch_xla call is the real one. See docs/ARCHITECTURE.md ("Simulated cores").

Run an unmodified torch_xla script (entry point ``xmp.spawn(fn, args=...)`` or
``torch_xla.launch(fn, args=...)``) on N simulated cores::

    python -m xla_utils.simulate --cores 8 train.py --epochs 1

From a notebook: ``run_script("train.py", cores=8, args=[...])``, or wrap a cell
that calls ``xmp.spawn`` / ``torch_xla.launch`` in ``with simulated_spawn(cores=8):``.

How it starts (no state of the calling process reaches a replica): the first
simulated launch starts a *zygote*, a fresh ``python -m xla_utils.simulate
--zygote`` interpreter that imports torch and torch_xla (without initialising the
XLA runtime) and then waits. Each launch sends it ``fn`` and ``args`` pickled with
cloudpickle (so functions, lambdas and models defined in a notebook cell or in
``__main__`` work) together with the caller's ``sys.path``, working directory and
environment; the zygote forks a job process, which forks one replica per core.
The zygote lives as long as the caller (it dies with it) and is restarted if it
died.

Collective errors are named and bounded: before every collective a replica records
its arrival (sequence number, collective, shapes, caller's ``file:line``) in a
``TCPStore`` and waits for the others. A mismatch (rank 0 in ``xm.all_reduce``
while the others are in ``xm.mesh_reduce``), a peer that returned from ``fn`` or
died, or ``XLA_UTILS_COLLECTIVE_TIMEOUT`` seconds (default 30) without the others
arriving raises :class:`CollectiveError`, naming the collective and where every
rank is.

Modules: :mod:`.protocol` (store keys, events, payload files: the one place
the two sides meet), :mod:`.caller` (zygote, job, :func:`run_replicas`),
:mod:`.forms` (which form a script or function is: spawn, SPMD, torchrun),
:mod:`.runner` (``python -m xla_utils.simulate``, :func:`run_script`,
:func:`simulated_spawn`), :mod:`.job` (the zygote's and job's code, replica
bootstrap), :mod:`.collectives` (torch_xla patched inside a replica),
:mod:`.dist` (torch.distributed's ``xla`` backend in a replica), :mod:`.compiled`
(``torch.compile`` in a replica) and :mod:`.spmd` (SPMD programs: one process with
N XLA:CPU devices).

Importing this package registers :func:`run_replicas` and :func:`prestart` with
:func:`xla_utils.runtime.launcher.register_simulator`: ``runtime.launch(fn,
simulate=N)`` runs through them, and ``import xla_utils`` imports this package, so
they are always registered.
"""
from __future__ import annotations

from ..runtime.launcher import register_simulator
from .caller import prestart, run_replicas
from .footprint import SimulatedMemoryError
from .protocol import COLLECTIVE_TIMEOUT_S, CollectiveError
from .runner import main, run_script, simulated_spawn

__all__ = ["CollectiveError", "run_script", "simulated_spawn", "main",
           "COLLECTIVE_TIMEOUT_S", "run_replicas", "prestart", "SimulatedMemoryError"]

# runtime sits below this package and never imports it: its launcher runs simulated jobs
# through what is registered here (import xla_utils imports this package).
register_simulator(run_replicas, prestart)
