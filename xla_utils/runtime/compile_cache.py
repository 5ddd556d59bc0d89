"""torch_xla's persistent compilation cache: compile a graph once per notebook session.

Re-running a training cell on a TPU recompiles every graph (minutes for a large
model). torch_xla can keep compiled executables on disk
(``torch_xla.runtime.initialize_cache(path, readonly=...)``, once per process,
before its first computation) and load them in the next run instead of
compiling. xla_utils' entry points (``fit``, ``predict``, ``evaluate``,
``lr_find``, ``check``) call :func:`enable_compile_cache` first thing in every
replica, with their ``compile_cache=`` option:

``"auto"`` (default)  on when the replicas run on a TPU, off on XLA:CPU.
a folder              on, under that folder (on XLA:CPU too: entries are
                      written, see below).
``True``              on, under :func:`default_compile_cache_root`.
``None`` / ``False``  off.

Each replica process gets its own folder,
``<root>/torch_xla-<version>[-libtpu-<version>]/<device>/replica-<rank>``
(thread-simulated replicas share one process, so one ``replicas-0-<n-1>``
folder): no two processes ever write the same file, which torch_xla's
documentation allows ("per-process folders, or one read-write process with
read-only others"). The version in the path keeps executables of one libtpu
away from another.

Problems with the folder are warnings, never failures: a folder that cannot be
created or written, or a disk with less than :data:`MIN_FREE_BYTES` free, turns
the cache off for the run, or makes it read-only where the folder already holds
entries (a cache attached as a read-only Kaggle dataset, a full
``/kaggle/working``). The reason is printed by the master replica and kept in
the status :func:`enable_compile_cache` returns.

XLA:CPU writes entries but cannot load them ("Deserializing serialized
executable not supported"): a second run there counts each entry it found as
``PersistentCacheDeserializeFailure`` and compiles again, so ``"auto"`` keeps
the cache off on XLA:CPU (docs/BENCHMARKS.md "Persistent compilation cache").
"""
from __future__ import annotations

import os
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Union

from ..utils.units import format_bytes

from .state import STATE
from .world import backend, master_print, rank
from .xla import load_xla

__all__ = ["CompileCacheOption", "CompileCacheStatus", "MIN_FREE_BYTES", "check_compile_cache_option",
           "default_compile_cache_root", "enable_compile_cache", "compile_cache_summary"]

CompileCacheOption = Union[str, os.PathLike, bool, None]

# Below this much free space the cache writes nothing (torch_xla silently writes
# truncated files on a full disk, which the next run cannot load).
MIN_FREE_BYTES = 512 * 2**20

_LOCK = threading.Lock()
_STATUS: "CompileCacheStatus | None" = None  # this process's; set once


@dataclass
class CompileCacheStatus:
    """What :func:`enable_compile_cache` did in this process.

    Attributes:
        state: ``"read-write"``, ``"read-only"`` or ``"off"``.
        folder: This process's cache folder (None when off without one).
        entries: Files in the folder before this run (entries an earlier run wrote).
        reason: Why the cache is off or read-only (None when read-write).
        warning: True when ``reason`` is a problem the user asked to hear about
            (an unusable folder), False for a deliberate off (``None``, XLA:CPU).
    """

    state: str
    folder: str | None = None
    entries: int = 0
    reason: str | None = None
    warning: bool = False


def check_compile_cache_option(option: CompileCacheOption, name: str = "compile_cache") -> None:
    """Raise ``ValueError`` in the calling process for a ``compile_cache=`` value
    :func:`enable_compile_cache` would not understand."""
    if option is None or isinstance(option, (bool, os.PathLike)):
        return
    if isinstance(option, str) and option:
        return
    raise ValueError(f"{name} must be 'auto', a folder, True, False or None, got {option!r}")


def default_compile_cache_root() -> Path:
    """A folder that survives a notebook (kernel) restart.

    ``$XLA_UTILS_COMPILE_CACHE`` when set; ``/kaggle/working/xla_compile_cache``
    on Kaggle (kept with the notebook's output when you save a version);
    ``/content/xla_compile_cache`` on Colab; else ``~/.cache/xla_utils/compile_cache``.
    """
    override = os.environ.get("XLA_UTILS_COMPILE_CACHE")
    if override:
        return Path(override).expanduser()
    for base in ("/kaggle/working", "/content"):
        if os.path.isdir(base) and os.access(base, os.W_OK):
            return Path(base) / "xla_compile_cache"
    return Path.home() / ".cache" / "xla_utils" / "compile_cache"


def _versions_key() -> str:
    from importlib import metadata

    parts = []
    for dist in ("torch_xla", "libtpu"):
        try:
            parts.append(f"{dist}-{metadata.version(dist)}")
        except metadata.PackageNotFoundError:
            pass
    return "-".join(parts) or "torch_xla-unknown"


def _process_folder(root: Path) -> Path:
    device = os.environ.get("PJRT_DEVICE", "CPU").lower()
    if STATE.sim is not None:  # replica threads of one process share its cache
        who = f"replicas-0-{STATE.sim.n - 1}"
    else:
        who = f"replica-{rank()}"
    return root / _versions_key() / device / who


def _usable(folder: Path) -> tuple[str, str | None, int]:
    """``(state, reason, entries)`` for ``folder``: read-write when it can be
    created and written with room to spare, read-only when it only has entries."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return "off", f"cannot create {folder} ({exc.strerror or exc})", 0
    try:
        entries = sum(1 for p in folder.iterdir() if p.is_file())
    except OSError as exc:
        return "off", f"cannot read {folder} ({exc.strerror or exc})", 0
    problem = None
    probe = folder / f".write_test_{os.getpid()}"
    try:
        probe.write_bytes(b"x")
        probe.unlink()
    except OSError as exc:
        problem = f"{folder} is not writable ({exc.strerror or exc})"
    if problem is None:
        free = shutil.disk_usage(folder).free
        if free < MIN_FREE_BYTES:
            problem = (f"only {format_bytes(free, 'MiB')} free on the disk of {folder} "
                       f"(the cache writes only with {format_bytes(MIN_FREE_BYTES, 'MiB')} free)")
    if problem is None:
        return "read-write", None, entries
    if entries:
        return "read-only", f"{problem}: its {entries} entries are used read-only", entries
    return "off", problem, 0


def enable_compile_cache(option: CompileCacheOption = "auto") -> CompileCacheStatus:
    """Initialise the persistent compilation cache in this replica's process.

    Call it first thing in a replica, before its first XLA computation; the
    first call in a process decides (threads of a simulated job wait for it)
    and later calls return the same status. A no-op on the torch backend.

    Args:
        option: ``"auto"``, a folder, ``True``, ``False`` or ``None`` (see the
            module docstring).

    Returns:
        The :class:`CompileCacheStatus`; problems are printed by the master
        replica as a ``compile cache`` warning and never raised.
    """
    global _STATUS
    with _LOCK:
        if _STATUS is None:
            _STATUS = _decide(option)
        status = _STATUS
    if status.warning:
        master_print(f"xla_utils: compile cache warning: {status.reason}")
    return status


def _decide(option: CompileCacheOption) -> CompileCacheStatus:
    check_compile_cache_option(option)
    if backend() != "xla":
        return CompileCacheStatus("off", reason="not on XLA (plain PyTorch)")
    if option is None or option is False:
        return CompileCacheStatus("off", reason="compile_cache=None")
    on_tpu = os.environ.get("PJRT_DEVICE", "").upper() == "TPU"
    if option == "auto" and not on_tpu:
        return CompileCacheStatus("off", reason="XLA:CPU cannot load cached executables "
                                  "(compile_cache='auto' turns it on on TPUs only)")
    root = default_compile_cache_root() if option in ("auto", True) else Path(option).expanduser()
    xla = load_xla()
    if xla["torch_xla"]._XLAC._xla_computation_cache_is_initialized():
        return CompileCacheStatus(
            "off", warning=True,
            reason="this process compiled an XLA graph before the cache could be set up "
                   "(torch_xla.runtime.initialize_cache must come first); it is off for this run")
    try:
        folder = _process_folder(root)
    except Exception as exc:  # a rank query that fails must not stop the run
        return CompileCacheStatus("off", warning=True, reason=f"no cache folder: {exc}")
    state, reason, entries = _usable(folder)
    if state != "off":
        xla["xr"].initialize_cache(str(folder), readonly=state == "read-only")
    return CompileCacheStatus(state, str(folder), entries, reason, warning=reason is not None)


def compile_cache_summary(status: CompileCacheStatus, before: dict[str, Any],
                          after: dict[str, Any]) -> str:
    """One line for a run report: how many graphs came from the cache.

    Args:
        status: What :func:`enable_compile_cache` returned.
        before, after: :func:`~xla_utils.runtime.xla_counters` snapshots around the run.
    """
    if status.state == "off":  # a deliberate off reads "off:", a problem "off (warning):"
        return f"compile cache off{' (warning)' if status.warning else ''}: {status.reason}"
    hits = after["cache_hits"] - before["cache_hits"]
    failed = after["cache_load_failures"] - before["cache_load_failures"]
    compiled = after["compiles"] - before["compiles"]
    line = (f"compile cache ({status.state}, {status.folder}): {hits} graph(s) loaded from it, "
            f"{compiled} compiled")
    if failed:
        line += (f"; {failed} entr{'y' if failed == 1 else 'ies'} found but not loadable here "
                 "(XLA:CPU cannot deserialise executables)")
    if status.reason:
        line += f"; {status.reason}"
    return line
