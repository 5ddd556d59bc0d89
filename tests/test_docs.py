"""Everything README.md and docs/*.md name exists.

Checked: repository file paths (``xla_utils/simulate/caller.py``, ``scripts/...``, ``.ci/run``),
links and their ``#anchors``, sections cited by name (``docs/BENCHMARKS.md "LR finder
rules"``, also from the package's docstrings and ``.ci/run``), every ``tpu_cache_ds``
sub-command and option (against the argparse parser of :mod:`xla_utils.cli`, both ways
for the README's cache section), ``python -m xla_utils.*`` modules, and dotted names
``xla_utils.x.y`` (resolved by import); docs/ARCHITECTURE.md's map, its tree against the modules
of xla_utils/ and its arrows against their imports (tests/import_graph.py). Each check fails with
the names that are missing.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import re
from pathlib import Path

import pytest

import import_graph

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# Files that cite documentation sections by name, besides the docs themselves.
CITING = DOCS + sorted((ROOT / "xla_utils").rglob("*.py")) + [ROOT / ".ci" / "run"]
TOP_LEVEL = ("xla_utils", "docs", "tests", "scripts", "notebooks", ".ci")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def _text(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def _prose(md: str) -> str:
    """The markdown without its fenced code blocks."""
    return FENCE.sub("", md)


def _headings(md: str) -> list[str]:
    return [m.group(1).strip() for m in re.finditer(r"^#{1,6}\s+(.*)$", _prose(md), re.M)]


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces -> hyphens."""
    s = re.sub(r"[^\w\- ]", "", heading.replace("`", "").lower())
    return s.replace(" ", "-")


def _section(md: str, title_start: str) -> str:
    """The text of the first ``##`` section whose title starts with ``title_start``."""
    m = re.search(rf"^## {re.escape(title_start)}.*?$(.*?)(?=^## |\Z)", md, re.S | re.M)
    assert m, f"no section starting {title_start!r}"
    return m.group(1)


def _build_parser() -> argparse.ArgumentParser:
    from xla_utils.cli import _parser

    return _parser()


def _subcommands() -> dict[str, set[str]]:
    """tpu_cache_ds sub-command -> its option strings."""
    parser = _build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {name: {o for a in p._actions for o in a.option_strings if o.startswith("--")} - {"--help"}
            for name, p in sub.choices.items()}


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_file_paths_exist(doc):
    prose = _prose(_text(doc))
    pattern = r"(?<![\w/~.-])((?:%s)/(?:[\w./-]*\w/?)?)" % "|".join(re.escape(t) for t in TOP_LEVEL)
    named = set(re.findall(pattern, prose)) | set(re.findall(r"(?<![\w/.-])(setup\.py|pyproject\.toml)\b", prose))
    assert named, f"{doc.name} names no repository file: the pattern is broken"
    missing = sorted(p for p in named if not (ROOT / p.rstrip("/")).exists())
    assert missing == [], f"{doc.name} names files that do not exist"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_links_and_anchors_exist(doc):
    md = _text(doc)
    missing = []
    for target in re.findall(r"\]\(([^)\s]+)\)", _prose(md)):
        if re.match(r"[a-z]+://|mailto:", target):
            continue
        path, _, anchor = target.partition("#")
        file = (doc.parent / path).resolve() if path else doc
        if not file.exists():
            missing.append(target)
        elif anchor and anchor not in {_slug(h) for h in _headings(_text(file))}:
            missing.append(target)
    assert missing == [], f"{doc.name} links to missing files or sections"


def test_sections_cited_by_name_exist():
    cited = 0
    missing = []
    for src in CITING:
        for file, title in re.findall(r"([\w./-]+\.md)[,:]?\s*\(?\"([^\"]+)\"", _text(src)):
            target = next((c for c in (ROOT / file, ROOT / "docs" / file, src.parent / file) if c.is_file()), None)
            cited += 1
            if target is None or not any(h.startswith(title) for h in _headings(_text(target))):
                missing.append(f"{src.relative_to(ROOT)}: {file} \"{title}\"")
    assert cited >= 3, "no section citations found: the pattern is broken"
    assert missing == []


def test_markdown_files_named_in_sources_exist():
    # e.g. a docstring citing a DESIGN.md that the project does not have
    missing = []
    for src in CITING:
        for name in set(re.findall(r"(?<![\w/.-])([\w./-]*[A-Z_]\w*\.md)\b", _text(src))):
            if not any(c.is_file() for c in (ROOT / name, ROOT / "docs" / name, src.parent / name)):
                missing.append(f"{src.relative_to(ROOT)}: {name}")
    assert missing == []


def _section_after(md: str, heading: str) -> str:
    """``heading`` (a markdown heading line) and the text under it, up to the next heading of
    its level or higher."""
    level = len(heading) - len(heading.lstrip("#"))
    m = re.search(rf"^{re.escape(heading)}$.*?(?=^#{{1,{level}}} |\Z)", md, re.S | re.M)
    return m.group(0) if m else ""


def test_benchmarks_open_with_the_current_figures():
    """docs/BENCHMARKS.md opens with one table of every benchmark's current figure: each row
    has a date and a command, and links to the section of that run, which names its date."""
    md = _text(ROOT / "docs" / "BENCHMARKS.md")
    prose = _prose(md)
    first_table = re.search(r"^\|.*\|\n\|[-| :]+\|\n(?:\|.*\|\n)+", prose, re.M)
    assert first_table, "docs/BENCHMARKS.md has no table"
    assert first_table.start() < prose.index("\n## ", prose.index("\n## ") + 1), \
        "the first table is not in the file's first section"
    header, _, *rows = first_table.group(0).strip().splitlines()
    columns = [c.strip() for c in header.strip("|").split("|")]
    assert columns[:2] == ["what", "figure"] and {"machine", "date", "command"} <= set(columns), columns
    assert len(rows) >= 20, "fewer rows than benchmarks"
    headings = {_slug(h): h for h in _headings(md)}
    full_headings = {_slug(m.group(2).strip()): m.group(0).strip()
                     for m in re.finditer(r"^(#{1,6})\s+(.*)$", prose, re.M)}
    bad = []
    for row in rows:
        cells = dict(zip(columns, (c.strip() for c in row.strip().strip("|").split(" | "))))
        what = cells.get("what", "")
        if not re.fullmatch(r"\d{4}-\d{2}-\d{2}", cells.get("date", "")):
            bad.append(f"{what}: date {cells.get('date')!r} is not YYYY-MM-DD")
        if "`" not in cells.get("command", ""):
            bad.append(f"{what}: no command")
        link = re.match(r"\[[^\]]+\]\(([^)\s]+)\)", what)
        if not link:
            bad.append(f"{what}: no link to its section")
            continue
        path, _, anchor = link.group(1).partition("#")
        if path:
            target = (ROOT / "docs" / path)
            if not target.is_file():
                bad.append(f"{what}: {path} does not exist")
                continue
            text = _text(target)
            if anchor and anchor not in {_slug(h) for h in _headings(text)}:
                bad.append(f"{what}: no section #{anchor} in {path}")
            continue
        if anchor not in headings:
            bad.append(f"{what}: no section #{anchor}")
        elif cells.get("date") and cells["date"] not in _section_after(prose, full_headings[anchor]):
            bad.append(f"{what}: its section #{anchor} does not name {cells['date']}")
    assert bad == [], "docs/BENCHMARKS.md's table of current figures"


def test_tpu_cache_ds_commands_and_options_exist():
    subs = _subcommands()
    all_options = set().union(*subs.values())
    bad = []
    for doc in DOCS:
        md = _text(doc)
        for line in re.findall(r"tpu_cache_ds\s+([a-z][^\n`#]*)", md):  # a command, in code or prose
            words = line.split()
            if words[0] not in subs:
                continue  # prose such as "tpu_cache_ds cache" / "tpu_cache_ds command"
            bad += [f"{doc.name}: tpu_cache_ds {words[0]} {o}"
                    for o in re.findall(r"(?<![\w-])--[a-z][a-z-]*", line) if o not in subs[words[0]]]
        for inline in re.findall(r"`tpu_cache_ds ([a-z]+)\b", md):
            if inline not in subs and inline not in ("command",):
                bad.append(f"{doc.name}: sub-command {inline}")
    cache_section = _section(_text(ROOT / "docs" / "CACHE.md"), "Cached dataset")
    prose_options = set(re.findall(r"(?<![\w-])--[a-z][a-z-]*", cache_section))
    bad += [f"docs/CACHE.md: {o} is not an option" for o in sorted(prose_options - all_options)]
    assert bad == []
    undocumented = sorted(all_options - prose_options)
    assert undocumented == [], "tpu_cache_ds options missing from docs/CACHE.md's cache section"


def test_python_m_modules_exist():
    named = set()
    for doc in DOCS:
        named |= set(re.findall(r"python3? -m (xla_utils(?:\.\w+)*)", _text(doc)))
    assert "xla_utils.demo" in named and "xla_utils.cache" in named
    missing = []
    for name in sorted(named):
        spec = importlib.util.find_spec(name)
        if spec is None:
            missing.append(name)
        elif spec.submodule_search_locations is not None:  # a package: needs __main__
            if importlib.util.find_spec(f"{name}.__main__") is None:
                missing.append(f"{name} (no __main__)")
        elif 'if __name__ == "__main__"' not in Path(spec.origin).read_text(encoding="utf-8"):
            missing.append(f"{name} (not runnable)")
    assert missing == []


def _resolve(dotted: str) -> bool:
    parts = dotted.split(".")
    for n in range(len(parts), 0, -1):  # the longest importable module prefix, then attributes
        try:
            obj = importlib.import_module(".".join(parts[:n]))
        except ImportError:
            continue
        try:
            for attr in parts[n:]:
                obj = getattr(obj, attr)
        except AttributeError:
            return False
        return True
    return False


def test_dotted_names_resolve():
    named = set()
    for doc in DOCS:
        named |= set(re.findall(r"(?<![\w.])(xla_utils(?:\.[A-Za-z_]\w*)+)", _text(doc)))
    assert len(named) > 5
    missing = sorted(n for n in named if not _resolve(n))
    assert missing == []


# --------------------------------------------------------------- the architecture map

_MAP_LINE = re.compile(r"^((?:[│ ] {2})*)[├└]─ (.+?)(?:\s{2,}|$)")


def _map_names(map_block: str) -> set[str]:
    """Dotted module names the map's tree names (``runtime/`` -> ``runtime``, and its
    children ``runtime.state``, ...; ``config, errors`` are two names)."""
    named: set[str] = set()
    parents: list[str] = []
    for line in map_block.splitlines():
        m = _MAP_LINE.match(line)
        if not m:
            continue
        parents = parents[:len(m.group(1)) // 3]
        for name in (n.strip() for n in m.group(2).split(",")):
            named.add(".".join(parents + [name.rstrip("/")]))
            if name.endswith("/"):
                parents = parents + [name[:-1]]
    return named


def _tree_modules(pkg: Path) -> set[str]:
    out = set()
    for p in pkg.rglob("*.py"):
        parts = list(p.relative_to(pkg).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        if parts:
            out.add(".".join(parts))
    return out


def test_architecture_map_matches_the_tree():
    md = _text(ROOT / "docs" / "ARCHITECTURE.md")
    block = md.split("## Map", 1)[1].split("```", 2)[1]
    named, modules = _map_names(block), _tree_modules(ROOT / "xla_utils")
    assert not modules - named, f"docs/ARCHITECTURE.md's map does not name {sorted(modules - named)}"
    assert not named - modules, f"docs/ARCHITECTURE.md's map names {sorted(named - modules)}, not in xla_utils/"


def test_the_map_check_reads_nesting_and_lists():
    block = ("xla_utils/\n├─ env   detection -> x\n├─ cache/   builder\n│  ├─ config, errors  c\n"
             "│  │                 continued\n│  └─ __main__   cli\n└─ cli   command\n")
    assert _map_names(block) == {"env", "cache", "cache.config", "cache.errors", "cache.__main__", "cli"}


# The map's arrows, each line against tests/import_graph.py's reading of the code. The rules:
# * every line of the tree names one module (a package line ``data/`` is its face,
#   ``__init__.py``; the first line ``xla_utils/`` is the package's face) and ends with
#   `` -> `` and its arrows, which wrap onto the next lines after a comma;
# * an arrow is the name of a module of xla_utils/ that the module imports (``if
#   TYPE_CHECKING:`` imports are none), with ``*`` when every import of it is inside a function
#   and without when one runs at import time; ``nothing``: the module imports no module of
#   xla_utils/; words in parentheses are comments (``nothing (NumPy)``);
# * a name is looked up in the line's package first (inside train/ ``loop`` is
#   ``xla_utils.train.loop``; on the line ``data/`` ``dataset`` is ``xla_utils.data.dataset``),
#   then from xla_utils/ (``step.optim`` is ``xla_utils.step.optim``, ``runtime`` the face
#   ``xla_utils.runtime``, ``runtime.world`` its module); ``xla_utils.x`` is ``xla_utils.x``;
# * an import of a package's face (``from xla_utils.runtime import sync``) is an arrow to the
#   face (``runtime``), of a module of it (``from xla_utils.runtime.world import sync``) one
#   to the module (``runtime.world``); the parent packages Python imports on the way are none.

_TREE_CHARS = "│├└─ "


def _map_arrows(map_block: str) -> dict[str, tuple[str, str | None]]:
    """Each line of the map's tree: the module(s) it names (dotted, relative to xla_utils/,
    ``""`` for the first line's face; ``"cache.config, cache.errors"`` for a line naming two), with the
    package its arrows are read in and its arrows' text (None: the line has no `` -> ``)."""
    entries: dict[str, tuple[str, str | None]] = {}
    parents: list[str] = []
    current = None
    for i, line in enumerate(map_block.strip("\n").splitlines()):
        m = _MAP_LINE.match(line)
        if i == 0 or m:  # the first line is xla_utils/ itself
            parents = parents[:len(m.group(1)) // 3] if m else []
            names = [n.strip() for n in m.group(2).split(",")] if m else [""]
            current = ", ".join(".".join(parents + [n.rstrip("/")]) for n in names)
            if m and len(names) == 1 and names[0].endswith("/"):  # a package: its face's line
                parents = parents + [names[0][:-1]]
            home = ".".join(["xla_utils", *parents])
            entries[current] = (home, line.rpartition(" -> ")[2].strip() if " -> " in line else None)
        elif current is not None and (entries[current][1] or "").endswith(","):  # wrapped arrows
            home, arrows = entries[current]
            entries[current] = (home, f"{arrows} {line.lstrip(_TREE_CHARS).strip()}")
    return entries


def _arrow_target(name: str, home: str, modules: dict[str, import_graph.Module]) -> str | None:
    """The module an arrow ``name`` names on a line of package ``home`` (None: no module)."""
    for candidate in (f"{home}.{name}", f"xla_utils.{name}", name):
        if candidate in modules:
            return candidate
    return None


def _arrow_name(target: str, home: str, modules: dict[str, import_graph.Module]) -> str:
    """How the map writes an arrow to ``target`` on a line of package ``home``."""
    for prefix in (f"{home}.", "xla_utils."):
        short = target.removeprefix(prefix)
        if short != target and _arrow_target(short, home, modules) == target:
            return short
    return target


def map_arrow_faults(map_block: str, modules: dict[str, import_graph.Module]) -> list[str]:
    """Where the map's arrows and the import graph (``modules``: import_graph.analyse's
    answer) differ, one line per module: the arrows missing from the map, those it has
    that the code does not."""
    faults = []
    for entry, (home, text) in _map_arrows(map_block).items():
        if ", " in entry:
            faults.append(f"{entry}: one module per line (each with its own arrows)")
            continue
        name = f"xla_utils.{entry}" if entry else "xla_utils"
        if text is None:
            faults.append(f"{name}: no ' -> ' and arrows (write '-> nothing' for no import)")
            continue
        if name not in modules:
            continue  # test_architecture_map_matches_the_tree names it
        words = [w.strip() for w in re.sub(r"\([^)]*\)", "", text).split(",") if w.strip()]
        listed, unknown = set(), []
        for word in words if words != ["nothing"] else []:
            target = _arrow_target(word.rstrip("*"), home, modules)
            if target is None:
                unknown.append(word)
            else:
                listed.add((target, word.endswith("*")))
        mod = modules[name]
        found = {(t, t not in mod.at_import) for t in mod.imports}
        shown = [", ".join(sorted(_arrow_name(t, home, modules) + "*" * lazy for t, lazy in arrows))
                 for arrows in (found - listed, listed - found)]
        parts = [f"missing {shown[0]}" if shown[0] else "", f"extra {shown[1]}" if shown[1] else "",
                 f"names no module: {', '.join(unknown)}" if unknown else ""]
        if any(parts):
            faults.append(f"{name}: " + "; ".join(p for p in parts if p))
    return faults


def test_architecture_map_has_the_arrows_of_the_code():
    """docs/ARCHITECTURE.md's map lists, for every module, exactly the modules it imports
    (tests/import_graph.py, the graph test_import and test_layering check), ``*`` on those
    imported only inside functions."""
    md = _text(ROOT / "docs" / "ARCHITECTURE.md")
    block = md.split("## Map", 1)[1].split("```", 2)[1]
    modules = import_graph.package()
    assert "train.trainer" in _map_arrows(block)  # the reader works
    faults = map_arrow_faults(block, modules)
    assert not faults, ("docs/ARCHITECTURE.md's map and the code's imports differ (`*`: only "
                        "inside functions):\n  " + "\n  ".join(faults))


def test_the_map_arrows_check_finds_missing_and_extra_arrows(tmp_path):
    top = tmp_path / "xla_utils"
    for rel, text in {"__init__.py": "from . import low\n", "low.py": "",
                      "pkg/__init__.py": "from .a import f\n",
                      "pkg/a.py": "from ..low import x\ndef f():\n    from . import b\n",
                      "pkg/b.py": "import xla_utils.low\nfrom xla_utils import pkg\n"}.items():
        (top / rel).parent.mkdir(parents=True, exist_ok=True)
        (top / rel).write_text(text)
    modules = import_graph.analyse(top)
    good = ("xla_utils/   face -> low\n├─ low   nothing here (really) -> nothing\n"
            "├─ pkg/   a package -> a\n│  ├─ a   imports low, then b -> low,\n"
            "│  │                                    b*\n│  └─ b   -> xla_utils.low, pkg\n")
    assert map_arrow_faults(good, modules) == []
    assert set(_map_arrows(good)) == {"", "low", "pkg", "pkg.a", "pkg.b"}
    assert _map_arrows(good)["pkg.a"] == ("xla_utils.pkg", "low, b*")
    bad = ("xla_utils/   face\n├─ low   -> pkg.a\n├─ pkg/   a package -> a\n"
           "│  ├─ a   -> low*, b*, nope\n│  ├─ b   -> low\n│  └─ a, b   both -> low\n")
    assert map_arrow_faults(bad, modules) == [
        "xla_utils: no ' -> ' and arrows (write '-> nothing' for no import)",
        "xla_utils.low: extra pkg.a",
        "xla_utils.pkg.a: missing low; extra low*; names no module: nope",
        "xla_utils.pkg.b: missing pkg",
        "pkg.a, pkg.b: one module per line (each with its own arrows)",
    ]


def test_every_trainer_option_is_in_one_group():
    """docs/TRAINER.md's "Options by group" table is the groups' reference: one row per
    group of TrainerConfig, in its order, naming its attribute, its class and exactly its
    fields, in their order."""
    import dataclasses

    from xla_utils.train.config import GROUPS

    table = _section(_text(ROOT / "docs" / "TRAINER.md"), "Options by group")
    rows = re.findall(r"^\| ([A-Za-z ]+) \| `config\.(\w+)` \(`(\w+)`\) \| (.*) \|$", table, re.M)
    assert [r[0] for r in rows] == ["data", "schedule", "optimisation", "augmentation and EMA",
                                    "checkpoints", "strategy and devices", "diagnostics"]
    assert [(attr, cls) for _, attr, cls, _ in rows] == [(a, c.__name__) for a, c in GROUPS.items()]
    for _, attr, _, cell in rows:
        named = re.findall(r"(?:^|, )`(\w+)`", cell)
        assert named == [f.name for f in dataclasses.fields(GROUPS[attr])], (attr, named)
