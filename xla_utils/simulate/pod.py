"""A pod slice rehearsed on one machine: ``python -m xla_utils.simulate --hosts H --cores C``.

:func:`run_pod` runs a script once per simulated host, as ``gcloud ... ssh --worker=all``
runs it on every TPU VM of a slice. Each host is a process group of its own, with its own
environment (:data:`xla_utils.runtime.hosts.POD_ENV`: its worker id, the slice's shape) and,
where this machine allows a mount namespace (root, ``unshare``), its own local disk: ``/tmp``,
the home folder (``~/.cache``: staged checkpoints, a bucket cache's local shards) and the
working folder start as this machine has them and what a host writes there only that host
sees (an overlay each), as on separate VMs. The hosts share only what a real
slice shares: buckets (``gs://``, e.g. an emulator on ``127.0.0.1``) and the network, here
loopback: the slice's store (:func:`~.protocol.serve_store`) and its interconnect folder
on ``/dev/shm``, through which the simulated cores' collectives meet (:mod:`.pod_link`).

Inside a host, ``fit()`` / ``predict()`` / the LR finder see a placement of H hosts (the
launch starts this host's C simulated cores as its share of the H x C world, global ordinal
0 possibly on another host: ``master_host``) and torch_xla's world queries answer as on a
pod (``xr.global_ordinal``, ``xr.local_ordinal``, ``xr.host_index``, ``xm.is_master_ordinal``
per host, so ``xm.save`` writes once per host, as on a real slice).

Rehearsing what goes wrong: ``late={1: 20}`` starts host 1 twenty seconds after the others;
``kill={1: 30}`` kills host 1 (its whole process group, SIGKILL) thirty seconds in. A host
that dies or fails is *lost*: every other host's waits (collectives, the launch's start, an
agreed value) end at once with an error naming it, and what is left of the slice is killed
after :data:`LOST_GRACE_S` seconds.
"""
from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

from ..runtime.hosts import POD_ENV, POD_LOST, PodWorld
from ..runtime.relay import forward_output
from .pod_link import launch_key, started_key
from .protocol import ABORT, FOLDER_PREFIX, describe_status, serve_store

__all__ = ["run_pod", "PodResult", "LOST_GRACE_S"]

# Seconds the other hosts get to end on their own after a host is lost (each is told at
# once); then what is left of the slice is killed.
LOST_GRACE_S = 30.0


@dataclass
class PodResult:
    """How a rehearsed slice ended.

    Attributes:
        codes: Each host's exit status (negative: the signal that ended it).
        lost: Why the slice was stopped early (the first host lost), or "".
    """

    codes: dict[int, int] = field(default_factory=dict)
    lost: str = ""

    @property
    def returncode(self) -> int:
        """0 when every host ended normally, else the first failing host's status (1 for
        a signal, or for a slice stopped early with no host's status: a timeout)."""
        bad = [c for _, c in sorted(self.codes.items()) if c != 0]
        if not bad:
            return 1 if self.lost else 0
        return bad[0] if bad[0] > 0 else 1


def _private_disk_command(host_dir: Path, cwd: str) -> list[str] | None:
    """The ``unshare`` prefix that gives one host its own ``/tmp``, home and working folder
    (an overlay each, upper layers in ``host_dir``), or None when this machine cannot."""
    if os.geteuid() != 0 or not shutil.which("unshare") or not shutil.which("mount"):
        return None
    lines, targets = [], []
    for folder in ("/tmp", os.path.expanduser("~"), cwd):
        path = Path(folder).resolve()
        if path != Path("/") and not any(path.is_relative_to(t) for t in targets):
            targets.append(path)
    for i, target in enumerate(map(str, targets)):
        up, work = host_dir / f"upper{i}", host_dir / f"work{i}"
        up.mkdir(parents=True), work.mkdir(parents=True)
        lines.append(f"mount -t overlay overlay -o lowerdir={shlex.quote(target)},"
                     f"upperdir={shlex.quote(str(up))},workdir={shlex.quote(str(work))} "
                     f"{shlex.quote(target)}")
    script = " && ".join(lines) + f" && cd {shlex.quote(cwd)} && exec \"$@\""
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "host"]


def _private_disks_work(base: Path) -> str:
    """Why the hosts cannot have private disks here ("" when they can): one trial mount."""
    probe = base / "probe"
    probe.mkdir()
    (probe / "lower").mkdir()
    cmd = _private_disk_command(probe, str(probe / "lower"))
    if cmd is None:
        return "private disks need root and unshare"
    proc = subprocess.run(cmd + ["true"], capture_output=True, text=True, timeout=30)
    return "" if proc.returncode == 0 else (proc.stderr.strip() or f"exit {proc.returncode}")


class _Host:
    """One simulated host: its process group and its output relay."""

    def __init__(self, pod: PodWorld, cmd: list[str], env: dict[str, str], cwd: str,
                 lock: threading.Lock) -> None:
        self.index = pod.host
        self.proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     start_new_session=True)
        # whole lines (the hosts' never cut into each other); each line of a host other than
        # the master host labelled (the master's progress bars are the run's one display)
        label = b"" if pod.is_master_host else f"[host {pod.host}] ".encode()
        self.relays = [threading.Thread(target=forward_output, args=(s, n, lock),
                                        kwargs={"label": label}, daemon=True)
                       for s, n in ((self.proc.stdout, "stdout"), (self.proc.stderr, "stderr"))]
        for t in self.relays:
            t.start()

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)


def run_pod(path: str | os.PathLike, hosts: int, host_cores: int = 4, args: Sequence[str] = (),
            master_host: int = 0, late: Mapping[int, float] | None = None,
            kill: Mapping[int, float] | None = None, timeout: float | None = None,
            private_disks: bool = True) -> PodResult:
    """Run ``python path args...`` once per simulated host of an ``hosts`` x ``cores`` pod
    slice (see the module's docstring) and wait for every host.

    Args:
        path: The script (what every host runs, as ``gcloud ... --worker=all`` would).
        hosts: Simulated hosts (TPU VMs), 1 or more.
        host_cores: Simulated cores per host (default 4, as a v4 or v5p VM).
        args: The script's own arguments.
        master_host: The host holding global ordinal 0 (default 0; on a real slice it need
            not be worker 0).
        late: ``{host: seconds}``: start those hosts that many seconds after the others.
        kill: ``{host: seconds}``: kill those hosts (SIGKILL, every process) that many
            seconds after the slice started.
        timeout: Seconds after which every host is killed (default: none).
        private_disks: Give each host its own ``/tmp``, home and working folder (default True;
            needs root and ``unshare``: without them the hosts share this machine's disk,
            and the run says so).

    Returns:
        :class:`PodResult`: each host's exit status and why the slice stopped early.

    Raises:
        ValueError: ``hosts`` or ``host_cores`` is not a positive int; ``master_host``,
            ``late`` or ``kill`` name no host of the slice (named).
    """
    late, kill, cores = dict(late or {}), dict(kill or {}), host_cores
    if not (isinstance(hosts, int) and hosts >= 1 and isinstance(cores, int) and cores >= 1):
        raise ValueError(f"hosts={hosts!r}, cores={cores!r}: both must be positive ints")
    for name, value in (("master_host", [master_host]), ("late", late), ("kill", kill)):
        bad = [h for h in value if not (isinstance(h, int) and 0 <= h < hosts)]
        if bad:
            raise ValueError(f"{name}: host {bad[0]!r} is not one of the slice's hosts "
                             f"0..{hosts - 1}")
    store = serve_store()
    base = Path(tempfile.mkdtemp(prefix=f"{FOLDER_PREFIX}{os.getpid()}-pod-",
                                 dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    disks = Path(tempfile.mkdtemp(prefix="xla_utils-pod-disks-", dir="/var/tmp"
                                  if os.path.isdir("/var/tmp") else None))
    cwd = os.getcwd()
    why = _private_disks_work(disks) if private_disks else "private_disks=False"
    if why:
        print(f"xla_utils.simulate: the {hosts} hosts share this machine's disk ({why}): a "
              "path that exists on one host only is not caught here", file=sys.stderr, flush=True)
    lock = threading.Lock()
    started: dict[int, _Host] = {}
    result = PodResult()
    t0 = time.monotonic()
    try:
        def start(h: int) -> None:
            pod = PodWorld(hosts, h, cores, master_host, store.port, str(base))
            env = {**os.environ, POD_ENV: pod.env_value(), "TPU_WORKER_ID": str(h)}
            # the script as __main__, its xmp.spawn / torch_xla.launch on this host's cores
            cmd = [sys.executable, "-m", "xla_utils.simulate", "--cores", str(cores), "--form",
                   "spawn", str(path), *map(str, args)]
            if not why:
                cmd = _private_disk_command(disks / f"host{h}", cwd) + cmd
            started[h] = _Host(pod, cmd, env, cwd, lock)

        _watch(start, started, store, hosts, late, kill, timeout, t0, result)
    finally:
        for host in started.values():
            host.kill()
        for host in started.values():
            with contextlib.suppress(Exception):
                host.proc.wait(timeout=10)
            for t in host.relays:
                t.join(timeout=2)
        del store
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(disks, ignore_errors=True)
    return result


def _watch(start, started: dict, store, hosts: int, late: dict, kill: dict,
           timeout: float | None, t0: float, result: PodResult) -> None:
    """Start the hosts (late ones late), kill the ones to kill, and follow them until every
    host has ended; a host that ends badly is lost (every other host told at once)."""
    killed: set[int] = set()
    lost_at = None
    while True:
        now = time.monotonic() - t0
        for h in range(hosts):
            if h not in started and now >= late.get(h, 0.0) and lost_at is None:
                start(h)
        for h, at in kill.items():
            if h in started and h not in killed and now >= at:
                started[h].kill()
                killed.add(h)
        for h, host in started.items():
            code = host.proc.poll()
            if code is None or h in result.codes:
                continue
            result.codes[h] = code
            if code != 0 and not result.lost:
                what = ("killed as asked (SIGKILL to every process)" if h in killed else
                        f"it ended first, with {describe_status(code)}"
                        + ("" if code < 0 else " (its output is above)"))
                result.lost = f"host {h} of {hosts} was lost: {what}"
                _tell_hosts(store, result.lost, hosts)
                lost_at = time.monotonic()
                print(f"xla_utils.simulate: {result.lost}", file=sys.stderr, flush=True)
        if len(result.codes) == len(started) and (len(started) == hosts or lost_at is not None):
            return
        if lost_at is not None and time.monotonic() - lost_at > LOST_GRACE_S:
            return
        if timeout is not None and now > timeout:
            result.lost = result.lost or (f"the slice ran past its timeout of {timeout} s; "
                                          "every host was killed")
            return
        time.sleep(0.1)


def _tell_hosts(store, why: str, hosts: int) -> None:
    """Mark a host lost in the slice's store: every launch any host started is aborted, and
    every host waiting for an agreed value stops."""
    store.set(POD_LOST, why)
    k = 1
    while any(store.check([started_key(k, h)]) for h in range(hosts)):
        store.set(launch_key(k, ABORT), why)
        k += 1
