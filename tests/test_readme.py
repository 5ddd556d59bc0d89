"""Every command and code block in README.md and docs/*.md runs.

Blocks are found by their content, wherever they live (the README keeps the quick start
and the set-up commands; the rest moved to docs/). They run as written, except for an
explicit table of substitutions (Kaggle paths -> generated image folders, 224 px -> 32 px,
a shorter run) that must each apply, so an edit cannot silently escape the test. The two
fresh-machine set-up commands are checked against what runs them: `.ci/run` (CI itself)
and `tests/test_demo.py` (`python -m xla_utils.demo`).
"""
from __future__ import annotations

import math
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
# docs/BENCHMARKS.md's commands are measurements (its scripts under scripts/, some for a GPU
# machine), not examples: they are not run here.
DOCS = [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").glob("*.md")
                                    if p.name != "BENCHMARKS.md")]
BLOCKS = [(m.group(1), m.group(2)) for doc in DOCS
          for m in re.finditer(r"```(\w*)\n(.*?)```", doc.read_text(encoding="utf-8"), re.S)]


def _block(lang: str, marker: str) -> str:
    """The one ``lang`` block of README.md or docs/*.md that contains ``marker``."""
    found = [code for lg, code in BLOCKS if lg == lang and marker in code]
    assert len(found) == 1, f"expected one {lang} block containing {marker!r}, found {len(found)}"
    return found[0]


def _substitute(code: str, subs: dict[str, str]) -> str:
    for old, new in subs.items():
        assert old in code, f"README block no longer contains {old!r}: update tests/test_readme.py"
        code = code.replace(old, new)
    return code


def _image_folders(root: Path, n: int = 6) -> None:
    """train_images/ and val_images/ (3 classes) plus training_labels.csv (multi-label) and
    train.csv (a number per training image: regression), and a flat test_images/ (5 images,
    unlabelled)."""
    rng = np.random.default_rng(0)
    rows = ["path,label"]
    for split, count in (("train_images", n), ("val_images", 2)):
        for c, name in enumerate(("healthy", "rust", "scab")):
            d = root / split / name
            d.mkdir(parents=True)
            for i in range(count):
                arr = rng.integers(0, 255, (48, 40, 3), dtype=np.uint8)
                arr[..., c] = 255  # a class-dependent colour
                Image.fromarray(arr).save(d / f"{i}.png")
                if split == "train_images":
                    rows.append(f"{name}/{i}.png,{name}{' rust' if i % 2 and name == 'scab' else ''}")
    (root / "training_labels.csv").write_text("\n".join(rows) + "\n")
    scores = [f"train_images/{r.split(',')[0]},{0.25 * k + 0.1:.2f}" for k, r in enumerate(rows[1:])]
    (root / "train.csv").write_text("path,score\n" + "\n".join(scores) + "\n")
    (root / "test_images").mkdir()
    for i in range(5):
        arr = rng.integers(0, 255, (48, 40, 3), dtype=np.uint8)
        arr[..., i % 3] = 255
        Image.fromarray(arr).save(root / "test_images" / f"test_{i}.png")


def test_every_block_is_covered():
    langs = sorted({lang for lang, _ in BLOCKS})
    assert langs == ["", "bash", "python"], langs  # "" = sample output, not code
    bash = [code for lang, code in BLOCKS if lang == "bash"]
    python = [code for lang, code in BLOCKS if lang == "python"]
    # two bash blocks run elsewhere: docs/STRATEGIES.md's torchrun command (tests/runtime/test_hosts.py)
    # and its pod slice rehearsal (tests/simulate/test_pod.py)
    assert len(bash) == 6 and len(python) == 12, "a README or docs/ block was added: run it in this file"


def test_quick_start_is_the_first_python_block_within_80_lines():
    """A notebook user meets the quick start first: README's first python block starts
    within its first 80 lines and is the quick start (split -> cache -> fit -> submission)."""
    lines = README.splitlines()
    first = next(i for i, line in enumerate(lines, 1) if line.startswith("```python"))
    assert first <= 80, f"README's first python block starts at line {first}"
    block = next(code for lang, code in re.findall(r"```(\w*)\n(.*?)```", README, re.S)
                 if lang == "python")
    assert block == _block("python", "xla_utils.split(")
    for call in ("build_cache(", "xla_utils.split(", "trainer.fit(simulate=8)",
                 "# history = trainer.fit()", "trainer.check()", "trainer.predict(",
                 "write_submission("):
        assert call in block, call


def test_setup_commands_are_what_ci_and_the_demo_test_run():
    setup = _block("bash", "bash .ci/run")
    ci = (ROOT / ".ci" / "run").read_text()
    assert "PJRT_DEVICE=CPU python -m pytest -q tests" in ci
    assert "torch==2.9.0 torchvision==0.24.0 torch_xla==2.9.0" in ci
    assert "torch==2.9.0 torchvision==0.24.0 torch_xla==2.9.0" in setup
    assert "python -m xla_utils.demo" in setup
    assert "-m\", \"xla_utils.demo\"" in (ROOT / "tests" / "test_demo.py").read_text()
    assert '"demo": ["scikit-learn"]' in (ROOT / "setup.py").read_text()


@pytest.mark.timeout(300)
def test_tpu_cache_ds_commands(tmp_path):
    _image_folders(tmp_path)
    code = _substitute(_block("bash", "tpu_cache_ds build train_images/ cache/train "), {
        "--size 224": "--size 32",
        "[--json]": "--json",
        "[--full]": "--full",
    })
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    ran = 0
    for line in code.splitlines():
        cmd = line.split("#")[0].strip()
        if not cmd:
            continue
        p = subprocess.run(shlex.split(cmd), cwd=tmp_path, capture_output=True, text=True,
                           env=env, timeout=240)
        assert p.returncode == 0, (cmd, p.stdout[-2000:], p.stderr[-2000:])
        ran += 1
    assert ran == 11
    assert (tmp_path / "grid.png").stat().st_size > 0
    assert not (tmp_path / "cache" / "big").exists()  # --dry-run writes nothing
    import json

    manifest = json.loads((tmp_path / "cache" / "train_csv" / "manifest.json").read_text())
    assert manifest["complete"]
    reg = json.loads((tmp_path / "cache" / "train_reg" / "manifest.json").read_text())
    assert reg["complete"] and reg["task"] == "regression" and reg["targets"] == ["score"]


@pytest.mark.timeout(300)
def test_cloud_storage_commands(tmp_path, gcs_emulator):
    """The "Data in Cloud Storage" commands, against the GCS emulator (tests/conftest.py)."""
    _image_folders(tmp_path)
    url = gcs_emulator()
    code = _substitute(_block("bash", "gs://my-bucket/cache/train --size"), {
        "gs://my-bucket/cache/train": url,
        "--size 224": "--size 32",
    })
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    lines = [ln.split("#")[0].strip() for ln in code.splitlines() if ln.split("#")[0].strip()]
    for cmd in lines:
        p = subprocess.run(shlex.split(cmd), cwd=tmp_path, capture_output=True, text=True, env=env, timeout=240)
        assert p.returncode == 0, (cmd, p.stdout[-2000:], p.stderr[-2000:])
    assert len(lines) == 3
    from xla_utils.data import CachedImageDataset

    assert len(CachedImageDataset(url, local_cache=tmp_path / "copy")) == 18


def _plants(root: Path, per_class: int = 10, tests: int = 5) -> None:
    """The quick start's layout: plants/train/<class>/*.png (3 classes, a class-dependent
    colour) and a flat plants/test/ of unlabelled images."""
    rng = np.random.default_rng(1)
    for c, name in enumerate(("healthy", "rust", "scab")):
        d = root / "plants" / "train" / name
        d.mkdir(parents=True)
        for i in range(per_class):
            arr = rng.integers(0, 255, (48, 40, 3), dtype=np.uint8)
            arr[..., c] = 255
            Image.fromarray(arr).save(d / f"{name}_{i}.png")
    (root / "plants" / "test").mkdir()
    for i in range(tests):
        arr = rng.integers(0, 255, (48, 40, 3), dtype=np.uint8)
        arr[..., i % 3] = 255
        Image.fromarray(arr).save(root / "plants" / "test" / f"test_{i}.png")


@pytest.mark.slow
@pytest.mark.multicore
@pytest.mark.timeout(600)
def test_quick_start_as_written(tmp_path, monkeypatch, capsys):
    """The README's quick start as a user pastes it into a CPU notebook, in a folder holding
    the layout it names (``DATA = "plants"``: one training folder, a flat test folder).
    Only sizes change (224 px -> 32 px, 64 -> 2 per core, 5 epochs -> 1); the rest runs as
    written: the ResNet-18 really trains on 8 simulated cores (``fit(simulate=8)``, about
    30 s on the CI machine), then check(), predict and write_submission."""
    _plants(tmp_path)
    monkeypatch.chdir(tmp_path)
    code = _substitute(_block("python", "xla_utils.split("), {
        "size=224": "size=32", "batch_size=64": "batch_size=2", "epochs=5": "epochs=1"})
    ns: dict = {}
    exec(compile(code, "README:quick-start", "exec"), ns)
    out = capsys.readouterr().out
    train, val, h = ns["train"], ns["val"], ns["history"]
    assert len(train) == 24 and len(val) == 6  # 20% held out of 30 images
    assert np.bincount(val.labels).tolist() == [2, 2, 2]  # stratified
    assert h.world_size == 8 and h.global_batch == 16 and len(h) == 1, h
    assert "8 cores x 2 per core = 16 global batch" in out
    assert (tmp_path / "ckpt" / "final.pt").exists()
    # check() printed its report once, and a stock ResNet-18 on a cache is not "NOT READY"
    assert out.count("xla_utils.check for TPU v5e:") == 1
    assert re.search(r"^xla_utils\.check for TPU v5e: READY", out, re.M), out[-3000:]
    assert ns["preds"].shape == (5, 3) and "wrote submission.csv: 5 rows" in out
    rows = (tmp_path / "submission.csv").read_text().splitlines()
    assert rows[0] == "image_id,label"
    assert [r.split(",")[0] for r in rows[1:]] == [f"test_{i}.png" for i in range(5)]
    assert all(r.split(",")[1] in train.classes for r in rows[1:])


@pytest.mark.slow
@pytest.mark.multicore
@pytest.mark.timeout(600)
def test_quick_start_on_a_gpu_notebook_without_torch_xla(tmp_path, no_torch_xla_env):
    """The README's quick start with its GPU line (``fit()``), run top to bottom where torch_xla
    is not installed and the machine has two devices (``XLA_UTILS_CPU_REPLICAS=2``: two CPU
    processes over gloo, as Kaggle's T4 x2 over NCCL), only its sizes substituted, with the
    competition's sample_submission.csv (ids without extension, its own order) next to the
    test folder: it finishes, check() reports on the device the notebook has and skips the
    TPU with how to get it, submission.csv is the sample's ids in its order, and nothing on
    this path speaks of XLA's cores or compiles."""
    _plants(tmp_path)
    ids = [f"test_{i}" for i in (3, 0, 4, 1, 2)]
    (tmp_path / "plants" / "sample_submission.csv").write_text(
        "id,label\n" + "".join(f"{x},healthy\n" for x in ids))
    code = _substitute(_block("python", "xla_utils.split("), {
        "size=224": "size=32", "batch_size=64": "batch_size=2", "epochs=5": "epochs=1",
        "history = trainer.fit(simulate=8)": "history = trainer.fit()"})
    code += "\nprint('COLUMNS', sorted(history[-1]))\nprint(history)\n"
    (tmp_path / "quick_start.py").write_text(code)
    env = dict(no_torch_xla_env, XLA_UTILS_CPU_REPLICAS="2")
    p = subprocess.run([sys.executable, "quick_start.py"], cwd=tmp_path, capture_output=True,
                       text=True, env=env, timeout=540)
    out = p.stdout
    assert p.returncode == 0, (out[-3000:], p.stderr[-3000:])
    assert "torch_xla -" in out  # the environment report saw no torch_xla
    assert "2 processes x 2 per process = 4 global batch; AdamW, max_lr" in out
    assert "xla_utils.check for the CPU (torch), 2 processes (XLA_UTILS_CPU_REPLICAS=2): " in out
    assert re.search(r"step: [\d.]+ ms as fit feeds it, [\d.]+ ms on a batch already on the device", out)
    assert "xla_utils.check for a TPU: skipped, torch_xla is not installed" in out
    assert "xla_utils.setup(install=True)" in out
    assert "ids, order and header from " + str(tmp_path / "plants" / "sample_submission.csv") in out
    rows = (tmp_path / "submission.csv").read_text().splitlines()
    assert rows[0] == "id,label" and [r.split(",")[0] for r in rows[1:]] == ids
    assert all(r.split(",")[1] in ("healthy", "rust", "scab") for r in rows[1:])
    columns = re.search(r"^COLUMNS (.*)$", out, re.M).group(1)
    assert "compiles" not in columns and "host_reads_per_step" not in columns, columns
    assert "compile" not in out and not re.search(r"\d+ cores?\b|per core", out), out[-3000:]
    assert "2 processes x 2 = 4 global batch" in out  # print(history)


@pytest.mark.slow
@pytest.mark.timeout(900)  # the whole competition loop on resnet18 (torch CPU backend)
def test_python_blocks(tmp_path, monkeypatch, capsys):
    """The competition loop with a val/ folder (docs/TRAINER.md), the loading loop and the
    debug call, in one namespace."""
    _image_folders(tmp_path)
    monkeypatch.chdir(tmp_path)
    quick = _fifteen_lines(tmp_path)
    ns: dict = {}
    exec(compile(quick, "docs/TRAINER.md:competition-loop", "exec"), ns)
    h = ns["history"]
    assert len(h) == 1 and 0.0 <= h[-1]["accuracy"] <= 1.0
    out = capsys.readouterr().out
    assert "lr_find suggests max_lr" in out and "global batch" in out
    assert (tmp_path / "ckpt" / "final.pt").exists()
    assert ns["preds"].shape == (5, 3) and "accuracy" in out and "wrote submission.csv: 5 rows" in out
    rows = (tmp_path / "submission.csv").read_text().splitlines()
    assert rows[0] == "image_id,label" and [r.split(",")[0] for r in rows[1:]] == [f"test_{i}.png" for i in range(5)]
    assert all(r.split(",")[1] in ("healthy", "rust", "scab") for r in rows[1:])

    finder = _substitute(_block("python", "res = lr_find("), {"batch_size=64": "batch_size=4"})
    exec(compile(finder, "README:lr_find", "exec"), ns)
    assert ns["res"].batch_size == 4 and ns["res"].suggestion > 0
    assert (tmp_path / "lr_find.png").stat().st_size > 0

    loading = _substitute(_block("python", "def train_epoch"), {"iterate_batches(ds, 64": "iterate_batches(ds, 4"})
    exec(compile(loading, "README:loading", "exec"), ns)
    import torch

    from xla_utils import runtime as rt

    train_epoch = ns["train_epoch"]  # the README's function; the job sends only what it uses

    def job():
        model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 32 * 32, 3)).to(rt.device())
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        train_epoch(model, opt, torch.nn.CrossEntropyLoss(), 0)
        return rt.world_size()

    assert rt.launch(job, simulate=1) == 1

    debug = _block("python", "trainer.debug()")
    exec(compile(debug, "README:debug", "exec"), ns)
    assert ns["report"].steps >= 1 and "compilations" in ns["report"].report

    capsys.readouterr()
    check = _block("python", "report = trainer.check()")
    exec(compile(check, "README:check", "exec"), ns)
    report = ns["report"]
    assert report.batch_size == 4 and len(report.per_step) == 4
    assert not {"host_sync", "cpu_fallback", "dynamic_shape"} & set(report.codes), report
    # After the README's fit (resnet18 with BatchNorm, trained weights) the trainer's step
    # warms up in steps 1-2 as fit's does and then reuses its graph: no recompile finding.
    assert "recompile" not in report.codes and "NOT READY" not in report.verdict, report
    assert sum(s["compiles"] for s in report.per_step[2:]) == 0, report.per_step
    assert {"memory", "input_bound"} <= set(report.codes)
    assert capsys.readouterr().out.count("xla_utils.check for TPU v5e:") == 1  # printed once

def test_augmentation_block(tmp_path, capsys):
    """docs/TRAINER.md's transform= / batch_transform= block trains on a cache of 32 px images,
    its transform on the loader threads (the fast path)."""
    import torch
    from torch import nn

    from xla_utils import CachedImageDataset, OneCycleTrainer, build_cache, split

    _image_folders(tmp_path, n=16)  # 36 training images: one batch of the block's default 32
    build_cache(tmp_path / "train_images", tmp_path / "cache", size=32, variants=2)
    train, val = split(CachedImageDataset(tmp_path / "cache"), val_fraction=0.25)
    model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, 3))
    ns: dict = {"torch": torch, "nn": nn, "OneCycleTrainer": OneCycleTrainer, "model": model,
                "train": train, "val": val}
    code = _substitute(_block("python", "batch_transform=lambda x, y"),
                       {"RandomResizedCrop(224": "RandomResizedCrop(32"})
    exec(compile(code, "docs/TRAINER.md:augmentation", "exec"), ns)
    capsys.readouterr()
    h = ns["trainer"].fit(epochs=1, max_lr=1e-3)
    assert len(h) == 1 and math.isfinite(h[-1]["train_loss"])
    out = capsys.readouterr().out
    assert "per sample" in out and "transform=" in out and "DataLoader" not in out, out


def _fifteen_lines(tmp_path: Path) -> str:
    """The Fifteen lines with generated image folders, 32 px, batch 4 and one epoch."""
    return _substitute(_block("python", "trainer.fit(max_lr=\"find\")"), {
        "/kaggle/input/plants/train": str(tmp_path / "train_images"),
        "/kaggle/input/plants/val": str(tmp_path / "val_images"),
        "/kaggle/input/plants/test": str(tmp_path / "test_images"),
        "size=224": "size=32",
        "batch_size=64": "batch_size=4",
        "epochs=5": "epochs=1",
    })


@pytest.mark.slow
@pytest.mark.multicore
@pytest.mark.timeout(300)
def test_fifteen_lines_on_two_torch_replicas(tmp_path, monkeypatch, capfd):
    """Unchanged on a machine with two devices (XLA_UTILS_CPU_REPLICAS=2: two CPU processes
    over gloo, as Kaggle's T4 x2 over NCCL): trained, evaluated and predicted on both."""
    _image_folders(tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("XLA_UTILS_CPU_REPLICAS", "2")
    ns: dict = {}
    exec(compile(_fifteen_lines(tmp_path), "README:fifteen-lines", "exec"), ns)
    h = ns["history"]
    assert h.world_size == 2 and h.global_batch == 8 and len(h) == 1
    out = capfd.readouterr().out
    assert "lr_find suggests max_lr" in out and "2 processes x 4 per process = 8 global batch" in out
    assert (tmp_path / "ckpt" / "final.pt").exists()
    assert ns["preds"].shape == (5, 3) and "wrote submission.csv: 5 rows" in out
    rows = (tmp_path / "submission.csv").read_text().splitlines()
    assert [r.split(",")[0] for r in rows[1:]] == [f"test_{i}.png" for i in range(5)]


@pytest.mark.slow
@pytest.mark.multicore
@pytest.mark.timeout(600)
def test_simulated_cores_blocks(tmp_path, capfd):
    script = str(ROOT / "tests" / "fixtures" / "idiom_digits.py")
    cmd = _substitute(_block("bash", "python -m xla_utils.simulate --cores"), {
        "train.py": script, "--cores 8": "--cores 2",
    })
    cmd = [line for line in cmd.splitlines() if line.strip() and not line.startswith("#")][0]
    env = dict(os.environ, PJRT_DEVICE="CPU", PYTHONPATH=str(ROOT))
    p = subprocess.run(shlex.split(cmd.replace("python", sys.executable, 1)), cwd=tmp_path,
                       capture_output=True, text=True, env=env, timeout=400)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "epoch 0 correct/seen" in p.stdout

    code = _substitute(_block("python", "simulated_spawn(cores=8)"), {
        '"train.py"': repr(script), 'cores=8, args': 'cores=2, args',
    })
    ns: dict = {}
    exec(compile(code, "README:simulate", "exec"), ns)
    assert ns["status"] == 0
    assert "8 cores, sum of the ranks: [28.0, 28.0]" in capfd.readouterr().out


class Block(__import__("torch").nn.Module):
    """A residual MLP block: the FSDP unit the README's ``fsdp_wrap=["Block"]`` names."""

    def __init__(self):
        super().__init__()
        import torch

        self.fc = torch.nn.Linear(32, 32)

    def forward(self, x):
        return (self.fc(x)).relu() + x



def _block_net():
    import torch

    return torch.nn.Sequential(torch.nn.Linear(64, 32), Block(), Block(), torch.nn.Linear(32, 10))


def _digits(n: int):
    import torch
    from sklearn.datasets import load_digits
    from torch.utils.data import TensorDataset

    d = load_digits()
    return TensorDataset(torch.tensor(d.data[:n], dtype=torch.float32) / 16, torch.tensor(d.target[:n]))


@pytest.mark.slow
@pytest.mark.multicore
def test_bigger_than_one_core_blocks(capsys):
    """"Models bigger than one core": the strategy example, the memory report and the
    language-model example, each on 8 simulated devices."""
    pytest.importorskip("torch_xla")
    import torch
    from torch import nn

    import xla_utils
    from xla_utils import OneCycleTrainer

    sys.path.insert(0, str(ROOT / "tests" / "fixtures"))
    from tiny_gpt import GPT, TokenWindows, stdlib_bytes
    from tiny_gpt import Block as GPTBlock

    strat = _substitute(_block("python", 'strategy="fsdp",\n'), {"epochs=3": "epochs=1"})
    ns: dict = dict(OneCycleTrainer=OneCycleTrainer, nn=nn, make_model=_block_net,
                    train_ds=_digits(128), val_ds=_digits(64))
    exec(compile(strat, "README:strategy", "exec"), ns)
    h = ns["history"]
    assert h.world_size == 8 and h.global_batch == 64 and "accuracy" in h[-1], h
    capsys.readouterr()
    sweep = _substitute(_block("python", "trainer.find_lr(simulate=8)"),
                        {"find_lr(simulate=8)": "find_lr(simulate=8, num_it=12)"})
    exec(compile(sweep, "README:find_lr", "exec"), ns)
    out = capsys.readouterr().out
    assert "lr_find: on one core: the model fits one v5e core" in out and out.splitlines()[-1] == "64", out

    mem = _block("python", "measure_memory(")
    x, y = _digits(8)[:]
    ns = dict(model=_block_net(), batch=(x, y), make_model=_block_net,
              step=lambda model, batch, loss_fn: nn.functional.cross_entropy(model(batch[0]), batch[1]))
    exec(compile(mem, "README:memory", "exec"), ns)
    out = capsys.readouterr().out
    assert "fsdp: params" in out and "(measured)" in out and "(paper)" in out, out[-2000:]
    assert 'strategy="fsdp"' in ns["report"].report, ns["report"]

    lm = _block("python", "def step(model, batch, loss_fn)")
    ns = dict(xla_utils=xla_utils, torch=torch, Block=GPTBlock, train=TokenWindows(stdlib_bytes(20_000), 32),
              make_gpt=lambda: GPT(block=32, d=32, layers=2, heads=2))
    exec(compile(lm, "README:language-model", "exec"), ns)
    out = capsys.readouterr().out
    assert "8 cores x 32 per core" in out or "global batch" in out, out[-2000:]
    assert ns["trainer"].model is not None
