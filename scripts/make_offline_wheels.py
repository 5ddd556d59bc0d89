"""Make a folder of wheels that installs xla_utils with the internet off.

Kaggle code competitions score notebooks offline: packages come from an attached
dataset of wheels. From a clone of this repository::

    python scripts/make_offline_wheels.py OUT_DIR            # --for kaggle (default)
    kaggle datasets create -p OUT_DIR                         # or upload OUT_DIR in the web UI

and in the notebook (dataset attached with *Add Input*)::

    !pip install --no-index --find-links /kaggle/input/<dataset> xla_utils

OUT_DIR then holds the xla_utils wheel (built from this checkout, no torch /
torchvision / torch_xla requirement, so pip never touches the platform's torch)
plus the pure-Python dependencies a TPU image may lack (``fastprogress``, pinned below 1.1
as setup.py pins it: 1.0.x has no dependencies of its own, and ``cloudpickle``), downloaded with
``pip download``. numpy and Pillow ship with every Kaggle and Colab image.
``--for none`` puts only the xla_utils wheel there (no network needed when this
Python has ``wheel`` or setuptools>=70.1: the build runs without build isolation).

The build runs on a copy of the sources in a temporary folder, so the checkout
gets no ``build/`` or ``*.egg-info``.
"""
from __future__ import annotations

import argparse
import ast
import importlib.util
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def install_requirement(name: str, setup_py: Path = ROOT / "setup.py") -> str:
    """``name``'s requirement as setup.py's ``INSTALL_REQUIRES`` states it (its pin included).

    Raises:
        SystemExit: setup.py has no literal ``INSTALL_REQUIRES`` naming ``name``.
    """
    tree = ast.parse(setup_py.read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "INSTALL_REQUIRES" for t in node.targets):
            for req in ast.literal_eval(node.value):
                if re.match(rf"{re.escape(name)}\b(?![-_.])", req, re.I):
                    return req
    raise SystemExit(f"{setup_py}: no {name} in INSTALL_REQUIRES")


# Pure-Python wheels (py3-none-any) each target may lack, pinned as setup.py pins them
# (fastprogress<1.1: 1.1 requires python-fasthtml, a web stack with compiled dependencies).
PURE_PYTHON = [install_requirement("fastprogress"), install_requirement("cloudpickle")]
DEPENDENCIES = {
    "kaggle": PURE_PYTHON,
    "colab": PURE_PYTHON,
    "none": [],
}
SOURCES = ("setup.py", "pyproject.toml", "README.md", "xla_utils")


def _can_build_offline() -> bool:
    """Whether setuptools here builds wheels without downloading anything."""
    try:
        from importlib.metadata import version

        major, minor = (int(p) for p in version("setuptools").split(".")[:2])
    except Exception:
        return False
    if (major, minor) < (61, 0):
        return False
    return (major, minor) >= (70, 1) or importlib.util.find_spec("wheel") is not None


def build_wheel(out_dir: Path, source: Path = ROOT) -> Path:
    """Build the xla_utils wheel from ``source`` into ``out_dir``.

    Args:
        out_dir: Folder for the wheel (created).
        source: A checkout holding setup.py, pyproject.toml, README.md, xla_utils/.

    Returns:
        The wheel's path.

    Raises:
        SystemExit: pip failed; the message names the cause and the fix.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    missing = [s for s in SOURCES if not (source / s).exists()]
    if missing:
        raise SystemExit(f"{source} is not an xla_utils checkout (missing {', '.join(missing)})")
    with tempfile.TemporaryDirectory(prefix="xla_utils_wheel_") as tmp:
        src = Path(tmp) / "src"
        src.mkdir()
        for name in SOURCES:
            p = source / name
            if p.is_dir():
                shutil.copytree(p, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
            else:
                shutil.copy2(p, src / name)
        built = Path(tmp) / "dist"
        cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(built), str(src)]
        if _can_build_offline():
            cmd.insert(4, "--no-build-isolation")
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            raise SystemExit(
                f"building the wheel failed ({' '.join(cmd)}):\n{res.stdout}{res.stderr}\n"
                "fix: pip install wheel 'setuptools>=61' (then the build needs no network), "
                "or run with internet access")
        wheels = sorted(built.glob("xla_utils-*.whl"))
        if len(wheels) != 1:
            raise SystemExit(f"expected one xla_utils wheel from pip, found {wheels}")
        target = out_dir / wheels[0].name
        shutil.copy2(wheels[0], target)
    return target


def download_dependencies(out_dir: Path, requirements: list[str]) -> list[Path]:
    """``pip download`` pure-Python wheels (no dependencies of their own) into ``out_dir``.

    Raises:
        SystemExit: pip could not download (no network?); the message says what to do.
    """
    if not requirements:
        return []
    before = set(out_dir.glob("*.whl"))
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "-q", "-d", str(out_dir), *requirements]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise SystemExit(
            f"pip download failed ({' '.join(cmd)}):\n{res.stdout}{res.stderr}\n"
            "fix: run this script with internet access, or pass --for none to make a folder "
            "with only the xla_utils wheel (for a notebook image that has "
            + ", ".join(requirements) + ")")
    new = sorted(set(out_dir.glob("*.whl")) - before)
    impure = [p.name for p in new if not p.name.endswith("-none-any.whl")]
    if impure:
        raise SystemExit(f"not pure-Python wheels (would not install on another Python): {impure}")
    return new


def make_offline_wheels(out_dir: str | Path, target: str = "kaggle") -> list[Path]:
    """Fill ``out_dir`` with the xla_utils wheel plus ``target``'s missing dependencies.

    Args:
        out_dir: Folder to fill (created); upload it as a Kaggle dataset.
        target: ``"kaggle"``, ``"colab"`` or ``"none"`` (only the xla_utils wheel).

    Returns:
        Every wheel now in ``out_dir``.
    """
    if target not in DEPENDENCIES:
        raise SystemExit(f"--for {target!r}: choose one of {', '.join(DEPENDENCIES)}")
    out = Path(out_dir)
    build_wheel(out)
    download_dependencies(out, DEPENDENCIES[target])
    return sorted(out.glob("*.whl"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out_dir", help="folder to fill with wheels (created)")
    p.add_argument("--for", dest="target", default="kaggle", choices=sorted(DEPENDENCIES),
                   help="the notebook image: its missing pure-Python dependencies are added "
                        "(default kaggle; none: only the xla_utils wheel)")
    args = p.parse_args(argv)
    wheels = make_offline_wheels(args.out_dir, args.target)
    print("\n".join(str(w) for w in wheels))
    print(f"install offline with: pip install --no-index --find-links {args.out_dir} xla_utils")
    return 0


if __name__ == "__main__":
    sys.exit(main())
