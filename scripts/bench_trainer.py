"""Trainer overhead: OneCycleTrainer.fit and lr_find vs hand-written torch_xla loops.

Three pairs, each variant in a fresh process, the pair back to back (alternating
which goes first), all pairs in every repetition:

* ``fit1``: ``fit(simulate=1)`` vs the hand-written loop on one XLA:CPU device;
  steps/s over epochs 2.. (epoch 1 compiles).
* ``fit8``: ``fit(simulate=8)`` (the thread job) vs the same hand-written loop on 8
  simulated cores (``runtime.launch(simulate=8)``: one process per replica, the way
  user code runs there; torch_xla's own thread-per-device spawn on CPU crashes);
  global steps/s over epochs 2...
* ``lr_find``: an ``lr_find(simulate=1)`` sweep vs a hand-written sweep (same
  exponential LR, loss read every step, same 4x divergence stop) on one XLA:CPU
  device; sweep steps/s over the whole call after the imports (device start and
  compilation included in both; the zygote is started before timing).

* ``ckpt`` (issue 54): ``fit(simulate=1)`` writing its epoch checkpoints only
  (``checkpoint_every=None``) vs the same with an in-epoch checkpoint every 25 optimizer
  steps as well (each a whole checkpoint: model, optimizer, history, written atomically while
  the replica waits): the cost of one in-epoch checkpoint, whose share at the default
  interval (30 minutes on Kaggle and Colab) follows from it.
* ``accum``, ``ema``, ``mixup``, ``all`` (issue 18): ``fit(simulate=1)`` with
  ``accum_steps=2`` / ``ema=0.999`` / ``mixup=0.2, cutmix=1.0, label_smoothing=0.1`` /
  all of them vs the plain ``fit(simulate=1)``; micro-batches/s (= images/s over the
  batch) over epochs 2.. (target: <= 3% overhead each). With ``--same-process`` each
  process runs both variants ``--rounds`` times (alternating), so each pair of the
  comparison ran in the same process. With ``--same-job`` each process starts one
  simulated job (``runtime.launch(simulate=1)``) that sets up both variants with the
  trainer's own loop functions (``loop.set_up``, ``loop.train_one_epoch``, as ``fit``
  runs them) and alternates their epochs, ``--epochs`` each: each pair is two epochs
  run back to back in the same job, so the job-to-job speed differences of this
  machine (about +-10%) cancel out of every pair ratio.

Prints every run with the load average, then medians and the overhead by ratio of
medians and by median of per-pair ratios, and graph executions / device->host
transfers per step of the ``fit1`` pair.

    PJRT_DEVICE=CPU python scripts/bench_trainer.py [--reps 5] [--epochs 4] [--pairs fit1,fit8,lr_find] [--json out.json]
    PJRT_DEVICE=CPU python scripts/bench_trainer.py --pairs accum,ema,mixup,all  # issue 18 options
    PJRT_DEVICE=CPU python scripts/bench_trainer.py --same-process --reps 3 --rounds 4 --pairs mixup
    PJRT_DEVICE=CPU python scripts/bench_trainer.py --same-job --reps 3 --epochs 12 \
        --pairs accum,ema,mixup,all
    PJRT_DEVICE=CPU python scripts/bench_trainer.py --reps 3 --pairs ema,mixup,all --model resnet \\
        --samples 512

``--model`` picks the network (``small`` by default, ``mlp``, ``resnet``; see ``make_model``).

The hand-written loops are what a careful user writes from the torch_xla docs:
``MpDeviceLoader`` + ``xm.optimizer_step`` and no host reads inside the training
loop. They are the only code in this repository outside ``xla_utils/runtime/`` that
calls torch_xla (with scripts/bench_predict.py), because they are the baseline.
"""
from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import sys
import tempfile
import time

import _bench

DEFAULT_SAMPLES = 2048
N_SAMPLES = DEFAULT_SAMPLES  # set by --samples
ROUNDS = 4  # set by --rounds (pairs per process with --same-process)
IMAGE = 32  # set by --image
CLASSES = 10
SWEEP = (1e-7, 10.0, 100)  # lr_find's defaults: start, end, steps
PAIRS = {"fit1": ("hand1", "fit1"), "fit8": ("hand8", "fit8"), "lr_find": ("hand_lr", "lr_find"),
         "accum": ("fit1", "fit1_accum"), "ema": ("fit1", "fit1_ema"),
         "mixup": ("fit1", "fit1_mixup"), "all": ("fit1", "fit1_all"),
         "ckpt": ("fit1_epochfiles", "fit1_ckpt")}
# The trainer options of issue 18, each timed against the plain fit(simulate=1).
OPTIONS = {"accum": dict(accum_steps=2), "ema": dict(ema=0.999),
           "mixup": dict(mixup=0.2, cutmix=1.0, label_smoothing=0.1),
           "all": dict(accum_steps=2, ema=0.999, mixup=0.2, cutmix=1.0, label_smoothing=0.1),
           # issue 54: epoch files only, against an in-epoch checkpoint every 25 optimizer steps
           "epochfiles": dict(checkpoint_every=None), "ckpt": dict(checkpoint_every=25)}


MODELS = ("small", "mlp", "resnet")
MODEL = "small"  # set by --model (the children get it on their command line)


def make_model():
    """The benchmark's model on 3 x IMAGE x IMAGE inputs (32 unless ``--image``), 10 classes
    (``--model``):

    * ``small`` (default; every figure in docs/BENCHMARKS.md before ``--model`` existed):
      two 3x3 convolutions (16, 32 channels) with max-pooling, then a 2048-64-10 MLP head;
    * ``mlp``: a 3072-64-10 MLP (the cheapest step: the worst case for per-step overhead);
    * ``resnet``: torchvision's ``ResNet`` with one basic block per stage (64-512
      channels) and BatchNorm (``weights=None``), the kind of network the issue 18
      options are used with.
    """
    import torch.nn as nn

    if MODEL == "mlp":
        return nn.Sequential(nn.Flatten(), nn.Linear(3 * IMAGE * IMAGE, 64), nn.ReLU(),
                             nn.Linear(64, CLASSES))
    if MODEL == "resnet":
        from torchvision.models.resnet import BasicBlock, ResNet

        return ResNet(BasicBlock, [1, 1, 1, 1], num_classes=CLASSES)
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(32 * 8 * 8, 64), nn.ReLU(), nn.Linear(64, CLASSES),
    )


def make_data():
    import torch

    g = torch.Generator().manual_seed(0)
    x = torch.randn(N_SAMPLES, 3, IMAGE, IMAGE, generator=g)
    y = torch.randint(0, CLASSES, (N_SAMPLES,), generator=g)
    return torch.utils.data.TensorDataset(x, y)


def _hand_epochs(batch: int, epochs: int, world: int) -> dict:
    """The hand-written training loop in this replica: per-epoch seconds and counters."""
    import torch
    import torch.nn.functional as F
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.debug.metrics as met
    import torch_xla.distributed.parallel_loader as pl
    import torch_xla.runtime as xr

    torch.manual_seed(0)
    dev = torch_xla.device()
    model = make_model().to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    data = make_data()
    sampler = torch.utils.data.distributed.DistributedSampler(
        data, num_replicas=world, rank=xr.global_ordinal(), shuffle=True, drop_last=True) \
        if world > 1 else None
    loader = torch.utils.data.DataLoader(data, batch_size=batch, shuffle=sampler is None,
                                         sampler=sampler, drop_last=True)
    device_loader = pl.MpDeviceLoader(loader, dev)
    steps = len(loader)
    times, execs, to_host = [], [], []
    for epoch in range(epochs):
        if sampler is not None:
            sampler.set_epoch(epoch)
        e0 = met.metric_data("ExecuteTime")[0] if met.metric_data("ExecuteTime") else 0
        h0 = met.metric_data("TransferFromDeviceTime")
        h0 = h0[0] if h0 else 0
        t0 = time.perf_counter()
        for x, y in device_loader:
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            xm.optimizer_step(opt)
        xm.wait_device_ops()
        times.append(time.perf_counter() - t0)
        execs.append((met.metric_data("ExecuteTime")[0] - e0) / steps)
        h1 = met.metric_data("TransferFromDeviceTime")
        to_host.append(((h1[0] if h1 else 0) - h0) / steps)
    return {"steps": steps, "epoch_s": times, "exec_per_step": execs, "to_host_per_step": to_host}


def run_hand1(batch: int, epochs: int) -> dict:
    return _hand_epochs(batch, epochs, 1)


def run_hand8(batch: int, epochs: int) -> dict:
    from xla_utils import runtime

    return runtime.launch(_hand_epochs, batch, epochs, 8, simulate=8)


def run_fit(batch: int, epochs: int, cores: int, **options) -> dict:
    """``fit(simulate=cores)`` with trainer ``options``; steps are micro-batches (with
    ``accum_steps`` several per optimizer step), so every variant counts images alike."""
    import torch

    from xla_utils import OneCycleTrainer

    torch.manual_seed(0)
    folder = tempfile.mkdtemp(prefix="bench-ckpt-") if "checkpoint_every" in options else None
    try:
        t = OneCycleTrainer(make_model(), torch.nn.CrossEntropyLoss(), make_data(),
                            batch_size=batch, epochs=epochs, optimizer="sgd", max_lr=0.01, seed=0,
                            checkpoint_dir=folder, **options)
        h = t.fit(simulate=cores)
    finally:
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)
    steps = N_SAMPLES // (batch * cores)
    return {"steps": steps, "epoch_s": [e["seconds"] for e in h.epochs],
            "to_host_per_step": [e["host_reads_per_step"] for e in h.epochs]}


def run_fit1(batch: int, epochs: int) -> dict:
    return run_fit(batch, epochs, 1)


def run_fit8(batch: int, epochs: int) -> dict:
    return run_fit(batch, epochs, 8)


def _option_runner(name: str):
    def run(batch: int, epochs: int) -> dict:
        return run_fit(batch, epochs, 1, **OPTIONS[name])
    return run


def _same_process_runner(name: str):
    """Both variants of an option pair in this one process, ``ROUNDS`` times, alternating
    which goes first (plain, option, option, plain, ...): each ``fit`` forks its job from
    this process's zygote, so the pair shares one process's speed (see ``--same-process``)."""
    def run(batch: int, epochs: int) -> dict:
        rates: dict[str, list[float]] = {"plain": [], name: []}
        for k in range(ROUNDS):
            for variant in (("plain", name) if k % 2 == 0 else (name, "plain")):
                r = run_fit(batch, epochs, 1, **({} if variant == "plain" else OPTIONS[name]))
                rates[variant].append(_rate(r))
        return rates
    return run


def _same_job_runner(name: str):
    """Both variants of an option pair set up in one simulated job, their epochs
    alternating (plain first in even epochs): micro-batches/s of every epoch after
    each variant's first (see ``--same-job``)."""
    def run(batch: int, epochs: int) -> dict:
        import torch

        from xla_utils import OneCycleTrainer, runtime

        trainers = []
        for variant in ("plain", name):
            torch.manual_seed(0)
            t = OneCycleTrainer(make_model(), torch.nn.CrossEntropyLoss(), make_data(),
                                batch_size=batch, epochs=epochs, optimizer="sgd", max_lr=0.01,
                                seed=0, **({} if variant == "plain" else OPTIONS[name]))
            inputs = t._check_inputs()  # as fit() does on the host before its job
            trainers.append((variant, t, inputs["train"], t._mix_config(inputs["train"])))
        return runtime.launch(_alternate_epochs, trainers, epochs, batch, simulate=1)
    return run


def _alternate_epochs(trainers: list, epochs: int, batch: int) -> dict:
    """In the job: ``loop.set_up`` each trainer, then alternate ``loop.train_one_epoch``."""
    from xla_utils.train import loop

    runs = []
    for variant, t, (data, spec), mix in trainers:
        s = loop.set_up(t.model, t.config, data, base_lr=0.01, lr_world=1, ckpt=None, mix=mix)
        runs.append((variant, t, data, spec, s, loop.TrainState(step=0, initial_loss=None)))
    rates: dict[str, list[float]] = {variant: [] for variant, *_ in runs}
    for epoch in range(epochs):
        for variant, t, data, spec, s, state in (runs if epoch % 2 == 0 else runs[::-1]):
            res = loop.train_one_epoch(epoch, s, state, s.batches(data, t.config, epoch, train=True),
                                       cfg=t.config, train_step=t.train_step, loss_fn=t.loss,
                                       inputs=spec)
            if epoch:  # the first epoch compiles
                rates[variant].append(N_SAMPLES // batch / res.seconds)
    return rates


def run_hand_lr(batch: int, epochs: int) -> dict:
    """A hand-written LR range test: lr_find's schedule, smoothing and stop."""
    import torch
    import torch.nn.functional as F
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.distributed.parallel_loader as pl

    torch.manual_seed(0)
    t0 = time.perf_counter()
    dev = torch_xla.device()
    model = make_model().to(dev)
    start, end, num = SWEEP
    opt = torch.optim.SGD(model.parameters(), lr=start, momentum=0.9)
    loader = torch.utils.data.DataLoader(make_data(), batch_size=batch, shuffle=True, drop_last=True)
    avg, best, steps, beta = 0.0, math.inf, 0, 0.98
    while steps < num:
        for x, y in pl.MpDeviceLoader(loader, dev):
            for g in opt.param_groups:
                g["lr"] = start * (end / start) ** (steps / (num - 1))
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            xm.optimizer_step(opt)
            value = loss.item()
            steps += 1
            avg = beta * avg + (1 - beta) * value
            smooth = avg / (1 - beta ** steps)
            best = min(best, smooth)
            if steps >= num or not math.isfinite(value) or smooth > 4 * best:
                return {"steps": steps, "seconds": time.perf_counter() - t0}
    return {"steps": steps, "seconds": time.perf_counter() - t0}


def run_lr_find(batch: int, epochs: int) -> dict:
    import torch

    from xla_utils import lr_find
    from xla_utils.simulate import caller as simulate

    simulate._zygote()  # started and ready before timing: the sweep is what is measured
    torch.manual_seed(0)
    model = make_model()
    start, end, num = SWEEP
    t0 = time.perf_counter()
    res = lr_find(model, torch.nn.CrossEntropyLoss(), make_data(), batch, optimizer="sgd",
                  start_lr=start, end_lr=end, num_it=num, show_progress=False, simulate=1)
    seconds = time.perf_counter() - t0
    # The job's fixed cost, reported apart: a thread job that receives the same
    # model and data, starts its XLA:CPU device and returns (fork, hand-over, return).
    from xla_utils import runtime

    t0 = time.perf_counter()
    runtime.launch_job(_handover, (model, make_data()), placement=runtime.resolve(1, simulate=1),
                       timeout=None, sim_threads=True)
    return {"steps": len(res.lrs), "seconds": seconds, "job_fixed_s": time.perf_counter() - t0}


def _handover(model, data) -> int:
    """What every thread job does before and after its work: take its arguments, start
    the device, return a result."""
    from xla_utils import runtime

    runtime.device()
    return len(data)


def _rate(r: dict) -> float:
    """Steps/s: steady epochs (2..) of a training run, or the whole sweep."""
    if "epoch_s" in r:
        steady = r["epoch_s"][1:]
        return r["steps"] * len(steady) / sum(steady)
    return r["steps"] / r["seconds"]


RUNNERS = {"hand1": run_hand1, "fit1": run_fit1, "hand8": run_hand8, "fit8": run_fit8,
           "hand_lr": run_hand_lr, "lr_find": run_lr_find,
           **{f"fit1_{name}": _option_runner(name) for name in OPTIONS},
           **{f"same_{name}": _same_process_runner(name) for name in OPTIONS},
           **{f"samejob_{name}": _same_job_runner(name) for name in OPTIONS}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--pairs", default="fit1,fit8,lr_find",
                    help=f"which pairs of {list(PAIRS)} (default: fit1,fit8,lr_find)")
    ap.add_argument("--model", choices=MODELS, default="small",
                    help="small (default: 2 convs + MLP head), mlp or resnet; see make_model")
    ap.add_argument("--samples", type=int, default=DEFAULT_SAMPLES,
                    help=f"training samples (default {DEFAULT_SAMPLES}; fewer for --model resnet)")
    ap.add_argument("--image", type=int, default=32,
                    help="image side in pixels (default 32; other sizes for --model resnet or mlp)")
    ap.add_argument("--same-process", action="store_true",
                    help="option pairs (accum, ema, mixup, all): run both variants in one process, "
                         "--rounds pairs per process, --reps processes (the pair then shares one "
                         "process's speed, which varies by +-10%% from process to process here)")
    ap.add_argument("--rounds", type=int, default=4, help="pairs per process with --same-process")
    ap.add_argument("--same-job", action="store_true",
                    help="option pairs: both variants set up in one simulated job per process, "
                         "their --epochs epochs alternating (pairs of epochs back to back)")
    ap.add_argument("--json", help="also write the raw results here")
    ap.add_argument("--child", choices=sorted(RUNNERS), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    global MODEL, N_SAMPLES, ROUNDS, IMAGE
    MODEL, N_SAMPLES, ROUNDS, IMAGE = args.model, args.samples, args.rounds, args.image
    if args.model == "small" and args.image != 32:
        ap.error("--image: the small model's head takes 32x32 images; use --model resnet or mlp")
    if args.child:
        print(json.dumps(RUNNERS[args.child](args.batch, args.epochs)))
        return 0
    pairs = [p for p in args.pairs.split(",") if p]
    unknown = set(pairs) - set(PAIRS)
    if unknown:
        ap.error(f"unknown pairs {sorted(unknown)}; choose from {list(PAIRS)}")
    print(f"start: {_bench.load()}; model {args.model}, images {args.image}x{args.image}",
          flush=True)
    if args.same_process or args.same_job:
        return _main_same_process(args, pairs)
    # per pair, so that per-pair ratios pair the runs made back to back (fit1 is the
    # baseline of several pairs)
    rates: dict[str, dict[str, list[float]]] = {p: {v: [] for v in PAIRS[p]} for p in pairs}
    raw: dict[str, list[dict]] = {v: [] for p in pairs for v in PAIRS[p]}
    for rep in range(args.reps):
        for pair in pairs:
            order = PAIRS[pair] if rep % 2 == 0 else PAIRS[pair][::-1]
            for variant in order:
                r = _bench.child(__file__, variant, "--batch", str(args.batch),
                                 "--epochs", str(args.epochs), "--model", args.model,
                                 "--samples", str(args.samples), "--image", str(args.image))
                rates[pair][variant].append(_rate(r))
                raw[variant].append(r)
                print(f"rep {rep} {variant:8s} {rates[pair][variant][-1]:8.2f} steps/s  "
                      f"({_bench.load()})", flush=True)
    print(f"\nend: {_bench.load()}; model {args.model} at {args.image}x{args.image}, "
          f"{args.samples} samples, batch {args.batch} per core, {args.reps} reps")
    summary = {p: _bench.compare(p, rates[p][PAIRS[p][0]], rates[p][PAIRS[p][1]], "steps/s",
                                 **({"base_name": "plain fit"} if p in OPTIONS else {}))
               for p in pairs}
    if "lr_find" in pairs:
        fixed = [r["job_fixed_s"] for r in raw["lr_find"]]
        print(f"lr_find job's fixed cost (fork, model and data hand-over, device start, return; "
              f"included in its sweep time): median {1000 * statistics.median(fixed):.0f} ms, "
              f"range {1000 * min(fixed):.0f}-{1000 * max(fixed):.0f} ms")
    if "fit1" in pairs:
        med = statistics.median
        print(f"fit1 device->host transfers per step: hand-written "
              f"{med(x for r in raw['hand1'] for x in r['to_host_per_step'][1:]):.3f}, trainer "
              f"{med(x for r in raw['fit1'] for x in r['to_host_per_step'][1:]):.3f}; "
              f"hand-written graph executions per step "
              f"{med(x for r in raw['hand1'] for x in r['exec_per_step'][1:]):.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "summary": summary, "raw": raw}, f, indent=1)
    return 0


def _main_same_process(args: argparse.Namespace, pairs: list[str]) -> int:
    """``--same-process`` / ``--same-job``: each option pair's variants side by side inside
    each process (or each job)."""
    how = "same-job" if args.same_job else "same-process"
    if set(pairs) - set(OPTIONS):
        raise SystemExit(f"--{how} times option pairs only ({sorted(OPTIONS)}), got {pairs}")
    rates = {p: {"plain": [], p: []} for p in pairs}
    for rep in range(args.reps):
        for pair in pairs:
            runner = f"{'samejob' if args.same_job else 'same'}_{pair}"
            r = _bench.child(__file__, runner, "--batch", str(args.batch), "--epochs",
                             str(args.epochs), "--model", args.model, "--samples",
                             str(args.samples), "--rounds", str(args.rounds), "--image",
                             str(args.image))
            for v in ("plain", pair):
                rates[pair][v] += r[v]
            print(f"rep {rep} {pair}: plain {', '.join(f'{x:.2f}' for x in r['plain'])}; {pair} "
                  f"{', '.join(f'{x:.2f}' for x in r[pair])} steps/s  ({_bench.load()})", flush=True)
    print(f"\nend: {_bench.load()}; model {args.model} at {args.image}x{args.image}, "
          f"{args.samples} samples, batch {args.batch} per core, {args.reps} processes x "
          + (f"{args.epochs - 1} epoch pairs (same job)" if args.same_job else
             f"{args.rounds} pairs (same process)"))
    summary = {p: _bench.compare(p, rates[p]["plain"], rates[p][p], "steps/s", base_name="plain fit")
               for p in pairs}
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, how.replace("-", "_"): True, "summary": summary}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
