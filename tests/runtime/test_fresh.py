"""xla_utils.runtime.fresh: one callable in a fresh interpreter (result, error, timeout,
environment, output), real processes, no torch_xla (each child starts in ~2 s)."""
from __future__ import annotations

import os
import sys
import time

import pytest

from xla_utils.runtime.fresh import child_env, run_fresh
from xla_utils.runtime.replica import ReplicaError

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _where(tag: str) -> dict:
    import torch

    print(f"child says {tag}")
    print("Defaulting to PJRT_DEVICE=CPU (noise that is not relayed)", file=sys.stderr)
    return {"tag": tag, "cwd": os.getcwd(), "path0": sys.path[:3], "pid": os.getpid(),
            "devices": os.environ.get("CPU_NUM_DEVICES"), "pjrt": os.environ.get("PJRT_DEVICE"),
            "spmd": os.environ.get("XLA_USE_SPMD"), "chips": os.environ.get("TPU_VISIBLE_CHIPS"),
            "extra": os.environ.get("XLA_UTILS_TEST_EXTRA"), "tensor": torch.arange(3)}


def _raise(msg: str) -> None:
    raise ValueError(msg)


def _sleep(pidfile: str) -> None:
    with open(pidfile, "w") as f:
        f.write(str(os.getpid()))
    time.sleep(120)


def _die() -> None:
    print("last words before dying", flush=True)
    os._exit(3)


def _exit_zero() -> None:
    sys.exit(0)


def test_result_environment_and_output(tmp_path, monkeypatch, capfd):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("XLA_USE_SPMD", "1")
    monkeypatch.setenv("TPU_VISIBLE_CHIPS", "0,1")
    env = child_env(2, {"XLA_UTILS_TEST_EXTRA": "yes"})
    assert env["PYTHONPATH"].split(os.pathsep)[0] == REPO  # this copy of xla_utils first
    got = run_fresh(_where, ("hello",), env=env, what="the test child", timeout=120)
    assert got["tag"] == "hello" and got["tensor"].tolist() == [0, 1, 2]
    assert got["pid"] != os.getpid()
    assert got["cwd"] == str(tmp_path)  # the caller's working folder
    assert got["path0"] == [p for p in sys.path if p][:3]  # the caller's sys.path, in order
    assert (got["devices"], got["pjrt"], got["spmd"], got["chips"], got["extra"]) == \
        ("2", "CPU", None, None, "yes")
    out, err = capfd.readouterr()
    assert "child says hello" in out and "Defaulting to PJRT_DEVICE" not in out + err


def test_env_for_the_tpu_and_for_a_process_that_sets_its_own(monkeypatch):
    monkeypatch.setenv("CPU_NUM_DEVICES", "4")
    monkeypatch.setenv("TPU_VISIBLE_CHIPS", "0")
    tpu = child_env("tpu")
    assert tpu["PJRT_DEVICE"] == "TPU" and "CPU_NUM_DEVICES" not in tpu
    assert tpu["TPU_VISIBLE_CHIPS"] == "0"
    own = child_env()
    assert own["CPU_NUM_DEVICES"] == "4" and own["PYTHONPATH"].split(os.pathsep)[0] == REPO
    with pytest.raises(ValueError, match="devices must be a positive int or 'tpu'"):
        child_env(0)


def test_an_exception_comes_back_with_its_type_and_traceback():
    with pytest.raises(ReplicaError) as info:
        run_fresh(_raise, ("boom in the child",), env=child_env(1), what="the test child",
                  timeout=120)
    err = info.value
    assert err.exc_type == "ValueError"
    assert "boom in the child" in err.remote_traceback and "in _raise" in err.remote_traceback


def test_a_child_that_dies_is_named_with_the_end_of_its_output(capfd):
    with pytest.raises(ReplicaError) as info:
        run_fresh(_die, env=child_env(1), what="the dying child", timeout=120, echo=False)
    assert info.value.exc_type == "ProcessDied"
    msg = str(info.value)
    assert "the dying child ended with exit status 3 without a result" in msg
    assert "last words before dying" in msg
    assert "last words" not in capfd.readouterr().out  # echo=False: kept, not printed


def test_sys_exit_zero_is_a_none_result():
    assert run_fresh(_exit_zero, env=child_env(1), what="the test child", timeout=120) is None


def test_timeout_kills_the_child(tmp_path):
    pidfile = tmp_path / "pid"
    with pytest.raises(TimeoutError, match=r"the sleeping child was killed after 5 s"):
        run_fresh(_sleep, (str(pidfile),), env=child_env(1), what="the sleeping child",
                  timeout=5)
    pid = int(pidfile.read_text())  # the child had started
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
