"""The notebooks in notebooks/: committed clean, and each runs top to bottom in tiny mode.

Every notebook is executed with nbclient in a fresh ipykernel started from *this*
interpreter (a temporary kernelspec whose argv is ``sys.executable``), with
``XLA_UTILS_NOTEBOOK_TINY=1`` and ``PJRT_DEVICE=CPU``: the digits demo data in a
temporary directory, a few epochs, simulated cores. A failing cell fails the test.
After the notebook's own cells, a test-only cell checks what the notebook claims
(scaling line printed by the forked replicas, compile counts, files written); the
notebooks themselves stay free of assertions.
"""
from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path

import pytest
from helpers import opt_level_params
from test_docs import _resolve  # the one resolver of dotted API names

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

NB_DIR = Path(__file__).resolve().parent.parent / "notebooks"
NOTEBOOKS = sorted(NB_DIR.glob("*.ipynb"))
EXPECTED = {"kaggle_quickstart.ipynb", "colab_quickstart.ipynb", "build_cache.ipynb",
            "debug_single_core.ipynb", "gpt_fsdp.ipynb", "competition.ipynb"}
KERNEL = "python3"

# Appended (in memory only) to each executed notebook: checks of what it claims.
CHECKS = {
    "kaggle_quickstart.ipynb": """
assert TINY and SIMULATE == 8, (TINY, SIMULATE)
assert history.world_size == 8 and history.global_batch == 8 * BATCH_SIZE, history
assert len(history) == EPOCHS, history
assert history[-1]["accuracy"] > 0.3, (
    f"the 8-core tiny run did not learn (chance is 0.1): lr_find suggested {lr.suggestion:.3g} "
    f"(rule {lr.rule!r}; all rules {lr.suggestions}) for one core at batch {lr.batch_size}, "
    f"scaled to {history.max_lr:.3g} ({history.lr_scaling}): {history}")
assert len({e["compiles"] for e in history.epochs}) == 1, "recompiled after the first epoch"
assert lr.batch_size == BATCH_SIZE and lr.suggestion > 0, lr
assert MODEL_PATH.is_file() and (OUT / "checkpoints" / "final.pt").is_file()
assert str(OUT).startswith(os.environ["XLA_UTILS_NOTEBOOK_WORKDIR"]), OUT
assert preds.shape == (len(test), 10) and test.unlabeled and test.num_variants == TTA == 2, preds.shape
_rows = SUBMISSION.read_text().splitlines()
assert _rows[0] == "image_id,label" and len(_rows) == len(test) + 1
assert [r.split(",")[0] for r in _rows[1:]] == sorted(p.name for p in TEST_SOURCE.iterdir())
assert score > 0.3, score
""",
    "colab_quickstart.ipynb": """
assert TINY and SIMULATE == 1 and DRIVE is None, (TINY, SIMULATE, DRIVE)
assert history.world_size == 1 and history.global_batch == BATCH_SIZE, history
assert len(history) == EPOCHS and history[-1]["accuracy"] > 0.3, history
assert len({e["compiles"] for e in history.epochs}) == 1, "recompiled after the first epoch"
assert MODEL_PATH.is_file() and (OUT / "checkpoints" / "final.pt").is_file()
assert str(OUT).startswith(os.environ["XLA_UTILS_NOTEBOOK_WORKDIR"]), OUT
assert preds.shape == (len(test), 10) and test.unlabeled and test.num_variants == TTA == 2, preds.shape
_rows = SUBMISSION.read_text().splitlines()
assert _rows[0] == "image_id,label" and len(_rows) == len(test) + 1
assert [r.split(",")[0] for r in _rows[1:]] == sorted(p.name for p in TEST_SOURCE.iterdir())
assert score > 0.3, score
""",
    "build_cache.ipynb": """
assert TINY and str(OUT_ROOT).startswith(os.environ["XLA_UTILS_NOTEBOOK_WORKDIR"]), OUT_ROOT
assert estimate.num_sources == len(train) and again.shards_built == 0
assert train.num_variants == 4 and val.num_variants == 1 and val.classes == train.classes
assert len(val) == sum(1 for _ in (WORK / "digits" / "val").rglob("*.png"))
assert val.manifest["source"]["kind"] == "csv"
assert PREVIEW.is_file() and (OUT_ROOT / "dataset-metadata.json").is_file()
assert len(files) < 60, len(files)
""",
    "gpt_fsdp.ipynb": """
assert TINY and SIMULATE == 8 and history.world_size == 8, (TINY, SIMULATE, history)
assert STRATEGY in ("fsdp", "spawn"), STRATEGY  # "spawn" only where strategy= does not exist yet
assert len(history) == EPOCHS and history[-1]["train_loss"] < math.log(256) - 0.5, history
assert held_loss < math.log(256) - 0.5, held_loss
assert len({e["compiles"] for e in history.epochs}) == 1, "recompiled after the first epoch"
""",
    "debug_single_core.ipynb": """
assert TINY and good.backend == "xla", good.backend
assert good.steps == STEPS and not any(s["compiles"] for s in good.per_step[2:]), good.per_step
assert all(s["compiles"] for s in bad_shape.per_step[2:]), bad_shape.per_step
assert "compiled again after warm-up" in bad_shape.report
assert all(s["executions"] == 2 and s["to_host"] == 2 for s in bad_item.per_step), bad_item.per_step
assert not any(s["compiles"] for s in bad_item.per_step[2:]), bad_item.per_step
assert "More than one device->host transfer" in bad_item.report
assert {"host_sync", "f64"} <= set(bad_check.codes) and not bad_check.ok, bad_check
assert not {"recompile", "cpu_fallback", "dynamic_shape", "padding"} & set(bad_check.codes), bad_check
assert fixed_check.ok and not {"host_sync", "f64", "padding"} & set(fixed_check.codes), fixed_check
assert pod_status == 0, pod_status
""",
}

CHECKS["competition.ipynb"] = """
assert TINY and SIMULATE == 2 and FOLDS == 5 and len(cv.folds) == 5, (TINY, SIMULATE, cv.folds)
assert cv.oof.shape == (len(train), NUM_CLASSES) and np.isfinite(cv.oof).all()
assert sorted(np.bincount(cv.fold_of).tolist())[-1] - sorted(np.bincount(cv.fold_of).tolist())[0] <= 1
assert np.allclose(cv.test, cv.test_folds.mean(0)) and cv.test.shape == (len(test), NUM_CLASSES)
assert all(e.get("phase") for e in last.epochs) and last.best_epoch is not None, last
for k in range(5):
    assert (OUT / "folds" / f"fold_{k}" / "history.csv").is_file()
    assert (OUT / "folds" / f"fold_{k}" / "best.pt").is_file() and (OUT / "cv" / f"fold_{k}.npz").is_file()
_rows = SUBMISSION.read_text().splitlines()
assert _rows[0] == "image_id,label" and len(_rows) == len(test) + 1
assert score > 0.3 and cv.oof_score > 0.3, (score, cv.oof_score)
"""

# Text each notebook must show; it comes from the forked replicas, so this also
# proves that their output reaches the notebook.
EXPECTED_OUTPUT = {
    "kaggle_quickstart.ipynb": [r"8 cores x 16 per core = 128 global batch; \w+, max_lr \S+ x 2\.83",
                                r"epoch 3  train_loss", r"wrote .*submission\.csv: \d+ rows",
                                r"submission accuracy against the hidden labels"],
    "colab_quickstart.ipynb": [r"1 core x 32 per core = 32 global batch; \w+, max_lr \S+ x 1 ",
                               r"epoch 3  train_loss", r"wrote .*submission\.csv: \d+ rows",
                               r"submission accuracy against the hidden labels"],
    "build_cache.ipynb": [r"OK: \d+ shards", r"wrote .*train_preview\.png", r"samples/s"],
    "gpt_fsdp.ipynb": [r"8 cores x 8 per core = 64 global batch", r"bytes from \d+ files",
                       r"fsdp: params .* per device \(paper\)", r"held-out loss \d"],
    "competition.ipynb": [r"2 cores x 16 per core = 32 global batch", r"OOF accuracy \d",
                          r"wrote .*submission\.csv: \d+ rows",
                          r"submission accuracy against the hidden labels"],
    "debug_single_core.ipynb": [r"Steps \[3, 4, 5\] compiled again after warm-up",
                                r"Steps 3\.\. reused the compiled graph",
                                r"xla_utils\.check for TPU v5e: NOT READY \(2 warnings\)",
                                r"ready: True",
                                r"2 cores on 2 hosts x 16 per core = 32 global batch",
                                r"slice exit status: 0"],
}


# Lines a notebook must show exactly once: check() and debug_run print their reports when
# they run, and str() of a report is only its verdict, so a cell that also prints the report
# object shows the verdict twice, and one that prints it instead of the report loses the findings.
ONCE = {
    "debug_single_core.ipynb": [r"^Steps \[3, 4, 5\] compiled again after warm-up",
                                r"^xla_utils\.check for TPU v5e: NOT READY \(2 warnings\)$",
                                r"^  \[warning\] host_sync: ", r"^  \[warning\] f64: ",
                                r"^xla_utils\.check for TPU v5e: READY",
                                r"^2 cores on 2 hosts x 16 per core"],
}


def _ids(paths):
    return [p.stem for p in paths]


def _code_cells(nb):
    return [c for c in nb.cells if c.cell_type == "code"]


def test_all_notebooks_present():
    assert EXPECTED <= {p.name for p in NOTEBOOKS}, sorted(p.name for p in NOTEBOOKS)
    assert set(CHECKS) == EXPECTED


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_ids(NOTEBOOKS))
def test_committed_clean(path):
    """No outputs or execution counts in the repository; one parameters cell;
    pip only behind the tiny-mode guard; no direct torch_xla use in cells."""
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    for cell in _code_cells(nb):
        assert cell.outputs == [], f"{path.name}: committed with outputs: {cell.source[:60]!r}"
        assert cell.execution_count is None, f"{path.name}: execution_count set: {cell.source[:60]!r}"
    tagged = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    assert len(tagged) == 1 and tagged[0].cell_type == "code", f"{path.name}: needs one parameters cell"
    assert re.search(r"^TINY = None\b", tagged[0].source, re.M), "the parameters cell sets TINY"
    for cell in _code_cells(nb):
        src = cell.source
        if "pip" in src and "install" in src:
            assert 'os.environ.get("XLA_UTILS_NOTEBOOK_TINY") == "1"' in src, src[:200]
            assert "-c" in src and "torch_xla" in src, "the install must pin the platform's torch/torch_xla"
        assert not re.search(r"^\s*(import|from)\s+torch_xla", src, re.M), f"{path.name} imports torch_xla"
        assert "xla_device(" not in src and "torch_xla.device(" not in src
    assert nb.metadata.get("kernelspec", {}).get("name") == KERNEL


@pytest.fixture(scope="session")
def kernel_env(tmp_path_factory):
    """A kernelspec that starts ipykernel with this interpreter, and the kernel's environment."""
    root = tmp_path_factory.mktemp("jupyter")
    spec_dir = root / "kernels" / KERNEL
    spec_dir.mkdir(parents=True)
    (spec_dir / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "xla_utils tests", "language": "python",
    }))
    work = tmp_path_factory.mktemp("notebook_work")  # shared: the digits are rendered once
    env = dict(os.environ, XLA_UTILS_NOTEBOOK_TINY="1", PJRT_DEVICE="CPU",
               XLA_UTILS_NOTEBOOK_WORKDIR=str(work), MPLBACKEND="agg", JUPYTER_PATH=str(root),
               PYDEVD_DISABLE_FILE_VALIDATION="1")
    return root, env


def _stream_text(nb) -> str:
    out = []
    for cell in _code_cells(nb):
        for o in cell.outputs:
            if o.output_type == "stream":
                out.append(o.text)
            elif o.output_type in ("execute_result", "display_data"):
                out.append(o.get("data", {}).get("text/plain", ""))
    return "".join(out)


# The notebooks whose kernel compiles XLA:CPU at LLVM level 1 (tests/conftest.py's xla_opt_level):
# they run many steps of few graphs (kaggle_quickstart: 48 s at level 0, 35 s at level 1;
# colab_quickstart: 56 s and 37 s; the others were as fast or faster at level 0).
OPT_LEVEL_1 = {"kaggle_quickstart", "colab_quickstart"}


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("path", opt_level_params(NOTEBOOKS, _ids(NOTEBOOKS), OPT_LEVEL_1))
def test_notebook_runs_in_tiny_mode(path, kernel_env, monkeypatch, tmp_path):
    root, env = kernel_env
    monkeypatch.setenv("JUPYTER_PATH", str(root))  # the kernelspec lookup happens in this process
    nb = nbformat.read(path, as_version=4)
    nb.cells.insert(0, nbformat.v4.new_code_cell(
        "import os, sys\n"
        f"assert os.path.realpath(sys.executable) == {os.path.realpath(sys.executable)!r}, sys.executable\n"
        "assert os.environ['XLA_UTILS_NOTEBOOK_TINY'] == '1'"))
    nb.cells.append(nbformat.v4.new_code_cell(CHECKS[path.name]
                                              + "\nassert not xla_utils.runtime.xla_runtime_initialized()"
                                              + "\nprint('notebook checks passed')"))
    client = nbclient.NotebookClient(nb, kernel_name=KERNEL, timeout=420,
                                     resources={"metadata": {"path": str(tmp_path)}})
    t0 = time.perf_counter()
    # raises CellExecutionError naming the failing cell; XLA_FLAGS as this test set it
    client.execute(env=dict(env, XLA_FLAGS=os.environ.get("XLA_FLAGS", "")))
    seconds = time.perf_counter() - t0
    text = _stream_text(nb)
    assert "notebook checks passed" in text
    for pattern in EXPECTED_OUTPUT[path.name]:
        assert re.search(pattern, text), f"{path.name}: no output matching {pattern!r}:\n{text[-3000:]}"
    for pattern in ONCE.get(path.name, []):
        found = len(re.findall(pattern, text, re.M))
        assert found == 1, f"{path.name}: {found} lines matching {pattern!r}, not 1:\n{text[-3000:]}"
    print(f"{path.name}: {seconds:.0f} s")


# ----------------------------------------------------------- notebook text against the API
# What a notebook's markdown names must exist and work: checkpoint file names, xla_utils
# names, the attributes it reads of trainer / history / lr / cv / caches, keyword options
# and its own parameters, the LR finder's rule, and "uncomment" only over commented code.
SPAN = re.compile(r"`([^`\n]+)`")
CKPT_NAME = re.compile(r"epoch_(?:[\w*-]|<[^>]+>)*\.(?:pt|dcp)")
# A real epoch file name, as OneCycleTrainer.fit writes it (test_notebook_resume_and_lr_cells
# checks the notebooks' names against the files a real run wrote, too).
REAL_CKPT = "epoch_003-20261126-101010-ab12.pt"
FILE_SUFFIXES = ("csv", "pt", "json", "png", "npz")
# Keyword options of other libraries that the notebooks' text shows.
FOREIGN_OPTIONS = {"barrier": "xm.optimizer_step", "start_method": "xmp.spawn",
                   "pretrained": "timm.create_model", "num_classes": "timm / torchvision"}


def _markdown(nb) -> str:
    return "\n".join(c.source for c in nb.cells if c.cell_type == "markdown")


def _name_regex(name: str) -> re.Pattern:
    """A checkpoint name as written (``epoch_<nnn>-<run id>.pt``, ``epoch_*.pt``) as a regex."""
    out = ""
    for part in re.split(r"(<[^>]+>|\*)", name):
        if part == "*":
            out += ".*"
        elif part.startswith("<"):
            out += r"[\w-]+" if "run" in part else r"\w+"
        else:
            out += "".join(rf"\d{{{len(t)}}}" if t.isdigit() else re.escape(t)
                           for t in re.split(r"(\d+)", part))  # epoch_002 is as good as epoch_003
    return re.compile(out)


def _known_options() -> set[str]:
    """Every keyword a public xla_utils callable or config accepts."""
    import dataclasses
    import inspect

    import xla_utils
    from xla_utils import cli, data
    from xla_utils.train import crossval, finetune, submission
    from xla_utils.diagnostics import debug, memory, readiness
    from xla_utils.train.config import OPTION_GROUPS

    names = set(OPTION_GROUPS)
    names |= {f.name for f in dataclasses.fields(xla_utils.CacheConfig)}
    funcs = [getattr(xla_utils, n) for n in xla_utils.__all__ if callable(getattr(xla_utils, n, None))]
    funcs += [getattr(xla_utils.OneCycleTrainer, n) for n in dir(xla_utils.OneCycleTrainer)
              if not n.startswith("_")]
    for mod in (cli, crossval, data, debug, finetune, memory, readiness, submission):
        funcs += [getattr(mod, n) for n in getattr(mod, "__all__", []) if callable(getattr(mod, n))]
    for f in funcs:
        try:
            names |= set(inspect.signature(f).parameters)
        except (TypeError, ValueError):
            pass
    return names


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    """The objects whose attributes notebooks name: a trainer, a cache, and the classes of
    ``history``, ``lr`` and ``cv``."""
    import numpy as np
    import torch
    from PIL import Image

    import xla_utils
    from xla_utils.train.history import History
    from xla_utils.train.lr_finder import LRFinderResult

    root = tmp_path_factory.mktemp("api")
    (root / "src" / "a").mkdir(parents=True)
    for i in range(2):
        Image.fromarray(np.full((8, 8, 3), 60 * i, np.uint8)).save(root / "src" / "a" / f"{i}.png")
    xla_utils.build_cache(root / "src", root / "cache", size=8, workers=1, verbose=False)
    ds = xla_utils.CachedImageDataset(root / "cache")
    trainer = xla_utils.OneCycleTrainer(torch.nn.Linear(2, 2), torch.nn.CrossEntropyLoss(), ds)
    cache_attrs = set(dir(ds)) | set(vars(ds))
    return {"trainer": set(dir(trainer)) | set(vars(trainer)), "history": set(dir(History)) |
            set(History.__dataclass_fields__), "lr": set(dir(LRFinderResult)) |
            set(LRFinderResult.__dataclass_fields__), "cv": set(dir(xla_utils.CVResult)) |
            set(xla_utils.CVResult.__dataclass_fields__),
            **{v: cache_attrs for v in ("ds", "train", "val", "test")}, "options": _known_options(),
            "parameters": "\n".join(c.source for p in NOTEBOOKS
                                    for c in _code_cells(nbformat.read(p, as_version=4)))}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_ids(NOTEBOOKS))
def test_notebook_text_matches_the_api(path, api):
    from xla_utils.train.lr_finder import DEFAULT_RULE

    nb = nbformat.read(path, as_version=4)
    md = _markdown(nb)
    code = "\n".join(c.source for c in _code_cells(nb))
    bad = []
    for name in set(CKPT_NAME.findall(md + "\n" + code)):
        if not _name_regex(name).fullmatch(REAL_CKPT):
            bad.append(f"checkpoint name {name!r}: fit writes names like {REAL_CKPT!r}")
    bad += [f"{n} does not exist" for n in sorted(set(re.findall(r"(?<![\w.])(xla_utils(?:\.\w+)+)", md)))
            if not _resolve(n.rstrip("."))]
    for var, attr in set(re.findall(r"(?<![\w.])(trainer|history|lr|cv|ds|train|val|test)\.(\w+)", md)):
        if attr not in api[var] and attr not in FILE_SUFFIXES:  # history.csv is a file
            bad.append(f"{var}.{attr} is not an attribute")
    for span in SPAN.findall(md):
        for name in re.findall(r"(?<![\w.])([A-Za-z_]\w*)=(?!=)", span):
            if name.isupper():
                if name not in code:
                    bad.append(f"{name} (in `{span}`) is not a parameter of the notebook")
            elif name not in api["options"] and name not in FOREIGN_OPTIONS:
                bad.append(f"{name}= (in `{span}`) is no xla_utils option")
        for name in re.findall(r"^[A-Z][A-Z0-9_]+$", span):  # a parameter (of some notebook)
            if name not in api["parameters"]:
                bad.append(f"{name} is not a parameter of a notebook")
    for cell in (c for c in nb.cells if c.cell_type == "markdown"):
        if re.search(r"find_lr|lr_find|LR range test", cell.source) and "suggest" in cell.source:
            if f"`{DEFAULT_RULE}`" not in cell.source:
                bad.append(f"an LR finder section does not name its rule `{DEFAULT_RULE}`")
    for k, cell in enumerate(nb.cells):
        if cell.cell_type == "markdown" and re.search(r"\buncomment", cell.source, re.I):
            nxt = next((c for c in nb.cells[k + 1:] if c.cell_type == "code"), None)
            if nxt is None or not re.search(r"^\s*#\s*\w[\w.]*\s*(=|\()", nxt.source, re.M):
                bad.append("says 'uncomment' over code that is not commented out")
    assert bad == [], f"{path.name}:\n  " + "\n  ".join(bad)


@pytest.mark.parametrize("name", ["kaggle_quickstart.ipynb", "colab_quickstart.ipynb"])
def test_notebook_resume_and_lr_cells(name, tmp_path, capsys, monkeypatch):
    """The quickstarts' own LR-finder and training cells, run as a user runs them: a run,
    an interruption (its last epoch file lost), then ``RESUME = "last"`` and a file name as
    the text describes. Plain torch on the CPU with a small MLP: the cells are the point."""
    import torch
    from sklearn.datasets import load_digits
    from torch import nn

    from xla_utils import OneCycleTrainer
    from xla_utils.train.lr_finder import DEFAULT_RULE

    monkeypatch.setenv("MPLBACKEND", "agg")
    nb = nbformat.read(NB_DIR / name, as_version=4)
    cells = {t: c.source for c in _code_cells(nb) for t in c.metadata.get("tags", [])}
    d = load_digits()
    data = torch.utils.data.TensorDataset(torch.tensor(d.data[:320], dtype=torch.float32) / 16,
                                          torch.tensor(d.target[:320]))
    trainer = OneCycleTrainer(lambda: nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10)),
                              nn.CrossEntropyLoss(), data, batch_size=16, epochs=3, optimizer="adam",
                              checkpoint_dir=tmp_path / "checkpoints")
    ns = {"trainer": trainer, "SIMULATE": None, "RESUME": None, "OUT": tmp_path}
    exec(cells["lr_find"], ns)
    exec(cells["train"], ns)
    lr, first = ns["lr"], ns["history"]
    # what the LR section says: the rule it names, one core at the per-core batch_size
    assert lr.rule == DEFAULT_RULE and lr.batch_size == 16 and lr.accum_steps == 1
    assert first.base_lr == pytest.approx(lr.suggestion) and len(first) == 3
    folder = tmp_path / "checkpoints"
    files = sorted(p.name for p in folder.glob("epoch_*"))
    assert files == [f"epoch_002-{first.run_id}.pt", f"epoch_003-{first.run_id}.pt"]
    for named in set(CKPT_NAME.findall(_markdown(nb))):  # every name the text gives is a real one
        assert any(_name_regex(named).fullmatch(f) for f in files), (named, files)

    (folder / f"epoch_003-{first.run_id}.pt").unlink()  # the run stopped during epoch 3
    capsys.readouterr()
    ns["RESUME"] = "last"
    exec(cells["lr_find"], ns)
    exec(cells["train"], ns)
    out = capsys.readouterr().out
    assert "no LR sweep" in out
    assert f"resuming run {first.run_id} from epoch_002-{first.run_id}.pt after epoch 2 of 3" in out
    resumed = ns["history"]
    assert len(resumed) == 3 and resumed.base_lr == first.base_lr
    assert [e["train_loss"] for e in resumed.epochs[:2]] == [e["train_loss"] for e in first.epochs[:2]]

    ns["RESUME"] = folder / f"epoch_002-{first.run_id}.pt"  # a file, named as the text shows
    exec(cells["train"], ns)
    assert len(ns["history"]) == 3
    ns["RESUME"] = folder / "epoch_009.pt"  # a wrong name: the error lists what is there
    with pytest.raises(FileNotFoundError, match=r"holds \(newest first\): .*epoch_003-.*resume=\"last\""):
        exec(cells["train"], ns)
