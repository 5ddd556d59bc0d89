"""Per-step cost of the issue 18 options (EMA, mixup/cutmix/label smoothing) in one process.

A training step (forward, backward, ``xm.optimizer_step``, the option, one sync) on one
XLA:CPU device, for the plain step and each option, run in interleaved rounds in one
process (no fork, no loader: the option's own cost). Prints per variant the median CPU
time per step of this process (steadier than wall time on a shared machine), steps/s, the
overhead against the plain step, XLA's own execution time per step (its ``ExecuteTime``
metric: the device's work; the rest of the wall time is the host's), and the host time
spent tracing the option alone.

    PJRT_DEVICE=CPU python scripts/bench_options_step.py [--model small|mlp|resnet] \\
        [--variants plain,ema,mix,mixup,cutmix,ls,timm-ema,timm-mixup] [--rounds 7] [--steps 60] \\
        [--shift K] [--old-mixup FILE]

Variants: ``ema`` (ema=0.999), ``mix`` (mixup=0.2, cutmix=1.0, label_smoothing=0.1),
``mixup`` / ``cutmix`` (one of them, smoothing 0.1), ``ls`` (label_smoothing=0.1 only);
baselines (timm installed): ``timm-ema`` (timm's ``ModelEmaV3(0.999, use_warmup=True)``)
and ``timm-mixup`` (timm's ``Mixup(mixup_alpha=0.2, label_smoothing=0.1)``), timm's own
code in the same step, so ``ema`` vs ``timm-ema`` is what xla_utils adds to the work itself.
``--old-mixup FILE`` (another version of xla_utils/train/mixup.py, e.g. from ``git show
REV:xla_utils/train/mixup.py > FILE``) adds ``old-<v>`` variants with that file's ``DeviceMix``
beside each mixing variant, before and after in one process. Each option's IR nodes per
step (what torch_xla traces and hashes on the host every step) are printed too.
Like scripts/bench_trainer.py this script calls torch_xla itself: it times the
library's device-side pieces (xla_utils.train.ema.DeviceEMA, xla_utils.train.mixup.DeviceMix) inside
a hand-written step.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_trainer  # noqa: E402  (its make_model, so --model means the same networks)

MIX = {"mix": (0.2, 1.0), "mixup": (0.2, 0.0), "cutmix": (0.0, 1.0), "ls": (0.0, 0.0)}
TIMM = ("timm-ema", "timm-mixup")  # timm's own classes in the hand step: the work as timm does it


class Variant:
    """One model, optimizer and option, stepping on ``dev`` over a few fixed device batches."""

    def __init__(self, name: str, dev, batches, old_mix=None):
        import torch

        from xla_utils.train.ema import DeviceEMA
        from xla_utils.train.mixup import DeviceMix, MixConfig

        torch.manual_seed(0)
        self.name, self.dev, self.batches, self.i = name, dev, batches, 0
        self.model = bench_trainer.make_model().to(dev)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9)
        self.ema = DeviceEMA(bench_trainer.make_model(), 0.999, 0, dev) if name == "ema" else None
        base = name[4:] if name.startswith("old-") else name
        make = old_mix if name.startswith("old-") else DeviceMix
        self.mix = make(MixConfig(*MIX[base], 0.1, bench_trainer.CLASSES), dev) \
            if base in MIX else None
        if name == "timm-ema":
            self.ema = TimmEMA(bench_trainer.make_model(), 0.999, dev)
        elif name == "timm-mixup":
            self.mix = TimmMixup(0.2, 0.1, bench_trainer.CLASSES)
        self.loss = torch.nn.CrossEntropyLoss()
        self.cpu_ms: list[float] = []
        self.exec_ms: list[float] = []  # XLA's ExecuteTime per step (device work on XLA:CPU)
        self.nodes = 0

    def step(self) -> None:
        import torch_xla
        import torch_xla.core.xla_model as xm

        x, y = self.batches[self.i % len(self.batches)]
        self.i += 1
        if self.mix is not None:
            if hasattr(self.mix, "prepare"):  # as the trainer's loop: before the step's ops
                self.mix.prepare()
            x, y = self.mix(x, y)
        for g in self.opt.param_groups:  # a changing LR, as the one-cycle schedule
            g["lr"] = 0.01 + 1e-5 * (self.i % 100 + 1)
        self.opt.zero_grad(set_to_none=True)
        self.loss(self.model(x), y).backward()
        xm.optimizer_step(self.opt)
        if self.ema is not None:
            self.ema.update(self.model)
        torch_xla.sync()

    def rate(self, n: int) -> float:
        """Steps/s over ``n`` steps (device drained before and after)."""
        import torch_xla.core.xla_model as xm
        import torch_xla.debug.metrics as met

        def executed_ns() -> float:
            d = met.metric_data("ExecuteTime")
            return d[1] if d else 0.0

        xm.wait_device_ops()
        t0, c0, e0 = time.perf_counter(), time.process_time(), executed_ns()
        for _ in range(n):
            self.step()
        xm.wait_device_ops()
        self.cpu_ms.append(1000 * (time.process_time() - c0) / n)
        self.exec_ms.append((executed_ns() - e0) / 1e6 / n)
        return n / (time.perf_counter() - t0)

    def trace_ms(self, n: int = 50) -> float:
        """Median host time to trace the option alone (no execution counted)."""
        import torch_xla

        x, y = self.batches[0]
        ts = []
        for _ in range(n):
            if self.mix is not None and hasattr(self.mix, "prepare"):
                self.mix.prepare()  # its own graph, once per chunk: not the step's tracing
            t0 = time.perf_counter()
            if self.mix is not None:
                keep = self.mix(x, y)
            elif self.ema is not None:
                self.ema.update(self.model)
                keep = None
            else:
                keep = None
            ts.append(time.perf_counter() - t0)
            if keep is not None:
                self.nodes = graph_nodes(keep)
            torch_xla.sync()
            del keep
        return 1000 * statistics.median(ts)


class TimmEMA:
    """timm's own ``ModelEmaV3(decay, use_warmup=True)`` in the hand-written step: what a user
    adding it to a torch_xla loop gets (``_foreach_lerp_`` with the host's decay as a
    Python float, which torch_xla sends to the device each step). Built on the host copy
    and moved, since timm 1.0's constructor makes a ``torch.Generator`` on the model's
    device, which XLA refuses."""

    def __init__(self, model, decay: float, dev):
        from timm.utils.model_ema import ModelEmaV3

        self.timm = ModelEmaV3(model, decay=decay, use_warmup=True)
        self.timm.module.to(dev)
        self.n = 0

    def update(self, model) -> None:
        self.n += 1
        self.timm.update(model, step=self.n)


class TimmMixup:
    """timm's own ``Mixup(mixup_alpha, cutmix_alpha=0, label_smoothing)`` in the hand-written
    step (the host draws lam with NumPy; torch_xla sends it to the device each step). It
    blends ``x`` in place, so it gets a copy of the (reused) batch. Not with cutmix: its box
    is cut with host integers, a new graph shape almost every step."""

    def __init__(self, alpha: float, smoothing: float, classes: int):
        from timm.data import Mixup

        self.timm = Mixup(mixup_alpha=alpha, cutmix_alpha=0.0, label_smoothing=smoothing,
                          num_classes=classes)

    def __call__(self, x, y):
        return self.timm(x.clone(), y)


def graph_nodes(tensors) -> int:
    """IR nodes of the pending graph of ``tensors`` (device data and constants included)."""
    import torch_xla

    text = torch_xla._XLAC._get_xla_tensors_text(list(tensors))
    return sum(1 for line in text.splitlines() if line.lstrip().startswith("%"))


def load_old_mix(path: str):
    """``DeviceMix`` of another version of xla_utils/train/mixup.py (imported inside the package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("xla_utils._mixup_old", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod.DeviceMix


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=bench_trainer.MODELS, default="small")
    ap.add_argument("--variants", default="plain,ema,mix")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--shift", type=int, default=0,
                    help="build the variants' models starting at this position of --variants "
                         "(vary it across processes: the build order can favour one variant)")
    ap.add_argument("--old-mixup", default=None,
                    help="another mixup.py: adds old-<variant> beside each mixing variant")
    args = ap.parse_args(argv)
    names = [v for v in args.variants.split(",") if v]
    if names[0] != "plain" or set(names) - {"plain", "ema", *MIX, *TIMM}:
        ap.error(f"--variants: 'plain' first, then any of ema, {', '.join(MIX)}, "
                 f"{', '.join(TIMM)}")
    if set(names) & set(TIMM):
        try:
            import timm  # noqa: F401
        except ImportError:
            ap.error(f"--variants {','.join(set(names) & set(TIMM))}: timm is not installed "
                     "(pip install timm)")
    old_mix = None
    if args.old_mixup:
        old_mix = load_old_mix(args.old_mixup)
        names = [m for n in names for m in ((f"old-{n}", n) if n in MIX else (n,))]
    bench_trainer.MODEL = args.model
    import torch
    import torch_xla
    import torch_xla.core.xla_model as xm

    dev = torch_xla.device()
    xm.set_rng_state(0, device=dev)
    g = torch.Generator().manual_seed(0)
    size = (args.batch, 3, bench_trainer.IMAGE, bench_trainer.IMAGE)
    batches = [(xm.send_cpu_data_to_device(torch.randn(size, generator=g), dev)[0],
                xm.send_cpu_data_to_device(
                    torch.randint(0, bench_trainer.CLASSES, (args.batch,), generator=g), dev)[0])
               for _ in range(4)]
    # Built in rotated order (--shift): a model instance keeps a speed of its own, and the
    # order of construction can favour one variant in every process.
    first = args.shift % len(names)
    built = {n: Variant(n, dev, batches, old_mix) for n in names[first:] + names[:first]}
    runs = {n: built[n] for n in names}
    for r in runs.values():  # compile
        for _ in range(3):
            r.step()
    rates: dict[str, list[float]] = {n: [] for n in names}
    print("start: load %.2f %.2f %.2f" % os.getloadavg(), flush=True)
    for k in range(args.rounds):
        for n in (names if k % 2 == 0 else names[::-1]):
            rates[n].append(runs[n].rate(args.steps))
    print("end: load %.2f %.2f %.2f; model %s, batch %d, %d rounds x %d steps; built from %s"
          % (*os.getloadavg(), args.model, args.batch, args.rounds, args.steps, names[first]))
    base_cpu = statistics.median(runs["plain"].cpu_ms)
    base_rate = statistics.median(rates["plain"])
    base_exec = statistics.median(runs["plain"].exec_ms)
    for n in names:
        cpu, rate = statistics.median(runs[n].cpu_ms), statistics.median(rates[n])
        ex = statistics.median(runs[n].exec_ms)
        trace = ""
        if n != "plain":
            trace = f"; tracing the option alone {runs[n].trace_ms():.3f} ms"
            if runs[n].mix is not None:
                trace += f", {runs[n].nodes} IR nodes"
        print(f"{n:10s} CPU {cpu:7.2f} ms/step ({cpu / base_cpu - 1:+6.1%}), {rate:7.1f} steps/s "
              f"({base_rate / rate - 1:+6.1%} by wall time), XLA execution {ex:6.2f} ms/step "
              f"({ex / base_exec - 1:+6.1%}){trace}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
