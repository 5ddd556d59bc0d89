"""Peak memory of a simulated torch.distributed program: all its processes together.

Runs ``python -m xla_utils.simulate --cores N`` on the DDP ResNet-18 fixture
(tests/fixtures/ddp_resnet18/train_resnet_ddp.py, batch 8 per core, 6 steps) for each N
given and samples, every ``--every`` seconds, the RSS and PSS (``/proc/PID/smaps_rollup``)
of the runner and every process under it (zygote, job, replicas). Prints one JSON line per
run: peak sum of RSS and of PSS (bytes), the peak's process count, wall time, the ranks'
mean loss per step, and with ``--smaps`` the largest replica's memory by mapping at its
own peak. Run it alone (``flock /tmp/xla_utils_heavy.lock``): other processes' load
skews nothing here but the time, their memory pressure skews RSS. ``--cgroup GIB`` runs
each program in a child memory cgroup (v1, writable) limited to GIB, so that a run that
outgrows it is killed there, not elsewhere on a shared host. ``--root DIR`` measures the
xla_utils of another checkout (the figures before a change) with this fixture.

    flock /tmp/xla_utils_heavy.lock python scripts/bench_sim_footprint.py --cores 2 4 8
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "fixtures" / "ddp_resnet18" / "train_resnet_ddp.py"


def tree(pid: int) -> list[int]:
    """``pid`` and all its descendants (from /proc)."""
    children = collections.defaultdict(list)
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children[ppid].append(int(name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, ()))
    return out


def rollup(pid: int) -> dict[str, int]:
    """RSS, PSS, anonymous and file-backed bytes of one process (0s if it is gone)."""
    out = {"Rss": 0, "Pss": 0, "Anonymous": 0}
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                k, _, v = line.partition(":")
                if k in out:
                    out[k] = int(v.split()[0]) * 1024
    except OSError:
        pass
    return out


def by_mapping(pid: int) -> dict[str, int]:
    """RSS bytes of one process by mapping name (anonymous mappings by size class)."""
    sizes: dict[str, int] = collections.Counter()
    name = "?"
    try:
        with open(f"/proc/{pid}/smaps") as f:
            for line in f:
                if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
                    parts = line.split()
                    lo, hi = (int(x, 16) for x in parts[0].split("-"))
                    name = parts[5] if len(parts) > 5 else (
                        f"[anon {'>=64MiB' if hi - lo >= 64 << 20 else '<64MiB'}]")
                    if "/site-packages/" in name:
                        name = "site-packages/" + name.split("/site-packages/")[1].split("/")[0]
                elif line.startswith("Rss:"):
                    sizes[name] += int(line.split()[1]) * 1024
    except OSError:
        pass
    return dict(sorted(sizes.items(), key=lambda kv: -kv[1])[:12])


def child_cgroup(limit: int) -> Path:
    """A new v1 memory cgroup under this process's, limited to ``limit`` bytes."""
    rel = next(line.split(":", 2)[2] for line in Path("/proc/self/cgroup").read_text().split("\n")
               if line.split(":")[1:2] == ["memory"])
    folder = Path("/sys/fs/cgroup/memory" + rel.rstrip("/")) / f"bench_sim_{os.getpid()}"
    folder.mkdir()
    (folder / "memory.limit_in_bytes").write_text(str(limit))
    return folder


def run(cores: int, every: float, smaps: bool, extra_env: dict[str, str], root: Path,
        args: list[str], cgroup: Path | None) -> dict:
    env = dict(os.environ, PJRT_DEVICE="CPU", XLA_UTILS_SIM_MEMORY_CHECK="0", **extra_env)
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "xla_utils.simulate", "--cores", str(cores), str(FIXTURE), *args]
    if cgroup is not None:
        cmd = ["sh", "-c", f'echo $$ > {cgroup}/cgroup.procs && exec "$@"', "sh", *cmd]
    t0 = time.monotonic()
    p = subprocess.Popen(cmd, env=env, cwd=root, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    import threading

    reader = threading.Thread(target=lambda: lines.extend(p.stdout), daemon=True)
    reader.start()
    peak = {"rss": 0, "pss": 0, "anon": 0, "procs": 0}
    replica_peak: tuple[int, int] = (0, 0)  # (rss, pid)
    detail: dict = {}
    while p.poll() is None:
        pids = tree(p.pid)
        rows = {q: rollup(q) for q in pids}
        rss = sum(r["Rss"] for r in rows.values())
        if rss > peak["rss"]:
            peak = {"rss": rss, "pss": sum(r["Pss"] for r in rows.values()),
                    "anon": sum(r["Anonymous"] for r in rows.values()), "procs": len(pids)}
        if smaps and rows:
            big = max(rows, key=lambda q: rows[q]["Rss"])
            if big != p.pid and rows[big]["Rss"] > replica_peak[0]:
                replica_peak = (rows[big]["Rss"], big)
                detail = by_mapping(big)
        time.sleep(every)
    reader.join(timeout=10)
    text = "".join(lines)
    losses = collections.defaultdict(list)
    for rank, step, loss in re.findall(r"rank (\d+) step (\d+) loss ([-0-9.e+naif]+)", text):
        losses[int(step)].append(float(loss))
    out = {"cores": cores, "rc": p.returncode, "wall_s": round(time.monotonic() - t0, 1),
           "peak_rss": peak["rss"], "peak_pss": peak["pss"], "peak_anon": peak["anon"],
           "procs_at_peak": peak["procs"], "env": extra_env, "root": str(root),
           "args": args, "cgroup_max": int((cgroup / "memory.max_usage_in_bytes").read_text())
           if cgroup is not None else None,
           "mean_loss": [round(sum(v) / len(v), 6) for _, v in sorted(losses.items())],
           "ranks_per_step": [len(v) for _, v in sorted(losses.items())]}
    if smaps:
        out["replica_peak_rss"] = replica_peak[0]
        out["replica_by_mapping"] = detail
    if p.returncode:
        out["tail"] = text[-3000:]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cores", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--every", type=float, default=0.25, help="sampling period, s (0.25)")
    ap.add_argument("--smaps", action="store_true", help="the largest replica by mapping")
    ap.add_argument("--env", nargs="*", default=[], help="NAME=VALUE for the run")
    ap.add_argument("--root", type=Path, default=ROOT, help="the checkout whose xla_utils runs")
    ap.add_argument("--cgroup", type=float, default=None, help="memory limit, GiB (cgroup v1)")
    ap.add_argument("--args", nargs="*", default=[], help="the fixture's arguments")
    args = ap.parse_args()
    extra = dict(kv.split("=", 1) for kv in args.env)
    for n in args.cores:
        cg = child_cgroup(int(args.cgroup * 2**30)) if args.cgroup else None
        try:
            out = run(n, args.every, args.smaps, extra, args.root.resolve(), args.args, cg)
        finally:
            if cg is not None:
                for _ in range(50):  # its processes may take a moment to leave it
                    try:
                        cg.rmdir()
                        break
                    except OSError:
                        time.sleep(0.2)
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
