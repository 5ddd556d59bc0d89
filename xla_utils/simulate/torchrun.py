"""torchrun-style scripts on simulated cores.

A script launched with ``torchrun --nproc_per_node N script.py`` is run as
``__main__`` by each of N processes, which find their rank in the environment
(``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``TORCHELASTIC_RUN_ID``, ...) and
usually call ``dist.init_process_group('xla', init_method='xla://')``. Under
``--cores N`` such a script runs as ``__main__`` in each of N simulated replicas
with those variables set (the ``xla://`` and ``env://`` rendezvous are the job's
own store, see :mod:`.dist`), so its collectives are the replicas' host
collectives.
"""
from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path
from typing import Sequence


def run_torchrun(path: str, devices: int, args: Sequence[str] = (),
                 timeout: float | None = None) -> int:
    """Run the script as ``__main__`` in each of ``devices`` simulated replicas with
    torchrun's environment; returns 0 (a replica's failure raises ``ReplicaError``)."""
    from .caller import run_replicas

    path = str(Path(path).resolve())
    run_replicas(torchrun_replica, (path, [str(a) for a in args]), devices,
                 timeout=timeout, pass_index=True, program=path)
    return 0


def torchrun_replica(index: int, path: str, args: list[str]) -> None:
    """One torchrun process: set torchrun's variables and run the script.

    Raises:
        RuntimeError: The script exited with a non-zero status.
    """
    import torch_xla.runtime as xr

    n = xr.world_size()
    os.environ.update(RANK=str(index), LOCAL_RANK=str(index), GROUP_RANK="0",
                      ROLE_RANK=str(index), WORLD_SIZE=str(n), LOCAL_WORLD_SIZE=str(n),
                      ROLE_WORLD_SIZE=str(n), TORCHELASTIC_RUN_ID="xla_utils-simulate",
                      MASTER_ADDR=os.environ.get("MASTER_ADDR", "127.0.0.1"),
                      MASTER_PORT=os.environ.get("MASTER_PORT", "29500"))
    sys.argv = [path, *args]
    sys.path.insert(0, str(Path(path).parent))
    try:
        runpy.run_path(path, run_name="__main__")
    except SystemExit as exc:
        if exc.code not in (None, 0):
            raise RuntimeError(f"{path} exited with status {exc.code!r} in torchrun "
                               f"process {index} of {n}") from None
