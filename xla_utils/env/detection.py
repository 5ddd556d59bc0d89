"""Where am I and what do I have: :func:`detect`, without side effects.

``detect()`` reads environment variables, ``sys.modules`` (only to see whether
``google.colab`` is loaded), package metadata (``importlib.metadata``: torch and torch_xla
are never imported) and a sysfs/dev tree. It never initialises the XLA runtime and makes
no network call, so it is safe to call in a notebook before ``xmp.spawn``. Metadata can
lie (a half-finished upgrade, a torch build torch_xla was not built against):
``detect(check_import=True)``, which ``setup()`` and the command line use, also imports
torch_xla in a subprocess (``PJRT_DEVICE=CPU``, so nothing touches a TPU or this process)
and reports "not ready" when that fails.

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

Every reader takes the same root (and environment), so the tests fake a machine. This
module imports only its neighbours in :mod:`xla_utils.env`, never torch: ``python -m
xla_utils.env`` is what a user runs on a machine whose torch or torch_xla is broken. The
chip facts are in :mod:`xla_utils.env.tpus`.
"""
from __future__ import annotations

import contextlib
import dataclasses
import glob
import math
import os
import platform as _platform
import re
import shutil
import subprocess
import sys
from typing import Any, Mapping

from .advice import advise, major_minor
from .gpu import gpu_facts, torch_devices
from .info import EnvInfo, VersionOf
from .libtpu_pairs import libtpu_warning
from .tpus import DEVICES_PER_CHIP, TPU_PCI_DEVICES, TYPE_COUNTS_CORES

__all__ = ["detect", "platform_name",
           "child_pythonpath", "forget_import_probes", "IMPORT_PROBE_TIMEOUT",
           "GOOGLE_PCI_VENDOR", "NVIDIA_PCI_VENDOR"]

GOOGLE_PCI_VENDOR = "0x1ae0"
NVIDIA_PCI_VENDOR = "0x10de"

_V2V3_BY_PLATFORM = {"kaggle": "v3", "colab": "v2"}
_COLAB_RUNTIME_VARS = ("COLAB_JUPYTER_IP", "COLAB_KERNEL_MANAGER_PROXY_HOST")


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
    ``sys.path``, ``PJRT_DEVICE=CPU`` (no libtpu probing, and this process never
    imports torch) and ``TORCHINDUCTOR_COMPILE_THREADS=1`` unless set (no inductor
    compile workers). The answer is cached per process for the installed versions.
    """
    key = (sys.executable, tuple(sys.path), _metadata_version("torch"), _metadata_version("torch_xla"))
    if key in _import_probes:
        return _import_probes[key]
    env = dict(os.environ, PJRT_DEVICE="CPU", PYTHONPATH=child_pythonpath())
    # importing torch_xla imports torch._inductor, whose compile-worker pool is another
    # interpreter importing torch: the check took 6.5 s with it, 4.6 s without (2 cores)
    env.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
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


def forget_import_probes() -> None:
    """Forget the cached answers of the ``import torch_xla`` check (after a pip install)."""
    _import_probes.clear()


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


def platform_name() -> str | None:
    """``"kaggle"``, ``"colab"`` or None for this process, from the environment, the
    ``/kaggle/input`` folder and the loaded modules only (no probe): what ``detect()``
    reports as ``platform``, cheaply."""
    return _detect_platform("/", os.environ, sys.modules)[0]


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
    tmm, xmm = major_minor(torch_v), major_minor(xla_v)
    tv = vof("torchvision")
    tvmm = major_minor(tv)
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
