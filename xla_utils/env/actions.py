"""What setup does about it: :func:`setup` (the report, an optional pip install, the
environment a spawn needs), :func:`prepare_spawn`, :func:`report` and
:func:`xla_fix_message`, the line ``runtime`` adds to its error when torch_xla fails."""
from __future__ import annotations

import importlib
import os
import subprocess
import sys
from typing import Any, Callable, Mapping, MutableMapping, Sequence

from .advice import install_advice, quoted
from .detection import detect, forget_import_probes
from .gpu import GPUFacts, report_lines
from .info import EnvInfo, VersionOf

__all__ = ["setup", "prepare_spawn", "report", "xla_fix_message"]

_KAGGLE_SPAWN_DROP = ("TPU_PROCESS_ADDRESSES", "CLOUD_TPU_TASK_ID")


def xla_fix_message(info: EnvInfo | None = None) -> str:
    """One or two lines: what is wrong with torch/torch_xla here and the exact pip command.

    ``runtime`` appends this to its error when torch_xla is missing or fails to import.
    """
    info = info or detect()
    adv = install_advice(info)
    if adv is not None:
        return adv.message + (f".\nFix: {adv.command}" if adv.command else ".")
    spec = f"torch_xla[tpu]=={info.torch_xla}" if info.accelerator == "tpu" else f"torch_xla=={info.torch_xla}"
    return (
        f"torch {info.torch} and torch_xla {info.torch_xla} are installed and paired, yet torch_xla "
        f"did not import; reinstall it.\nFix: pip install --force-reinstall --no-deps {quoted(spec)}"
    )


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
    """``setup(install=True)``: pip-install what :func:`~.advice.install_advice` names, or say
    why not; returns the environment detected again after an installation."""
    adv = install_advice(info)
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
            forget_import_probes()  # the files changed: probe the import again
            info = detect(root, env, mods, version_of=version_of, check_import=True)
            out(f"installed; next step now: {info.next_step}")
            if "torch" in mods or "torch_xla" in mods:
                out(
                    "torch is already imported in this kernel: restart the kernel "
                    "(Colab: Runtime > Restart session; Kaggle: Run > Restart & clear cell outputs), "
                    "then run xla_utils.setup() again."
                )
    return info
