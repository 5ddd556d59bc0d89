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
    "kaggle_quickstart.ipynb": [r"8 cores x 16 per core = 128 global batch; max_lr \S+ x 2\.83",
                                r"epoch 3  train_loss", r"wrote .*submission\.csv: \d+ rows",
                                r"submission accuracy against the hidden labels"],
    "colab_quickstart.ipynb": [r"1 core x 32 per core = 32 global batch; max_lr \S+ x 1 ",
                               r"epoch 3  train_loss", r"wrote .*submission\.csv: \d+ rows",
                               r"submission accuracy against the hidden labels"],
    "build_cache.ipynb": [r"OK: \d+ shards", r"wrote .*train_preview\.png", r"samples/s"],
    "gpt_fsdp.ipynb": [r"8 cores x 8 per core = 64 global batch", r"bytes from \d+ files",
                       r"fsdp: params .* per device \(paper\)", r"held-out loss \d"],
    "competition.ipynb": [r"2 cores x 16 per core = 32 global batch", r"OOF score \d",
                          r"wrote .*submission\.csv: \d+ rows",
                          r"submission accuracy against the hidden labels"],
    "debug_single_core.ipynb": [r"Steps \[3, 4, 5\] compiled again after warm-up",
                                r"Steps 3\.\. reused the compiled graph",
                                r"xla_utils\.check for TPU v5e: NOT READY \(2 warnings\)",
                                r"ready: True"],
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


@pytest.mark.timeout(600)
@pytest.mark.parametrize("path", NOTEBOOKS, ids=_ids(NOTEBOOKS))
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
    client.execute(env=env)  # raises CellExecutionError naming the failing cell
    seconds = time.perf_counter() - t0
    text = _stream_text(nb)
    assert "notebook checks passed" in text
    for pattern in EXPECTED_OUTPUT[path.name]:
        assert re.search(pattern, text), f"{path.name}: no output matching {pattern!r}:\n{text[-3000:]}"
    print(f"{path.name}: {seconds:.0f} s")
