"""The runner: ``xmp.spawn`` / ``torch_xla.launch`` on simulated cores.

``python -m xla_utils.simulate --cores N script.py``, :func:`run_script` and
:func:`simulated_spawn`; each spawn is one :func:`.caller.run_replicas` job.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import runpy
import sys
from pathlib import Path
from typing import Iterator, Mapping, Sequence

from .caller import run_replicas
from .footprint import SimulatedMemoryError
from .forms import FORMS, detect_form
from .pod import run_pod
from ..runtime.hosts import simulated_pod
from .spmd import run_spmd
from .torchrun import run_torchrun


@contextlib.contextmanager
def simulated_spawn(cores: int = 8, timeout: float | None = None,
                    form: str = "auto") -> Iterator[None]:
    """Within the block, ``xmp.spawn(fn, args=...)`` and ``torch_xla.launch(fn, args=...)``
    run ``fn(index, *args)`` on ``cores`` simulated XLA:CPU cores (1, 2, 4 or 8).

    ``form="auto"`` (default): a ``fn`` whose code uses SPMD (``use_spmd``, ``Mesh``,
    ``mark_sharding``, FSDPv2, ...) is one program owning every device, so it runs
    once, as ``fn(0, *args)``, in a fresh process with ``cores`` XLA:CPU devices
    (printed to stderr); ``form="spawn"``: always ``cores`` replicas (a replica that
    calls ``xr.use_spmd()`` then raises a named error). ``xr.use_spmd()`` called in
    the block itself raises a named error (the calling process has one device).

    ``nprocs`` may be ``None``, ``1`` (one core, as torch_xla does) or ``cores``;
    anything else raises ``ValueError`` as torch_xla does. ``start_method`` is ignored
    (replicas always start from a clean interpreter). ``timeout`` in seconds, default
    none. Replica exceptions are raised as ``ReplicaError``.
    """
    if not isinstance(cores, int) or cores < 1:
        raise ValueError(f"cores must be a positive int, got {cores!r}")
    if form not in ("auto", "spawn"):
        raise ValueError(f"simulated_spawn(form={form!r}): use 'auto' or 'spawn'")
    import torch_xla
    import torch_xla.distributed.xla_multiprocessing as xmp

    pod = simulated_pod()  # a host of a rehearsed slice: its cores join the slice's world

    def spawn(fn, args=(), nprocs=None, join=True, daemon=False, start_method="spawn"):
        if nprocs not in (None, 1, cores):
            raise ValueError(f"Unsupported nprocs ({nprocs}): use nprocs=None (all {cores} "
                             "simulated cores) or 1, as torch_xla requires")
        return run_replicas(fn, tuple(args), 1 if nprocs == 1 else cores, timeout=timeout,
                            pass_index=True, detect_spmd=form == "auto",
                            pod=None if nprocs == 1 else pod)

    def launch(fn, args=(), start_method="spawn", debug_single_process=False):
        return spawn(fn, args=args, nprocs=1 if debug_single_process else None)

    def use_spmd(*a, **k):
        raise RuntimeError(
            f"xr.use_spmd() called inside `with simulated_spawn(cores={cores}):` runs in this "
            "process, which has one XLA:CPU device, not the simulated ones. Put the SPMD "
            "code in a function and run it with torch_xla.launch(fn) in the block (or "
            f"xla_utils.launch(fn, simulate={cores})): it then runs in a fresh process with "
            f"{cores} XLA:CPU devices.")

    import torch_xla.runtime as xr

    saved = (xmp.spawn, torch_xla.launch, xr.use_spmd)
    xmp.spawn, torch_xla.launch, xr.use_spmd = spawn, launch, use_spmd
    try:
        yield
    finally:
        xmp.spawn, torch_xla.launch, xr.use_spmd = saved


def run_script(path: str | os.PathLike, cores: int = 8, args: Sequence[str] = (),
               timeout: float | None = None, form: str = "auto", *, hosts: int | None = None,
               master_host: int = 0, late: Mapping[int, float] | None = None,
               kill: Mapping[int, float] | None = None) -> int:
    """Run a torch_xla script as ``__main__`` on ``cores`` simulated cores
    (``%run``-like; ``args`` become ``sys.argv[1:]``).

    ``form``: ``"spawn"`` (``xmp.spawn`` / ``torch_xla.launch`` replicas with host
    collectives), ``"spmd"`` (one fresh process with ``cores`` XLA:CPU devices,
    see :mod:`.spmd`), ``"torchrun"`` (the script as ``__main__`` in each replica,
    see :mod:`.torchrun`) or ``"auto"`` (SPMD if the script names an SPMD API such
    as ``use_spmd`` or ``mark_sharding``, torchrun if it checks
    ``is_torchelastic_launched``; the choice is printed to stderr).

    ``hosts=H`` rehearses a pod slice of H hosts x ``cores`` cores each: the script runs
    once per simulated host, each a process group with its own ``/tmp`` and working folder,
    meeting over loopback (:mod:`.pod`); ``master_host`` holds global ordinal 0; ``late``
    (``{host: seconds}``) starts hosts late, ``kill`` (``{host: seconds}``) kills them. The
    slice's exit status is returned (a lost host is said on stderr).

    Returns the script's exit status (0 when it ends normally or calls
    ``sys.exit(0)``); a replica's exception propagates as ``ReplicaError``.
    """
    path = str(path)
    if hosts is not None:
        _check_pod_form(path, form)
        result = run_pod(path, hosts, cores, args, master_host=master_host, late=late,
                         kill=kill, timeout=timeout)
        if result.lost:
            print(f"xla_utils.simulate: the slice stopped: {result.lost}", file=sys.stderr)
        return result.returncode
    if form not in FORMS:
        raise ValueError(f"form={form!r}: use one of {FORMS}")
    spawn_form = "auto" if form == "auto" else "spawn"  # functions using SPMD: see below
    if form == "auto":
        form, why = detect_form(path)
        if form == "spmd":
            print(f"xla_utils.simulate: running {path} as SPMD (one process with {cores} "
                  f"XLA:CPU devices) because {why}; pass --form spawn (form='spawn') to "
                  "run it as xmp.spawn replicas", file=sys.stderr, flush=True)
        elif form == "torchrun":
            print(f"xla_utils.simulate: running {path} as torchrun would (as __main__ in "
                  f"each of {cores} replicas, RANK/WORLD_SIZE set) because {why}",
                  file=sys.stderr, flush=True)
    if form == "spmd":
        return run_spmd(path, cores, args, timeout)
    if form == "torchrun":
        return run_torchrun(path, cores, args, timeout)
    saved_argv, saved_path = sys.argv[:], sys.path[:]
    sys.argv = [path, *map(str, args)]
    sys.path.insert(0, str(Path(path).resolve().parent))
    try:
        with simulated_spawn(cores, timeout=timeout, form=spawn_form):
            runpy.run_path(path, run_name="__main__")
    except SystemExit as exc:
        code = exc.code
        if code is None:
            return 0
        if isinstance(code, int):
            return code
        print(code, file=sys.stderr)
        return 1
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m xla_utils.simulate --cores N script.py [args...]``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--zygote"]:
        from .job import zygote_main

        zygote_main(int(argv[1]))
        return 0
    p = argparse.ArgumentParser(
        prog="python -m xla_utils.simulate",
        description="Run a torch_xla script (xmp.spawn / torch_xla.launch) on N simulated "
                    "XLA:CPU cores.")
    p.add_argument("--cores", type=int, default=8, help="simulated cores: 1, 2, 4 or 8 (default 8)")
    p.add_argument("--timeout", type=float, default=None,
                   help="seconds after which the replicas are killed (default: none)")
    p.add_argument("--form", choices=FORMS, default="auto",
                   help="spawn: xmp.spawn/torch_xla.launch replicas; spmd: one process with "
                        "N XLA:CPU devices; torchrun: the script as __main__ in each of N "
                        "replicas (RANK, WORLD_SIZE set); auto (default): spmd if the script "
                        "names an SPMD API (use_spmd, Mesh, mark_sharding, ...), torchrun if "
                        "it checks is_torchelastic_launched, else spawn")
    p.add_argument("--hosts", type=int, default=None,
                   help="rehearse a pod slice: run the script once per simulated host (each "
                        "its own process group and private /tmp, home and working folder), --cores "
                        "simulated cores each, meeting over loopback (default: one host, the "
                        "script run here)")
    p.add_argument("--master-host", type=int, default=0,
                   help="with --hosts: the host holding global ordinal 0 (default 0)")
    p.add_argument("--late-host", action="append", default=[], metavar="HOST:SECONDS",
                   help="with --hosts: start HOST that many seconds after the others")
    p.add_argument("--kill-host", action="append", default=[], metavar="HOST:SECONDS",
                   help="with --hosts: kill HOST (every process) that many seconds in")
    p.add_argument("script", help="path of the script to run as __main__")
    p.add_argument("args", nargs=argparse.REMAINDER, help="the script's own arguments")
    ns = p.parse_args(argv)
    if ns.cores < 1:
        p.error("--cores must be >= 1")
    if ns.hosts is not None:
        return _main_pod(p, ns)
    for flag, given in (("--master-host", ns.master_host), ("--late-host", ns.late_host),
                        ("--kill-host", ns.kill_host)):
        if given:
            p.error(f"{flag} rehearses a pod slice: it needs --hosts H")
    from ..runtime.replica import ReplicaError

    try:
        return run_script(ns.script, cores=ns.cores, args=ns.args, timeout=ns.timeout,
                          form=ns.form)
    except (ReplicaError, SimulatedMemoryError) as exc:
        print(f"xla_utils.simulate: {exc}", file=sys.stderr)
        return 1



def _check_pod_form(path: str, form: str) -> None:
    """A rehearsed slice runs spawn-form scripts (and xla_utils' own loops); refuse the others.

    Raises:
        ValueError: the script is (or ``form`` names) an SPMD or torchrun program.
    """
    why = f"form={form!r}"
    if form == "auto":
        form, why = detect_form(path)
    if form in ("spmd", "torchrun"):
        raise ValueError(
            f"{path} is a {form} program ({why}); a pod slice of several hosts is rehearsed for "
            "xmp.spawn / torch_xla.launch scripts and xla_utils' own fit/predict (strategy="
            f"'spawn'). Rehearse the {form} program on one host (python -m xla_utils.simulate "
            "--cores N script.py)")


def _host_times(p: argparse.ArgumentParser, flag: str, values: Sequence[str]) -> dict[int, float]:
    out = {}
    for v in values:
        host, _, secs = v.partition(":")
        try:
            out[int(host)] = float(secs)
        except ValueError:
            p.error(f"{flag} {v!r}: use HOST:SECONDS, e.g. {flag} 1:20")
        if out[int(host)] < 0:
            p.error(f"{flag} {v!r}: SECONDS must be 0 or more")
    return out


def _main_pod(p: argparse.ArgumentParser, ns: argparse.Namespace) -> int:
    """``--hosts H``: the script on a rehearsed pod slice (:func:`run_script`'s ``hosts``)."""
    if ns.hosts < 1:
        p.error("--hosts must be >= 1")
    try:
        return run_script(ns.script, ns.cores, ns.args, ns.timeout, hosts=ns.hosts,
                          master_host=ns.master_host,
                          late=_host_times(p, "--late-host", ns.late_host),
                          kill=_host_times(p, "--kill-host", ns.kill_host))
    except ValueError as exc:
        p.error(str(exc))
