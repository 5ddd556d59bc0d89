"""The libtpu each torch_xla line is known to work with, and the warning when another one is installed.

libtpu is the TPU runtime torch_xla's PJRT client loads; pip lets any version sit beside any
torch_xla, and a libtpu newer than the one a torch_xla release was built with can break its
PJRT runtime only once a TPU is used. :func:`libtpu_warning` (shown by ``python -m
xla_utils.env`` and ``setup()``) names the installed pair, the known one and the exact pip
command. Lines not in :data:`KNOWN_LIBTPU` (2.5-2.7, whose libtpu came from Google's nightly
index) get no warning: nothing is known about them here.
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["KnownLibtpu", "KNOWN_LIBTPU", "libtpu_warning"]


@dataclass(frozen=True)
class KnownLibtpu:
    """The libtpu a platform runs with one torch_xla line.

    Attributes:
        install: the libtpu version to install (on PyPI).
        also_works: other libtpu versions known to work with this line.
        why: where the pairing comes from, one clause.
    """

    install: str
    also_works: tuple[str, ...]
    why: str


# torch_xla major.minor -> the libtpu known to work with it.
KNOWN_LIBTPU: dict[tuple[int, int], KnownLibtpu] = {
    (2, 8): KnownLibtpu(
        "0.0.17", (),
        "Kaggle's TPU image forces libtpu 0.0.17 for torch_xla 2.8 because a newer one broke its "
        "PJRT runtime; torch_xla[tpu]==2.8.0 pins it too"),
    (2, 9): KnownLibtpu(
        "0.0.21.1", ("0.0.21",),
        "Colab's TPU runtime pairs torch_xla 2.9 with libtpu 0.0.21.1; torch_xla[tpu]==2.9.0 pins 0.0.21"),
}


def libtpu_warning(torch_xla: str | None, libtpu: str | None, dist: str = "libtpu") -> str | None:
    """The warning for a libtpu that is not the one known to work with the installed torch_xla.

    Args:
        torch_xla: installed torch_xla version as pip shows it (``"2.8.0"``), or None.
        libtpu: installed libtpu version, or None (no warning: a missing libtpu on a TPU is
            :mod:`xla_utils.env`'s "install-libtpu" advice).
        dist: the distribution that provides it, ``"libtpu"`` or ``"libtpu-nightly"`` (the
            command then removes the nightly first). Default ``"libtpu"``.

    Returns:
        One sentence ending with the pip command, or None when the pair is known to work or
        nothing is known about this torch_xla line.
    """
    if not torch_xla or not libtpu:
        return None
    parts = torch_xla.split("+")[0].split(".")
    try:
        line = (int(parts[0]), int(parts[1]))
    except (IndexError, ValueError):
        return None
    known = KNOWN_LIBTPU.get(line)
    if known is None or libtpu in (known.install, *known.also_works):
        return None
    command = f"pip install libtpu=={known.install}"
    if dist != "libtpu":
        command = f"pip uninstall -y {dist} && {command}"
    return (
        f"{dist} {libtpu} is installed with torch_xla {torch_xla}, which is known to work with "
        f"libtpu {known.install} ({known.why}); on a TPU another libtpu can fail inside the PJRT "
        f"runtime. Fix (then restart the kernel if torch_xla was imported): {command}"
    )
