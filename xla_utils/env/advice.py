"""What to do next: the one step :func:`advise` gives for an :class:`~.info.EnvInfo`
(the exact, pinned ``pip install`` line, or "ready"), from the torch_xla wheel and release
tables below. Pure functions of the facts :mod:`.detection` found: nothing is read here."""
from __future__ import annotations

import re
import sys

from .info import Advice, EnvInfo

__all__ = ["advise", "install_advice", "major_minor", "quoted", "TORCH_XLA_WHEELS",
           "TORCH_XLA_RELEASES", "LAST_TORCH_XLA", "OLDEST_SUPPORTED", "FRESH_VENV_DIR"]

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


def major_minor(version: str | None) -> tuple[int, int] | None:
    """``"2.8.0+cpu"`` -> ``(2, 8)``; None for None or a version that does not start so."""
    if not version:
        return None
    m = re.match(r"\s*(\d+)\.(\d+)", version)
    return (int(m.group(1)), int(m.group(2))) if m else None


def _parse_python(version: str) -> tuple[int, int]:
    mm = major_minor(version)
    return mm if mm else (sys.version_info[0], sys.version_info[1])


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


def quoted(spec: str) -> str:
    """``spec`` in double quotes when a shell would read its ``[]`` or ``*``."""
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


def install_advice(info: EnvInfo) -> Advice | None:
    """The torch / torch_xla / libtpu problem on this machine, or None.

    Args:
        info: what :func:`~xla_utils.env.detect` found.

    Returns:
        The fix as :class:`~.info.Advice` (``pip_args`` set when :func:`~xla_utils.env.setup`
        may run it), or None when torch, torch_xla and libtpu need nothing.
    """
    tpu = info.accelerator == "tpu"
    py = _parse_python(info.python)
    tmm, xmm = major_minor(info.torch), major_minor(info.torch_xla)
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
            f"pip install {quoted(spec)}",
            [spec],
            blocking=tpu,
        )
    if xmm != tmm:
        return Advice(
            "mismatch",
            f"torch {info.torch} and torch_xla {info.torch_xla} are different versions "
            "(importing torch_xla fails with 'undefined symbol'); install the torch_xla that "
            "matches the installed torch",
            f"pip install {quoted(spec)}",
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
            f"pip install --force-reinstall --no-deps {quoted(spec)}",
        )
    if tpu and not info.libtpu:
        return Advice(
            "install-libtpu",
            "libtpu is not installed, so torch_xla cannot reach the TPU",
            f"pip install {quoted(spec)}",
            [spec],
        )
    return None


def advise(info: EnvInfo) -> Advice:
    """The ONE next step for ``info``: the most urgent fix, or ``kind == "ready"``.

    Args:
        info: what :func:`~xla_utils.env.detect` found.

    Returns:
        The :class:`~.info.Advice` to show (``kind == "ready"`` when nothing blocks).
    """
    adv = install_advice(info)
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

