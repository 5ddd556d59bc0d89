"""`import xla_utils` and environment detection must not import torch or torch_xla
(importing torch_xla in a notebook before xmp.spawn is what breaks spawning), nor change the
import system; the import graph; package faces only re-export."""
from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

import import_graph

REPO = Path(__file__).resolve().parents[1]

PROBE = r"""
import json, sys
import xla_utils
after_import = sorted(m for m in ("torch", "torch_xla") if m in sys.modules)
info = xla_utils.detect()                # lazy re-export from xla_utils.env
import xla_utils.env
xla_utils.env.detect()
xla_utils.env.xla_fix_message()
assert xla_utils.EnvInfo is xla_utils.env.EnvInfo
assert xla_utils.setup is xla_utils.env.setup
after_detect = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "torch_xla", "torchvision", "libtpu"))
print(json.dumps({"after_import": after_import, "after_detect": after_detect,
                  "platform": info.platform, "torch_xla": info.torch_xla}))
"""


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def test_import_and_detect_do_not_import_torch():
    proc = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                          env=_env(), cwd=str(REPO), timeout=60)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout.strip().splitlines()[-1])
    assert data["after_import"] == []
    assert data["after_detect"] == []
    # detect() did run and saw the installed torch_xla (whichever stack runs the tests) through metadata only
    assert data["torch_xla"] == metadata.version("torch_xla")


def test_import_makes_the_notebooks_cuda_check_nvml_based_unless_the_user_chose():
    """A torch.cuda.is_available() after import xla_utils asks NVML, not the CUDA driver (which
    would stop the notebook from forking GPU replicas); a value the user set is kept."""
    code = ("import os, xla_utils, torch; "
            "print(os.environ['PYTORCH_NVML_BASED_CUDA_CHECK'], torch.cuda._nvml_based_avail())")
    env = _env()
    env.pop("PYTORCH_NVML_BASED_CUDA_CHECK", None)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         cwd=str(REPO), timeout=120)
    assert out.returncode == 0 and out.stdout.split() == ["1", "True"], out.stderr[-2000:]
    env["PYTORCH_NVML_BASED_CUDA_CHECK"] = "0"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         cwd=str(REPO), timeout=120)
    assert out.returncode == 0 and out.stdout.split() == ["0", "False"], out.stderr[-2000:]


def test_cli_does_not_import_torch():
    # -X importtime lists every module the interpreter imports (on stderr); the CLI's
    # `import torch_xla` check runs in a child process, whose imports are not listed.
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "xla_utils.env", "--json"],
                          capture_output=True, text=True, env=_env(), cwd=str(REPO), timeout=300)
    assert proc.returncode == 0, proc.stderr
    imported = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if "|" in line}
    assert "xla_utils" in imported and "importlib.metadata" in imported  # the probe works
    assert not [m for m in imported if re.match(r"(torch|torch_xla|torchvision)(\.|$)", m)]
    json.loads(proc.stdout)


# --------------------------------------------------------------------------- import graph
# (tests/import_graph.py: the one reading of xla_utils/'s imports that the tests share)


PKG = REPO / "xla_utils"


def test_import_graph_has_no_cycle():
    graph = import_graph.graph(import_time_only=True)
    assert "xla_utils.cache.format" in graph and "xla_utils.cache.format" in graph["xla_utils.data.dataset"]
    done: set[str] = set()

    def walk(m: str, path: list[str]) -> None:
        for n in sorted(graph.get(m, ())):
            assert n not in path, "import cycle: " + " -> ".join(path[path.index(n):] + [n])
            if n not in done:
                walk(n, path + [n])
        done.add(m)

    for m in graph:
        walk(m, [m])


def test_library_never_imports_its_cli():
    # only the command-line entry points (`python -m ...` modules) may reach xla_utils.cli
    graph = import_graph.graph(import_time_only=False)
    offenders = sorted(m for m, deps in graph.items()
                       if "xla_utils.cli" in deps and m != "xla_utils.cli" and not m.endswith(".__main__"))
    assert offenders == []


def test_cache_reader_imports_only_the_format_and_the_storage_room():
    graph = import_graph.graph(import_time_only=False)
    reader = {"xla_utils.cache.format", "xla_utils.cache.storage", "xla_utils.cache.fetch", "xla_utils.cache.config"}
    cache_deps = {d for m, deps in graph.items() if m == "xla_utils.data" or m.startswith("xla_utils.data.")
                  for d in deps if d.startswith("xla_utils.cache")}
    assert cache_deps == reader
    # the format imports nothing of xla_utils but the typo helper, which imports nothing at all
    assert {d for d in graph["xla_utils.cache.format"]
            if d.startswith("xla_utils")} == {"xla_utils.utils.suggest"}
    assert graph["xla_utils.utils.suggest"] == set()
    # the reader's side of the cache never reaches the builder's
    writer = {"xla_utils.cache.builder", "xla_utils.cache.worker", "xla_utils.cache.sources",
              "xla_utils.cache.images", "xla_utils.cache.runners"}
    for m in reader:
        assert not {d for d in graph[m] if d in writer}, m


def _type_checking_imports(face: Path) -> dict[str, str]:
    tree = ast.parse(face.read_text(encoding="utf-8"))
    seen: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.If) and import_graph.is_type_checking(node):
            for imp in node.body:
                assert isinstance(imp, ast.ImportFrom) and imp.level == 1
                for a in imp.names:
                    seen[a.name] = imp.module or a.name
    return seen


def test_type_checking_imports_match_the_lazy_exports():
    import xla_utils

    exports = dict(xla_utils._EXPORTS, runtime="runtime")
    assert _type_checking_imports(PKG / "__init__.py") == exports
    for name in xla_utils.__all__:  # every public name resolves lazily
        assert getattr(xla_utils, name) is not None
    assert (PKG / "py.typed").is_file()


FACES = ("train", "diagnostics")  # the packages whose faces export names


@pytest.mark.parametrize("package", FACES)
def test_package_faces_name_what_users_import(package):
    """``from xla_utils.train import OneCycleTrainer`` is the object ``xla_utils`` exports;
    every name the top exports from a module of the package is on its face, and the face's
    TYPE_CHECKING imports agree with its lazy table."""
    import importlib

    import xla_utils

    face = importlib.import_module(f"xla_utils.{package}")
    assert _type_checking_imports(PKG / package / "__init__.py") == face._EXPORTS
    from_top = {n for n, m in xla_utils._EXPORTS.items() if m.split(".")[0] == package}
    assert from_top == set(face.__all__), sorted(from_top ^ set(face.__all__))
    for name in face.__all__:
        assert getattr(face, name) is getattr(xla_utils, name), name
        assert name in dir(face)
    with pytest.raises(AttributeError, match=f"xla_utils.{package}' has no attribute 'nope'"):
        face.nope


def test_package_faces_import_nothing_until_a_name_is_used():
    code = ("import sys; import xla_utils.train, xla_utils.diagnostics; "
            "print(sorted(m for m in sys.modules if m.startswith(('torch', 'xla_utils.train.', "
            "'xla_utils.diagnostics.')))); xla_utils.train.History; "
            "print('xla_utils.train.history' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=REPO).stdout.splitlines()
    assert out == ["[]", "True"], out


def test_architecture_names_every_public_name():
    """docs/ARCHITECTURE.md "Modules at a glance" (the README's Modules section, moved
    there) names exactly the package's public names."""
    import xla_utils

    text = (REPO / "docs" / "ARCHITECTURE.md").read_text(encoding="utf-8")
    start = text.index("## Modules at a glance")
    para = text[start:text.index("| module | owns |", start)]
    named = set(re.findall(r"`(\w+)`", para))
    assert named == set(xla_utils.__all__), (sorted(named ^ set(xla_utils.__all__)))


def test_simulate_is_a_package_whose_protocol_stands_alone():
    # runtime/ never imports simulate, not even inside a function: simulate sits above it
    # and registers its launcher with runtime.launcher when imported, which the package
    # face does; simulate's protocol module, which both sides of a simulated job share,
    # imports nothing of xla_utils but the one atomic write, which imports nothing.
    lazy = import_graph.graph(import_time_only=False)
    assert (PKG / "simulate" / "__init__.py").is_file() and not (PKG / "simulate.py").exists()
    for mod, deps in lazy.items():
        if mod.startswith("xla_utils.runtime"):
            assert not [d for d in deps if d.startswith("xla_utils.simulate")], mod
    assert "xla_utils.runtime.launcher" in lazy["xla_utils.simulate"]
    assert "xla_utils.simulate" in import_graph.graph(import_time_only=True)["xla_utils"]
    assert lazy["xla_utils.simulate.protocol"] == {"xla_utils.utils.atomic"}
    assert lazy["xla_utils.utils.atomic"] == set()
    for name in ("CollectiveError", "run_script", "simulated_spawn", "main", "run_replicas",
                 "prestart", "COLLECTIVE_TIMEOUT_S"):
        assert name in __import__("xla_utils.simulate", fromlist=["x"]).__all__


def test_runtime_alone_gets_the_simulated_launcher_registered():
    # a script that imports only xla_utils.runtime still launches simulated jobs: the
    # package face imported simulate, which registered itself (no torch imported for it)
    code = ("import sys, xla_utils.runtime.launcher as launcher; "
            "from xla_utils.simulate import prestart, run_replicas; "
            "sim = launcher._simulator(); "
            "assert sim.run_replicas is run_replicas and sim.prestart is prestart; "
            "print(sorted(m for m in ('torch', 'torch_xla') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=_env(), cwd=str(REPO), timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


# --------------------------------------------------------------------------- faces


def test_import_adds_no_finder_and_imports_no_torch_xla():
    """``import xla_utils`` leaves the import system as it found it: no finder of its own in
    ``sys.meta_path`` (no hook aliasing module paths), and torch_xla not imported."""
    code = ("import json, sys; before = list(sys.meta_path); import xla_utils; "
            "print(json.dumps({'added': [repr(f) for f in sys.meta_path if f not in before], "
            "'removed': [repr(f) for f in before if f not in sys.meta_path], "
            "'torch_xla': 'torch_xla' in sys.modules, 'file': xla_utils.__file__}))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=_env(), cwd=str(REPO), timeout=120)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout.strip().splitlines()[-1])
    assert data["file"] == str(PKG / "__init__.py")  # this checkout's package was the one probed
    assert data["added"] == [] and data["removed"] == [], data
    assert data["torch_xla"] is False


MAX_FACE_LINES = 200


def face_faults(top: Path) -> list[str]:
    """What makes a package's ``__init__.py`` under ``top`` more than a face: over
    :data:`MAX_FACE_LINES` lines, a class, or any function but one lazy ``__getattr__``."""
    faults = []
    for path in sorted(top.rglob("__init__.py")):
        text = path.read_text(encoding="utf-8")
        shown = path.relative_to(top.parent)
        if len(text.splitlines()) > MAX_FACE_LINES:
            faults.append(f"{shown}: {len(text.splitlines())} lines (> {MAX_FACE_LINES}: move "
                          "the code into a module of the package and re-export its names)")
        tree = ast.parse(text)
        functions = sorted((n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))),
                           key=lambda n: n.lineno)
        classes = sorted((n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)), key=lambda n: n.lineno)
        if len(functions) > 1 or [f for f in functions if f.name != "__getattr__"]:
            named = ", ".join(f"{f.name}() (line {f.lineno})" for f in functions[:4])
            more = f" and {len(functions) - 4} more" if len(functions) > 4 else ""
            faults.append(f"{shown}: defines {named}{more} (a face defines at most one function, "
                          "a lazy __getattr__)")
        faults += [f"{shown}:{c.lineno}: defines class {c.name} (a face only re-exports)" for c in classes]
    return faults


def test_package_faces_only_re_export():
    """Every package's ``__init__.py`` is a face: at most 200 lines, no class, and no function
    but one lazy ``__getattr__`` (``utils.lazy``); the code lives in the package's modules."""
    faces = sorted(PKG.rglob("__init__.py"))
    assert PKG / "env" / "__init__.py" in faces and PKG / "data" / "__init__.py" in faces
    faults = face_faults(PKG)
    assert not faults, "\n".join(faults)


def test_face_check_names_the_file_at_fault(tmp_path):
    top = tmp_path / "pkg"
    for rel, text in {"__init__.py": "def __getattr__(name):\n    raise AttributeError(name)\n",
                      "ok/__init__.py": "from .mod import f\n__all__ = ['f']\n",
                      "big/__init__.py": "x = 1\n" * (MAX_FACE_LINES + 1),
                      "code/__init__.py": "def helper():\n    pass\n\nclass Thing:\n    pass\n"}.items():
        (top / rel).parent.mkdir(parents=True, exist_ok=True)
        (top / rel).write_text(text)
    assert face_faults(top) == [
        f"pkg/big/__init__.py: {MAX_FACE_LINES + 1} lines (> {MAX_FACE_LINES}: move the code into a "
        "module of the package and re-export its names)",
        "pkg/code/__init__.py: defines helper() (line 1) (a face defines at most one function, a "
        "lazy __getattr__)",
        "pkg/code/__init__.py:4: defines class Thing (a face only re-exports)",
    ]
