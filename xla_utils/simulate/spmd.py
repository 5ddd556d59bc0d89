"""SPMD programs on simulated cores: one fresh process with N real XLA:CPU devices.

An SPMD program (``xr.use_spmd()``, ``xs.Mesh``, ``mark_sharding``, FSDPv2,
``MpDeviceLoader(input_sharding=...)``) is one process that owns every device;
XLA's own partitioner inserts the collectives. Its faithful simulation is that
process with ``PJRT_DEVICE=CPU CPU_NUM_DEVICES=N`` (no host collectives). The
runner decides the form before running by reading the script's names
(:func:`.forms.detect_form`), says so, and runs the script through :func:`spmd_child_main`,
where ``xmp.spawn`` / ``torch_xla.launch`` raise a named error (a program that
mixes the two forms); replicas of the multi-process form refuse ``xr.use_spmd()``
(see :mod:`.collectives`), so a program never silently gets fewer devices than
``--cores``.
"""
from __future__ import annotations

import os
import runpy
import subprocess
import sys
from pathlib import Path
from typing import Sequence

from .dist import LOOPBACK_ENV, patch_distributed_spmd


def run_spmd(path: str, cores: int, args: Sequence[str] = (),
             timeout: float | None = None) -> int:
    """Run the script as ``__main__`` in a fresh process with ``cores`` XLA:CPU
    devices; returns its exit status."""
    env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES=str(cores), **LOOPBACK_ENV)
    env.pop("XLA_USE_SPMD", None)
    here = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join([here, env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "xla_utils.simulate", "--spmd-child", str(cores), path,
           *map(str, args)]
    try:
        return subprocess.run(cmd, env=env, timeout=timeout).returncode
    except subprocess.TimeoutExpired:
        print(f"xla_utils.simulate: SPMD run of {path} killed after {timeout:g} s (--timeout)",
              file=sys.stderr)
        return 1


def spmd_child_main(cores: int, path: str, args: Sequence[str]) -> int:
    """The SPMD process: refuse the multi-process entry points, run the script."""
    refuse_multiprocess(path, cores)
    patch_distributed_spmd()
    sys.argv = [path, *args]
    sys.path.insert(0, str(Path(path).resolve().parent))
    try:
        runpy.run_path(path, run_name="__main__")
    except SystemExit as exc:
        code = exc.code
        return 0 if code is None else code if isinstance(code, int) else 1
    return 0


def refuse_multiprocess(what: str, cores: int) -> None:
    """In an SPMD process, make ``xmp.spawn`` / ``torch_xla.launch`` raise a named
    error (a program that mixes the two forms)."""
    import torch_xla
    import torch_xla.distributed.xla_multiprocessing as xmp

    def mixed(*a, **k):
        raise RuntimeError(
            f"{what} mixes SPMD and multi-process forms: it was run as SPMD (one process "
            f"with {cores} XLA:CPU devices) and then called xmp.spawn / torch_xla.launch. "
            "A program is one or the other; to run its xmp.spawn form, pass --form spawn "
            "(run_script(..., form='spawn')) and do not call xr.use_spmd().")

    xmp.spawn = torch_xla.launch = mixed
