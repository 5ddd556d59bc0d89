"""Inference overhead: OneCycleTrainer.predict vs a hand-written MpDeviceLoader loop.

Both run the same CNN (random weights, fixed seed) over the same uint8 image
cache (scikit-learn's 1,797 digits rendered at 32x32) at the same batch on one
XLA:CPU device, normalise on the device, apply a softmax and bring every
prediction to the host as one numpy array. Each repetition runs both variants,
each in a fresh process, alternating the order. Timed spans start after the imports:

* hand-written: its first pass (device start, compilation, the pass, the read)
  and ``--calls - 1`` more passes in the same process (compiled);
* ``predict(simulate=1)``: the zygote's start (from ``OneCycleTrainer(...)``, which
  starts it, until it is ready: what the first call pays when it comes at once),
  then ``--calls`` calls: the first (it forks the trainer's live job, which starts
  an XLA:CPU client and compiles) and the later ones (sent to the same live job,
  which reuses its compiled graphs: their compile counts are printed too;
  ``xla_utils.simulate.live``).

With ``--interleaved`` each repetition is one process that holds both: the trainer
(its zygote started first) and, after it, the hand-written loop on this process's own
XLA:CPU device; after each variant's first (compiling) pass, ``--calls - 1`` hand
passes and later ``predict`` calls alternate (which goes first alternates too), so each
pair ran within a second of each other. This machine's speed drifts between fast and
slow phases of tens of seconds, which separate processes per variant catch unequally.

Reports median images/s and the overhead of predict's first and later calls
against the hand-written first pass (ratio of medians and median of per-rep
ratios), with the load average, and the largest difference between the two
prediction arrays.

    PJRT_DEVICE=CPU python scripts/bench_predict.py [--reps 5] [--batch 64] [--repeat 3] [--calls 3] \\
        [--num-workers N] [--interleaved] [--json out.json]

The hand-written loop is what a careful user writes from the torch_xla docs:
a ``DataLoader`` over the cache, ``MpDeviceLoader``, outputs kept on the device
and read once at the end. It is, with scripts/bench_trainer.py, the only code
outside ``xla_utils/runtime/`` that calls torch_xla, because it is the baseline.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import _bench

CLASSES = 10
MEAN, STD = (0.5,) * 3, (0.5,) * 3


def make_model():
    import torch
    import torch.nn as nn

    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(32 * 8 * 8, 64), nn.ReLU(), nn.Linear(64, CLASSES),
    )


def build(cache: Path, repeat: int) -> None:
    """The digits, ``repeat`` times over (a bigger pass), as a 32x32 uint8 cache."""
    import numpy as np
    from sklearn.datasets import load_digits

    from xla_utils import build_cache

    d = load_digits()
    imgs = [np.repeat((im * 15).astype(np.uint8)[..., None], 3, axis=2) for im in d.images] * repeat
    build_cache([(im, int(t)) for im, t in zip(imgs, list(d.target) * repeat)], cache, size=32,
                verbose=False)


def hand_pass(model, loader, dev):
    """One pass of the hand-written loop: softmax outputs kept on the device, read once."""
    import torch
    import torch_xla.distributed.parallel_loader as pl

    from xla_utils.data import images_to_float

    outs = []
    with torch.no_grad():
        for x, _ in pl.MpDeviceLoader(loader, dev):
            outs.append(torch.softmax(model(images_to_float(x, MEAN, STD)), 1))
    return torch.cat(outs).cpu().numpy()


def run_hand(cache: str, batch: int, calls: int) -> dict:
    import torch
    import torch_xla

    from xla_utils import CachedImageDataset

    ds = CachedImageDataset(cache)
    t0 = time.perf_counter()
    dev = torch_xla.device()
    model = make_model().to(dev).eval()
    loader = torch.utils.data.DataLoader(ds, batch_size=batch, shuffle=False, drop_last=False)
    seconds = []
    for _ in range(calls):  # the first pass compiles, the later ones do not
        preds = hand_pass(model, loader, dev)
        seconds.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
    return {"seconds": seconds, "images": len(ds), "preds": preds.tolist()}


def run_predict(cache: str, batch: int, calls: int, num_workers: int | None = None) -> dict:
    import torch

    from xla_utils import CachedImageDataset, OneCycleTrainer, runtime
    from xla_utils.simulate import caller as simulate

    runtime.xla_available()  # imports torch_xla (untimed, as in run_hand); the runtime stays untouched
    ds = CachedImageDataset(cache)
    t0 = time.perf_counter()
    t = OneCycleTrainer(make_model(), torch.nn.CrossEntropyLoss(), ds, batch_size=batch, mean=MEAN, std=STD,
                        num_workers=num_workers)
    simulate._zygote()  # started by OneCycleTrainer(...); wait until it is ready
    zygote_s = time.perf_counter() - t0
    from xla_utils.simulate.live import live_job_for

    seconds, compiles = [], []
    for _ in range(calls):
        t0 = time.perf_counter()
        preds = t.predict(ds, simulate=1)
        seconds.append(time.perf_counter() - t0)
        compiles.append(live_job_for(t, 1).last_counters["compiles"])
    return {"seconds": seconds, "zygote_s": zygote_s, "images": len(ds), "preds": preds.tolist(),
            "compiles": compiles}


def run_both(cache: str, batch: int, calls: int, num_workers: int | None = None) -> dict:
    """``--interleaved``: predict's later calls and the hand loop's compiled passes
    alternating in this one process (see the module docstring)."""
    import torch
    import torch_xla

    from xla_utils import CachedImageDataset, OneCycleTrainer, runtime
    from xla_utils.simulate import caller as simulate

    runtime.xla_available()
    ds = CachedImageDataset(cache)
    t = OneCycleTrainer(make_model(), torch.nn.CrossEntropyLoss(), ds, batch_size=batch, mean=MEAN,
                        std=STD, num_workers=num_workers)
    simulate._zygote()  # the zygote forks clean jobs: started before this process's own device
    dev = torch_xla.device()
    model = make_model().to(dev).eval()
    loader = torch.utils.data.DataLoader(ds, batch_size=batch, shuffle=False, drop_last=False)

    def hand() -> tuple[float, Any]:
        t0 = time.perf_counter()
        preds = hand_pass(model, loader, dev)
        return time.perf_counter() - t0, preds

    def ours() -> tuple[float, Any]:
        t0 = time.perf_counter()
        preds = t.predict(ds, simulate=1)
        return time.perf_counter() - t0, preds

    first = {"hand": hand()[0], "predict": ours()[0]}
    later: dict[str, list[float]] = {"hand": [], "predict": []}
    for k in range(calls - 1):
        for name, fn in ((("hand", hand), ("predict", ours)) if k % 2 == 0 else
                         (("predict", ours), ("hand", hand))):
            sec, out = fn()
            later[name].append(sec)
            if name == "hand":
                hand_preds = out
            else:
                our_preds = out
    return {"first": first, "later": later, "images": len(ds),
            "max_abs_diff": float(abs(hand_preds - our_preds).max())}


def _main_interleaved(args: argparse.Namespace, cache: Path) -> dict:
    """``--interleaved``: ``--reps`` processes, each alternating the two variants."""
    hand, ours, diff = [], [], 0.0
    for rep in range(args.reps):
        r = _bench.child(__file__, "both", "--cache", str(cache), "--batch", str(args.batch),
                         "--calls", str(args.calls),
                         *([] if args.num_workers is None else ["--num-workers", str(args.num_workers)]))
        n = r["images"]
        hand += [n / s for s in r["later"]["hand"]]
        ours += [n / s for s in r["later"]["predict"]]
        diff = max(diff, r["max_abs_diff"])
        print(f"rep {rep}: first pass {r['first']['hand']:.2f} s, first call "
              f"{r['first']['predict']:.2f} s; hand compiled passes "
              f"{', '.join(f'{x:.2f}' for x in r['later']['hand'])} s; predict later calls "
              f"{', '.join(f'{x:.2f}' for x in r['later']['predict'])} s  ({_bench.load()})",
              flush=True)
    print(f"\nend: {_bench.load()}; batch {args.batch}, {args.reps} processes x "
          f"{args.calls - 1} interleaved pairs, predict num_workers="
          f"{'automatic' if args.num_workers is None else args.num_workers}; images/s below")
    summary = {"later_vs_compiled": _bench.compare(
        "predict later calls vs hand-written compiled passes (interleaved)", hand, ours,
        "images/s")}
    print(f"max |difference| of the predictions {diff:.2e}")
    return {"rates": {"hand_later": hand, "later": ours}, "summary": summary,
            "max_abs_diff": diff}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3, help="passes of the 1,797 digits in the cache")
    ap.add_argument("--calls", type=int, default=3, help="predict calls per process (>= 2)")
    ap.add_argument("--num-workers", type=int, default=None,
                    help="predict's loader threads (default: automatic, as users get; 0 = batches "
                         "assembled in the transfer thread, as the hand-written loop's DataLoader "
                         "assembles them in its own thread)")
    ap.add_argument("--interleaved", action="store_true",
                    help="each process holds both variants and alternates hand passes and later "
                         "predict calls (pairs a second apart); see the module docstring")
    ap.add_argument("--json", help="also write the medians and per-run rates here")
    ap.add_argument("--child", choices=["hand", "predict", "both"], help=argparse.SUPPRESS)
    ap.add_argument("--cache", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.calls < 2:
        ap.error("--calls must be >= 2 (the first call and later ones are reported apart)")
    if args.child:
        run = {"hand": lambda: run_hand(args.cache, args.batch, args.calls),
               "predict": lambda: run_predict(args.cache, args.batch, args.calls, args.num_workers),
               "both": lambda: run_both(args.cache, args.batch, args.calls, args.num_workers)}
        out = run[args.child]()
        print("\n" + json.dumps(out))  # after any progress bar
        return 0

    import numpy as np

    print(f"start: {_bench.load()}", flush=True)
    rates: dict[str, list[float]] = {"hand": [], "hand_later": [], "first": [], "later": []}
    zygote: list[float] = []
    diff = 0.0
    with tempfile.TemporaryDirectory() as tmp:
        cache = Path(tmp) / "cache"
        build(cache, args.repeat)
        if args.interleaved:
            result = _main_interleaved(args, cache)
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(result, f, indent=1)
            return 0
        for rep in range(args.reps):
            preds = {}
            for variant in (("hand", "predict") if rep % 2 == 0 else ("predict", "hand")):
                r = _bench.child(__file__, variant, "--cache", str(cache), "--batch",
                                 str(args.batch), "--calls", str(args.calls),
                                 *([] if args.num_workers is None else
                                   ["--num-workers", str(args.num_workers)]))
                n, sec = r["images"], r["seconds"]
                preds[variant] = np.asarray(r["preds"])
                if variant == "hand":
                    rates["hand"].append(n / sec[0])
                    rates["hand_later"].append(n / statistics.median(sec[1:]))
                    what = (f"first pass {sec[0]:.2f} s, later (compiled) passes "
                            f"{', '.join(f'{x:.2f}' for x in sec[1:])} s")
                else:
                    zygote.append(r["zygote_s"])
                    rates["first"].append(n / sec[0])
                    rates["later"].append(n / statistics.median(sec[1:]))
                    what = (f"zygote start {r['zygote_s']:.2f} s, first call {sec[0]:.2f} s, "
                            f"later calls {', '.join(f'{x:.2f}' for x in sec[1:])} s; "
                            f"compiles per call {r['compiles']}")
                print(f"rep {rep} {variant:8s} {n} images: {what}  ({_bench.load()})", flush=True)
            diff = max(diff, float(np.abs(preds["hand"] - preds["predict"]).max()))
    print(f"\nend: {_bench.load()}; batch {args.batch}, {args.reps} reps, {args.calls} predict "
          f"calls per process, predict num_workers="
          f"{'automatic' if args.num_workers is None else args.num_workers}; images/s below")
    summary = {
        "first_call": _bench.compare("predict first call vs hand-written first pass",
                                     rates["hand"], rates["first"], "images/s"),
        "later_calls": _bench.compare("predict later calls vs hand-written first pass",
                                      rates["hand"], rates["later"], "images/s"),
        "later_vs_compiled": _bench.compare(
            "predict later calls vs hand-written later (compiled) passes", rates["hand_later"],
            rates["later"], "images/s"),
    }
    print(f"zygote start (paid once per process, overlapping whatever follows "
          f"OneCycleTrainer(...)): median {statistics.median(zygote):.2f} s; max |difference| "
          f"of the predictions {diff:.2e}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rates": rates, "zygote_s": zygote, "summary": summary,
                       "max_abs_diff": diff}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
