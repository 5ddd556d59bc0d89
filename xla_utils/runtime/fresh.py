"""One fresh interpreter: run a callable in a new Python process and get its result.

Every part of xla_utils that needs a process of its own (the SPMD simulation of a
function, a strategy's mesh run on N devices, the memory measurement, an SPMD script)
goes through :func:`run_fresh`, a process whose XLA runtime is untouched and whose
device count is its own (``PJRT_DEVICE=CPU CPU_NUM_DEVICES=N``, or this host's TPU):

* **environment**: :func:`child_env` (this ``xla_utils`` and this process's ``sys.path``
  on ``PYTHONPATH``, the device variables; the child also takes this process's exact
  ``sys.path`` and working folder);
* **arguments in, result out**: ``fn`` and ``args`` are cloudpickled (notebook functions
  and models work); the result comes back pickled with device tensors as CPU tensors
  (:func:`~xla_utils.runtime.replica.dumps_cpu`);
* **output**: relayed chunk by chunk to this process's ``sys.stdout`` / ``sys.stderr``
  (a notebook's too) by :func:`~xla_utils.runtime.relay.forward_output`, or only kept
  (``echo=False``); its last lines go into the error of a process that died;
* **errors**: an exception in ``fn`` is raised here as
  :class:`~xla_utils.runtime.replica.ReplicaError` with its traceback and type; a child
  that dies without a result is a ``ReplicaError`` of type ``"ProcessDied"`` with the
  end of its output; past ``timeout`` seconds the child is killed and ``TimeoutError``
  raised. An interrupt here (Ctrl-C, a notebook's stop button) kills the child too.
"""
from __future__ import annotations

import os
import pickle
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from ..utils.atomic import atomic_write
from ..env import child_pythonpath
from .relay import OutputTail, forward_output
from .replica import ReplicaError, dumps_cpu

__all__ = ["run_fresh", "child_env", "fresh_child_main", "write_call", "read_call"]

# This host's TPU variables: a child with XLA:CPU devices must not see them.
_TPU_VARS = ("TPU_NUM_DEVICES", "TPU_VISIBLE_CHIPS", "TPU_PROCESS_BOUNDS",
             "TPU_CHIPS_PER_PROCESS_BOUNDS", "XRT_TPU_CONFIG", "COLAB_TPU_ADDR")
# A launch's per-replica variables and SPMD mode: a fresh process decides its own.
_LAUNCH_VARS = ("XLA_USE_SPMD", "PJRT_LOCAL_PROCESS_RANK", "PJRT_LOCAL_PROCESS_COUNT")

# XLA's noise that says nothing to a user of the child's output.
RUNTIME_NOISE = ("Defaulting to PJRT_DEVICE", "GSPMD sharding propagation")

_WHERE, _JOB, _OUT = "where.pkl", "job.pkl", "out.pkl"


def child_env(devices: int | str | None = None, extra: Mapping[str, str] | None = None
              ) -> dict[str, str]:
    """The environment of a fresh interpreter started from this process.

    Args:
        devices: an int N: ``PJRT_DEVICE=CPU CPU_NUM_DEVICES=N`` with this host's TPU
            variables removed and ``TORCHINDUCTOR_COMPILE_THREADS=1`` unless set (no inductor
            worker pool per simulated replica); ``"tpu"``: ``PJRT_DEVICE=TPU`` (this host's chips);
            None (default): the device variables are left as they are (a process that
            sets its own).
        extra: variables set last (e.g. ``XLA_FLAGS``).

    Returns:
        This process's environment with ``PYTHONPATH`` from
        :func:`xla_utils.env.child_pythonpath` and the settings above.
    """
    env = dict(os.environ)
    if devices is not None:
        for k in _LAUNCH_VARS:
            env.pop(k, None)
    if devices == "tpu":
        env["PJRT_DEVICE"] = "TPU"
        env.pop("CPU_NUM_DEVICES", None)
    elif devices is not None:
        if not isinstance(devices, int) or devices < 1:
            raise ValueError(f"devices must be a positive int or 'tpu', got {devices!r}")
        for k in _TPU_VARS:
            env.pop(k, None)
        env.update(PJRT_DEVICE="CPU", CPU_NUM_DEVICES=str(devices))
        # torch_xla's import would start inductor's compile-worker pool in each XLA:CPU child
        # (an interpreter importing torch: ~4 s of CPU and its memory, per replica); one
        # compile thread starts none. A value the user set wins.
        env.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    env["PYTHONPATH"] = child_pythonpath()
    env.update(extra or {})
    return env


def run_fresh(fn: Callable[..., Any], args: Sequence[Any] = (), *, env: Mapping[str, str],
              what: str, timeout: float | None = None, echo: bool = True) -> Any:
    """``fn(*args)`` in a fresh interpreter; its result here.

    Args:
        fn: called as ``fn(*args)`` in the child (cloudpickled; a module-level function
            is sent by name).
        args: its arguments (cloudpickled).
        env: the child's environment, from :func:`child_env`.
        what: what the child is, for messages (e.g. ``"the SPMD process running train"``).
        timeout: seconds after which the child is killed (default: none).
        echo: print the child's output here as it comes (default True); False keeps
            only its end for the error of a child that died.

    Returns:
        What ``fn`` returned, device tensors as CPU tensors (``SystemExit(0)`` or
        ``sys.exit()`` in ``fn``: None).

    Raises:
        ReplicaError: ``fn`` raised (its traceback and type), or the child died without
            a result (type ``"ProcessDied"``, the end of its output in the message).
        TimeoutError: ``timeout`` seconds passed; the child was killed.
    """
    import cloudpickle

    with tempfile.TemporaryDirectory(prefix="xla_utils_fresh_") as d:
        folder = Path(d)
        write_call(folder, cloudpickle.dumps((fn, tuple(args)), protocol=pickle.HIGHEST_PROTOCOL))
        rc, tail = _run_child(folder, dict(env), what, timeout, echo)
        out = folder / _OUT
        if not out.exists():
            raise ReplicaError(0, f"{what} ended with exit status {rc} without a result; "
                                  f"the end of its output:\n{tail.lines()}", "ProcessDied")
        kind, payload = pickle.loads(out.read_bytes())
    if kind == "error":
        raise ReplicaError(0, payload[0], payload[1])
    return pickle.loads(payload)


def _run_child(folder: Path, env: dict[str, str], what: str, timeout: float | None,
               echo: bool) -> tuple[int, OutputTail]:
    """Start the child on ``folder``, relay its output until it ends; its exit status."""
    cmd = [sys.executable, "-c",
           "import sys; from xla_utils.runtime.fresh import fresh_child_main; "
           "fresh_child_main(sys.argv[1])", str(folder)]
    sys.stdout.flush()
    sys.stderr.flush()
    proc = subprocess.Popen(cmd, env=env, cwd=os.getcwd(), stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    lock, tail = threading.Lock(), OutputTail()
    relays = [threading.Thread(target=forward_output, args=(stream, name, lock),
                               kwargs={"echo": echo, "tail": tail, "drop": RUNTIME_NOISE},
                               daemon=True, name=f"xla_utils-fresh-{name}")
              for stream, name in ((proc.stdout, "stdout"), (proc.stderr, "stderr"))]
    for t in relays:
        t.start()
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill(proc)
        raise TimeoutError(f"{what} was killed after {timeout:g} s (timeout)") from None
    except BaseException:
        _kill(proc)
        raise
    for t in relays:
        t.join(timeout=5)
    return rc, tail


def _kill(proc: subprocess.Popen) -> None:
    proc.kill()
    proc.wait()


def write_call(folder: Path, call: bytes) -> None:
    """Write what a fresh interpreter runs into ``folder``: ``call`` (the cloudpickled
    ``(fn, args)``), this process's ``sys.path`` and working folder (:func:`read_call`)."""
    (folder / _WHERE).write_bytes(pickle.dumps((list(sys.path), os.getcwd())))
    (folder / _JOB).write_bytes(call)


def read_call(folder: Path) -> tuple[Callable[..., Any], tuple]:
    """In the fresh interpreter: take the caller's ``sys.path`` and working folder, then
    unpickle the ``(fn, args)`` that :func:`write_call` wrote in ``folder``."""
    path, cwd = pickle.loads((folder / _WHERE).read_bytes())
    sys.path[:] = [p for p in path if p] + [p for p in sys.path if p not in path]
    os.chdir(cwd)
    return pickle.loads((folder / _JOB).read_bytes())


def fresh_child_main(folder: str) -> None:
    """The child of :func:`run_fresh`: take the caller's ``sys.path`` and folder, run
    ``fn(*args)``, write ``("ok", result)`` or ``("error", (traceback, type))``, exit."""
    import traceback

    d = Path(folder)
    try:
        fn, args = read_call(d)
        result: tuple[str, Any] = ("ok", dumps_cpu(fn(*args)))
    except SystemExit as exc:
        result = (("ok", pickle.dumps(None)) if exc.code in (None, 0) else
                  ("error", (traceback.format_exc(), "SystemExit")))
    except BaseException as exc:  # noqa: BLE001 (handed back to the caller)
        result = ("error", (traceback.format_exc(), type(exc).__name__))
    atomic_write(d / _OUT, pickle.dumps(result), durable=False)  # a temporary folder
    sys.stdout.flush()
    sys.stderr.flush()
    # The XLA runtime's teardown can crash natively at exit; the result is written.
    os._exit(0)

