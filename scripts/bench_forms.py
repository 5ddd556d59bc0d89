"""Simulated step time of each torch_xla program form on N cores vs one device.

One MLP (``--width``, 3 hidden layers), one global batch (``--batch``), one seed,
trained ``--steps`` steps in each form under ``python -m xla_utils.simulate``:

* ``one device``: ``xmp.spawn`` on 1 core (``xm.optimizer_step``), the reference;
* ``xm``: ``xmp.spawn`` on N cores, ``xm.optimizer_step`` (host all-reduce);
* ``ddp``: torch.distributed ``xla`` backend + ``DistributedDataParallel``;
* ``compiled``: a ``torch_xla.compile(full_graph=True)`` step calling ``xm.optimizer_step``;
* ``spmd``: ``xr.use_spmd()``, batch sharded ``('data', None)`` on an N-device mesh
  (one process with N XLA:CPU devices, in-graph collectives).

Each form runs in a fresh ``python -m xla_utils.simulate`` process, ``--reps`` times,
alternating; the step time is the median over steps after the first ``--warmup``
(compilation excluded), the step ending with ``xm.wait_device_ops()``. Prints
one table (median of reps, ratio to one device, final loss: equal across forms)
with the host's load average (the machine may be shared).

    python scripts/bench_forms.py --cores 8 --reps 3 --steps 30 --batch 256 --width 512
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
FORMS = (("one device", "xm", 1), ("xm", "xm", 0), ("ddp", "ddp", 0),
         ("compiled", "compiled", 0), ("spmd", "spmd", 0))


def _model(width: int):
    import torch
    import torch.nn as nn

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(),
                         nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 1))


def _batch(step: int, batch: int):
    import torch

    g = torch.Generator().manual_seed(step)
    x = torch.randn(batch, 64, generator=g)
    return x, (x[:, :1] * 2 - x[:, 1:2]).tanh()


def _timed_loop(step_fn, cfg: dict, rank: int, ws: int, shard=None) -> tuple[list, float]:
    """Run the steps; per-step seconds and the last step's loss (a local mean)."""
    import torch_xla
    import torch_xla.core.xla_model as xm

    dev = torch_xla.device()
    b = cfg["batch"] // ws
    times, loss = [], None
    for s in range(cfg["steps"]):
        x, y = _batch(s, cfg["batch"])
        if shard is None:
            x, y = x[rank * b:(rank + 1) * b], y[rank * b:(rank + 1) * b]
        t = time.perf_counter()
        x, y = x.to(dev), y.to(dev)
        if shard is not None:
            shard(x)
            shard(y)
        loss = step_fn(x, y)
        torch_xla.sync()
        xm.wait_device_ops()
        times.append(time.perf_counter() - t)
    return times, loss


def _replica(index: int, mode: str, cfg: dict) -> None:
    import torch
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.runtime as xr

    ws, rank = xr.world_size(), xr.global_ordinal()
    model = _model(cfg["width"]).to(torch_xla.device())
    if mode == "ddp":
        import torch.distributed as dist
        import torch_xla.distributed.xla_backend  # noqa: F401
        from torch.nn.parallel import DistributedDataParallel as DDP

        dist.init_process_group("xla", init_method="xla://")
        model = DDP(model, gradient_as_bucket_view=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)

    def step(x, y):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step() if mode == "ddp" else xm.optimizer_step(opt)
        return loss

    if mode == "compiled":
        step = torch_xla.compile(step, full_graph=True)
    times, loss = _timed_loop(step, cfg, rank, ws)
    loss = xm.all_reduce(xm.REDUCE_SUM, loss, scale=1.0 / ws).item()
    if rank == 0:
        Path(cfg["out"]).write_text(json.dumps({"times": times, "loss": loss, "devices": ws}))


def _spmd(cfg: dict) -> None:
    import numpy as np
    import torch
    import torch_xla
    import torch_xla.distributed.spmd as xs
    import torch_xla.runtime as xr

    xr.use_spmd()
    n = xr.global_runtime_device_count()
    mesh = xs.Mesh(np.arange(n), (n,), ("data",))
    model = _model(cfg["width"]).to(torch_xla.device())
    opt = torch.optim.SGD(model.parameters(), lr=0.05)

    def step(x, y):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        return loss

    times, loss = _timed_loop(step, cfg, 0, 1,
                              shard=lambda t: xs.mark_sharding(t, mesh, ("data", None)))
    Path(cfg["out"]).write_text(json.dumps({"times": times, "loss": loss.item(), "devices": n}))


def _program(argv: list[str]) -> None:
    """``bench_forms.py --program MODE CFG_JSON``: the benchmarked program itself."""
    mode, cfg = argv[0], json.loads(argv[1])
    if mode == "spmd":
        _spmd(cfg)
    else:
        import torch_xla.distributed.xla_multiprocessing as xmp

        xmp.spawn(_replica, args=(mode, cfg))


def _run(mode: str, cores: int, cfg: dict) -> dict:
    env = dict(os.environ, PJRT_DEVICE="CPU")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    form = "spmd" if mode == "spmd" else "spawn"
    cmd = [sys.executable, "-m", "xla_utils.simulate", "--cores", str(cores), "--form", form,
           str(Path(__file__).resolve()), "--program", mode, json.dumps(cfg)]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    if p.returncode != 0:
        raise RuntimeError(f"{mode} on {cores} failed ({p.returncode}):\n{p.stderr[-3000:]}")
    return json.loads(Path(cfg["out"]).read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cores", type=int, default=8)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5, help="steps not timed (compilation)")
    ap.add_argument("--batch", type=int, default=256, help="global batch (all forms)")
    ap.add_argument("--width", type=int, default=512)
    a = ap.parse_args()
    if a.batch % a.cores or a.steps <= a.warmup:
        ap.error("--batch must be a multiple of --cores and --steps > --warmup")
    rows: dict[str, list[dict]] = {name: [] for name, _, _ in FORMS}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(a.reps):
            order = FORMS if rep % 2 == 0 else FORMS[::-1]
            for name, mode, cores in order:
                cfg = {"steps": a.steps, "batch": a.batch, "width": a.width,
                       "out": os.path.join(tmp, f"{mode}-{rep}.json")}
                r = _run(mode, cores or a.cores, cfg)
                r["step_ms"] = 1000 * statistics.median(r["times"][a.warmup:])
                rows[name].append(r)
                print(f"rep {rep} {name:10s} ({r['devices']} devices): step "
                      f"{r['step_ms']:8.2f} ms, final loss {r['loss']:.6f} "
                      f"(load {os.getloadavg()[0]:.1f})", flush=True)
    base = statistics.median(r["step_ms"] for r in rows["one device"])
    print(f"\nmedian of {a.reps} reps, global batch {a.batch}, MLP width {a.width}, "
          f"{a.steps - a.warmup} timed steps; load %.2f %.2f %.2f" % os.getloadavg())
    print(f"{'form':12s} {'devices':>7s} {'step ms':>9s} {'vs one':>7s} {'final loss':>11s}")
    for name, rs in rows.items():
        step = statistics.median(r["step_ms"] for r in rs)
        print(f"{name:12s} {rs[0]['devices']:7d} {step:9.2f} {step / base:6.2f}x "
              f"{rs[0]['loss']:11.6f}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--program"]:
        _program(sys.argv[2:])
    else:
        main()
