"""Steps/s and host RAM of ``strategy="spmd"`` vs ``"spawn"`` on 8 simulated devices, side by side.

Each run is a fresh interpreter that trains the byte-level GPT of
``tests/fixtures/tiny_gpt.py`` (the standard library's sources as tokens) with
``OneCycleTrainer(..., strategy=S).fit(simulate=N)``; runs alternate between the strategies.
Reported per strategy (medians over ``--reps``):

* steps/s of the epochs after the first (compilation excluded), from ``History``;
* peak host memory of the whole process tree (the caller, the simulation's zygote and
  job, every replica process under "spawn"; the one SPMD process under "spmd"), as the
  proportional set size (PSS: shared pages split between sharers) summed over the tree
  and sampled every 0.5 s, and the same as RSS for comparison.

    python scripts/bench_strategies.py --reps 3 --devices 8 --epochs 3
    python scripts/bench_strategies.py --strategies spawn --reps 1 --epochs 2 --bytes 60000  # smoke

Needs a trainer with the ``strategy`` option (issue 17); without it the script says so
and exits with status 2 before starting anything.
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
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

CHILD = r"""
import json, sys, time
sys.path.insert(0, sys.argv[1])
import torch
import xla_utils
from tiny_gpt import GPT, Block, TokenWindows, lm_step, stdlib_bytes

strategy, devices, epochs, nbytes = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
block, d, layers, batch = (int(v) for v in sys.argv[6].split(","))
train = TokenWindows(stdlib_bytes(nbytes), block, as_dict=True)
extra = {} if strategy == "spawn" else {"strategy": strategy}
if strategy == "fsdp":
    extra["fsdp_wrap"] = [Block]
t = xla_utils.OneCycleTrainer(lambda: GPT(block=block, d=d, layers=layers, heads=4),
                              torch.nn.CrossEntropyLoss(), train, train_step=lm_step,
                              batch_size=batch, epochs=epochs, max_lr=1e-3, seed=0, **extra)
t0 = time.perf_counter()
h = t.fit(simulate=devices)
wall = time.perf_counter() - t0
steps = len(train) // (batch * devices)
later = h.epochs[1:] or h.epochs
print("RESULT", json.dumps({
    "package": xla_utils.__file__, "wall_s": wall, "steps_per_epoch": steps,
    "steps_per_s": [steps / e["seconds"] for e in later],
    "loss": h[-1]["train_loss"], "compiles": [e["compiles"] for e in h.epochs]}))
"""


def _tree(root: int) -> set[int]:
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
    return tree


def _tree_memory_mb(root: int) -> tuple[float, float]:
    """``(PSS, RSS)`` of ``root`` and all its descendants, in MB."""
    pss = rss = 0
    for p in _tree(root):
        try:
            with open(f"/proc/{p}/smaps_rollup") as f:
                for line in f:
                    if line.startswith("Pss:"):
                        pss += int(line.split()[1])
                    elif line.startswith("Rss:"):
                        rss += int(line.split()[1])
        except OSError:
            pass
    return pss / 1024, rss / 1024


def _run(strategy: str, args: argparse.Namespace) -> dict:
    env = dict(os.environ, PJRT_DEVICE="CPU", PYTHONPATH=str(ROOT))
    size = f"{args.block},{args.d_model},{args.layers},{args.batch_size}"
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        p = subprocess.Popen([sys.executable, "-c", CHILD, str(ROOT / "tests" / "fixtures"),
                              strategy, str(args.devices), str(args.epochs), str(args.bytes), size],
                             stdout=out, stderr=err, text=True, env=env)
        peak_pss = peak_rss = 0.0
        while p.poll() is None:
            pss, rss = _tree_memory_mb(p.pid)
            peak_pss, peak_rss = max(peak_pss, pss), max(peak_rss, rss)
            time.sleep(0.5)
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    for line in stdout.splitlines():
        if line.startswith("RESULT "):
            res = json.loads(line[7:])
            assert res["package"].startswith(str(ROOT)), res["package"]
            return dict(res, peak_pss_mb=peak_pss, peak_rss_mb=peak_rss)
    raise RuntimeError(f"{strategy} run failed ({p.returncode}):\n{stderr[-3000:]}")


def _require_strategy(strategies: list[str]) -> None:
    from xla_utils.train.trainer import TrainerConfig

    # A class attribute in both layouts: a field's default (flat) or its group's alias.
    if any(s != "spawn" for s in strategies) and not hasattr(TrainerConfig, "strategy"):
        print(f"bench_strategies: this xla_utils ({ROOT}) has no TrainerConfig.strategy "
                 f"(issue 17), so {[s for s in strategies if s != 'spawn']} cannot run. Fix: run "
                 "it on a tree with strategy='spmd'/'fsdp' merged, or pass --strategies spawn.", file=sys.stderr)
        sys.exit(2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--strategies", nargs="+", default=["spawn", "spmd"],
                    choices=["spawn", "spmd", "fsdp"])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--devices", type=int, default=8)
    ap.add_argument("--epochs", type=int, default=3, help="the first epoch (compiling) is not timed")
    ap.add_argument("--bytes", type=int, default=400_000, help="standard-library bytes to train on")
    ap.add_argument("--block", type=int, default=64)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=8, help="sequences per device per step")
    args = ap.parse_args()
    _require_strategy(args.strategies)
    results: dict[str, list[dict]] = {s: [] for s in args.strategies}
    for rep in range(args.reps):
        order = args.strategies if rep % 2 == 0 else args.strategies[::-1]
        for s in order:
            r = _run(s, args)
            results[s].append(r)
            print(f"rep {rep + 1} {s:>5}: {statistics.median(r['steps_per_s']):.2f} steps/s, "
                  f"wall {r['wall_s']:.1f} s, peak PSS {r['peak_pss_mb']:.0f} MB "
                  f"(RSS {r['peak_rss_mb']:.0f} MB), loss {r['loss']:.3f}, compiles "
                  f"{r['compiles']}  (load %.2f %.2f %.2f)" % os.getloadavg(), flush=True)
    print(f"\n{args.devices} simulated devices, GPT d={args.d_model} x {args.layers} layers, "
          f"{args.batch_size} x {args.block} tokens per device, medians of {args.reps}:")
    print("| strategy | steps/s | whole fit (s) | peak host PSS (MB) | peak host RSS (MB) |")
    print("|---|---:|---:|---:|---:|")
    for s, rs in results.items():
        sps = statistics.median(statistics.median(r["steps_per_s"]) for r in rs)
        print(f"| {s} | {sps:.2f} | {statistics.median(r['wall_s'] for r in rs):.1f} | "
              f"{statistics.median(r['peak_pss_mb'] for r in rs):.0f} | "
              f"{statistics.median(r['peak_rss_mb'] for r in rs):.0f} |")


if __name__ == "__main__":
    main()
