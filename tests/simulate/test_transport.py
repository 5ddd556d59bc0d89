"""xla_utils.simulate's transport on real XLA:CPU: payloads of any size, jobs that die.

Everything a simulated replica hands back (its result, an error report) and sends
another replica (``rendezvous`` / ``mesh_reduce`` bytes, tensors of a collective)
is a file in the job's folder on /dev/shm; the store carries keys and events only
(a store value is limited to 8 MiB). A job that dies is reported with what killed
it. Each test checks that the job's folder is gone afterwards.
"""
from __future__ import annotations

import glob
import os
import pickle
import signal
import tempfile

import pytest
import torch

from xla_utils import runtime as rt
from xla_utils.runtime import launcher
from xla_utils.runtime.placement import resolve
from xla_utils.simulate import caller as sim_caller
from xla_utils.simulate import protocol

MB = 1 << 20
SHM = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def _folders() -> list[str]:
    return glob.glob(os.path.join(SHM, f"{protocol.FOLDER_PREFIX}{os.getpid()}-*"))


@pytest.fixture(autouse=True)
def no_leaked_folders():
    assert _folders() == []
    yield
    assert _folders() == [], "a simulated job left its folder on /dev/shm"


def _launch(fn, *args, n: int, threads: bool):
    """A process job (launch(fn, simulate=n)) or a thread job (what fit/predict run)."""
    return launcher.launch_job(fn, args, placement=resolve(simulate=n), timeout=300,
                               sim_threads=threads)


def _big_result(nbytes: int):
    return {"rank": rt.rank(), "x": torch.arange(nbytes // 4, dtype=torch.float32)}


@pytest.mark.multicore
@pytest.mark.timeout(300)
@pytest.mark.parametrize("threads", [False, True], ids=["processes", "threads"])
def test_a_result_over_the_store_limit_is_handed_back(threads):
    out = _launch(_big_result, 24 * MB, n=2, threads=threads)
    assert out["rank"] == 0 and out["x"].numel() == 6 * MB
    assert out["x"][-1].item() == 6 * MB - 1


def _big_traceback(nbytes: int):
    if rt.rank() == 1:
        raise ValueError("x" * nbytes + " END")
    if rt.world_size() > 1 and rt.backend() == "xla":
        rt.sync()  # thread replicas meet here (rank 1 aborts the barrier)
    return 0


@pytest.mark.multicore
@pytest.mark.timeout(300)
@pytest.mark.parametrize("threads", [False, True], ids=["processes", "threads"])
def test_an_error_report_over_the_store_limit_is_handed_back(threads):
    with pytest.raises(rt.ReplicaError) as info:
        _launch(_big_traceback, 10 * MB, n=2, threads=threads)
    err = info.value
    assert err.rank == 1 and err.exc_type == "ValueError"
    assert err.remote_traceback.rstrip().endswith(" END")
    assert len(err.remote_traceback) > 10 * MB


def _kill_own_job(sig: int):
    if rt.rank() == 0:
        os.killpg(os.getpgid(0), sig)  # the job and every replica
    import time

    time.sleep(60)


@pytest.mark.multicore
@pytest.mark.timeout(300)
@pytest.mark.parametrize("threads", [False, True], ids=["processes", "threads"])
def test_a_sigkilled_job_is_reported_as_sigkill(threads):
    with pytest.raises(rt.ReplicaError) as info:
        _launch(_kill_own_job, int(signal.SIGKILL), n=2, threads=threads)
    msg = str(info.value)
    assert info.value.exc_type == "ProcessDied"
    assert "killed by signal 9 (SIGKILL)" in msg and "out of memory" in msg


@pytest.mark.multicore
@pytest.mark.timeout(300)
def test_a_sigterm_is_named_without_the_memory_hint():
    with pytest.raises(rt.ReplicaError) as info:
        _launch(_kill_own_job, int(signal.SIGTERM), n=2, threads=True)
    msg = str(info.value)
    assert "killed by signal 15 (SIGTERM)" in msg
    assert "memory" not in msg and "signal or out of memory" not in msg


def _delete_job_folder(caller_pid: int):
    import shutil

    if rt.world_size() > 1 and rt.backend() == "xla":
        rt.sync()  # every thread replica is past its start before the folder goes
    if rt.rank() == 0:
        for folder in glob.glob(os.path.join(SHM, f"{protocol.FOLDER_PREFIX}{caller_pid}-*")):
            shutil.rmtree(folder)
    return torch.zeros(4)


@pytest.mark.multicore
@pytest.mark.timeout(300)
@pytest.mark.parametrize("threads", [False, True], ids=["processes", "threads"])
def test_a_broken_transport_is_named(threads):
    with pytest.raises(rt.ReplicaError) as info:
        _launch(_delete_job_folder, os.getpid(), n=2, threads=threads)
    msg = str(info.value)
    assert info.value.rank == 0
    assert "TransportError" in msg and "FileNotFoundError" in msg
    assert f"{protocol.FOLDER_PREFIX}{os.getpid()}-" in msg and "result" in msg
    assert "killed" not in msg


def _cut_store_connection_then_raise():
    import socket

    from xla_utils.simulate import collectives

    if rt.rank() == 0:
        port = collectives._World.store.port
        for fd in map(int, os.listdir("/proc/self/fd")):
            try:
                s = socket.socket(fileno=os.dup(fd))
            except OSError:
                continue
            with s:
                try:
                    if s.getpeername()[1] == port:
                        s.shutdown(socket.SHUT_RDWR)  # this replica's store connection
                except (OSError, IndexError, TypeError):
                    pass
        raise ValueError("deliberate, after the store connection was cut")
    return 0


@pytest.mark.multicore
@pytest.mark.timeout(300)
def test_a_lost_store_connection_is_named():
    with pytest.raises(rt.ReplicaError) as info:
        _launch(_cut_store_connection_then_raise, n=2, threads=False)
    err = info.value
    msg = str(err)
    assert err.rank == 0 and err.exc_type == "TransportError"
    assert "connection to the caller's store failed while reporting 'error'" in msg
    assert "deliberate, after the store connection was cut" in msg  # the report it carried
    assert "died abruptly" not in msg and "killed" not in msg


def test_a_corrupt_result_file_is_named(tmp_path):
    # the caller's side of the protocol against a real store and a real file
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    (tmp_path / protocol.RESULT).write_bytes(pickle.dumps(list(range(1000)))[:100])
    protocol.event(store, "result", 0)
    watch = sim_caller._JobWatch(store, str(tmp_path), 1)
    watch.read()
    err = watch.first_error
    assert not watch.got_result and err.exc_type == "TransportError"
    assert "is corrupt" in str(err) and str(tmp_path / protocol.RESULT) in str(err)


def test_a_lost_report_and_an_exit_status_are_named(tmp_path):
    # what the caller says about a job that is gone: a report its store connection
    # could not carry, else the status the zygote wrote (pid 2**22 + 1 never exists)
    absent = 2 ** 22 + 1
    protocol.write_payload(str(tmp_path), protocol.JOB_STATUS, b"0")
    err = sim_caller._job_died(absent, str(tmp_path))
    assert "ended with exit code 0" in str(err) and "killed" not in str(err)
    protocol.write_payload(str(tmp_path), protocol.lost_name(3), b"Broken pipe")
    err = sim_caller._job_died(absent, str(tmp_path))
    assert err.rank == 3 and err.exc_type == "TransportError" and "Broken pipe" in str(err)


def test_folders_of_dead_callers_are_removed(tmp_path):
    dead = os.path.join(SHM, f"{protocol.FOLDER_PREFIX}{2 ** 22 + 1}-old")
    os.makedirs(dead, exist_ok=True)
    folder = sim_caller._new_job_folder()
    try:
        assert not os.path.exists(dead) and os.path.isdir(folder)
    finally:
        os.rmdir(folder)


def _save_and_mesh_reduce(path: str, mb: int):
    import torch_xla.core.xla_model as xm
    import torch_xla.runtime as xr

    n = mb * MB // 4
    state = {"w": torch.full((n,), float(xr.global_ordinal() + 1))}
    xm.save(state, path)  # master only
    # a tensor: torch.load(weights_only=True) in torch_xla's mesh_reduce refuses numpy arrays
    arr = torch.full((n,), float(xr.global_ordinal() + 1))
    total = xm.mesh_reduce("big", arr, lambda xs: [float(x[0]) for x in xs] + [x.numel() for x in xs[-1:]])
    xm.rendezvous("after")
    return total


@pytest.mark.slow
@pytest.mark.multicore
@pytest.mark.timeout(600)
def test_xm_save_and_mesh_reduce_of_64_mb_on_8_cores(tmp_path):
    path = str(tmp_path / "state.pt")
    out = rt.launch(_save_and_mesh_reduce, path, 64, simulate=8, timeout=500)
    assert out == [float(r + 1) for r in range(8)] + [16 * MB]
    saved = torch.load(path)
    assert saved["w"].numel() == 16 * MB and saved["w"][0].item() == 1.0
