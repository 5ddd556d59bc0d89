"""Run a function in a fresh process that owns N real XLA devices (SPMD form).

:func:`run_on_devices` cloudpickles ``fn`` and ``args`` (notebook functions and
models work), starts ``python -m xla_utils.simulate.devices`` with
``PJRT_DEVICE=CPU CPU_NUM_DEVICES=N`` (or ``PJRT_DEVICE=TPU`` for the host's
chips), runs ``fn(*args)`` there as the one replica (no host collectives: SPMD's
collectives are XLA's own) and returns its result, device tensors turned into CPU
tensors. The child's output is relayed line by line, so progress shows in a
notebook too. An exception in the child is raised here as ``ReplicaError`` with
its traceback.
"""
from __future__ import annotations

import os
import pickle
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

__all__ = ["run_on_devices"]


def run_on_devices(fn: Callable[..., Any], args: tuple, devices: int | None, *,
                   timeout: float | None = None) -> Any:
    """``fn(*args)`` in a fresh process with ``devices`` XLA:CPU devices (None: the TPU).

    Args:
        fn: Called as ``fn(*args)`` in the child (cloudpickled).
        args: Its arguments.
        devices: Number of simulated XLA:CPU devices; None runs on this host's TPU
            chips (``PJRT_DEVICE=TPU``).
        timeout: Seconds after which the child is killed (default none).

    Returns:
        What ``fn`` returned (CPU tensors).

    Raises:
        ReplicaError: ``fn`` raised in the child, or the child died.
        TimeoutError: ``timeout`` passed; the child was killed.
    """
    import cloudpickle

    from ..runtime.replica import ReplicaError

    env = dict(os.environ)
    env.pop("XLA_USE_SPMD", None)
    if devices is None:
        env["PJRT_DEVICE"] = "TPU"
        env.pop("CPU_NUM_DEVICES", None)
    else:
        env.update(PJRT_DEVICE="CPU", CPU_NUM_DEVICES=str(devices))
    here = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join([here, env.get("PYTHONPATH", "")])
    with tempfile.TemporaryDirectory(prefix="xla_utils-devices-") as d:
        job, out = Path(d) / "job.pkl", Path(d) / "out.pkl"
        (Path(d) / "where.pkl").write_bytes(pickle.dumps((list(sys.path), os.getcwd())))
        job.write_bytes(cloudpickle.dumps((fn, tuple(args))))
        sys.stdout.flush()
        proc = subprocess.Popen([sys.executable, "-m", "xla_utils.simulate.devices", d], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                bufsize=1, start_new_session=True)
        try:
            _relay(proc, timeout)
        except BaseException:
            proc.kill()
            proc.wait()
            raise
        if not out.exists():
            raise ReplicaError(0, f"the device process died (exit code {proc.returncode}) "
                               "without a Python traceback", "ProcessDied")
        kind, payload = pickle.loads(out.read_bytes())
    if kind == "error":
        raise ReplicaError(0, payload[0], payload[1])
    return pickle.loads(payload)


def _relay(proc: subprocess.Popen, timeout: float | None) -> None:
    """Print the child's output as it comes; kill it after ``timeout`` seconds."""
    import threading

    timer = None
    expired = threading.Event()
    if timeout is not None:
        def kill() -> None:
            expired.set()
            proc.kill()
        timer = threading.Timer(timeout, kill)
        timer.daemon = True
        timer.start()
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if "Defaulting to PJRT_DEVICE" not in line and "GSPMD sharding propagation" not in line:
                print(line, end="", flush=True)
        proc.wait()
    finally:
        if timer is not None:
            timer.cancel()
    if expired.is_set():
        raise TimeoutError(f"the device process was killed after {timeout} s (timeout)")


def child_main(folder: str) -> int:
    """The child: load the job, run it as the one XLA replica, write the result."""
    import traceback

    d = Path(folder)
    try:
        path, cwd = pickle.loads((d / "where.pkl").read_bytes())
        sys.path[:] = [p for p in path if p] + [p for p in sys.path if p not in path]
        os.chdir(cwd)
        fn, args = pickle.loads((d / "job.pkl").read_bytes())
    except Exception:
        (d / "out.pkl").write_bytes(pickle.dumps(("error", (traceback.format_exc(),
                                                              "UnpicklingError"))))
        return 1
    import torch

    from ..runtime.replica import dumps_cpu
    from ..runtime.state import STATE

    STATE.local.backend, STATE.local.in_replica = "xla", True
    try:
        with torch.autograd.set_multithreading_enabled(False):
            result = ("ok", dumps_cpu(fn(*args)))
    except BaseException as exc:
        result = ("error", (traceback.format_exc(), type(exc).__name__))
    (d / "out.pkl").write_bytes(pickle.dumps(result))
    sys.stdout.flush()
    # The XLA runtime's teardown can crash natively at exit; the result is written.
    os._exit(0)


if __name__ == "__main__":
    sys.exit(child_main(sys.argv[1]))
