"""Where am I, what do I have, what should I do next.

``detect()`` answers the first two questions without side effects: it reads
environment variables, ``sys.modules`` (only to see whether ``google.colab`` is
loaded), package metadata (``importlib.metadata``: torch and torch_xla are never
imported) and a sysfs/dev tree. It never initialises the XLA runtime and makes
no network call, so it is safe to call in a notebook before ``xmp.spawn``.
Metadata can lie (a half-finished upgrade, a torch build torch_xla was not
built against): ``detect(check_import=True)``, which ``setup()`` and the CLI use,
also imports torch_xla in a subprocess (``PJRT_DEVICE=CPU``, so nothing touches a
TPU or this process) and reports "not ready" when that fails.

``python -m xla_utils.env`` prints a short report and the one next step (an
exact, pinned ``pip install`` line, or "ready"); ``--json`` prints the
:class:`EnvInfo` fields as JSON and ``--root DIR`` reads a faked machine tree.

Detection order:

1. Kaggle: ``KAGGLE_KERNEL_RUN_TYPE`` / ``KAGGLE_URL_BASE`` or ``<root>/kaggle/input``.
2. Colab: ``google.colab`` in ``sys.modules``; in a subprocess of a Colab kernel
   (``!python -m xla_utils.env``) the runtime's ``COLAB_JUPYTER_IP`` /
   ``COLAB_KERNEL_MANAGER_PROXY_HOST``. ``COLAB_RELEASE_TAG`` alone is not proof:
   Kaggle's images inherit it.
3. TPU chips: PCI scan of ``<root>/sys/bus/pci/devices/*/{vendor,device}``
   (Google vendor 0x1ae0), then ``<root>/dev/accel*``, then ``<root>/dev/vfio/*``;
   ``TPU_ACCELERATOR_TYPE`` refines the generation (v2 and v3 share a PCI id) but is
   never, on its own, proof that a chip is present: ``PJRT_DEVICE=TPU`` without a
   chip makes libtpu hang for more than five minutes.
4. NVIDIA GPUs: PCI vendor 0x10de with a display class, ``<root>/dev/nvidiaN``,
   ``<root>/proc/driver/nvidia/gpus/*``.

Why this module is above 800 lines (about 970): detection, advice and setup share the
wheel and release tables and :class:`EnvInfo` below, every part takes the same faked
root and environment in the tests, and the module must stay standalone (it imports
only :mod:`xla_utils.env.libtpu_pairs` and :mod:`xla_utils.env.tpus`, never torch), because
``python -m xla_utils.env`` is what a user runs on a machine whose torch or torch_xla
is broken. Each section is small functions (none over 80 lines); the chip facts are
in :mod:`xla_utils.env.tpus`.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import glob
import importlib
import json
import math
import os
import platform as _platform
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, MutableMapping, Sequence

from .tpus import DEVICES_PER_CHIP, TPU_PCI_DEVICES, TYPE_COUNTS_CORES
from .libtpu_pairs import libtpu_warning
from .gpu import GPUFacts, gpu_facts, report_lines, torch_devices

__all__ = [
    "EnvInfo",
    "Advice",
    "detect",
    "advise",
    "xla_fix_message",
    "prepare_spawn",
    "setup",
    "report",
    "main",
    "child_pythonpath",
]

# --------------------------------------------------------------------------
# Facts
# --------------------------------------------------------------------------
GOOGLE_PCI_VENDOR = "0x1ae0"
NVIDIA_PCI_VENDOR = "0x10de"
# torch_xla major.minor -> Python versions with Linux x86_64 wheels on PyPI
# (checked with `pip index versions torch_xla --python-version X`).
TORCH_XLA_WHEELS: dict[tuple[int, int], tuple[tuple[int, int], ...]] = {
    (2, 5): ((3, 9), (3, 10), (3, 11)),
    (2, 6): ((3, 9), (3, 10), (3, 11)),
    (2, 7): ((3, 9), (3, 10), (3, 11)),
    (2, 8): ((3, 10), (3, 11), (3, 12), (3, 13)),
    (2, 9): ((3, 10), (3, 11), (3, 12), (3, 13)),
}
# Newest patch release of each torch_xla line (torch has the same patch level).
TORCH_XLA_RELEASES = {(2, 5): "2.5.1", (2, 6): "2.6.0", (2, 7): "2.7.0", (2, 8): "2.8.0", (2, 9): "2.9.0"}
LAST_TORCH_XLA = (2, 9)
OLDEST_SUPPORTED = (2, 5)
FRESH_VENV_DIR = "~/xla-venv"

_V2V3_BY_PLATFORM = {"kaggle": "v3", "colab": "v2"}
_COLAB_RUNTIME_VARS = ("COLAB_JUPYTER_IP", "COLAB_KERNEL_MANAGER_PROXY_HOST")
_KAGGLE_SPAWN_DROP = ("TPU_PROCESS_ADDRESSES", "CLOUD_TPU_TASK_ID")

VersionOf = Callable[[str], "str | None"]


# --------------------------------------------------------------------------
# Result types
# --------------------------------------------------------------------------
@dataclass
class EnvInfo:
    """What :func:`detect` found. Every field is JSON-serialisable.

    Sizes are GiB (2**30 bytes). Versions are distribution versions as pip shows
    them (``"2.8.0+cpu"``) or ``None`` when not installed.
    """

    platform: str  # "kaggle" | "colab" | "tpu-vm" | "local"
    accelerator: str  # "tpu" | "gpu" | "cpu"
    tpu_generation: str | None  # "v2" "v3" "v4" "v5e" "v5p" "v6e", "v2/v3" if ambiguous, "unknown"
    tpu_type: str | None  # slice name for this host, e.g. "v5e-8", "v3-8", "v4-8"
    tpu_chips: int  # TPU chips on this host (0 without a TPU)
    num_devices: int  # devices xmp.spawn uses: TPU XLA devices; GPUs; 1 on a CPU
    gpu_count: int  # NVIDIA GPUs found (0 if none)
    gpu_name: str | None  # model of the first GPU when the driver reports it
    python: str  # e.g. "3.12.3"
    os: str  # platform.system(), e.g. "Linux"
    machine: str  # platform.machine(), e.g. "x86_64"
    torch: str | None
    torchvision: str | None
    torch_xla: str | None
    libtpu: str | None
    paired: bool  # torch and torch_xla both installed with the same major.minor
    pjrt_device: str | None  # PJRT_DEVICE as set now (None if unset)
    cpus: int | None  # host vCPUs usable by this process (affinity and cgroup quota)
    ram_gb: float | None  # RAM usable by this process, GiB (MemTotal, capped by cgroup)
    disk_free_gb: float | None  # free space of the working directory's file system, GiB
    cwd: str  # the working directory measured for disk_free_gb
    root: str  # the file-system root that was scanned ("/" normally)
    evidence: list[str] = field(default_factory=list)  # why platform/accelerator were chosen
    warnings: list[str] = field(default_factory=list)
    import_error: str | None = None  # why `import torch_xla` failed (only checked with check_import=True)
    ready: bool = False  # nothing to install or fix before training
    next_step: str = ""  # one line: "ready ..." or what to do, with the exact command
    next_command: str | None = None  # just the shell command of next_step, if any
    # nvidia-smi's GPUs (name, compute_capability, memory_mib, index, uuid), on root "/" only
    gpus: list[dict[str, Any]] = field(default_factory=list)
    torch_replicas: int = 1  # processes fit(cores="all") runs on the torch backend
    torch_replica_kind: str = "cpu"  # "cuda" (NCCL) or "cpu"

    def to_dict(self) -> dict[str, Any]:
        """Fields as a plain dict (stable keys, declaration order)."""
        return dataclasses.asdict(self)

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)


@dataclass
class Advice:
    """One recommendation from :func:`advise`.

    ``kind`` is one of: ``ready``, ``install-torch``, ``install-torch-xla``,
    ``mismatch``, ``broken-import``, ``install-libtpu``, ``torch-too-new``, ``torch-too-old``,
    ``python-unsupported``, ``no-xla-wheels``, ``pjrt-without-tpu``.
    ``pip_args`` are the arguments after ``pip install`` when :func:`setup` may run
    them (only for torch_xla/libtpu fixes that keep the installed torch).
    """

    kind: str
    message: str
    command: str | None = None
    pip_args: list[str] | None = None
    blocking: bool = True


# --------------------------------------------------------------------------
# Small readers (all relative to a root so tests can fake a machine)
# --------------------------------------------------------------------------
def _p(root: str, path: str) -> str:
    return os.path.join(root, path.lstrip("/"))


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            return fh.read().strip()
    except OSError:
        return None


def _metadata_version(name: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None
    except Exception:  # a broken dist-info must not break detection
        return None


def child_pythonpath() -> str:
    """``PYTHONPATH`` for a fresh interpreter started from this one: the folder holding
    this ``xla_utils`` first (so the child imports the same copy), then this process's
    ``sys.path`` (a notebook's added folders, the venv's site-packages), empty entries left out."""
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # env/ in xla_utils/
    return os.pathsep.join(dict.fromkeys([here] + [p for p in sys.path if p]))


# seconds `import torch_xla` may take in the probe (about 20 s on a loaded 2-core machine)
IMPORT_PROBE_TIMEOUT = 180.0
_import_probes: dict[tuple, tuple[bool | None, str]] = {}


def _probe_torch_xla_import(timeout: float = IMPORT_PROBE_TIMEOUT) -> tuple[bool | None, str]:
    """Does ``import torch_xla`` work for this interpreter? ``(True, "")``, ``(False, why)``
    or ``(None, why)`` when the check itself could not finish.

    Runs ``python -c "import torch_xla"`` in a subprocess with this process's
    ``sys.path`` and ``PJRT_DEVICE=CPU`` (no libtpu probing, and this process never
    imports torch). The answer is cached per process for the installed versions.
    """
    key = (sys.executable, tuple(sys.path), _metadata_version("torch"), _metadata_version("torch_xla"))
    if key in _import_probes:
        return _import_probes[key]
    env = dict(os.environ, PJRT_DEVICE="CPU", PYTHONPATH=child_pythonpath())
    try:
        proc = subprocess.run([sys.executable, "-c", "import torch_xla"], env=env, capture_output=True,
                              text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return None, f"`import torch_xla` took longer than {timeout:.0f} s, so it was not checked"
    except OSError as e:
        return None, f"could not run {sys.executable} to check `import torch_xla` ({e})"
    if proc.returncode == 0:
        result: tuple[bool | None, str] = (True, "")
    else:
        lines = [ln.strip() for ln in proc.stderr.splitlines() if ln.strip()]
        why = lines[-1] if lines else (f"killed by signal {-proc.returncode}" if proc.returncode < 0
                                       else f"exit code {proc.returncode}")
        result = (False, why[:400])
    _import_probes[key] = result
    return result


def _major_minor(version: str | None) -> tuple[int, int] | None:
    if not version:
        return None
    m = re.match(r"\s*(\d+)\.(\d+)", version)
    return (int(m.group(1)), int(m.group(2))) if m else None


def _parse_python(version: str) -> tuple[int, int]:
    mm = _major_minor(version)
    return mm if mm else (sys.version_info[0], sys.version_info[1])


def _scan_pci(root: str) -> list[tuple[str, str, str, str]]:
    """(slot, vendor, device, class) for every PCI function, lower-case hex."""
    out = []
    for dev in sorted(glob.glob(_p(root, "/sys/bus/pci/devices/*"))):
        vendor = (_read(os.path.join(dev, "vendor")) or "").lower()
        device = (_read(os.path.join(dev, "device")) or "").lower()
        cls = (_read(os.path.join(dev, "class")) or "").lower()
        if vendor:
            out.append((os.path.basename(dev), vendor, device, cls))
    return out


def _parse_accelerator_type(value: str | None) -> tuple[str, int] | None:
    """``"v3-8"`` -> ("v3", 8); ``"v5litepod-8"`` -> ("v5e", 8). None if unparsable."""
    if not value:
        return None
    m = re.fullmatch(r"(v\d+)([a-z]*)-(\d+)", value.strip().lower())
    if not m:
        return None
    num, suffix, n = m.group(1), m.group(2), int(m.group(3))
    if suffix.startswith("lite"):  # v5litepod-8, v5lite-8
        suffix = "e"
    return num + suffix, n


def _tpu_type_name(gen: str | None, chips: int) -> str | None:
    if not gen or gen == "unknown" or chips <= 0:
        return None
    n = chips * 2 if gen in TYPE_COUNTS_CORES or gen == "v2/v3" else chips
    return f"{gen}-{n}"


def _cpu_count(root: str) -> int | None:
    if os.path.abspath(root) == "/":
        try:
            n: int | None = len(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            n = os.cpu_count()
    else:
        info = _read(_p(root, "/proc/cpuinfo"))
        n = sum(1 for line in info.splitlines() if line.startswith("processor")) if info else None
        n = n or None
    quota = None
    cpu_max = _read(_p(root, "/sys/fs/cgroup/cpu.max"))  # cgroup v2: "max 100000" | "200000 100000"
    if cpu_max:
        parts = cpu_max.split()
        if len(parts) == 2 and parts[0] != "max":
            try:
                quota = math.ceil(int(parts[0]) / int(parts[1]))
            except (ValueError, ZeroDivisionError):
                quota = None
    else:  # cgroup v1
        q = _read(_p(root, "/sys/fs/cgroup/cpu/cpu.cfs_quota_us"))
        per = _read(_p(root, "/sys/fs/cgroup/cpu/cpu.cfs_period_us"))
        try:
            if q and per and int(q) > 0:
                quota = math.ceil(int(q) / int(per))
        except (ValueError, ZeroDivisionError):
            quota = None
    if quota:
        n = min(n, quota) if n else quota
    return n


def _ram_gb(root: str) -> float | None:
    info = _read(_p(root, "/proc/meminfo"))
    total = None
    if info:
        m = re.search(r"^MemTotal:\s+(\d+)\s*kB", info, re.M)
        if m:
            total = int(m.group(1)) * 1024
    limit = None
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        raw = _read(_p(root, path))
        if raw and raw.isdigit() and int(raw) < (1 << 60):
            limit = int(raw)
            break
    if total is None and limit is None:
        return None
    usable = min(x for x in (total, limit) if x is not None)
    return round(usable / 2**30, 1)


def _disk_free_gb(path: str) -> float | None:
    try:
        return round(shutil.disk_usage(path).free / 2**30, 1)
    except OSError:
        return None


# --------------------------------------------------------------------------
# Detection
# --------------------------------------------------------------------------
def _detect_platform(root: str, env: Mapping[str, str], modules: Mapping[str, Any]) -> tuple[str | None, str | None]:
    """("kaggle"|"colab"|None, evidence)."""
    for var in ("KAGGLE_KERNEL_RUN_TYPE", "KAGGLE_URL_BASE"):
        if env.get(var):
            return "kaggle", f"env {var}"
    if os.path.isdir(_p(root, "/kaggle/input")):
        return "kaggle", f"{_p(root, '/kaggle/input')} exists"
    if "google.colab" in modules:
        return "colab", "google.colab is imported"
    for var in _COLAB_RUNTIME_VARS:
        if env.get(var):
            return "colab", f"env {var}"
    return None, None


def _detect_tpu(root: str, env: Mapping[str, str], pci, evidence: list[str], warnings: list[str]):
    """Return (generation or None, chips)."""
    gens: dict[str, int] = {}
    for slot, vendor, device, cls in pci:
        if vendor != GOOGLE_PCI_VENDOR:
            continue
        if device in TPU_PCI_DEVICES:
            gen = TPU_PCI_DEVICES[device]
        elif cls.startswith("0x12"):  # "processing accelerator": a TPU we do not know yet
            gen = "unknown"
        else:  # gVNIC and other Google virtual devices
            continue
        gens[gen] = gens.get(gen, 0) + 1
    accel = [p for p in glob.glob(_p(root, "/dev/accel*")) if re.fullmatch(r"accel\d+", os.path.basename(p))]
    vfio = [p for p in glob.glob(_p(root, "/dev/vfio/*")) if os.path.basename(p).isdigit()]
    acc_type_raw = env.get("TPU_ACCELERATOR_TYPE")
    acc_type = _parse_accelerator_type(acc_type_raw)
    tpu_env_hint = bool(acc_type or env.get("ISTPUVM") == "1" or env.get("TPU_WORKER_ID") is not None)

    chips = 0
    gen: str | None = None
    if gens:
        gen = max(gens, key=gens.get)
        chips = sum(gens.values())
        ids = ", ".join(f"{n}x {g}" for g, n in sorted(gens.items()))
        evidence.append(f"PCI vendor {GOOGLE_PCI_VENDOR}: {ids}")
    elif accel:
        chips = len(accel)
        evidence.append(f"{len(accel)} /dev/accel* device(s)")
    elif vfio and tpu_env_hint:
        chips = len(vfio)
        evidence.append(f"{len(vfio)} /dev/vfio group(s) with TPU environment variables")

    if chips == 0:
        if acc_type_raw:
            warnings.append(
                f"TPU_ACCELERATOR_TYPE={acc_type_raw} is set but no TPU chip is visible "
                f"(no PCI vendor {GOOGLE_PCI_VENDOR}, /dev/accel*, /dev/vfio/*)."
            )
        elif env.get("ISTPUVM") == "1":
            warnings.append("ISTPUVM=1 is set but no TPU chip is visible.")
        return None, 0

    if acc_type:
        env_gen = acc_type[0]
        evidence.append(f"TPU_ACCELERATOR_TYPE={acc_type_raw}")
        if gen in (None, "unknown") or (gen == "v2/v3" and env_gen in ("v2", "v3")):
            gen = env_gen
        elif gen != env_gen:
            warnings.append(
                f"TPU_ACCELERATOR_TYPE={acc_type_raw} disagrees with the PCI scan ({gen}); trusting PCI."
            )
    if gen is None:
        gen = "unknown"
    return gen, chips


def _detect_gpu(root: str, pci) -> tuple[int, str | None, str | None]:
    pci_gpus = [s for s, v, d, c in pci if v == NVIDIA_PCI_VENDOR and c.startswith("0x03")]
    dev = [p for p in glob.glob(_p(root, "/dev/nvidia*")) if re.fullmatch(r"nvidia\d+", os.path.basename(p))]
    procs = sorted(glob.glob(_p(root, "/proc/driver/nvidia/gpus/*")))
    count = max(len(pci_gpus), len(dev), len(procs))
    name = None
    for d in procs:
        info = _read(os.path.join(d, "information")) or ""
        m = re.search(r"^Model:\s*(.+)$", info, re.M)
        if m:
            name = m.group(1).strip()
            break
    why = None
    if count:
        why = f"NVIDIA: {len(pci_gpus)} PCI display device(s), {len(dev)} /dev/nvidiaN, {len(procs)} driver entries"
    return count, name, why


def detect(
    root: str = "/",
    environ: Mapping[str, str] | None = None,
    modules: Mapping[str, Any] | None = None,
    *,
    version_of: VersionOf | None = None,
    python: str | None = None,
    system: str | None = None,
    machine: str | None = None,
    cwd: str | None = None,
    check_import: bool = False,
) -> EnvInfo:
    """Describe this machine without importing torch/torch_xla or touching the runtime.

    Args:
        root: file-system root whose ``sys``, ``dev``, ``proc`` and ``kaggle`` trees
            are read (default ``"/"``; tests pass a faked tree).
        environ: environment variables (default ``os.environ``).
        modules: loaded modules, consulted for ``google.colab`` (default ``sys.modules``).
        version_of: ``name -> version or None`` for installed distributions
            (default: ``importlib.metadata.version``).
        python: Python version string (default: the running interpreter's).
        system, machine: OS and CPU architecture (default: ``platform.system()`` /
            ``platform.machine()``); torch_xla has wheels for Linux x86_64 only.
        cwd: directory whose free disk space is reported (default: ``os.getcwd()``).
        check_import: also import torch_xla in a subprocess when the metadata says it
            is installed (a few seconds, up to 20 s on a loaded 2-core machine; cached
            per process), so that a pair that fails to load (``undefined symbol``) is
            reported as not ready. Only with this interpreter's own metadata
            (``version_of`` None). Default False.

    Returns:
        An :class:`EnvInfo` whose ``next_step`` says what to do (see :func:`advise`).
    """
    env = os.environ if environ is None else environ
    mods = sys.modules if modules is None else modules
    vof = version_of or _metadata_version
    evidence: list[str] = []
    warnings: list[str] = []
    plat, accelerator, gen, chips, num_devices, gpu = _detect_hardware(root, env, mods, evidence,
                                                                       warnings)
    versions = _detect_versions(vof, warnings)
    pjrt = env.get("PJRT_DEVICE") or None
    cpus = _cpu_count(root)
    warnings += _setup_warnings(pjrt, accelerator, cpus, num_devices)
    import_error = None
    if check_import and version_of is None and versions["torch_xla"]:
        import_error = _import_error(warnings)
    work = cwd or os.getcwd()
    info = EnvInfo(
        platform=plat,
        accelerator=accelerator,
        tpu_generation=gen if accelerator == "tpu" else None,
        tpu_type=_tpu_type_name(gen, chips) if accelerator == "tpu" else None,
        tpu_chips=chips,
        num_devices=num_devices,
        gpu_count=gpu[0],
        gpu_name=gpu[1],
        python=python or _platform.python_version(),
        os=system or _platform.system(),
        machine=machine or _platform.machine(),
        **versions,
        pjrt_device=pjrt,
        cpus=cpus,
        ram_gb=_ram_gb(root),
        disk_free_gb=_disk_free_gb(work),
        cwd=work,
        root=root,
        evidence=evidence,
        warnings=warnings,
        import_error=import_error,
    )
    if root == "/" and accelerator != "tpu":
        _add_gpu_facts(info, env)
    adv = advise(info)
    info.ready = adv.kind == "ready"
    info.next_step = adv.message + (f": {adv.command}" if adv.command else "")
    info.next_command = adv.command
    return info


def _add_gpu_facts(info: EnvInfo, env: Mapping[str, str]) -> None:
    """The GPUs from nvidia-smi (none: no GPU facts; CUDA is not initialised) and the torch
    replicas ``fit`` runs on them, into ``info``."""
    facts = gpu_facts()
    info.gpus = [dataclasses.asdict(g) for g in facts]
    with contextlib.suppress(ValueError):  # a bad XLA_UTILS_CPU_REPLICAS fails at fit
        devs = torch_devices(dict(env), gpus=facts)
        info.torch_replicas, info.torch_replica_kind = devs.count, devs.kind


def _detect_hardware(root: str, env: Mapping[str, str], mods: Mapping[str, Any],
                     evidence: list[str], warnings: list[str]
                     ) -> tuple[str, str, str | None, int, int, tuple[int, str | None]]:
    """Platform and accelerator from the file system and environment.

    Appends what it concluded from to ``evidence`` (and doubts to ``warnings``).

    Returns:
        ``(platform, accelerator, tpu_generation, tpu_chips, num_devices,
        (gpu_count, gpu_name))``; ``accelerator`` is ``"tpu"``, ``"gpu"`` or ``"cpu"``.
    """
    plat, why = _detect_platform(root, env, mods)
    if why:
        evidence.append(why)
    if plat is None and env.get("COLAB_RELEASE_TAG"):
        evidence.append("COLAB_RELEASE_TAG alone is not taken as Colab (Kaggle images inherit it)")

    pci = _scan_pci(root)
    gen, chips = _detect_tpu(root, env, pci, evidence, warnings)
    if gen == "v2/v3" and plat in _V2V3_BY_PLATFORM:
        # v2 and v3 share a PCI id; Kaggle only ever offered v3-8, Colab only v2-8.
        gen = _V2V3_BY_PLATFORM[plat]
        evidence.append(f"0x0027 on {plat} means {gen}")
    gpu_count, gpu_name, gpu_why = _detect_gpu(root, pci)

    if chips:
        accelerator = "tpu"
        num_devices = chips * DEVICES_PER_CHIP.get(gen or "unknown", 1)
    elif gpu_count:
        accelerator = "gpu"
        num_devices = gpu_count
        evidence.append(gpu_why or "NVIDIA GPU")
    else:
        accelerator = "cpu"
        num_devices = 1
    if plat is None:
        plat = "tpu-vm" if accelerator == "tpu" else "local"
    return plat, accelerator, gen, chips, num_devices, (gpu_count, gpu_name)


def _detect_versions(vof: VersionOf, warnings: list[str]) -> dict[str, Any]:
    """Installed versions of torch, torchvision, torch_xla and libtpu, and
    whether torch and torch_xla are a pair; a torchvision that does not match
    torch, and a libtpu other than the one known to work with the torch_xla
    (:mod:`xla_utils.env.libtpu_pairs`), are added to ``warnings``.

    Returns:
        The :class:`EnvInfo` fields ``torch``, ``torchvision``, ``torch_xla``,
        ``libtpu`` and ``paired``.
    """
    libtpu = None
    for dist in ("libtpu", "libtpu-nightly"):
        libtpu = vof(dist)
        if libtpu:
            break
    torch_v, xla_v = vof("torch"), vof("torch_xla")
    pairing = libtpu_warning(xla_v, libtpu, dist)
    if pairing:
        warnings.append(pairing)
    tmm, xmm = _major_minor(torch_v), _major_minor(xla_v)
    tv = vof("torchvision")
    tvmm = _major_minor(tv)
    if tmm and tvmm and tmm[0] == 2 and tvmm != (0, tmm[1] + 15):
        warnings.append(
            f"torchvision {tv} does not match torch {torch_v} (expected 0.{tmm[1] + 15}.x)."
        )
    return {"torch": torch_v, "torchvision": tv, "torch_xla": xla_v, "libtpu": libtpu,
            "paired": bool(tmm and xmm and tmm == xmm)}


def _import_error(warnings: list[str]) -> str | None:
    """Why ``import torch_xla`` fails in a subprocess (None when it works); a probe
    that could not decide is added to ``warnings``."""
    ok, why = _probe_torch_xla_import()
    if ok is None:
        warnings.append(why + ".")
    return why if ok is False else None


def _setup_warnings(pjrt: str | None, accelerator: str, cpus: int | None,
                    num_devices: int) -> list[str]:
    """Warnings about ``PJRT_DEVICE`` against the hardware, and too few host CPUs."""
    warnings = []
    if pjrt and pjrt.upper() == "TPU" and accelerator != "tpu":
        warnings.append(
            "PJRT_DEVICE=TPU is set but no TPU chip was found: libtpu would retry the "
            "metadata server and hang for more than 5 minutes. Unset it or set PJRT_DEVICE=CPU."
        )
    if pjrt and pjrt.upper() == "CPU" and accelerator == "tpu":
        warnings.append("PJRT_DEVICE=CPU on a TPU machine: XLA will run on the host CPU, not the TPU.")
    if accelerator in ("tpu", "gpu") and cpus is not None and cpus <= 4:
        warnings.append(
            f"only {cpus} vCPUs feed {num_devices} device(s): decoding/augmenting images on the "
            "host will starve the accelerator; build a uint8 cache (xla_utils.build_cache)."
        )
    return warnings

# --------------------------------------------------------------------------
# Advice
# --------------------------------------------------------------------------
def _pair_line(mm: tuple[int, int], tpu: bool) -> str:
    rel = TORCH_XLA_RELEASES[mm]
    xla = f'"torch_xla[tpu]=={rel}"' if tpu else f"torch_xla=={rel}"
    return f"pip install torch=={rel} torchvision==0.{mm[1] + 15}.{rel.rsplit('.', 1)[1]} {xla}"


def _newest_pair_for(py: tuple[int, int]) -> tuple[int, int] | None:
    ok = [mm for mm, pys in TORCH_XLA_WHEELS.items() if py in pys]
    return max(ok) if ok else None


def _fresh_venv(py: tuple[int, int], tpu: bool) -> str:
    target = py if _newest_pair_for(py) == LAST_TORCH_XLA else (3, 12)
    return (
        f"python{target[0]}.{target[1]} -m venv {FRESH_VENV_DIR} && "
        f"{FRESH_VENV_DIR}/bin/{_pair_line(LAST_TORCH_XLA, tpu)}"
    )


def _xla_spec(mm: tuple[int, int], tpu: bool) -> str:
    return f"torch_xla[tpu]=={mm[0]}.{mm[1]}.*" if tpu else f"torch_xla=={mm[0]}.{mm[1]}.*"


def _quote(spec: str) -> str:
    return f'"{spec}"' if any(c in spec for c in "[]*") else spec


def _no_wheels_advice(info: EnvInfo, tmm: tuple[int, int] | None) -> Advice:
    """Advice on an OS or CPU with no torch_xla wheels (plain PyTorch only)."""
    if tmm is None:
        return Advice(
            "install-torch",
            f"torch is not installed (torch_xla has no wheels for {info.os} {info.machine}; "
            "xla_utils will run on plain PyTorch)",
            "pip install torch torchvision",
        )
    return Advice(
        "no-xla-wheels",
        f"torch_xla has no wheels for {info.os} {info.machine}: no TPU or simulated XLA cores "
        "here; xla_utils runs on plain PyTorch",
        blocking=False,
    )


def _no_torch_advice(info: EnvInfo, py: tuple[int, int], xmm: tuple[int, int] | None,
                     tpu: bool) -> Advice:
    """Advice when torch is not installed (whatever torch_xla is)."""
    if xmm in TORCH_XLA_WHEELS:
        spec = f"torch=={xmm[0]}.{xmm[1]}.*"
        return Advice(
            "install-torch",
            f"torch_xla {info.torch_xla} is installed but torch is not",
            f'pip install "{spec}" "torchvision==0.{xmm[1] + 15}.*"',
        )
    pair = _newest_pair_for(py)
    if pair is None:
        return Advice(
            "python-unsupported",
            f"torch is not installed and torch_xla has no wheels for Python {py[0]}.{py[1]} "
            "(3.10-3.13 only); use a venv with a supported Python",
            _fresh_venv(py, tpu),
        )
    return Advice("install-torch", "torch and torch_xla are not installed", _pair_line(pair, tpu))


def _install_advice(info: EnvInfo) -> Advice | None:
    """The torch / torch_xla / libtpu problem on this machine, or None."""
    tpu = info.accelerator == "tpu"
    py = _parse_python(info.python)
    tmm, xmm = _major_minor(info.torch), _major_minor(info.torch_xla)
    last = ".".join(map(str, LAST_TORCH_XLA))
    wheels_os = info.os == "Linux" and info.machine.lower() in ("x86_64", "amd64")

    if not wheels_os:
        return _no_wheels_advice(info, tmm)
    if tmm is None:
        return _no_torch_advice(info, py, xmm, tpu)
    if tmm > LAST_TORCH_XLA:
        return Advice(
            "torch-too-new",
            f"torch {info.torch} is newer than the last torch_xla release ({last}.0), so torch_xla has "
            "no matching release. Keep this torch for plain PyTorch; for XLA use the "
            f"{last} pair in a fresh venv",
            _fresh_venv(py, tpu),
        )
    if tmm < OLDEST_SUPPORTED:
        return Advice(
            "torch-too-old",
            f"torch {info.torch} is older than the torch_xla versions xla_utils supports "
            f"(2.5-{last}); use the {last} pair in a fresh venv",
            _fresh_venv(py, tpu),
        )
    spec = _xla_spec(tmm, tpu)
    if py not in TORCH_XLA_WHEELS.get(tmm, ()) and xmm != tmm:  # a paired install is trusted
        return Advice(
            "python-unsupported",
            f"torch_xla {tmm[0]}.{tmm[1]} has no wheels for Python {py[0]}.{py[1]}; "
            f"use the {last} pair in a fresh venv",
            _fresh_venv(py, tpu),
        )
    if xmm is None:
        note = "" if tpu else "; here it is needed only for simulated XLA cores (without it xla_utils runs on plain PyTorch)"
        return Advice(
            "install-torch-xla",
            f"torch_xla is not installed (torch {info.torch} is){note}",
            f"pip install {_quote(spec)}",
            [spec],
            blocking=tpu,
        )
    if xmm != tmm:
        return Advice(
            "mismatch",
            f"torch {info.torch} and torch_xla {info.torch_xla} are different versions "
            "(importing torch_xla fails with 'undefined symbol'); install the torch_xla that "
            "matches the installed torch",
            f"pip install {_quote(spec)}",
            [spec],
        )
    if info.import_error:
        spec = f"torch_xla[tpu]=={info.torch_xla}" if tpu else f"torch_xla=={info.torch_xla}"
        return Advice(
            "broken-import",
            f"not ready: torch {info.torch} and torch_xla {info.torch_xla} pair by version, but "
            f"`import torch_xla` fails ({info.import_error}); reinstall torch_xla over the installed "
            f"torch (if it still fails, this torch is not the PyPI build torch_xla was built against: "
            f"use the {last} pair in a fresh venv)",
            f"pip install --force-reinstall --no-deps {_quote(spec)}",
        )
    if tpu and not info.libtpu:
        return Advice(
            "install-libtpu",
            "libtpu is not installed, so torch_xla cannot reach the TPU",
            f"pip install {_quote(spec)}",
            [spec],
        )
    return None


def advise(info: EnvInfo) -> Advice:
    """The ONE next step for ``info``: the most urgent fix, or ``kind == "ready"``."""
    adv = _install_advice(info)
    if adv is not None and adv.blocking:
        return adv
    if info.pjrt_device and info.pjrt_device.upper() == "TPU" and info.accelerator != "tpu":
        return Advice(
            "pjrt-without-tpu",
            "PJRT_DEVICE=TPU is set but there is no TPU chip here (libtpu would hang >5 min); "
            'set it to CPU (in a notebook: os.environ["PJRT_DEVICE"] = "CPU"), in a shell',
            "export PJRT_DEVICE=CPU",
        )
    if adv is not None and adv.kind == "no-xla-wheels":
        return Advice("ready", f"ready ({adv.message})")
    if adv is not None:
        return adv
    if info.accelerator == "tpu":
        todo = []
        if not info.pjrt_device:
            todo.append("PJRT_DEVICE will be set to TPU")
        if info.platform == "kaggle":
            todo.append("TPU_PROCESS_ADDRESSES/CLOUD_TPU_TASK_ID are dropped before spawning")
        extra = f" ({'; '.join(todo)})" if todo else ""
        return Advice("ready", f"ready: {info.num_devices} TPU {info.tpu_generation} devices{extra}")
    if info.torch_xla:
        return Advice("ready", "ready (no TPU: plain PyTorch by default, launch(simulate=N) for N XLA:CPU devices)")
    return Advice("ready", "ready (plain PyTorch)")


def xla_fix_message(info: EnvInfo | None = None) -> str:
    """One or two lines: what is wrong with torch/torch_xla here and the exact pip command.

    ``runtime`` appends this to its error when torch_xla is missing or fails to import.
    """
    info = info or detect()
    adv = _install_advice(info)
    if adv is not None:
        return adv.message + (f".\nFix: {adv.command}" if adv.command else ".")
    spec = f"torch_xla[tpu]=={info.torch_xla}" if info.accelerator == "tpu" else f"torch_xla=={info.torch_xla}"
    return (
        f"torch {info.torch} and torch_xla {info.torch_xla} are installed and paired, yet torch_xla "
        f"did not import; reinstall it.\nFix: pip install --force-reinstall --no-deps {_quote(spec)}"
    )


# --------------------------------------------------------------------------
# Actions
# --------------------------------------------------------------------------
def prepare_spawn(info: EnvInfo | None = None, environ: MutableMapping[str, str] | None = None) -> None:
    """Edit the environment the way the platform needs right before ``xmp.spawn``.

    With a TPU: sets ``PJRT_DEVICE=TPU`` if unset, and on Kaggle removes
    ``TPU_PROCESS_ADDRESSES`` and ``CLOUD_TPU_TASK_ID`` (as Kaggle's official TPU
    notebook does). Without a TPU it changes nothing. ``environ`` defaults to
    ``os.environ``; ``info`` defaults to :func:`detect` on that environment.
    """
    env = os.environ if environ is None else environ
    info = info or detect(environ=env)
    if info.accelerator != "tpu":
        return
    if info.platform == "kaggle":
        for var in _KAGGLE_SPAWN_DROP:
            env.pop(var, None)
    if not env.get("PJRT_DEVICE"):
        env["PJRT_DEVICE"] = "TPU"


def report(info: EnvInfo) -> str:
    """A short human-readable report ending with the one next step."""
    if info.accelerator == "tpu":
        acc = (
            f"TPU {info.tpu_type or info.tpu_generation}: {info.tpu_chips} chip(s), "
            f"{info.num_devices} XLA device(s)"
        )
    elif info.accelerator == "gpu":
        acc = f"GPU: {info.gpu_count} x {info.gpu_name or 'NVIDIA'}"
    else:
        acc = "CPU only"
    pj = info.pjrt_device or "unset"

    def v(x: str | None) -> str:
        return x or "-"

    pair = "paired" if info.paired else ("NOT paired" if info.torch and info.torch_xla else "")
    if info.import_error:
        pair += " by version, but `import torch_xla` FAILS"
    host = []
    host.append(f"{info.cpus} vCPUs" if info.cpus else "? vCPUs")
    host.append(f"{info.ram_gb:g} GiB RAM" if info.ram_gb is not None else "? GiB RAM")
    host.append(f"{info.disk_free_gb:g} GiB free in {info.cwd}" if info.disk_free_gb is not None else "disk ?")
    lines = [
        "xla_utils environment",
        f"  platform     {info.platform}",
        *([f"  evidence     {'; '.join(info.evidence)}"] if info.evidence else []),
        f"  accelerator  {acc}; PJRT_DEVICE={pj}",
        f"  python       {info.python} ({info.os} {info.machine})",
        f"  torch        {v(info.torch)}   torchvision {v(info.torchvision)}   "
        f"torch_xla {v(info.torch_xla)} {pair}".rstrip()
        + (f"   libtpu {info.libtpu}" if info.libtpu else ""),
        f"  host         {', '.join(host)}",
    ]
    if info.gpus or info.torch_replicas > 1:
        gpus = [GPUFacts(**{**g, "compute_capability": tuple(g["compute_capability"])})
                for g in info.gpus]
        lines += report_lines(gpus, info.torch_replicas, info.torch_replica_kind)
    lines += [f"  warning: {w}" for w in info.warnings]
    lines.append(f"next step: {info.next_step}")
    return "\n".join(lines)


def _default_runner(cmd: Sequence[str]) -> int:
    return subprocess.call(list(cmd))


def setup(
    install: bool = False,
    *,
    runner: Callable[[list[str]], Any] | None = None,
    root: str = "/",
    environ: MutableMapping[str, str] | None = None,
    modules: Mapping[str, Any] | None = None,
    version_of: VersionOf | None = None,
    out: Callable[[str], None] = print,
) -> EnvInfo:
    """Notebook helper: print the report, optionally install torch_xla, fix the environment.

    Args:
        install: if True and torch_xla is missing, mismatched, or (on a TPU) libtpu
            is missing, run ``[sys.executable, "-m", "pip", "install", "torch_xla==X.Y.*"]``
            (``torch_xla[tpu]`` on a TPU) pinned to the installed torch's major.minor.
            torch itself is never installed or upgraded: with torch missing or newer
            than the last torch_xla (2.9) it refuses and prints the command to run.
        runner: callable that runs the pip argv and returns an exit code or a
            ``CompletedProcess`` (default: ``subprocess.call``). Tests inject a recorder.
        root, environ, modules, version_of: as for :func:`detect` (defaults:
            ``"/"``, ``os.environ``, ``sys.modules``, ``importlib.metadata``).
        out: where lines are printed (default ``print``).

    The report also imports torch_xla in a subprocess (when this interpreter's own
    metadata is read, ``version_of`` None) so that a pair that fails to load is "not
    ready"; ``install=True`` does not reinstall such a pair itself (it prints the command).

    Environment: with a TPU, applies :func:`prepare_spawn`'s edits (``PJRT_DEVICE=TPU``
    if unset; Kaggle drops ``TPU_PROCESS_ADDRESSES``/``CLOUD_TPU_TASK_ID``). Without a
    TPU, sets ``PJRT_DEVICE=CPU`` if unset (warning if torch_xla is already imported,
    because it reads the variable at import).

    Returns:
        The :class:`EnvInfo` after any installation.
    """
    env = os.environ if environ is None else environ
    mods = sys.modules if modules is None else modules
    info = detect(root, env, mods, version_of=version_of, check_import=True)
    out(report(info))

    if install:
        info = _install(info, runner, root, env, mods, version_of, out)

    if info.accelerator == "tpu":
        prepare_spawn(info, env)
    elif not env.get("PJRT_DEVICE"):
        env["PJRT_DEVICE"] = "CPU"
        if mods.get("torch_xla") is not None:  # None: an import that was blocked
            out(
                "warning: torch_xla was imported before setup(); PJRT_DEVICE=CPU may not take "
                "effect until the kernel is restarted and setup() runs first."
            )
    info.pjrt_device = env.get("PJRT_DEVICE") or None
    return info


def _install(info: EnvInfo, runner: Callable[[list[str]], Any] | None, root: str,
             env: Mapping[str, str], mods: Mapping[str, Any], version_of: VersionOf | None,
             out: Callable[[str], None]) -> EnvInfo:
    """``setup(install=True)``: pip-install what :func:`_install_advice` names, or say
    why not; returns the environment detected again after an installation."""
    adv = _install_advice(info)
    if adv is None:
        out("setup(install=True): nothing to install.")
    elif not adv.pip_args:
        what = ("will not reinstall packages that are already installed" if adv.kind == "broken-import"
                else "will not install or change torch")
        out(
            f"setup(install=True) {what}; "
            f"{adv.message}" + (f".\nRun yourself: {adv.command}" if adv.command else ".")
        )
    else:
        cmd = [sys.executable, "-m", "pip", "install", *adv.pip_args]
        out("running: " + " ".join(cmd))
        result = (runner or _default_runner)(cmd)
        rc = getattr(result, "returncode", result)
        if rc not in (0, None):
            out(f"pip failed (exit code {rc}); the command was: {' '.join(cmd)}")
        else:
            importlib.invalidate_caches()
            _import_probes.clear()  # the files changed: probe the import again
            info = detect(root, env, mods, version_of=version_of, check_import=True)
            out(f"installed; next step now: {info.next_step}")
            if "torch" in mods or "torch_xla" in mods:
                out(
                    "torch is already imported in this kernel: restart the kernel "
                    "(Colab: Runtime > Restart session; Kaggle: Run > Restart & clear cell outputs), "
                    "then run xla_utils.setup() again."
                )
    return info


# --------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------
def main(argv: Sequence[str] | None = None) -> int:
    """``python -m xla_utils.env [--json] [--root DIR] [--no-import-check]``; returns the exit code (0)."""
    parser = argparse.ArgumentParser(
        prog="python -m xla_utils.env",
        description="Report platform, accelerator and torch/torch_xla versions, and the one next step.",
    )
    parser.add_argument("--json", action="store_true", help="print the EnvInfo fields as JSON")
    parser.add_argument("--root", default="/", help="file-system root to scan (default /; for faked trees)")
    parser.add_argument("--no-import-check", action="store_true",
                        help="trust the package metadata instead of importing torch_xla in a subprocess "
                        "(faster; misses a pair that fails to load)")
    args = parser.parse_args(argv)
    info = detect(root=args.root, check_import=not args.no_import_check)
    print(info.to_json() if args.json else report(info))
    return 0

