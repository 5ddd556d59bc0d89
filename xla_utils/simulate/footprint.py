"""The memory of simulated replica processes: measured while a job runs, checked before.

Every simulated replica is a process forked from the zygote: what it shares with the
zygote (torch, torch_xla, the interpreter: about 0.6 GB) costs once, what it
allocates itself (compiled graphs, tensors, its share of the collectives' payload
files) costs once per core. While a job runs, the caller samples that private memory
of its replicas (:class:`ReplicaMeter`, ``/proc/PID/smaps_rollup``) and records their
largest sum, per replica, per program (the script, or the replica function's file and
name) in ``~/.cache/xla_utils/simulate_footprint.json`` (``XLA_UTILS_SIM_FOOTPRINT_FILE``),
also when the job was killed. Before the next launch of that program on N cores,
:func:`check_fits` compares N times that figure (a program never run before: the
private memory of an idle replica, :data:`IDLE_REPLICA_BYTES`) with what the machine
has left: ``MemAvailable``, and the room under the memory limit of this process's
cgroup (v1 ``memory.limit_in_bytes`` / v2 ``memory.max``, of every ancestor too)
where one applies; when it does not fit, :class:`SimulatedMemoryError` says so with
both numbers and the fix before any replica starts. ``XLA_UTILS_SIM_MEMORY_CHECK=0``
skips the check.
"""
from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from ..utils.atomic import atomic_write
from ..utils.units import format_bytes

GIB = float(1 << 30)

# Private memory of a replica that ran a small graph (torch_xla 2.9, XLA:CPU): about
# 15 MB measured, rounded up; the estimate for a program never run before.
IDLE_REPLICA_BYTES = 64 << 20

# The zygote's own memory (torch and torch_xla imported: about 0.6 GB), bytes; counted
# when a launch must start it.
ZYGOTE_BYTES = 700 << 20

# The share of what is left that the replicas may take: the caller, the zygote and the
# job grow a little too.
HEADROOM = 0.95

# Programs whose figures are kept (the most recently run).
MAX_RECORDS = 256

# How often the caller samples its replicas' memory, s: every SAMPLE_S, and every
# SAMPLE_FIRST_S in the job's first FIRST_S seconds (short jobs get sampled too). A sample
# reads smaps_rollup, a walk of each replica's page tables (a few ms for 8 replicas of
# 1.5 GB).
SAMPLE_S, SAMPLE_FIRST_S, FIRST_S = 1.0, 0.1, 5.0


class SimulatedMemoryError(MemoryError):
    """The replicas of a simulated launch would not fit this machine's memory."""


@dataclass
class Room:
    """Memory a launch may still use, in bytes, and what limits it."""

    free: int  # bytes: the smaller of MemAvailable and the cgroup's room
    why: str  # e.g. "MemAvailable" or "the cgroup /x's memory limit (12.0 GiB, 3.1 GiB in use)"


def _meminfo_available() -> int | None:
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return None


def _cgroup_dirs() -> list[tuple[str, Path, int]]:
    """``(cgroup path, folder, version)`` of this process's memory cgroup and each
    ancestor whose folder is visible, innermost first."""
    mounts: dict[int, tuple[str, Path]] = {}  # version -> (root inside the hierarchy, mount point)
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/mountinfo").read_text().splitlines():
            pre, _, post = line.partition(" - ")
            fields, fstype = pre.split(), post.split()
            if fstype[:1] == ["cgroup2"]:
                mounts.setdefault(2, (fields[3], Path(fields[4])))
            elif fstype[:1] == ["cgroup"] and "memory" in fstype[-1].split(","):
                mounts[1] = (fields[3], Path(fields[4]))
    paths: dict[int, str] = {}
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            num, controllers, path = line.split(":", 2)
            if "memory" in controllers.split(","):
                paths[1] = path
            elif num == "0" and controllers == "":
                paths[2] = path
    out = []
    for version in (1, 2):
        if version not in mounts or version not in paths:
            continue
        root, mount = mounts[version]
        rel = os.path.relpath(paths[version], root) if paths[version].startswith(root) else None
        if rel is None:
            continue
        parts = [] if rel == "." else rel.split("/")
        for depth in range(len(parts), -1, -1):
            folder = mount.joinpath(*parts[:depth])
            limit_file = "memory.limit_in_bytes" if version == 1 else "memory.max"
            if (folder / limit_file).exists():
                out.append(("/" + "/".join(parts[:depth]), folder, version))
    return out


def _stat(folder: Path, key: str) -> int:
    with contextlib.suppress(OSError, ValueError):
        for line in (folder / "memory.stat").read_text().splitlines():
            k, _, v = line.partition(" ")
            if k == key:
                return int(v)
    return 0


def cgroup_room() -> tuple[int, str] | None:
    """``(bytes left, description)`` under the tightest memory limit of this process's
    cgroup and its ancestors (v1 or v2), or None where no limit applies. Page cache
    that the kernel can drop (inactive files) counts as free."""
    best = None
    for path, folder, version in _cgroup_dirs():
        try:
            if version == 1:
                limit = int((folder / "memory.limit_in_bytes").read_text())
                used = int((folder / "memory.usage_in_bytes").read_text())
                inactive = _stat(folder, "total_inactive_file")
            else:
                text = (folder / "memory.max").read_text().strip()
                if text == "max":
                    continue
                limit, used = int(text), int((folder / "memory.current").read_text())
                inactive = _stat(folder, "inactive_file")
        except (OSError, ValueError):
            continue
        if limit >= 1 << 60:  # v1's "no limit"
            continue
        used = max(used - inactive, 0)
        left = max(limit - used, 0)
        if best is None or left < best[0]:
            best = (left, f"the memory limit of cgroup {path} ({format_bytes(limit, 'GiB')}, "
                          f"{format_bytes(used, 'GiB')} in use)")
    return best


def memory_room() -> Room:
    """What a launch may still use: MemAvailable, or less under a cgroup limit."""
    avail = _meminfo_available()
    room = Room(avail if avail is not None else 1 << 62, "MemAvailable")
    cg = cgroup_room()
    if cg is not None and cg[0] < room.free:
        room = Room(cg[0], cg[1])
    return room


# --------------------------------------------------------------------------
# What a program's replicas used: sampled while it runs, kept between runs
# --------------------------------------------------------------------------
def footprint_file() -> Path:
    """Where the per-program figures are kept (``XLA_UTILS_SIM_FOOTPRINT_FILE``,
    default ``~/.cache/xla_utils/simulate_footprint.json``)."""
    env = os.environ.get("XLA_UTILS_SIM_FOOTPRINT_FILE")
    return Path(env) if env else Path.home() / ".cache" / "xla_utils" / "simulate_footprint.json"


def _load() -> dict:
    with contextlib.suppress(OSError, ValueError):
        data = json.loads(footprint_file().read_text())
        if isinstance(data, dict):
            return data
    return {}


def recorded(program: str) -> dict | None:
    """The last figures of ``program``: ``{"replica_bytes", "cores", "when"}``, or None."""
    entry = _load().get(program)
    return entry if isinstance(entry, dict) and "replica_bytes" in entry else None


def record(program: str, replica_bytes: int, devices: int) -> None:
    """Keep ``program``'s largest private memory per replica (bytes) of its last run."""
    path = footprint_file()
    data = _load()
    data[program] = {"replica_bytes": int(replica_bytes), "cores": devices,
                     "when": time.strftime("%Y-%m-%dT%H:%M:%S")}
    if len(data) > MAX_RECORDS:  # the most recently run programs are kept
        keep = sorted(data, key=lambda k: str(data[k].get("when", "")))[-MAX_RECORDS:]
        data = {k: data[k] for k in keep}
    with contextlib.suppress(OSError):
        atomic_write(path, json.dumps(data, indent=1, sort_keys=True))


def _private_bytes(pid: int) -> int:
    """Pages of ``pid`` that no other process maps (what it cost beyond the zygote)."""
    total = 0
    with contextlib.suppress(OSError, ValueError):
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith(("Private_Clean:", "Private_Dirty:")):
                    total += int(line.split()[1]) * 1024
    return total


class ReplicaMeter:
    """Samples the private memory of a job's replica processes (the job's children)
    and its payload folder; :attr:`peak` is their largest sum so far divided by the
    number of replicas (bytes per replica at the job's peak)."""

    def __init__(self, job: int, folder: str, n: int) -> None:
        self.job, self.folder, self.n = job, folder, n
        self.peak = 0
        self.start = self.next = time.monotonic()

    def sample(self) -> None:
        """Take a sample, at most every :data:`SAMPLE_S` seconds (:data:`SAMPLE_FIRST_S`
        at first)."""
        now = time.monotonic()
        if now < self.next:
            return
        self.next = now + (SAMPLE_FIRST_S if now - self.start < FIRST_S else SAMPLE_S)
        try:
            kids = Path(f"/proc/{self.job}/task/{self.job}/children").read_text().split()
        except OSError:
            return
        replicas = sum(_private_bytes(int(p)) for p in kids)
        payload = 0  # the collectives' files
        with contextlib.suppress(OSError):
            with os.scandir(self.folder) as it:
                payload = sum(e.stat().st_size for e in it if e.is_file())
        self.peak = max(self.peak, (replicas + payload) // max(self.n, 1))


def check_fits(program: str, n: int, zygote_running: bool) -> None:
    """Refuse a launch of ``program`` on ``n`` replica processes that would not fit.

    Raises:
        SimulatedMemoryError: n times the program's recorded private memory per
            replica (:data:`IDLE_REPLICA_BYTES` if never run) exceeds what is left
            (:func:`memory_room`, less 5% headroom); names both and the fix.
    """
    if os.environ.get("XLA_UTILS_SIM_MEMORY_CHECK", "1") == "0":
        return
    rec = recorded(program)
    per = rec["replica_bytes"] if rec else IDLE_REPLICA_BYTES
    need = n * per + (0 if zygote_running else ZYGOTE_BYTES)
    room = memory_room()
    if need <= room.free * HEADROOM:
        return
    fit = max(int(room.free * HEADROOM - (0 if zygote_running else ZYGOTE_BYTES)) // per, 0)
    cores = [c for c in (8, 4, 2, 1) if c <= fit]
    source = (f"{format_bytes(per, 'GiB')} per replica, measured in its run on {rec['cores']} "
              f"core(s) at {rec['when']}" if rec else
              f"{format_bytes(per, 'GiB')} per replica, the least a replica takes")
    fewer = (f"simulate {cores[0]} core(s) (--cores {cores[0]}, cores={cores[0]} or "
             f"simulate={cores[0]})" if cores else "free memory (no core count fits now)")
    raise SimulatedMemoryError(
        f"{n} simulated replica processes of {program} need about {format_bytes(need, 'GiB')} "
        f"({source}{'' if zygote_running else ', plus the zygote'}), but this machine has "
        f"{format_bytes(room.free, 'GiB')} left ({room.why}); no replica was started. Fix: "
        f"{fewer}, or use a lighter form: an SPMD program (xr.use_spmd(); one process "
        f"owning all {n} devices, --form spmd) or xla_utils' fit/predict(simulate={n}), "
        "whose replicas are threads of one process. XLA_UTILS_SIM_MEMORY_CHECK=0 starts "
        "it anyway.")

