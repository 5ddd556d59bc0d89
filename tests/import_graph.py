"""The one import graph of ``xla_utils/`` that the tests read (tests/test_import.py,
tests/test_layering.py, tests/test_docs.py's check of docs/ARCHITECTURE.md's map).

Not a test module (no ``test_`` functions): import it as ``import import_graph`` (tests/ is
on ``sys.path`` in the test process). Read from the source with ``ast``, never imported:

* **Arrows.** Every module's imports of modules of its package, also those inside functions (a
  lazy import is still an arrow), each with the line of its first import and whether it runs
  at import time (``Module.at_import``: an import at module level, in an ``if``/``try``/``with``
  block or a class body) or only inside a function. ``if TYPE_CHECKING:`` blocks are left out:
  they never run, and they are how a module names a type from above it in an annotation.
  ``import a.b`` is an arrow to ``a.b``; ``from pkg import name`` is an arrow to ``pkg.name``
  when that is a module, else to ``pkg`` (a package's face, ``xla_utils.runtime``, is a module
  of its own). Parent packages that Python imports first are not arrows of their own, and a
  module's import of itself is no arrow.
* **Rooms.** A room is a subpackage (``cache/``, ``data/``, ``diagnostics/``, ``env/``,
  ``runtime/``, ``simulate/``, ``step/``, ``train/``, ``utils/``: its modules may share their
  privates) or a top-level module of the package (``cli``, ``demo``, and the face itself).
* **Private reaches across rooms.** A private name (one underscore; dunders are not private)
  taken from another room: ``from .x import _y``, ``x._y`` where ``x`` is an imported module
  of the package, and ``obj._y`` where ``_y`` is defined (a function, class, module or class
  attribute, or ``self._y = ...``) only in other rooms.

:func:`analyse` reads any package (the layering checks' self-tests build a fake one in a
temporary folder); :func:`package` is ``xla_utils/``'s, read once per test process.
"""
from __future__ import annotations

import ast
import functools
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["PKG", "REPO", "Module", "analyse", "graph", "is_type_checking", "package"]

REPO = Path(__file__).resolve().parents[1]
PKG = REPO / "xla_utils"


@dataclass
class Module:
    name: str  # dotted
    path: Path
    room: str
    shown: str  # the path as messages show it: relative to the package's parent
    imports: dict[str, int] = field(default_factory=dict)  # module -> line of its first import
    at_import: set[str] = field(default_factory=set)  # the arrows that run at import time
    reaches: list[tuple[int, str, str]] = field(default_factory=list)  # line, name, why

    @property
    def is_package(self) -> bool:
        return self.path.name == "__init__.py"


def private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def module_name(path: Path, top: Path) -> str:
    parts = list(path.relative_to(top.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def room(name: str, is_package: bool) -> str:
    """The subpackage a module belongs to, or the top-level module itself."""
    parts = name.split(".")
    if len(parts) > 2 or (len(parts) == 2 and is_package):
        return ".".join(parts[:2])
    return name


def is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def run_nodes(tree: ast.Module) -> list[tuple[ast.AST, bool]]:
    """Every node of ``tree`` outside ``if TYPE_CHECKING:`` blocks, each with whether it runs
    at import time (False inside a function or lambda)."""
    out: list[tuple[ast.AST, bool]] = []

    def visit(node: ast.AST, at_import: bool) -> None:
        out.append((node, at_import))
        inner = at_import and not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and is_type_checking(child):
                for c in child.orelse:
                    visit(c, inner)
            else:
                visit(child, inner)

    visit(tree, True)
    return out


def definitions(tree: ast.Module) -> set[str]:
    """Private names a module defines: functions, classes, module and class attributes,
    and ``self._y`` / ``cls._y`` assignments."""
    found: set[str] = set()

    def targets(node: ast.AST) -> list[ast.AST]:
        if isinstance(node, (ast.Assign,)):
            return list(node.targets)
        if isinstance(node, (ast.AnnAssign, ast.AugAssign)):
            return [node.target]
        return []

    def scan(body: list[ast.stmt], scope: str) -> None:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                found.add(node.name)
                scan(node.body, "class" if isinstance(node, ast.ClassDef) else "function")
                continue
            for t in targets(node):
                for n in ast.walk(t):
                    if isinstance(n, ast.Name) and scope in ("module", "class"):
                        found.add(n.id)
                    elif (isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
                          and n.value.id in ("self", "cls")):
                        found.add(n.attr)
            for name in ("body", "orelse", "finalbody"):
                inner = getattr(node, name, None)
                if isinstance(inner, list) and not isinstance(node, ast.ClassDef):
                    scan([s for s in inner if isinstance(s, ast.stmt)], scope)
            for handler in getattr(node, "handlers", []):
                scan(handler.body, scope)

    scan(tree.body, "module")
    return {n for n in found if private(n)}


def analyse(top: Path) -> dict[str, Module]:
    """The modules of the package at ``top``: their import arrows (with lines, and which run
    at import time), their rooms and their private reaches into other rooms."""
    paths = sorted(top.rglob("*.py"))
    names = {module_name(p, top): p for p in paths}
    trees = {n: ast.parse(p.read_text(encoding="utf-8"), str(p)) for n, p in names.items()}
    mods = {n: Module(n, p, room(n, p.name == "__init__.py"), str(p.relative_to(top.parent)))
            for n, p in names.items()}
    defined: dict[str, set[str]] = defaultdict(set)  # room -> private names defined there
    for n, tree in trees.items():
        defined[mods[n].room] |= definitions(tree)
    for n, tree in trees.items():
        _read_module(mods[n], tree, mods, defined, top.name)
    return mods


def _read_module(mod: Module, tree: ast.Module, mods: dict[str, Module],
                 defined: dict[str, set[str]], top: str) -> None:
    n = mod.name
    package = n if mod.is_package else n.rpartition(".")[0]
    aliases: dict[str, str] = {}  # local name -> module of the package it is bound to

    def arrow(target: str, line: int, at_import: bool) -> None:
        if target != n and target in mods:
            mod.imports.setdefault(target, line)
            if at_import:
                mod.at_import.add(target)

    def reach(line: int, name: str, owner: str) -> None:
        if private(name) and owner in mods and mods[owner].room != mod.room:
            mod.reaches.append((line, name, f"private to {owner}"))

    nodes = run_nodes(tree)
    for node, at_import in nodes:
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == top:
                    arrow(a.name, node.lineno, at_import)
                    if a.asname:
                        aliases[a.asname] = a.name
                    else:
                        aliases[a.name.split(".")[0]] = a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            if base.split(".")[0] != top:
                continue
            for a in node.names:
                sub = f"{base}.{a.name}"
                if sub in mods:
                    arrow(sub, node.lineno, at_import)
                    aliases[a.asname or a.name] = sub
                    if private(a.name) and mods[sub].room != mod.room:
                        mod.reaches.append((node.lineno, a.name, f"private module {sub}"))
                else:
                    arrow(base, node.lineno, at_import)
                    reach(node.lineno, a.name, base)
    for node, _ in nodes:
        if not isinstance(node, ast.Attribute) or not private(node.attr):
            continue
        owner = dotted(node.value, aliases)
        if owner in mods:  # module._y
            reach(node.lineno, node.attr, owner)
        elif node.attr not in defined[mod.room]:  # obj._y
            rooms = sorted(r for r, names in defined.items() if node.attr in names)
            if rooms:
                mod.reaches.append((node.lineno, node.attr, f"defined only in {rooms}"))


def dotted(node: ast.AST, aliases: dict[str, str]) -> str | None:
    """The module an expression like ``runtime`` or ``xla_utils.runtime`` names."""
    if isinstance(node, ast.Name):
        return aliases.get(node.id)
    if isinstance(node, ast.Attribute):
        base = dotted(node.value, aliases)
        return None if base is None else f"{base}.{node.attr}"
    return None


@functools.lru_cache(maxsize=None)
def package() -> dict[str, Module]:
    """``xla_utils/``'s modules, read once per process (shared: do not change them)."""
    return analyse(PKG)


def graph(import_time_only: bool) -> dict[str, set[str]]:
    """``xla_utils/``'s modules and the modules each imports: at import time only, or also
    inside functions."""
    return {n: set(m.at_import if import_time_only else m.imports) for n, m in package().items()}
