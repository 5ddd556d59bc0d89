"""Time to hand back a 100 MB state from 8 simulated cores (docs/BENCHMARKS.md,
"Handing back a large state from simulated cores").

Each rep launches the same function on 8 simulated cores twice, alternating: once
returning a 100 MB state dict (float32 tensors shaped like a ResNet-50's, built
inside the replica), once returning nothing; the difference of the two launch
times is the hand-back (pickling on rank 0, the file on /dev/shm, reading and
unpickling in the caller). Both job kinds: ``processes`` (``launch(fn,
simulate=8)``) and ``threads`` (what ``fit``/``predict`` run).

    PJRT_DEVICE=CPU python scripts/bench_handback.py --reps 5
"""
from __future__ import annotations

import argparse
import os
import statistics
import time


def _state(mb: int, give: bool):
    import torch

    if not give:
        return None
    n = mb * (1 << 20) // 4
    sizes = [2_359_296] * (n // 2_359_296) + [n % 2_359_296]  # ResNet-50's largest kernel
    return {f"layer{i}.weight": torch.randn(s) for i, s in enumerate(sizes) if s}


def main() -> None:
    from xla_utils.runtime import launcher

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--mb", type=int, default=100)
    p.add_argument("--cores", type=int, default=8)
    args = p.parse_args()
    launcher._launch(_state, (1, True), cores="all", simulate=args.cores, timeout=600,
                     sim_threads=True)  # start the zygote
    for threads in (False, True):
        kind = "threads" if threads else "processes"
        diffs, fulls = [], []
        for _ in range(args.reps):
            times = {}
            for give in (True, False):
                t0 = time.perf_counter()
                out = launcher._launch(_state, (args.mb, give), cores="all", simulate=args.cores,
                                       timeout=600, sim_threads=threads)
                times[give] = time.perf_counter() - t0
                if give:
                    got = sum(v.numel() * 4 for v in out.values())
                    assert got == args.mb * (1 << 20), got
            diffs.append(times[True] - times[False])
            fulls.append(times[True])
        print(f"{kind}: {args.mb} MB from {args.cores} cores: hand-back median "
              f"{statistics.median(diffs):.2f} s (reps {[round(d, 2) for d in diffs]}); "
              f"whole launch median {statistics.median(fulls):.2f} s; "
              f"load average {os.getloadavg()[0]:.1f}", flush=True)


if __name__ == "__main__":
    main()
