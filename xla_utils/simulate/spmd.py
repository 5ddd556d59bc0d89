"""SPMD programs on simulated cores: one fresh process with N real XLA:CPU devices.

An SPMD program (``xr.use_spmd()``, ``xs.Mesh``, ``mark_sharding``, FSDPv2,
``MpDeviceLoader(input_sharding=...)``) is one process that owns every device;
XLA's own partitioner inserts the collectives. Its faithful simulation is that
process with ``PJRT_DEVICE=CPU CPU_NUM_DEVICES=N`` (no host collectives). The
runner decides the form before running by reading the script's names
(:func:`.forms.detect_form`), says so, and runs the script through :func:`spmd_script_child`,
where ``xmp.spawn`` / ``torch_xla.launch`` raise a named error (a program that
mixes the two forms); replicas of the multi-process form refuse ``xr.use_spmd()``
(see :mod:`.collectives`), so a program never silently gets fewer devices than
``--cores``.
"""
from __future__ import annotations

import runpy
import sys
from pathlib import Path
from typing import Sequence

from ..runtime.fresh import child_env, run_fresh
from .dist import LOOPBACK_ENV, patch_distributed_spmd


def run_spmd(path: str, devices: int, args: Sequence[str] = (),
             timeout: float | None = None) -> int:
    """Run the script as ``__main__`` in a fresh process with ``devices`` XLA:CPU devices
    (:func:`xla_utils.runtime.fresh.run_fresh`); returns its exit status (1 after a timeout).

    Raises:
        ReplicaError: the script raised (its traceback), or its process died.
    """
    try:
        return run_fresh(spmd_script_child, (devices, path, tuple(map(str, args))),
                         env=child_env(devices, LOOPBACK_ENV),
                         what=f"the SPMD process running {path}", timeout=timeout)
    except TimeoutError:
        print(f"xla_utils.simulate: SPMD run of {path} killed after {timeout:g} s (--timeout)",
              file=sys.stderr)
        return 1


def spmd_script_child(devices: int, path: str, args: Sequence[str]) -> int:
    """In the SPMD process: refuse the multi-process entry points, run the script; its
    exit status."""
    refuse_multiprocess(path, devices)
    patch_distributed_spmd()
    sys.argv = [path, *args]
    sys.path.insert(0, str(Path(path).resolve().parent))
    try:
        runpy.run_path(path, run_name="__main__")
    except SystemExit as exc:
        code = exc.code
        if code is None or isinstance(code, int):
            return code or 0
        print(code, file=sys.stderr)
        return 1
    return 0


def refuse_multiprocess(what: str, devices: int) -> None:
    """In an SPMD process, make ``xmp.spawn`` / ``torch_xla.launch`` raise a named
    error (a program that mixes the two forms)."""
    import torch_xla
    import torch_xla.distributed.xla_multiprocessing as xmp

    def mixed(*a, **k):
        raise RuntimeError(
            f"{what} mixes SPMD and multi-process forms: it was run as SPMD (one process "
            f"with {devices} XLA:CPU devices) and then called xmp.spawn / torch_xla.launch. "
            "A program is one or the other; to run its xmp.spawn form, pass --form spawn "
            "(run_script(..., form='spawn')) and do not call xr.use_spmd().")

    xmp.spawn = torch_xla.launch = mixed
