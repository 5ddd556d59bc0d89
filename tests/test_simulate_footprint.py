"""xla_utils.simulate's footprint on the host (issue 38): what a simulated job exposes
to the network, and its memory (the estimate before a launch, the DDP ResNet on 8
simulated cores under a 12 GiB limit)."""
from __future__ import annotations

import ipaddress
import os
import threading
import time
from pathlib import Path

import pytest

from xla_utils import runtime as rt

ROOT = Path(__file__).resolve().parents[1]


# --------------------------------------------------------------------------
# Network: nothing a simulated job exchanges listens beyond the loopback address
# --------------------------------------------------------------------------
def _listening() -> dict[int, tuple[str, int]]:
    """Every listening TCP socket of this network namespace: inode -> (address, port)."""
    out = {}
    for table, v6 in (("/proc/net/tcp", False), ("/proc/net/tcp6", True)):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if f[3] != "0A":  # TCP_LISTEN
                continue
            hexaddr, hexport = f[1].split(":")
            raw = bytes.fromhex(hexaddr)
            # the kernel prints each 32-bit word in host (little-endian) order
            raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
            addr = ipaddress.IPv6Address(raw) if v6 else ipaddress.IPv4Address(raw)
            out[int(f[9])] = (str(addr), int(hexport, 16))
    return out


def _tree(pid: int) -> set[int]:
    """``pid`` and its descendants."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                stat = Path(f"/proc/{name}/stat").read_text()
            except OSError:
                continue
            children.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(name))
    out, todo = set(), [pid]
    while todo:
        p = todo.pop()
        out.add(p)
        todo.extend(children.get(p, ()))
    return out


def _sockets_of(pids: set[int]) -> set[int]:
    inodes = set()
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:["):
                inodes.add(int(link[8:-1]))
    return inodes


def _is_loopback(addr: str) -> bool:
    ip = ipaddress.ip_address(addr)
    mapped = getattr(ip, "ipv4_mapped", None)
    return (mapped or ip).is_loopback


def _hold_open(init: str, flag: str) -> int:
    """A replica that sets up a torch.distributed process group (``xla://`` or
    ``env://``) and a gloo group, all-reduces once in each, then waits (60 s at most) until ``flag`` exists."""
    import torch
    import torch.distributed as dist
    import torch_xla
    import torch_xla.distributed.xla_backend  # noqa: F401

    if init == "env":
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29500",
                          RANK=str(rt.rank()), WORLD_SIZE=str(rt.world_size()))
    dist.init_process_group("xla", init_method=f"{init}://")
    x = torch.ones(2, device=torch_xla.device())
    dist.all_reduce(x)
    cpu = torch.ones(1)  # a gloo group too (CPU tensors): its sockets are the job's
    dist.all_reduce(cpu, group=dist.new_group(backend="gloo"))
    assert cpu.item() == rt.world_size()
    Path(f"{flag}.{rt.rank()}").touch()
    end = time.monotonic() + 60
    while not os.path.exists(flag) and time.monotonic() < end:
        time.sleep(0.05)
    return int(x.cpu()[0].item())


@pytest.mark.multicore
@pytest.mark.timeout(300)
@pytest.mark.parametrize("init", ["xla", "env"])
def test_a_simulated_job_listens_on_loopback_only(init, tmp_path):
    flag = str(tmp_path / "go")
    out: dict = {}
    job = threading.Thread(target=lambda: out.update(
        r=rt.launch(_hold_open, init, flag, simulate=2, timeout=240)), daemon=True)
    job.start()
    try:
        end = time.monotonic() + 200
        while not all(os.path.exists(f"{flag}.{r}") for r in range(2)):
            assert job.is_alive() and time.monotonic() < end, "the job did not get going"
            time.sleep(0.05)
        pids = _tree(os.getpid())  # the caller (its store), the zygote, the job, replicas
        assert len(pids) >= 4
        mine = _sockets_of(pids)
        listening = {i: a for i, a in _listening().items() if i in mine}
    finally:
        Path(flag).touch()
        job.join(timeout=120)
    assert out.get("r") == 2  # both replicas all-reduced through the process group
    # the job's store is there, on the loopback address ...
    assert any(_is_loopback(a) for a, _ in listening.values()), listening
    # ... and nothing of the job listens on any other address
    assert [a for a in listening.values() if not _is_loopback(a[0])] == []


def _hold_open_spmd(flag: str) -> int:
    """An SPMD program (one process, every device) that sets up a process group
    through ``xla://``, then waits (60 s at most) until ``flag`` exists."""
    import torch.distributed as dist
    import torch_xla.distributed.xla_backend  # noqa: F401
    import torch_xla.runtime as xr

    xr.use_spmd()
    # torch_xla refuses its own backend under SPMD and names gloo (the CPU group of
    # distributed checkpointing)
    dist.init_process_group("gloo", init_method="xla://")
    Path(f"{flag}.0").touch()
    end = time.monotonic() + 60
    while not os.path.exists(flag) and time.monotonic() < end:
        time.sleep(0.05)
    return dist.get_world_size()


@pytest.mark.timeout(300)
def test_an_spmd_job_listens_on_loopback_only(tmp_path):
    """torch_xla's ``xla://`` handler would host a store on ``*:12355`` in the SPMD
    process; the simulator gives it an in-process store instead (gloo's own
    listener binds the loopback interface)."""
    flag = str(tmp_path / "go")
    out: dict = {}
    job = threading.Thread(target=lambda: out.update(
        r=rt.launch(_hold_open_spmd, flag, simulate=2, timeout=240)), daemon=True)
    job.start()
    try:
        end = time.monotonic() + 200
        while not os.path.exists(f"{flag}.0"):
            assert job.is_alive() and time.monotonic() < end, "the job did not get going"
            time.sleep(0.05)
        pids = _tree(os.getpid()) - {os.getpid()}  # the SPMD process (the caller may
        assert pids                                 # host other tests' servers)
        listening = {i: a for i, a in _listening().items() if i in _sockets_of(pids)}
    finally:
        Path(flag).touch()
        job.join(timeout=120)
    assert out.get("r") == 1
    assert [a for a in listening.values() if not _is_loopback(a[0])] == [], listening
