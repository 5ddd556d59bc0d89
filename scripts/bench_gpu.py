"""GPU: OneCycleTrainer.fit and predict against a hand-written loop and the no-loader ceiling.

Issue 34's measurement, side by side in one process, per model (torchvision's ResNet-18
and ResNet-50, random weights, 10 classes; 224x224, batch 256 by default), on a uint8
cache this script renders and builds itself (``build_cache``):

* ``ceiling``: the training step on one batch that stays on the device (normalised,
  channels_last, autocast, SGD): no loader, no copies;
* ``hand``: the hand-written loop of the issue: ``DataLoader(CachedImageDataset, shuffle,
  drop_last, num_workers=--workers, pin_memory, persistent_workers)``, per step
  ``x.to(dev, non_blocking=True)``, normalised on the device (``(x.permute(0, 3, 1, 2).float()
  / 255 - mean) / std`` in channels_last), a channels_last model, autocast in the precision
  the trainer picks for this device (bf16 from compute capability 8.0, fp16 with a
  ``GradScaler`` below, fp32 on the CPU), ``loss.backward(); opt.step();
  opt.zero_grad(set_to_none=True)``, ``OneCycleLR.step()``; the loss is never read;
* ``fit``: ``OneCycleTrainer(model, CrossEntropyLoss(), cache, batch_size, epochs,
  optimizer="sgd", max_lr, flip=False).fit()`` with its automatic settings; its history's
  seconds per epoch.

Training figures are images/s over epochs 2.. (epoch 1 warms up: cuDNN picks its kernels);
with ``--epochs 1`` over epoch 1. Then inference, after one warm-up call each:
``trainer.predict(cache)`` (softmax, one numpy array) against a hand-written inference loop
(the same DataLoader unshuffled, channels_last, autocast, softmax, outputs kept on the
device and read once), the median of ``--predict-reps`` calls each. Every figure is printed
with the host's load average and the GPU's name; ``--json`` writes them all.

On a GPU machine with torch, CUDA and torchvision but no torch_xla and no package index
(xla_utils' pure-Python dependencies, fastprogress and cloudpickle, carried as wheels in a
folder: ``python scripts/make_offline_wheels.py WHEELS_DIR`` elsewhere), from the
repository root::

    python scripts/bench_gpu.py --wheels WHEELS_DIR --json gpu.json

``--wheels`` puts the folder and every ``*.whl`` in it on ``sys.path`` (pure-Python wheels
import from there); the checkout's own ``xla_utils`` is found from the repository root
and comes first.
A CPU smoke run (tests/test_bench_gpu.py)::

    python scripts/bench_gpu.py --models resnet18 --image 32 --batch 8 --images 64 --epochs 1 --workers 0

``--gpus all`` measures scaling instead, per model: ``fit(cores=1)`` against
``fit(cores="all")`` on the host's k GPUs at the same per-GPU ``--batch`` (images/s over
epochs 2..; scaling efficiency = all / (k x one)), and the all-reduce time of one step's
gradients (the model's parameters in float32, all-reduced by ``xla_utils.launch`` on the k
replicas, median of 20 after 3 warm-up calls). On a one-GPU machine ``cores="all"`` is the
same in-process run as ``cores=1``: its ratio shows what ``"all"`` costs there (nothing).
``XLA_UTILS_CPU_REPLICAS=2`` rehearses it on the CPU::

    XLA_UTILS_CPU_REPLICAS=2 python scripts/bench_gpu.py --gpus all --models resnet18 --image 32 --batch 8 --images 64 --epochs 1

``--compile [MODE]`` measures issue 45's ``compile=`` instead, per model (default models
ResNet-50 and timm's ConvNeXt-T, ViT-S/16 and EfficientNet-B0, ``timm:<name>`` for a timm
model): the eager hand loop, the same loop with ``torch.compile(model, mode=MODE)``, eager
``fit()``, and ``fit(compile=MODE)`` twice, each in a fresh process on one new inductor
cache folder: cold (the folder empty) and warm (the folder the cold run filled, as a new
Kaggle session with ``/kaggle/working`` kept). Training figures as above (epochs 2..); the
first epochs' seconds, their compile seconds and the warm run's cache hits are printed and
in ``--json``. On a GPU machine in one call::

    python scripts/bench_gpu.py --wheels WHEELS_DIR --compile --json compile.json

(or one model per call, ``--models resnet50 --cache DIR``, where a call's time is limited).

A CPU rehearsal (tests/test_bench_gpu.py; ``--compile-backend aot_eager`` skips inductor's
C++ compiles)::

    python scripts/bench_gpu.py --compile --compile-backend aot_eager --models tiny --image 32 --batch 8 --images 32 --epochs 1 --workers 0
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CLASSES = 10
MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
MAX_LR = 0.1


class Rendered:
    """Map-style source of ``n`` rendered ``size`` x ``size`` RGB images: noise plus a
    bright square whose place and colour depend on the class (``i % 10``)."""

    def __init__(self, n: int, size: int):
        self.n, self.size = n, size

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        import numpy as np

        rng = np.random.default_rng(i)
        c, s = i % CLASSES, self.size
        img = rng.integers(0, 96, (s, s, 3), dtype=np.uint8)
        q = max(1, s // 4)
        y0, x0 = (c // 5) * (s // 2), (c % 5) * (s - q) // 4
        img[y0:y0 + q, x0:x0 + q] = (60 + 19 * c, 255 - 19 * c, 120)
        return img, c


COMPILE_MODELS = ("resnet50,timm:convnext_tiny,timm:vit_small_patch16_224,"
                  "timm:efficientnet_b0")
# issue 45's table: ConvNeXt-T trains at max_lr 0.01 (0.1 diverges with SGD at batch 256)
MODEL_LR = {"timm:convnext_tiny": 0.01}


def make_model(name: str):
    """A torchvision model by name, ``timm:<name>`` (random weights, 10 classes), or
    ``tiny`` (two convolutions: CPU rehearsals of the script's flow)."""
    if name == "tiny":
        from torch import nn

        return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                             nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                             nn.Flatten(), nn.Linear(8, CLASSES))
    if name.startswith("timm:"):
        import timm

        return timm.create_model(name[5:], pretrained=False, num_classes=CLASSES)
    import torchvision

    return getattr(torchvision.models, name)(weights=None, num_classes=CLASSES)


def sync(dev) -> None:
    import torch

    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def device_facts():
    """``(device, precision, words)``: the device the trainer will use and the precision
    its ``precision="auto"`` picks there (the hand loop uses the same)."""
    import torch

    from xla_utils.step.device_plan import resolve_precision

    if torch.cuda.is_available():
        from xla_utils.env.gpu import cuda_facts

        dev = torch.device("cuda")
        facts = cuda_facts(dev)
        return dev, resolve_precision("auto", "cuda", facts.compute_capability), facts.describe()
    return torch.device("cpu"), "fp32", f"cpu ({os.cpu_count()} cores)"


class Step:
    """The hand-written training step: channels_last model, autocast, SGD (+ GradScaler in fp16)."""

    def __init__(self, name: str, dev, precision: str, total_steps: int,
                 compile_mode: str | None = None, backend: str = "inductor"):
        import torch

        torch.manual_seed(0)
        self.dev = dev
        self.model = make_model(name).to(dev).to(memory_format=torch.channels_last).train()
        lr = MODEL_LR.get(name, MAX_LR)
        # --compile: the hand loop with torch.compile(model), as a user writes it
        self.forward = self.model if compile_mode is None else (
            torch.compile(self.model, mode=compile_mode) if backend == "inductor" else
            torch.compile(self.model, backend=backend))
        self.opt = torch.optim.SGD(self.model.parameters(), lr=lr / 25, momentum=0.9)
        self.sched = torch.optim.lr_scheduler.OneCycleLR(self.opt, lr, total_steps=total_steps)
        dtype = torch.float16 if precision == "fp16" else torch.bfloat16
        self.autocast = torch.autocast(dev.type, dtype=dtype, enabled=precision != "fp32")
        self.scaler = torch.amp.GradScaler(dev.type) if precision == "fp16" else None
        self.loss = torch.nn.CrossEntropyLoss()
        self.mean = torch.tensor(MEAN, device=dev).view(1, 3, 1, 1) * 255
        self.std = torch.tensor(STD, device=dev).view(1, 3, 1, 1) * 255

    def normalise(self, x):
        import torch

        return ((x.permute(0, 3, 1, 2).float() - self.mean) / self.std).contiguous(
            memory_format=torch.channels_last)

    def __call__(self, x, y) -> None:
        with self.autocast:
            loss = self.loss(self.forward(x), y)
        if self.scaler is None:
            loss.backward()
            self.opt.step()
        else:
            self.scaler.scale(loss).backward()
            self.scaler.step(self.opt)
            self.scaler.update()
        self.opt.zero_grad(set_to_none=True)
        if self.sched.last_epoch + 1 < self.sched.total_steps:
            self.sched.step()


def loader(ds, batch: int, workers: int, dev, shuffle: bool):
    import torch

    return torch.utils.data.DataLoader(ds, batch_size=batch, shuffle=shuffle, drop_last=shuffle,
                                       num_workers=workers, pin_memory=dev.type == "cuda",
                                       persistent_workers=workers > 0)


def rate(images: list[int], seconds: list[float]) -> float:
    """Images/s over epochs 2.. (all epochs when there is one)."""
    k = 1 if len(seconds) > 1 else 0
    return sum(images[k:]) / sum(seconds[k:])


def run_hand(name: str, ds, args, dev, precision: str, compile_mode: str | None = None):
    """The hand-written loop (``compile_mode``: its model through ``torch.compile``);
    ``(images/s, its Step)``; ``step.seconds``: each epoch's."""
    import torch

    dl = loader(ds, args.batch, args.workers, dev, shuffle=True)
    step = Step(name, dev, precision, args.epochs * len(dl), compile_mode,
                getattr(args, "compile_backend", "inductor"))
    images, seconds = [], []
    for _ in range(args.epochs):
        sync(dev)
        t0, n = time.perf_counter(), 0
        for x, y in dl:
            x = step.normalise(x.to(dev, non_blocking=True))
            step(x, y.to(dev, non_blocking=True))
            n += len(y)
        sync(dev)
        images.append(n)
        seconds.append(time.perf_counter() - t0)
    del dl
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    step.seconds = seconds
    return rate(images, seconds), step


def run_ceiling(name: str, ds, args, dev, precision: str) -> float:
    """The same step on one device-resident batch: no loader, no copies."""
    import numpy as np
    import torch

    steps = max(2, len(ds) // args.batch)
    step = Step(name, dev, precision, steps + 3)
    x = torch.from_numpy(np.stack([ds.image(i) for i in range(args.batch)])).to(dev)
    y = torch.as_tensor([ds.label(i) for i in range(args.batch)], device=dev)
    x = step.normalise(x)
    for _ in range(3):  # warm-up: cuDNN picks its kernels
        step(x, y)
    sync(dev)
    t0 = time.perf_counter()
    for _ in range(steps):
        step(x, y)
    sync(dev)
    return steps * args.batch / (time.perf_counter() - t0)


def run_fit(name: str, ds, args, cores: int | str = 1, **compiled):
    """``OneCycleTrainer.fit`` (``compiled``: ``compile=``, ``compile_cache=``);
    ``(images/s, the trainer)``; ``trainer.history``: the run's History."""
    import torch

    from xla_utils import OneCycleTrainer

    torch.manual_seed(0)
    t = OneCycleTrainer(make_model(name), torch.nn.CrossEntropyLoss(), ds, batch_size=args.batch,
                        epochs=args.epochs, optimizer="sgd", max_lr=MODEL_LR.get(name, MAX_LR),
                        flip=False, num_workers=args.fit_workers, **compiled)
    h = t.fit(cores=cores)  # cores=1: beside the one-GPU hand loop
    t.history = h
    images = [r["images_per_s"] * r["seconds"] for r in h.epochs]
    return rate(images, [r["seconds"] for r in h.epochs]), t


def fit_child(args) -> None:
    """``--child-fit``: ``fit(compile=...)`` of one model in this fresh process, its figures
    and the persistent caches' counters written to ``--child-out``."""
    from torch._dynamo.utils import counters

    from xla_utils import CachedImageDataset

    ds = CachedImageDataset(args.cache)
    fit, t = run_fit(args.child_fit, ds, args, compile=args.compile,
                     compile_cache=args.child_cache)
    first = t.history.epochs[0]
    Path(args.child_out).write_text(json.dumps({
        "fit": fit, "first_epoch_s": first["seconds"], "compile_s": first["compile_seconds"],
        "compiles": [r["compiles"] for r in t.history.epochs],
        "fxgraph_hit": counters["inductor"]["fxgraph_cache_hit"],
        "fxgraph_miss": counters["inductor"]["fxgraph_cache_miss"],
        "autograd_hit": counters["aot_autograd"]["autograd_cache_hit"],
        "autograd_miss": counters["aot_autograd"]["autograd_cache_miss"]}))


def fresh_fit(name: str, args, folder: Path) -> dict:
    """``fit(compile=...)`` in a fresh process on the inductor cache ``folder``."""
    import subprocess

    out = folder.parent / f"{folder.name}-{time.monotonic_ns()}.json"
    argv = [sys.executable, str(Path(__file__).resolve()), "--child-fit", name, "--child-cache",
            str(folder), "--child-out", str(out), "--cache", str(args.cache), "--compile",
            args.compile, "--batch", str(args.batch), "--epochs", str(args.epochs),
            "--image", str(args.image), "--images", str(args.images)]
    if args.fit_workers is not None:
        argv += ["--fit-workers", str(args.fit_workers)]
    if args.wheels:
        argv += ["--wheels", args.wheels]
    env = dict(os.environ)
    if args.compile_backend != "inductor":
        env["XLA_UTILS_COMPILE_BACKEND"] = args.compile_backend
    subprocess.run(argv, check=True, env=env)
    return json.loads(out.read_text())


def bench_compile(name: str, ds, args, dev, precision: str) -> dict:
    """Issue 45: eager and compiled hand loops, eager fit, fit(compile=) cold and warm."""
    hand, _ = run_hand(name, ds, args, dev, precision)
    chand, cstep = run_hand(name, ds, args, dev, precision, compile_mode=args.compile)
    first, cstep = cstep.seconds[0], None  # its model off the GPU before the next runs
    fit, _ = run_fit(name, ds, args)
    folder = Path(tempfile.mkdtemp(prefix="bench_compile_")) / "cache"
    cold, warm = fresh_fit(name, args, folder), fresh_fit(name, args, folder)
    r = {"model": name, "mode": args.compile, "hand": hand, "hand_compiled": chand,
         "hand_compiled_first_epoch_s": first, "fit": fit, "fit_compiled": cold["fit"],
         "fit_compiled_warm": warm["fit"], "cold": cold, "warm": warm,
         "fit_compiled_over_hand_compiled": cold["fit"] / chand,
         "fit_compiled_over_fit": cold["fit"] / fit,
         "warm_over_cold_compile_s": warm["compile_s"] / max(cold["compile_s"], 1e-9)}
    print(f"{name} ({args.compile}): hand {hand:,.0f} img/s | hand compiled {chand:,.0f} (first "
          f"epoch {first:.1f} s) | fit {fit:,.0f} | fit compiled {cold['fit']:,.0f} | "
          f"fit compiled/hand compiled {r['fit_compiled_over_hand_compiled']:.2f} | fit "
          f"compiled/fit {r['fit_compiled_over_fit']:.2f} || first epoch cold "
          f"{cold['first_epoch_s']:.1f} s (compiling {cold['compile_s']:.1f} s), warm "
          f"{warm['first_epoch_s']:.1f} s (compiling {warm['compile_s']:.1f} s, "
          f"{r['warm_over_cold_compile_s']:.2f} of cold; cache hits FX {warm['fxgraph_hit']}, "
          f"AOTAutograd {warm['autograd_hit']})  (load {'%.2f %.2f %.2f' % os.getloadavg()})",
          flush=True)
    return r


def hand_predict(step: Step, ds, args, dev):
    import torch

    model = step.model.eval()
    outs = []
    with torch.no_grad(), step.autocast:
        for x, _ in loader(ds, args.batch, args.workers, dev, shuffle=False):
            outs.append(torch.softmax(model(step.normalise(x.to(dev, non_blocking=True))).float(), 1))
    return torch.cat(outs).cpu().numpy()


def timed(fn, reps: int) -> tuple[float, object]:
    """Median seconds of ``reps`` calls of ``fn`` after one warm-up call, and its last result."""
    out = fn()
    seconds = []
    for _ in range(reps):
        t0 = time.perf_counter()
        out = fn()
        seconds.append(time.perf_counter() - t0)
    return statistics.median(seconds), out


def bench_model(name: str, ds, args, dev, precision: str, rep: int) -> dict:
    ceiling = run_ceiling(name, ds, args, dev, precision)
    if rep % 2 == 0:
        hand, step = run_hand(name, ds, args, dev, precision)
        fit, trainer = run_fit(name, ds, args)
    else:
        fit, trainer = run_fit(name, ds, args)
        hand, step = run_hand(name, ds, args, dev, precision)
    hs, hand_preds = timed(lambda: hand_predict(step, ds, args, dev), args.predict_reps)
    ps, preds = timed(lambda: trainer.predict(ds, cores=1), args.predict_reps)
    r = {"model": name, "ceiling": ceiling, "hand": hand, "fit": fit, "fit_over_hand": fit / hand,
         "predict": len(ds) / ps, "hand_predict": len(ds) / hs, "predict_over_hand": hs / ps,
         "predict_shape": list(preds.shape), "hand_predict_shape": list(hand_preds.shape)}
    print(f"{name}: ceiling {ceiling:,.0f} img/s | hand {hand:,.0f} | fit {fit:,.0f} | fit/hand "
          f"{r['fit_over_hand']:.2f} || predict {r['predict']:,.0f} img/s | hand inference "
          f"{r['hand_predict']:,.0f} | predict/hand {r['predict_over_hand']:.2f}  "
          f"(load {'%.2f %.2f %.2f' % os.getloadavg()})", flush=True)
    return r


def _allreduce_seconds(numel: int, reps: int = 20) -> dict:
    """In every replica: the median seconds of an all-reduce of ``numel`` float32 values."""
    import torch

    from xla_utils import runtime

    dev = runtime.device()
    x = torch.ones(numel, device=dev)
    seconds = []
    for i in range(reps + 3):
        sync(dev)
        t0 = time.perf_counter()
        runtime.all_reduce(x)
        sync(dev)
        if i >= 3:
            seconds.append(time.perf_counter() - t0)
    return {"world": runtime.world_size(), "seconds": statistics.median(seconds)}


def bench_scaling(name: str, ds, args, replicas: int) -> dict:
    """``fit`` on one device and on all ``replicas`` at the same per-device batch, and the
    all-reduce time of the model's gradients on all of them."""
    import xla_utils

    one = run_fit(name, ds, args, cores=1)[0]
    every = run_fit(name, ds, args, cores="all")[0]
    numel = sum(p.numel() for p in make_model(name).parameters())
    reduce = xla_utils.launch(_allreduce_seconds, numel)
    r = {"model": name, "replicas": replicas, "fit_1": one, "fit_all": every,
         "efficiency": every / (replicas * one), "params": numel,
         "allreduce_ms": 1e3 * reduce["seconds"], "allreduce_world": reduce["world"]}
    print(f"{name}: fit cores=1 {one:,.0f} img/s | cores='all' ({replicas}) {every:,.0f} img/s "
          f"| efficiency {r['efficiency']:.2f} | all-reduce of {numel / 1e6:.1f} M float32 "
          f"{r['allreduce_ms']:.1f} ms on {reduce['world']} (load "
          f"{'%.2f %.2f %.2f' % os.getloadavg()})", flush=True)
    return r


def build(args) -> Path:
    """The rendered cache: ``--cache`` when it already holds one, else built there (or in a
    temporary folder)."""
    from xla_utils import build_cache

    out = Path(args.cache) if args.cache else Path(tempfile.mkdtemp(prefix="bench_gpu_")) / "cache"
    if not (out / "manifest.json").exists():
        t0 = time.perf_counter()
        build_cache(Rendered(args.images, args.image), out, size=args.image, verbose=False)
        print(f"built {args.images:,} rendered {args.image}x{args.image} images into {out} in "
              f"{time.perf_counter() - t0:.1f} s", flush=True)
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=None,
                   help="torchvision model names or timm:<name> (default resnet18,resnet50; "
                        "with --compile ResNet-50, ConvNeXt-T, ViT-S, EfficientNet-B0)")
    p.add_argument("--image", type=int, default=224, help="image side in pixels")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--images", type=int, default=12288, help="images in the rendered cache")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--workers", type=int, default=8, help="the hand loop's DataLoader processes")
    p.add_argument("--fit-workers", type=int, default=None,
                   help="the trainer's num_workers (default: its automatic choice)")
    p.add_argument("--predict-reps", type=int, default=2, help="timed calls after the warm-up one")
    p.add_argument("--reps", type=int, default=1, help="rounds (hand and fit alternate order)")
    p.add_argument("--cache", default=None, help="folder of the rendered cache (reused when built)")
    p.add_argument("--wheels", default=None,
                   help="a folder of wheels (fastprogress, cloudpickle) or packages to import from")
    p.add_argument("--json", default=None, help="write every figure there")
    p.add_argument("--gpus", choices=("1", "all"), default="1",
                   help="all: fit's scaling over every GPU (cores=1 against cores='all')")
    p.add_argument("--compile", nargs="?", const="default", default=None, metavar="MODE",
                   help="issue 45: compiled hand loop and fit(compile=MODE), cold and warm "
                        "(default mode 'default'; default models: ResNet-50, timm ConvNeXt-T, "
                        "ViT-S, EfficientNet-B0)")
    p.add_argument("--compile-backend", default="inductor",
                   help="torch.compile backend of --compile (aot_eager: a CPU rehearsal)")
    for hidden in ("--child-fit", "--child-cache", "--child-out"):  # fresh_fit's child
        p.add_argument(hidden, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.models = args.models or (COMPILE_MODELS if args.compile else "resnet18,resnet50")
    sys.path.insert(0, str(ROOT))
    if args.wheels:
        sys.path[1:1] = [str(w) for w in sorted(Path(args.wheels).glob("*.whl"))] + [args.wheels]

    import torch

    from xla_utils import CachedImageDataset

    if args.child_fit:
        return fit_child(args)
    dev, precision, where = device_facts()
    args.cache = str(build(args))
    ds = CachedImageDataset(args.cache)
    print(f"{where}: torch {torch.__version__}, precision {precision}; {len(ds):,} images "
          f"{args.image}x{args.image}, batch {args.batch}, {args.epochs} epochs; hand loop "
          f"DataLoader with {args.workers} workers", flush=True)
    if args.compile is not None:
        results = [bench_compile(m.strip(), ds, args, dev, precision)
                   for m in args.models.split(",")]
    elif args.gpus == "all":
        from xla_utils.runtime import torch_devices

        replicas = torch_devices().count
        results = [bench_scaling(m.strip(), ds, args, replicas)
                   for _ in range(args.reps) for m in args.models.split(",")]
    else:
        results = [bench_model(m.strip(), ds, args, dev, precision, rep)
                   for rep in range(args.reps) for m in args.models.split(",")]
    summary = {"device": where, "torch": torch.__version__, "precision": precision,
               "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
               "args": vars(args), "results": results}
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))
    return summary


if __name__ == "__main__":
    main()
