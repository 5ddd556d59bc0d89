"""Imports run one way, and no room takes another room's private names (issue 35).

The import graph, the rooms and the private reaches are tests/import_graph.py's (the one
reading of the source that the tests share): every import counts, also those inside functions
(a lazy import is still an arrow); ``if TYPE_CHECKING:`` blocks are left out: they never run,
and they are how a module names a type from above it in an annotation.

* **No import circle** in ``xla_utils/``: the module graph has no strongly connected
  component of more than one module. ``from pkg import name`` is an arrow to ``pkg.name``
  when that is a module, else to ``pkg``. Parent packages that Python imports first are not
  arrows of their own (the package face ``xla_utils`` runs before any module of it).
* **No private reach across rooms.** A room is a subpackage (``cache/``, ``data/``,
  ``diagnostics/``, ``env/``, ``runtime/``, ``simulate/``, ``step/``, ``train/``, ``utils/``: its
  modules may share their privates) or a top-level module of ``xla_utils/`` (``cli``,
  ``demo``: each a room of its own). Taken across rooms, a private name (one underscore;
  dunders are not private) is refused as ``from .x import _y``, as ``x._y`` where ``x`` is
  an imported xla_utils module, and as ``obj._y`` where ``_y`` is defined (a function,
  class, module or class attribute, or ``self._y = ...``) only in other rooms, e.g. a
  trainer's ``_lr_groups`` written from outside the trainer's module.
* **Packages stack one way**: no two rooms import each other, directly or through others
  (counting imports inside functions, not ``if TYPE_CHECKING:`` ones); commands
  (``__main__`` modules, which nothing imports) are not counted.
"""
from __future__ import annotations

import ast
from pathlib import Path

from import_graph import PKG, REPO, Module, analyse, package


def circles(mods: dict[str, Module]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in mods[v].imports:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(mods):
        if v not in index:
            connect(v)
    return found


def _cycle_text(comp: list[str], mods: dict[str, Module]) -> str:
    """One circle through ``comp``, each arrow with the file and line of its import."""
    start, members = comp[0], set(comp)
    paths = {start: [start]}
    todo = [start]
    while todo:  # breadth first back to start, inside the component
        v = todo.pop(0)
        for w in sorted(mods[v].imports):
            if w == start:
                path = paths[v] + [start]
                return start + "".join(f" -[{mods[a].shown}:{mods[a].imports[b]}]-> {b}"
                                       for a, b in zip(path, path[1:]))
            if w in members and w not in paths:
                paths[w] = paths[v] + [w]
                todo.append(w)
    raise AssertionError(f"no circle through {comp}")


def _reach_lines(mods: dict[str, Module]) -> list[str]:
    return [f"{m.shown}:{line}: {m.name} takes `{name}` ({why}; its room is {m.room})"
            for m in mods.values() for line, name, why in m.reaches]


# --------------------------------------------------------------------------- the package


def test_no_import_circle_inside_xla_utils():
    mods = package()
    assert "xla_utils.train.trainer" in mods and mods["xla_utils.train.trainer"].imports  # the reader works
    found = circles(mods)
    assert not found, "import circles (move what both need down, or pass it in; a type " \
        "for annotations only goes under `if TYPE_CHECKING:`):\n  " + "\n  ".join(
            f"{comp}: e.g. {_cycle_text(comp, mods)}" for comp in found)


def test_no_module_takes_another_rooms_private_names():
    mods = package()
    lines = _reach_lines(mods)
    assert not lines, "private names taken across rooms (give the owner a public function " \
        "or argument instead):\n  " + "\n  ".join(lines)


# --------------------------------------------------------------------------- the checks


FAKE = {
    "__init__.py": "from .version import V\n",
    "version.py": "V = 1\n",
    "low.py": "from typing import TYPE_CHECKING\n"
              "if TYPE_CHECKING:\n    from .high import High  # annotations only: allowed\n"
              "def _helper():\n    return 1\n"
              "def public():\n    return _helper()\n",
    "high.py": "from . import low\n"
               "from .low import _helper\n"  # private import across rooms
               "class High:\n    def __init__(self):\n        self._state = 0\n"
               "def use(obj):\n    low._helper()\n"  # module._private
               "    return obj._owned, obj.__dict__, obj._state\n"  # _owned: pkg's; _state: own
               "def lazy():\n    from . import cyc_b\n    return cyc_b\n",
    "cyc_b.py": "def f():\n    from .high import use\n    return use\n",  # lazy circle
    "pkg/__init__.py": "",
    "pkg/a.py": "class Box:\n    def __init__(self):\n        self._owned = 1\n",
    "pkg/b.py": "from .a import Box\nfrom ..low import public\n"
                "def peek(box: Box):\n    return box._owned\n",  # same room: allowed
}


def test_the_checks_find_circles_and_private_reaches(tmp_path):
    top = tmp_path / "fake"
    for rel, text in FAKE.items():
        (top / rel).parent.mkdir(parents=True, exist_ok=True)
        (top / rel).write_text(text)
    mods = analyse(top)
    assert circles(mods) == [["fake.cyc_b", "fake.high"]]
    assert "fake.high" not in mods["fake.low"].imports  # TYPE_CHECKING import left out
    # which arrows run at import time, which only inside a function
    assert set(mods["fake.high"].imports) == {"fake.low", "fake.cyc_b"}
    assert mods["fake.high"].at_import == {"fake.low"} and mods["fake.cyc_b"].at_import == set()
    text = _cycle_text(circles(mods)[0], mods)
    assert text == "fake.cyc_b -[fake/cyc_b.py:2]-> fake.high -[fake/high.py:10]-> fake.cyc_b", text
    assert sorted((line, name) for line, name, _ in mods["fake.high"].reaches) == [
        (2, "_helper"), (7, "_helper"), (8, "_owned")]
    assert mods["fake.pkg.b"].reaches == [] and mods["fake.low"].reaches == []
    lines = _reach_lines(mods)
    assert "fake/high.py:8: fake.high takes `_owned` (defined only in ['fake.pkg']; its room " \
        "is fake.high)" in lines, lines


MAX_MODULE_LINES, MAX_FUNCTION_LINES = 800, 80


def test_modules_and_functions_stay_small():
    """Issue 35: every module at most 800 lines and every function at most 80, docstring
    included, naming each offender."""
    too_long = []
    for path in sorted(PKG.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        tree = ast.parse(text)
        lines = len(text.splitlines())
        if lines > MAX_MODULE_LINES:
            too_long.append(f"{path.relative_to(REPO)}: {lines} lines (> {MAX_MODULE_LINES}: "
                            "split a concern out into a module of its own)")
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    too_long.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name}(): {n} "
                                    f"lines (> {MAX_FUNCTION_LINES}: move a step into a helper)")
    assert not too_long, "\n".join(too_long)


def test_at_most_12_entries_at_the_top():
    # the top level is grouped by domain (issue 35): a new module goes into its package.
    # Rooms count (packages and modules); data files such as py.typed do not.
    entries = sorted(p.name for p in PKG.iterdir() if p.name != "__pycache__"
                     and (p.suffix == ".py" or (p / "__init__.py").is_file()))
    assert len(entries) <= 12, entries
    modules = [e for e in entries if e.endswith(".py")]
    assert set(modules) <= {"__init__.py", "cli.py", "demo.py"}, modules


def room_graph(mods: dict[str, Module]) -> dict[str, Module]:
    """The rooms as nodes of one graph, an arrow where a module imports another room's module.
    The face ``xla_utils`` and commands (``__main__`` modules, which nothing imports) are
    left out."""
    rooms: dict[str, Module] = {}
    for m in mods.values():
        if m.room == PKG.name or m.name.endswith(".__main__"):
            continue
        node = rooms.setdefault(m.room, Module(m.room, m.path, m.room, m.room))
        for imp in m.imports:
            if imp in mods and mods[imp].room not in (m.room, PKG.name):
                node.imports.setdefault(mods[imp].room, 0)
    return rooms


def test_packages_stack_one_way():
    mods = package()
    rooms = room_graph(mods)
    assert {"xla_utils.train", "xla_utils.diagnostics", "xla_utils.step", "xla_utils.cli"} <= set(rooms)
    assert "xla_utils.diagnostics" in rooms["xla_utils.train"].imports  # the reader sees lazy arrows
    found = circles(rooms)
    assert not found, "packages that import each other (move what both need below both, or " \
        "pass it in):\n  " + "\n  ".join(
            f"{comp}: e.g. {_cycle_text(comp, rooms)}; modules: " + ", ".join(
                f"{m.shown} -> {i}" for m in mods.values() if m.room in comp
                and not m.name.endswith(".__main__") for i in m.imports
                if i in mods and mods[i].room in comp and mods[i].room != m.room)
            for comp in found)


def test_room_graph_finds_a_package_circle(tmp_path):
    top = tmp_path / "xla_utils"
    for rel, text in {"__init__.py": "", "a/__init__.py": "", "a/x.py": "from ..b import y\n",
                      "b/__init__.py": "", "b/y.py": "def f():\n    from ..a import z\n",
                      "a/z.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                      "    from ..c import x\n",  # an annotation's import from above: no arrow
                      "c.py": "from .a import x\n"}.items():
        (top / rel).parent.mkdir(parents=True, exist_ok=True)
        (top / rel).write_text(text)
    rooms = room_graph(analyse(top))
    assert [set(c) for c in circles(rooms)] == [{"xla_utils.a", "xla_utils.b"}]
    assert set(rooms["xla_utils.c"].imports) == {"xla_utils.a"}


# --------------------------------------------------------------------------- one placement

MAX_PLACEMENT_SIGNATURES = 12


def placement_signatures(top: Path) -> list[str]:
    """``path:line name()`` of every function of the package at ``top`` that takes a parameter
    named ``simulate`` or ``cores`` (positional, keyword-only, however many lines its
    signature spans)."""
    found = []
    for path in sorted(top.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = node.args
                names = {p.arg for p in a.posonlyargs + a.args + a.kwonlyargs}
                if names & {"simulate", "cores"}:
                    found.append(f"{path.relative_to(top.parent)}:{node.lineno} {node.name}()")
    return found


def test_where_a_run_happens_is_resolved_at_the_entry_points_only():
    """Issue 44: the user's ``cores=`` / ``simulate=`` reach only the public entry points (fit,
    predict, evaluate, find_lr / lr_find, debug, launch, cross_validate, the simulate
    runners, the demo) and ``runtime.resolve``, which turns them into the one
    :class:`~xla_utils.runtime.placement.Placement` everything below them takes."""
    found = placement_signatures(PKG)
    assert any(f.endswith(" resolve()") for f in found), found  # the reader works
    assert len(found) <= MAX_PLACEMENT_SIGNATURES, (
        f"{len(found)} functions take `simulate` or `cores` (at most "
        f"{MAX_PLACEMENT_SIGNATURES}: pass a runtime.Placement below the entry points):\n  "
        + "\n  ".join(found))


def test_placement_signatures_reads_every_form(tmp_path):
    top = tmp_path / "pkg"
    top.mkdir()
    (top / "m.py").write_text("def a(x,\n      simulate=None):\n    pass\n"
                              "def b(*, cores='all'):\n    pass\n"
                              "class C:\n    async def c(self, cores, /):\n        pass\n"
                              "def d(placement, devices):\n    pass\n")
    assert placement_signatures(top) == ["pkg/m.py:1 a()", "pkg/m.py:4 b()", "pkg/m.py:7 c()"]
