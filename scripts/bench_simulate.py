"""Simulated cores on the demo: this tree vs the thread recipe of a git ref.

Three ways to run the demo's training (``xla_utils.demo``: digits cache, its CNN,
Adam, one-cycle, per-core batch 16, fixed max_lr) on N simulated cores, alternating,
each in a fresh interpreter:

* ``baseline``: ``fit(simulate=N)`` of the package at ``--baseline`` (replica threads
  in a job forked from the caller), extracted with ``git archive``;
* ``fit (this tree)``: ``fit(simulate=N)`` here (replica threads in a job forked from
  the clean zygote);
* ``processes (this tree)``: the same replica function through
  ``runtime.launch(simulate=N)`` (one process per replica: what user code gets).

Prints per-step times (epochs after the first, so compilation is excluded),
whole-``fit`` wall time, accuracy and the peak memory (PSS) of the process tree.
With ``--demo-reps K`` it also times the whole demo (``python -m xla_utils.demo``)
K times for the baseline and this tree.

    python scripts/bench_simulate.py --reps 3 --cores 8 --epochs 3 --demo-reps 3
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, os, sys, time
from pathlib import Path
import torch
from xla_utils.demo import make_cnn, render_digits, CACHE_SIZE
from xla_utils.cache import build_cache
from xla_utils.data import CachedImageDataset
from xla_utils.train.trainer import OneCycleTrainer
import xla_utils

work = Path(sys.argv[1]); cores = int(sys.argv[2]); epochs = int(sys.argv[3])
train = CachedImageDataset(work / "cache" / "train")
val = CachedImageDataset(work / "cache" / "val")
tr = OneCycleTrainer(make_cnn, torch.nn.CrossEntropyLoss(), train, val, batch_size=16,
                     epochs=epochs, optimizer="adam", flip=False, mean=(0.5,) * 3,
                     std=(0.5,) * 3, seed=0)
t0 = time.perf_counter()
if sys.argv[4] == "processes":
    from xla_utils import runtime
    from xla_utils.train.replica_loops import FitPlan, fit_replica
    plan = FitPlan(model=tr.model, loss=tr.loss, config=tr.config, train_step=tr.train_step,
                   eval_step=tr.eval_step, inputs=tr._check_inputs(), base_lr=3e-3, lr_world=1,
                   ckpt=None, run_id="bench")
    h = runtime.launch(fit_replica, plan, simulate=cores)
else:
    h = tr.fit(simulate=cores, max_lr=3e-3)
wall = time.perf_counter() - t0
steps = len(train) // (16 * cores)
print("RESULT", json.dumps({
    "package": xla_utils.__file__, "wall_s": wall, "steps_per_epoch": steps,
    "epoch_s": [e["seconds"] for e in h], "accuracy": h[-1]["accuracy"],
}), flush=True)
"""


def _prepare(work: Path) -> None:
    sys.path.insert(0, str(ROOT))
    from xla_utils.cache import build_cache
    from xla_utils.demo import CACHE_SIZE, render_digits

    train_dir, val_dir = render_digits(work / "images")
    build_cache(train_dir, work / "cache" / "train", size=CACHE_SIZE, variants=4,
                scale=(0.7, 1.0), rotate=10.0)
    from xla_utils.data import CachedImageDataset

    classes = CachedImageDataset(work / "cache" / "train").classes
    build_cache(val_dir, work / "cache" / "val", size=CACHE_SIZE, variants=1, classes=classes)


def _tree_pss_mb(root: int) -> float:
    """Proportional set size (shared pages split between sharers) of ``root`` and
    all its descendants, in MB."""
    parent = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    parent[int(d)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except OSError:
                pass
    tree, grew = {root}, True
    while grew:
        new = {p for p, pp in parent.items() if pp in tree and p not in tree}
        tree |= new
        grew = bool(new)
    kb = 0
    for p in tree:
        try:
            with open(f"/proc/{p}/smaps_rollup") as f:
                kb += sum(int(line.split()[1]) for line in f if line.startswith("Pss:"))
        except OSError:
            pass
    return kb / 1024


def _run(package_root: Path, work: Path, cores: int, epochs: int, mode: str) -> dict:
    env = dict(os.environ, PJRT_DEVICE="CPU", PYTHONPATH=str(package_root))
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        p = subprocess.Popen([sys.executable, "-c", CHILD, str(work), str(cores), str(epochs),
                              mode],
                             stdout=out, stderr=err, text=True, env=env, cwd=work)
        peak = 0.0
        while p.poll() is None:
            peak = max(peak, _tree_pss_mb(p.pid))
            time.sleep(1.0)
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    for line in stdout.splitlines():
        if line.startswith("RESULT "):
            res = json.loads(line[7:])
            assert res["package"].startswith(str(package_root)), res["package"]
            res["peak_pss_mb"] = peak
            return res
    raise RuntimeError(f"run failed ({p.returncode}):\n{stderr[-3000:]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--cores", type=int, default=8)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--baseline", default="main", help="git ref of the thread-based design")
    ap.add_argument("--demo-reps", type=int, default=0,
                    help="also time the whole demo this many times per package")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        base = tmp / "baseline"
        base.mkdir()
        archive = subprocess.run(["git", "archive", args.baseline, "xla_utils"], cwd=ROOT,
                                 capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(base)], input=archive, check=True)
        work = tmp / "work"
        _prepare(work)
        runs = {"baseline": (base, "fit"), "fit (this tree)": (ROOT, "fit"),
                "processes (this tree)": (ROOT, "processes")}
        rows: dict[str, list[dict]] = {k: [] for k in runs}
        for rep in range(args.reps):
            for name, (root, mode) in runs.items():
                t = time.perf_counter()
                r = _run(root, work, args.cores, args.epochs, mode)
                per_step = [s / r["steps_per_epoch"] for s in r["epoch_s"][1:]]
                r["step_ms"] = 1000 * statistics.median(per_step)
                rows[name].append(r)
                print(f"rep {rep} {name}: step {r['step_ms']:.1f} ms, fit {r['wall_s']:.1f} s, "
                      f"acc {r['accuracy']:.3f}, peak memory (PSS) {r['peak_pss_mb']:.0f} MB "
                      f"({time.perf_counter() - t:.0f} s, load {os.getloadavg()[0]:.1f})",
                      flush=True)
        demo: dict[str, list[float]] = {"baseline": [], "fit (this tree)": []}
        for rep in range(args.demo_reps):
            for name, root in (("baseline", base), ("fit (this tree)", ROOT)):
                demo[name].append(_run_demo(root, tmp / f"demo-{rep}-{len(demo[name])}-{name[:3]}"))
                print(f"demo rep {rep} {name}: {demo[name][-1]:.1f} s "
                      f"(load {os.getloadavg()[0]:.1f})", flush=True)
    if not args.reps:
        rows = {}
    else:
        base_step = statistics.median(r["step_ms"] for r in rows["baseline"])
        base_wall = statistics.median(r["wall_s"] for r in rows["baseline"])
        print(f"\nmedians of {args.reps} ({args.cores} simulated cores, {args.epochs} epochs):")
    for name, rs in rows.items():
        step = statistics.median(r["step_ms"] for r in rs)
        wall = statistics.median(r["wall_s"] for r in rs)
        mem = statistics.median(r["peak_pss_mb"] for r in rs)
        print(f"  {name:24s} step {step:6.1f} ms ({step / base_step:.2f}x)  fit {wall:6.1f} s "
              f"({wall / base_wall:.2f}x)  peak PSS {mem:5.0f} MB  "
              f"accuracy {statistics.median(r['accuracy'] for r in rs):.3f}")
    if args.demo_reps:
        b, n = statistics.median(demo["baseline"]), statistics.median(demo["fit (this tree)"])
        print(f"  whole demo (python -m xla_utils.demo), median of {args.demo_reps}: "
              f"{b:.1f} s (baseline) vs {n:.1f} s (this tree), ratio {n / b:.2f}")


def _run_demo(package_root: Path, out: Path) -> float:
    env = dict(os.environ, PJRT_DEVICE="CPU", PYTHONPATH=str(package_root))
    out.mkdir(parents=True)
    t = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "xla_utils.demo", "--out", str(out)], cwd=out,
                       env=env, capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"demo failed ({p.returncode}):\n{p.stderr[-3000:]}")
    return time.perf_counter() - t


if __name__ == "__main__":
    main()
