"""The offline install: scripts/make_offline_wheels.py's folder, the README's cell, the wheel.

What a Kaggle code competition does with the internet off: a folder of wheels, then
``pip install --no-index --find-links <folder> xla_utils``. The install here goes
into a fresh virtual environment that sees this stack's packages (torch, torch_xla,
numpy, ...) but not the xla_utils of the checkout, as on a Kaggle TPU image; the
installed copy then runs ``python -m xla_utils.env`` and ``python -m xla_utils.demo
--tiny`` from a folder outside the repository.
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import re
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TORCH_STACK = {"torch", "torchvision", "torch_xla", "torch-xla", "libtpu"}


def _script():
    spec = importlib.util.spec_from_file_location(
        "make_offline_wheels", ROOT / "scripts" / "make_offline_wheels.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def wheel_dir(tmp_path_factory) -> Path:
    """The folder the script makes for a stack that has the dependencies (no network)."""
    out = tmp_path_factory.mktemp("wheels")
    wheels = _script().make_offline_wheels(out, "none")
    assert [w.name for w in wheels] == ["xla_utils-0.1.0-py3-none-any.whl"]
    return out


def _dist_name(requirement: str) -> str:
    return re.match(r"\s*([A-Za-z0-9._-]+)", requirement).group(1).lower().replace("_", "-")


def _requires(metadata_text: str) -> list[str]:
    return [line.split(":", 1)[1].strip() for line in metadata_text.splitlines()
            if line.startswith("Requires-Dist:")]


def test_wheel_metadata_names_no_torch(wheel_dir):
    """No Requires-Dist (not even in an extra) that could make pip replace the platform's torch."""
    whl = next(wheel_dir.glob("xla_utils-*.whl"))
    with zipfile.ZipFile(whl) as z:
        meta = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
        names = z.namelist()
    requires = _requires(meta)
    assert requires, "the wheel has no Requires-Dist at all: wrong METADATA?"
    assert {_dist_name(r) for r in requires} & {n.replace("_", "-") for n in TORCH_STACK} == set(), \
        requires
    assert "xla_utils/__init__.py" in names and "xla_utils/py.typed" in names
    assert not [n for n in names if n.startswith(("tests/", "scripts/")) or n.endswith(".pyc")]


def test_fastprogress_pin_installs_no_web_stack_and_matches_offline_wheels(wheel_dir):
    """A fresh ``pip install`` of the wheel and the offline wheels take the same fastprogress,
    and not 1.1+, whose METADATA requires fastcore and python-fasthtml (uvicorn, starlette)."""
    from packaging.requirements import Requirement

    whl = next(wheel_dir.glob("xla_utils-*.whl"))
    with zipfile.ZipFile(whl) as z:
        meta = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    pins = [Requirement(r) for r in _requires(meta) if _dist_name(r) == "fastprogress"]
    assert len(pins) == 1, _requires(meta)
    spec = pins[0].specifier
    assert not spec.contains("1.1.0") and not spec.contains("1.1.6"), spec  # require python-fasthtml
    assert spec.contains("1.0.5") and spec.contains("1.0.3"), spec  # no requirements of their own
    offline = _script().DEPENDENCIES
    for target in ("kaggle", "colab"):
        ours = [Requirement(r) for r in offline[target] if _dist_name(r) == "fastprogress"]
        assert [r.specifier for r in ours] == [spec], (target, offline[target])


def test_dependencies_cannot_drag_torch():
    """The install requirements, followed through what is installed here, never reach torch."""
    seen, todo = set(), ["xla_utils"]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            reqs = importlib.metadata.requires(name) or []
        except importlib.metadata.PackageNotFoundError:
            continue
        todo += [_dist_name(r) for r in reqs if "extra ==" not in r]
    assert {"numpy", "pillow", "fastprogress", "cloudpickle"} <= seen
    assert not seen & {n.replace("_", "-") for n in TORCH_STACK}, sorted(seen)


def _readme_offline_cell() -> str:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    cells = re.findall(r"^!pip install --no-index --find-links \S+ xla_utils$", text, re.M)
    assert len(cells) == 1, "README.md: expected one offline install cell (!pip install --no-index ...)"
    return cells[0]


def _stack_venv(tmp: Path) -> Path:
    """A venv whose site sees this stack's packages, minus the checkout's xla_utils (a Kaggle image)."""
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    stack = tmp / "stack_site"
    stack.mkdir()
    for entry in Path(sysconfig.get_paths()["purelib"]).iterdir():
        if "xla_utils" not in entry.name.lower().replace("-", "_"):
            (stack / entry.name).symlink_to(entry)
    py = venv / "bin" / "python"
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    Path(site, "_platform_stack.pth").write_text(f"import site; site.addsitedir({str(stack)!r})\n")
    return py


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_readme_offline_cell_installs_a_wheel_that_runs(wheel_dir, tmp_path):
    py = _stack_venv(tmp_path)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PIP_INDEX_URL")}
    # only the cell's own options: no pip.conf index or find-links of this machine
    env.update(PJRT_DEVICE="CPU", PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INDEX="1",
               PIP_CONFIG_FILE=os.devnull)
    outside = tmp_path / "elsewhere"
    outside.mkdir()

    def run(*args: str) -> str:
        p = subprocess.run([str(py), *args], cwd=outside, env=env, capture_output=True, text=True,
                           timeout=240)
        assert p.returncode == 0, f"{args}: exit {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
        return p.stdout + p.stderr

    where = run("-c", "import importlib.util as u; s = u.find_spec('xla_utils'); print(s and s.origin)")
    assert where.strip() == "None", f"the fresh venv already sees an xla_utils: {where}"
    cell = _readme_offline_cell().lstrip("!")
    args = cell.split()[1:]  # after "pip"
    args[args.index("--find-links") + 1] = str(wheel_dir)
    out = run("-m", "pip", *args)
    assert "Successfully installed xla" in out.replace("xla-utils", "xla_utils"), out
    origin = Path(run("-c", "import xla_utils; print(xla_utils.__file__)").strip())
    assert origin.is_relative_to(py.parent.parent), origin
    assert not origin.resolve().is_relative_to(ROOT), origin
    assert "torch_xla" in run("-m", "xla_utils.env")
    demo = run("-m", "xla_utils.demo", "--tiny", "--out", str(tmp_path / "demo"))
    m = re.search(r"final validation accuracy ([0-9.]+)%", demo)
    assert m and float(m.group(1)) > 50, demo[-2000:]


def test_script_refuses_unknown_target(tmp_path):
    with pytest.raises(SystemExit, match="choose one of"):
        _script().make_offline_wheels(tmp_path, "laptop")


def test_wheel_holds_every_module(wheel_dir):
    # every package of the tree is found (setup.py's find_packages): none is left out of a wheel
    whl = next(wheel_dir.glob("xla_utils-*.whl"))
    with zipfile.ZipFile(whl) as z:
        names = set(z.namelist())
    tree = {p.relative_to(ROOT).as_posix() for p in (ROOT / "xla_utils").rglob("*.py")}
    assert len(tree) > 50 and not tree - names, sorted(tree - names)
