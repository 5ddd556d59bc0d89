"""Time to hand back a 100 MB state from 8 simulated cores (docs/BENCHMARKS.md,
"Handing back a large state from simulated cores").

Each rep launches the same function on 8 simulated cores twice, alternating: both
build a 100 MB state dict on every replica (float32 tensors of ResNet-50's largest
kernel size); one returns it, the other returns nothing. The difference of the
two launch times is the hand-back (pickling on rank 0, the file on /dev/shm, reading and
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

    n = mb * (1 << 20) // 4
    sizes = [2_359_296] * (n // 2_359_296) + [n % 2_359_296]  # ResNet-50's largest kernel
    state = {f"layer{i}.weight": torch.full((s,), 0.5) for i, s in enumerate(sizes) if s}
    return state if give else None


def _components(mb: int, reps: int) -> None:
    import pickle
    import tempfile

    from xla_utils.runtime.replica import dumps_cpu
    from xla_utils.simulate import protocol

    state = _state(mb, True)
    rows = []
    for _ in range(reps):
        folder = tempfile.mkdtemp(dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
        t0 = time.perf_counter()
        data = dumps_cpu(state)
        t1 = time.perf_counter()
        protocol.write_payload(folder, protocol.RESULT, data)
        t2 = time.perf_counter()
        back = protocol.read_payload(folder, protocol.RESULT)
        t3 = time.perf_counter()
        pickle.loads(back)
        t4 = time.perf_counter()
        os.unlink(os.path.join(folder, protocol.RESULT))
        os.rmdir(folder)
        rows.append((t1 - t0, t2 - t1, t3 - t2, t4 - t3, t4 - t0))
    med = [statistics.median(r[i] for r in rows) for i in range(5)]
    print(f"in one process, {mb} MB: dumps_cpu {med[0]:.2f} s, write {med[1]:.2f} s, read "
          f"{med[2]:.2f} s, loads {med[3]:.2f} s, total {med[4]:.2f} s (medians of {reps}); "
          f"load average {os.getloadavg()[0]:.1f}", flush=True)


def main() -> None:
    from xla_utils.runtime import launcher
    from xla_utils.runtime.placement import resolve

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--mb", type=int, default=100)
    p.add_argument("--cores", type=int, default=8)
    args = p.parse_args()
    _components(args.mb, args.reps)
    placement = resolve(simulate=args.cores)
    launcher.launch_job(_state, (1, True), placement=placement, timeout=600,
                        sim_threads=True)  # start the zygote
    for threads in (False, True):
        kind = "threads" if threads else "processes"
        diffs, fulls = [], []
        for _ in range(args.reps):
            times = {}
            for give in (True, False):
                t0 = time.perf_counter()
                out = launcher.launch_job(_state, (args.mb, give), placement=placement,
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
