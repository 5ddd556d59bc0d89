"""tests/stacks.py, the table of which CI stack runs which test (issue 42): every test file
has a stack, every entry names something that exists, and the deselection keeps the tests
of "both" and of the stack named."""
from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

import stacks

ROOT = Path(__file__).resolve().parents[1]
TEST_FILES = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "tests").rglob("test_*.py")
                    if "fixtures" not in p.parts)


def _functions(path: str) -> set[str]:
    tree = ast.parse((ROOT / path).read_text())
    return {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef))}


@pytest.mark.parametrize("path", TEST_FILES)
def test_every_test_file_has_a_stack(path):
    for name in sorted(_functions(path)):
        if name.startswith("test_"):
            assert stacks.stack_of(f"{path}::{name}") in ("both", *stacks.STACKS)


def test_every_entry_names_a_test_that_exists():
    for entry in stacks.BOTH + stacks.COLAB + stacks.KAGGLE:
        path, _, test = entry.partition("::")
        assert (ROOT / path).exists(), f"tests/stacks.py: {entry} names no file or folder"
        if test:
            name = re.sub(r"\[.*", "", test)
            assert name in _functions(path), f"tests/stacks.py: {entry}: no {name} in {path}"
    every = stacks.BOTH + stacks.COLAB + stacks.KAGGLE
    assert len(every) == len(set(every)), "an entry stands twice in tests/stacks.py"


# what the two stacks differ in, as the package's modules reach it (the rule's first half)
VERSIONED = re.compile(r"^\s*(import|from)\s+(torch_xla|torch\.distributed|multiprocessing|subprocess)\b"
                       r"|os\.fork\(", re.M)


def test_tests_of_modules_that_reach_torch_xla_distributed_or_processes_run_on_both():
    """The rule as the code states it: a module that imports torch_xla, torch.distributed,
    multiprocessing or subprocess (or forks) has its tests (tests/<package>/test_<module>.py,
    else the package's whole test folder) on both stacks."""
    reaching = sorted(p for p in (ROOT / "xla_utils").rglob("*.py") if VERSIONED.search(p.read_text()))
    assert reaching, "the pattern finds nothing: it no longer matches the package's imports"
    for module in reaching:
        rel = module.relative_to(ROOT / "xla_utils")
        package = rel.parts[0] if len(rel.parts) > 1 else ""
        mirror = ROOT / "tests" / package / f"test_{module.stem}.py"
        target = (mirror.relative_to(ROOT).as_posix() + "::test_x" if mirror.exists()
                  else f"tests/{package}/test_x.py::test_x")
        assert stacks.stack_of(target) == "both", (
            f"xla_utils/{rel.as_posix()} reaches what the stacks differ in: its tests "
            f"({target.split('::')[0]}) belong in tests/stacks.py's BOTH")


def test_the_longest_entry_wins():
    forms = "tests/simulate/test_forms.py"
    assert stacks.stack_of(f"{forms}::test_list_reduce_scatter_groups_and_subset_rendezvous_8_cores") == "both"
    assert stacks.stack_of("tests/runtime/test_fresh.py::test_x") == "both"
    one = next(e for e in stacks.COLAB + stacks.KAGGLE if "::" in e)
    assert stacks.stack_of(one + "[x]" if "[" not in one else one) != "both"
    with pytest.raises(KeyError, match="tests/stacks.py"):
        stacks.stack_of("tests/test_nowhere_else.py::test_x")
    # a file entry does not cover a file whose name merely starts the same
    assert not stacks._covers("tests/test_docs.py", "tests/test_docs.pyc::x")


def test_a_stack_runs_both_and_its_own_share(tmp_path):
    """``XLA_UTILS_CI_STACK`` deselects the other stack's tests at collection, and an
    unknown stack is refused naming the variable."""
    def collected(stack: str) -> subprocess.CompletedProcess:
        env = {"XLA_UTILS_CI_STACK": stack, "PATH": "/usr/bin:/bin", "PJRT_DEVICE": "CPU"}
        return subprocess.run([sys.executable, "-m", "pytest", "-q", "--collect-only", "-p",
                               "no:cacheprovider", "tests/utils/test_units.py", "tests/test_layering.py",
                               "tests/test_stacks.py"], cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=120)

    runs = {s: collected(s) for s in stacks.STACKS}
    ids = {}
    for s, p in runs.items():
        assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
        ids[s] = {line for line in p.stdout.splitlines() if "::" in line}
    for s, got in ids.items():
        assert got and all(stacks.stack_of(i) in ("both", s) for i in got)
    # together the two stacks collect every test of those files, and "both" on each
    union = set.union(*ids.values())
    assert all(stacks.stack_of(i) == "both" for i in set.intersection(*ids.values()))
    assert any(stacks.stack_of(i) != "both" for i in union)
    bad = collected("tpu")
    assert bad.returncode != 0 and "XLA_UTILS_CI_STACK='tpu'" in bad.stdout + bad.stderr


def test_contributing_lists_the_table():
    doc = (ROOT / stacks.DOC).read_text()
    assert stacks.markdown() in doc, f"{stacks.DOC} lists another table: run `python tests/stacks.py --write`"
