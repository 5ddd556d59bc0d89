"""SPMD functions on simulated cores: ``launch(fn, simulate=N)`` and ``simulated_spawn()``.

A function (a notebook cell's training function) that uses SPMD (``use_spmd``,
``Mesh``, ``mark_sharding``, FSDPv2, ``input_sharding``) is one program that owns
every device, so its faithful simulation is one fresh process with
``PJRT_DEVICE=CPU CPU_NUM_DEVICES=N`` (as for a script, see :mod:`.spmd`), not N
replica processes. :func:`.forms.fn_uses_spmd` reads the function's code (and the code
of the user functions and classes it names, not library code) for SPMD names;
:func:`run_spmd_fn` sends ``fn`` and its arguments there with cloudpickle, runs
it once and returns its result (device tensors as CPU tensors) or raises
``ReplicaError`` with its traceback.
"""
from __future__ import annotations

import os
import pickle
import subprocess
import sys
import tempfile
import threading
import traceback
from pathlib import Path
from typing import Any, Callable

from .dist import LOOPBACK_ENV, patch_distributed_spmd

_PAYLOAD, _RESULT, _ERROR = "payload.pkl", "result.pkl", "error.txt"


def run_spmd_fn(fn: Callable[..., Any], args: tuple, cores: int, why: str,
                timeout: float | None = None, pass_index: bool = False) -> Any:
    """Run ``fn(*args)`` (``fn(0, *args)`` with ``pass_index``) once in a fresh process
    with ``cores`` XLA:CPU devices and return its result.

    Raises:
        ReplicaError: ``fn`` raised (its traceback), or the process died.
        TimeoutError: ``timeout`` seconds passed; the process was killed.
    """
    import cloudpickle

    from ..runtime.replica import ReplicaError
    from .relay import forward_output

    name = getattr(fn, "__qualname__", repr(fn))
    print(f"xla_utils.simulate: running {name} as SPMD (one process with {cores} XLA:CPU "
          f"devices) because {why}", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(prefix="xla_utils_spmd_") as folder:
        Path(folder, _PAYLOAD).write_bytes(
            cloudpickle.dumps((fn, args), protocol=pickle.HIGHEST_PROTOCOL))
        env = _spmd_env(cores)
        cmd = [sys.executable, "-m", "xla_utils.simulate", "--spmd-fn", str(cores), folder,
               "1" if pass_index else "0"]
        sys.stdout.flush()
        sys.stderr.flush()
        proc = subprocess.Popen(cmd, env=env, cwd=os.getcwd(), stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        lock = threading.Lock()
        threads = [threading.Thread(target=forward_output, args=(s, n, lock), daemon=True)
                   for s, n in ((proc.stdout, "stdout"), (proc.stderr, "stderr"))]
        for t in threads:
            t.start()
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise TimeoutError(f"the SPMD process running {name} was killed after "
                               f"{timeout:g} s (timeout)") from None
        for t in threads:
            t.join(timeout=5)
        err = Path(folder, _ERROR)
        if err.exists():
            exc_type, _, tb = err.read_text(encoding="utf-8").partition("\n")
            raise ReplicaError(0, tb, exc_type)
        res = Path(folder, _RESULT)
        if rc != 0 or not res.exists():
            raise ReplicaError(0, f"the SPMD process running {name} ended with exit status "
                                  f"{rc} without a result (its output is above)", "ProcessDied")
        return pickle.loads(res.read_bytes())


def _spmd_env(cores: int) -> dict[str, str]:
    env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES=str(cores), **LOOPBACK_ENV)
    for k in ("XLA_USE_SPMD", "TPU_NUM_DEVICES", "TPU_VISIBLE_CHIPS", "TPU_PROCESS_BOUNDS",
              "PJRT_LOCAL_PROCESS_RANK", "PJRT_LOCAL_PROCESS_COUNT"):
        env.pop(k, None)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(Path(__file__).resolve().parents[2])] + [p for p in sys.path if p])
    return env


def spmd_fn_child_main(cores: int, folder: str, pass_index: bool) -> int:
    """The SPMD process of :func:`run_spmd_fn`: run ``fn`` once, write its result."""
    import cloudpickle

    from ..runtime.replica import dumps_cpu
    from .spmd import refuse_multiprocess

    refuse_multiprocess(f"the function sent by launch(fn, simulate={cores})", cores)
    patch_distributed_spmd()
    try:
        fn, args = cloudpickle.loads(Path(folder, _PAYLOAD).read_bytes())
        out = fn(0, *args) if pass_index else fn(*args)
        Path(folder, _RESULT).write_bytes(dumps_cpu(out))
    except BaseException as exc:  # noqa: BLE001 (handed back to the caller)
        if isinstance(exc, SystemExit) and exc.code in (None, 0):
            Path(folder, _RESULT).write_bytes(pickle.dumps(None))
            return 0
        Path(folder, _ERROR).write_text(
            f"{type(exc).__name__}\n{traceback.format_exc()}", encoding="utf-8")
        return 1
    return 0
