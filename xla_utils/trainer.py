"""One-cycle training on every TPU core, plus the single-core debug loop.

``OneCycleTrainer(model, loss, train_data, val_data, batch_size=32, ...).fit()``
launches one replica per core through :func:`xla_utils.runtime.launch` (fork,
so models and functions defined in a notebook work), scales the LR by the world
size, drives LR and momentum with :class:`~xla_utils.schedule.OneCycleSchedule`
every optimizer step, and returns a :class:`History` to the notebook.

The step loop owns its step boundary: each step is forward, backward,
``runtime.optimizer_step`` (gradients averaged over replicas) and one
``runtime.sync()``. The loss is accumulated on the device and read only every
``log_every`` steps; validation metrics are device sums reduced once per pass.
Every rank gets the same number of full batches (training drops the ragged
tail of the global shuffle; validation pads and masks), so after the first
epoch nothing compiles again.
"""
from __future__ import annotations

import copy
import dataclasses
import math
import os
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from . import runtime
from .data import IMAGENET_MEAN, IMAGENET_STD, images_to_float, is_image_batch, iterate_batches
from .metrics import MetricAccumulator, resolve_metrics
from .optim import make_optimizer
from .schedule import OneCycleSchedule

__all__ = ["TrainerConfig", "OneCycleTrainer", "History", "DebugReport", "debug_run",
           "scale_lr"]

LR_SCALING = ("linear", "sqrt", "none")


@dataclass
class TrainerConfig:
    """Hyper-parameters of :class:`OneCycleTrainer` (all keyword arguments of it).

    batch_size: samples per core per step (global batch = batch_size x cores). Default 32.
    epochs: passes over the training data. Default 1.
    max_lr: peak LR for ONE core at ``batch_size`` (scaled by ``lr_scaling``), or
        ``"find"`` to run the LR finder first. Default 1e-3.
    optimizer: ``"sgd"`` (momentum), ``"adam"``, ``"adamw"`` or a callable
        ``f(params, lr=..., weight_decay=...)``. Default ``"adamw"``.
    weight_decay: default 0.0 (AdamW: decoupled).
    pct_start, div_factor, final_div_factor, moms: one-cycle shape (torch
        ``OneCycleLR`` defaults 0.3, 25, 1e4; momentum/beta1 0.95 -> 0.85 -> 0.95).
    lr_scaling: how ``max_lr`` grows with the number of cores k: ``"linear"``
        (x k, Goyal et al. 2017), ``"sqrt"`` (x sqrt k) or ``"none"``. Default
        None = linear for SGD, sqrt for Adam/AdamW and callables.
    bf16: run forward/backward under ``torch.autocast(dtype=bfloat16)``. Default False.
    metrics: validation metrics (``"accuracy"``, ``"top5"``/``"top<k>"``, ``"f1"``);
        None = accuracy (+top5 above 10 classes), F1 for multi-label data.
    checkpoint_dir: write ``epoch_<n>.pt`` after every epoch and ``final.pt`` at the
        end; None = no files. keep_checkpoints: epoch files kept (default 2).
    seed: seeds data order and device RNG (flips, dropout). Default 0.
    flip: random horizontal flip of uint8 image batches on the device. Default True.
    mean, std: per-channel normalisation of uint8 images, in 0..1 units (ImageNet).
    log_every: steps between loss reads for the progress bar (default 20; each
        read waits for the device).
    num_workers: host threads/processes assembling batches (None = automatic).
    """

    batch_size: int = 32
    epochs: int = 1
    max_lr: float | str = 1e-3
    optimizer: str | Callable[..., torch.optim.Optimizer] = "adamw"
    weight_decay: float = 0.0
    pct_start: float = 0.3
    div_factor: float = 25.0
    final_div_factor: float = 1e4
    moms: tuple[float, float, float] | None = (0.95, 0.85, 0.95)
    lr_scaling: str | None = None
    bf16: bool = False
    metrics: Sequence[str] | None = None
    checkpoint_dir: str | os.PathLike | None = None
    keep_checkpoints: int = 2
    seed: int = 0
    flip: bool = True
    mean: tuple[float, float, float] = IMAGENET_MEAN
    std: tuple[float, float, float] = IMAGENET_STD
    log_every: int = 20
    num_workers: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise ValueError(f"batch_size must be a positive int (per core), got {self.batch_size!r}")
        if not isinstance(self.epochs, int) or self.epochs < 1:
            raise ValueError(f"epochs must be a positive int, got {self.epochs!r}")
        if self.max_lr != "find" and not (isinstance(self.max_lr, (int, float)) and self.max_lr > 0):
            raise ValueError(f"max_lr must be a positive number or 'find', got {self.max_lr!r}")
        if self.lr_scaling is not None and self.lr_scaling not in LR_SCALING:
            raise ValueError(f"lr_scaling must be one of {LR_SCALING} or None, got {self.lr_scaling!r}")
        if self.log_every < 1:
            raise ValueError("log_every must be >= 1")

    @property
    def scaling_rule(self) -> str:
        if self.lr_scaling is not None:
            return self.lr_scaling
        return "linear" if self.optimizer == "sgd" else "sqrt"


def scale_lr(lr: float, world_size: int, rule: str) -> float:
    """``lr`` for ``world_size`` cores under ``rule`` (linear, sqrt or none)."""
    factor = {"linear": world_size, "sqrt": math.sqrt(world_size), "none": 1.0}[rule]
    return lr * factor


@dataclass
class History:
    """What :meth:`OneCycleTrainer.fit` returns.

    ``epochs`` holds one dict per epoch: ``epoch``, ``train_loss``, ``val_loss`` and
    validation metrics (when ``val_data`` was given), ``lr_max`` (peak LR used),
    ``lr_last`` (LR of the epoch's last step), ``images_per_s`` (global, this
    epoch including any compilation), ``compiles`` (XLA compilations so far in
    the run, cumulative), ``host_reads_per_step`` (device->host transfers per
    training step in this process, all its replicas together: the progress-bar
    loss reads), ``seconds``. ``state_dict`` is the final model state on the CPU.
    """

    epochs: list[dict[str, Any]]
    world_size: int
    global_batch: int
    base_lr: float
    max_lr: float
    lr_scaling: str
    lr_note: str
    backend: str
    state_dict: dict[str, torch.Tensor] = field(repr=False, default_factory=dict)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.epochs[i]

    def __len__(self) -> int:
        return len(self.epochs)

    def table(self) -> str:
        """The per-epoch history as an aligned text table."""
        if not self.epochs:
            return "(no epochs)"
        keys = [k for k in self.epochs[-1] if k != "epoch"]
        head = ["epoch"] + keys
        rows = [[str(e["epoch"])] + [_fmt(e.get(k)) for k in keys] for e in self.epochs]
        widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
        lines = ["  ".join(h.rjust(w) for h, w in zip(head, widths))]
        lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
        return "\n".join(lines)

    def __str__(self) -> str:
        cores = f"{self.world_size} core{'s' if self.world_size > 1 else ''}"
        return (f"{cores} x {self.global_batch // self.world_size} = {self.global_batch} global "
                f"batch, max_lr {self.max_lr:.3g} (from {self.base_lr:.3g}: {self.lr_note}), "
                f"backend {self.backend}\n" + self.table())


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return "-" if v is None else str(v)


def _default_train_step(model: torch.nn.Module, batch: tuple, loss_fn: Callable) -> torch.Tensor:
    x, y = batch
    return loss_fn(model(x), y)


def _default_eval_step(model: torch.nn.Module, batch: tuple) -> torch.Tensor:
    x, _ = batch
    return model(x)


class OneCycleTrainer:
    """Train ``model`` with the one-cycle policy on all TPU cores.

    Parameters
    ----------
    model:
        An ``nn.Module`` or a zero-argument factory returning one. It is created
        once, here in the calling process (seeded with ``seed``), and every
        replica starts from exactly these weights.
    loss:
        ``loss(outputs, targets) -> scalar`` (e.g. ``nn.CrossEntropyLoss()``;
        ``nn.BCEWithLogitsLoss()`` for multi-label). Validation uses its
        per-sample form (``reduction="none"``) when it has one.
    train_data, val_data:
        A :class:`~xla_utils.data.CachedImageDataset` (uint8 batches, normalised
        and flipped on the device) or any map-style dataset returning
        ``(input, target)``.
    train_step:
        Optional hook ``train_step(model, (x, y), loss) -> loss tensor`` for
        other problem types. ``eval_step(model, (x, y)) -> outputs`` likewise.
    **config:
        Any field of :class:`TrainerConfig` (batch_size, epochs, max_lr, ...).
    """

    def __init__(self, model: torch.nn.Module | Callable[[], torch.nn.Module], loss: Callable,
                 train_data, val_data=None, *, train_step: Callable | None = None,
                 eval_step: Callable | None = None, **config: Any):
        try:
            self.config = TrainerConfig(**config)
        except TypeError as exc:
            names = [f.name for f in dataclasses.fields(TrainerConfig)]
            raise TypeError(f"{exc}; OneCycleTrainer options are {names}") from None
        if isinstance(model, torch.nn.Module):
            self.model = model
        elif callable(model):
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(self.config.seed)
                self.model = model()
            if not isinstance(self.model, torch.nn.Module):
                raise TypeError(f"model factory returned {type(self.model).__name__}, not nn.Module")
        else:
            raise TypeError("model must be an nn.Module or a zero-argument factory")
        self.loss = loss
        self.train_data = train_data
        self.val_data = val_data
        self.train_step = train_step or _default_train_step
        self.eval_step = eval_step or _default_eval_step
        self.lr_finder_result = None

    # ------------------------------------------------------------------ API
    def find_lr(self, simulate: int | None = None, **kwargs: Any):
        """Run :func:`xla_utils.lr_find` on one core with this trainer's model,
        loss, data, per-core batch size, optimizer and image normalisation; the
        result is also kept in ``self.lr_finder_result``. Extra keywords go to
        ``lr_find`` (e.g. ``accum_steps=8`` to answer for an 8-core run)."""
        from .lr_finder import lr_find

        cfg = self.config
        kwargs.setdefault("batch_tfm", lambda x: self._prepare(x, train=False))
        self.lr_finder_result = lr_find(self.model, self.loss, self.train_data, cfg.batch_size,
                                        optimizer=cfg.optimizer, weight_decay=cfg.weight_decay,
                                        seed=cfg.seed, simulate=simulate, **kwargs)
        return self.lr_finder_result

    def fit(self, *, cores: int | str = "all", simulate: int | None = None,
            max_lr: float | str | None = None, resume: str | os.PathLike | None = None,
            debug: bool = False, timeout: float | None = None) -> "History | DebugReport":
        """Train on all cores (``cores="all"``) or one (``cores=1``).

        ``simulate=N`` runs N simulated XLA:CPU cores (no TPU needed). ``max_lr``
        overrides the configured one (``"find"`` runs the LR finder first).
        ``resume`` is a checkpoint written by an earlier fit: training continues
        at the next epoch with the same schedule. ``debug=True`` runs
        :func:`debug_run` instead (one core, a few steps, XLA report).
        After training ``self.model`` holds the final weights.
        """
        if debug:
            return debug_run(self.model, self.loss, self.train_data,
                             batch_size=self.config.batch_size, optimizer=self.config.optimizer,
                             train_step=self.train_step,
                             prepare=lambda x: self._prepare(x, train=False))
        cfg = self.config
        base_lr = cfg.max_lr if max_lr is None else max_lr
        lr_world = 1  # the world size base_lr is meant for
        ckpt = None
        if resume is not None:
            ckpt = _load_checkpoint(resume)
            self.model.load_state_dict(ckpt["model"])
            base_lr, lr_world = ckpt["base_lr"], ckpt.get("lr_world", 1)
        elif base_lr == "find":
            # Measure at the run's own global batch: k accumulated micro-batches
            # of the per-core batch are exactly one k-core step's gradient, so
            # the answer needs no scaling rule on top of the finder's rule.
            lr_world = _planned_world_size(cores, simulate)
            res = self.find_lr(simulate=1 if simulate is not None else None, accum_steps=lr_world,
                               epochs=cfg.epochs)
            base_lr = res.suggestion
            if not math.isfinite(base_lr):
                raise RuntimeError(f"lr_find gave no suggestion (stopped: {res.stop_reason}); "
                                   "pass max_lr=<number> or look at trainer.lr_finder_result.plot()")
            print(f"lr_find suggests max_lr {base_lr:.3g} for the global batch {res.batch_size} "
                  f"({cfg.batch_size} x {lr_world} micro-batches on one core, rule {res.rule}, "
                  f"run of {res.planned_steps} steps).", flush=True)
            if not res.confident:
                warnings.warn(f"fit(max_lr='find'): {res.warning}. Training with max_lr "
                              f"{base_lr:.3g} anyway; check trainer.lr_finder_result.plot() and "
                              "pass fit(max_lr=<number>)", RuntimeWarning, stacklevel=2)
        if not (isinstance(base_lr, (int, float)) and base_lr > 0):
            raise ValueError(f"max_lr must be a positive number or 'find', got {base_lr!r}")
        out = runtime.launch(self._replica, float(base_lr), lr_world, ckpt, cores=cores,
                             simulate=simulate, timeout=timeout)
        self.model.load_state_dict(out.state_dict)
        return out

    # ------------------------------------------------------------- replica
    def _replica(self, base_lr: float, lr_world: int, ckpt: dict | None) -> History:
        cfg = self.config
        ws, rk, dev = runtime.world_size(), runtime.rank(), runtime.device()
        model = self.model
        if runtime.is_simulated() or runtime.backend() == "torch":
            # Threads share one Python object (and in-process we keep the
            # caller's model untouched until success): give each replica its own.
            model = copy.deepcopy(model)
        model = model.to(dev)
        rule = cfg.scaling_rule
        # base_lr is for lr_world cores (1, or the world lr_find measured for)
        max_lr = scale_lr(base_lr, ws, rule) / scale_lr(1.0, lr_world, rule)
        how = f"{rule} scaling" if lr_world == 1 else \
            f"measured by lr_find for {lr_world} cores, {rule} scaling beyond"
        runtime.master_print(
            f"{ws} core{'s' if ws > 1 else ''} x {cfg.batch_size} per core = "
            f"{ws * cfg.batch_size} global batch; max_lr {base_lr:.3g} x "
            f"{max_lr / base_lr:.3g} = {max_lr:.3g} ({how})")
        opt = make_optimizer(cfg.optimizer, model.parameters(), lr=max_lr / cfg.div_factor,
                             weight_decay=cfg.weight_decay)

        def batches(data, epoch: int, train: bool):
            return iterate_batches(data, cfg.batch_size, world_size=ws, rank=rk, shuffle=train,
                                   seed=cfg.seed, epoch=epoch, drop_last=train,
                                   num_workers=cfg.num_workers)

        steps_per_epoch = len(batches(self.train_data, 0, True))
        sched = OneCycleSchedule(total_steps=cfg.epochs * steps_per_epoch, max_lr=max_lr,
                                 pct_start=cfg.pct_start, div_factor=cfg.div_factor,
                                 final_div_factor=cfg.final_div_factor, moms=cfg.moms)
        history: list[dict[str, Any]] = []
        start_epoch = 0
        if ckpt is not None:
            if (ckpt["world_size"], ckpt["steps_per_epoch"]) != (ws, steps_per_epoch):
                raise ValueError(
                    f"checkpoint was written with {ckpt['world_size']} cores and "
                    f"{ckpt['steps_per_epoch']} steps/epoch; this run has {ws} and "
                    f"{steps_per_epoch}: the one-cycle schedule would not continue exactly")
            opt.load_state_dict(ckpt["optimizer"])
            start_epoch, history = ckpt["epoch"], list(ckpt["history"])
        autocast = torch.autocast(device_type=dev.type, dtype=torch.bfloat16, enabled=cfg.bf16)
        master_bar, progress_bar = runtime.progress_bars()
        mb = master_bar(range(start_epoch, cfg.epochs)) if runtime.is_master() else None
        step = start_epoch * steps_per_epoch
        for epoch in (mb if mb is not None else range(start_epoch, cfg.epochs)):
            runtime.set_seed(cfg.seed * 1_000_003 + epoch * 1_009 + rk)
            model.train()
            t0 = time.perf_counter()
            to_host0 = runtime.metrics()["to_host"]
            # Device data, not torch.zeros(device=xla): a zeros *op* would make
            # each epoch's first step a different graph (one recompile).
            loss_sum = runtime.to_device(torch.zeros(()), dev)
            lr_last = sched.lr(step)
            it = runtime.device_prefetch(batches(self.train_data, epoch, True))
            pb = progress_bar(range(steps_per_epoch), parent=mb) if mb is not None else None
            for i, (x, y, _valid) in zip(pb if pb is not None else range(steps_per_epoch), it):
                x = self._prepare(x, train=True)
                lr_last = sched.apply(opt, step)
                opt.zero_grad(set_to_none=True)
                with autocast:
                    loss = self.train_step(model, (x, y), self.loss)
                loss.backward()
                runtime.optimizer_step(opt)
                loss_sum = loss_sum + loss.detach().float()
                runtime.sync()
                step += 1
                if pb is not None and ((i + 1) % cfg.log_every == 0 or i + 1 == steps_per_epoch):
                    seen = (i + 1) * cfg.batch_size * ws
                    pb.comment = (f"loss {float(loss_sum.cpu()) / (i + 1):.4f}  "
                                  f"{seen / (time.perf_counter() - t0):.0f} img/s")
            to_host = runtime.metrics()["to_host"] - to_host0
            train_loss = runtime.all_reduce(float(loss_sum.cpu()) / steps_per_epoch, op="mean")
            seconds = time.perf_counter() - t0
            record: dict[str, Any] = {"epoch": epoch + 1, "train_loss": train_loss}
            if self.val_data is not None:
                val = self._evaluate(model, dev, batches(self.val_data, epoch, False), autocast)
                record.update({"val_loss": val.pop("loss")}, **val)
            record.update(lr_max=max_lr, lr_last=lr_last,
                          images_per_s=steps_per_epoch * cfg.batch_size * ws / seconds,
                          compiles=runtime.metrics()["compiles"],
                          host_reads_per_step=to_host / steps_per_epoch, seconds=seconds)
            history.append(record)
            if mb is not None:
                mb.write(_epoch_line(record))
            if cfg.checkpoint_dir is not None:
                self._checkpoint(model, opt, epoch + 1, history, base_lr, lr_world, ws,
                                 steps_per_epoch)
        state = model.state_dict()
        if cfg.checkpoint_dir is not None:
            runtime.save(state, Path(cfg.checkpoint_dir) / "final.pt")
        return History(epochs=history, world_size=ws, global_batch=ws * cfg.batch_size,
                       base_lr=base_lr, max_lr=max_lr, lr_scaling=rule, lr_note=how,
                       backend=runtime.backend(), state_dict=state)

    def _prepare(self, x: torch.Tensor, train: bool) -> torch.Tensor:
        if is_image_batch(x):
            cfg = self.config
            return images_to_float(x, cfg.mean, cfg.std, flip=train and cfg.flip)
        return x

    def _evaluate(self, model, dev, val_batches, autocast) -> dict[str, float]:
        model.eval()
        acc = None
        with torch.no_grad():
            for x, y, valid in runtime.device_prefetch(val_batches):
                with autocast:
                    out = self.eval_step(model, (self._prepare(x, train=False), y))
                if acc is None:
                    multilabel = y.dtype.is_floating_point and y.dim() == 2
                    names = resolve_metrics(self.config.metrics, multilabel,
                                            out.shape[1] if out.dim() == 2 else None)
                    acc = MetricAccumulator(names, self.loss, dev)
                acc.update(out, y, valid)
                runtime.sync()
        if acc is None:
            raise ValueError("val_data yielded no batch")
        return acc.compute()

    def _checkpoint(self, model, opt, epoch: int, history, base_lr, lr_world, ws,
                    steps_per_epoch) -> None:
        cfg = self.config
        directory = Path(cfg.checkpoint_dir)
        state = {
            "model": model.state_dict(), "optimizer": opt.state_dict(), "epoch": epoch,
            "history": history, "base_lr": base_lr, "lr_world": lr_world, "world_size": ws,
            "steps_per_epoch": steps_per_epoch,
            "config": {k: v for k, v in dataclasses.asdict(cfg).items() if k != "optimizer"},
        }
        runtime.save(state, directory / f"epoch_{epoch:03d}.pt")
        if runtime.is_master():
            old = sorted(directory.glob("epoch_*.pt"))[:-cfg.keep_checkpoints]
            for p in old:
                p.unlink(missing_ok=True)


def _epoch_line(r: dict[str, Any]) -> str:
    parts = [f"epoch {r['epoch']}", f"train_loss {r['train_loss']:.4f}"]
    for k in ("val_loss", "accuracy", "f1"):
        if k in r:
            parts.append(f"{k} {r[k]:.4f}")
    parts += [f"{r['images_per_s']:.0f} img/s", f"{r['compiles']} compiles"]
    return "  ".join(parts)


def _planned_world_size(cores: int | str, simulate: int | None) -> int:
    """The world size a launch will have, found without touching the XLA runtime."""
    if cores == 1:
        return 1
    if simulate is not None:
        return simulate
    if runtime.backend() == "xla":
        from . import env

        return max(env.detect().num_devices or 1, 1)
    return 1


def _load_checkpoint(path: str | os.PathLike) -> dict:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    ckpt = torch.load(path, map_location="cpu", weights_only=False)
    missing = {"model", "optimizer", "epoch", "history", "base_lr", "world_size",
               "steps_per_epoch"} - set(ckpt)
    if missing:
        raise ValueError(f"{path} is not an xla_utils epoch checkpoint (missing {sorted(missing)}); "
                         "final.pt holds weights only: load it with model.load_state_dict")
    return ckpt


# ---------------------------------------------------------------------------
# Single-core debug mode
# ---------------------------------------------------------------------------
@dataclass
class DebugReport:
    """What :func:`debug_run` measured. ``per_step`` holds the counter deltas
    (compiles, executions, to_host, ...) of every step; ``report`` is the text."""

    backend: str
    steps: int
    losses: list[float]
    per_step: list[dict[str, Any]]
    fallback_ops: dict[str, int]
    report: str

    def __str__(self) -> str:
        return self.report


def debug_run(model: torch.nn.Module | Callable[[], torch.nn.Module], loss: Callable, data,
              batch_size: int = 8, steps: int = 5, optimizer: Any = "sgd", lr: float = 1e-3,
              train_step: Callable | None = None, prepare: Callable | None = None,
              print_report: bool = True) -> DebugReport:
    """Run a few plain training steps on ONE core and explain what XLA did.

    A plain ``torch.utils.data.DataLoader`` (no prefetch thread), and every step
    ends with ``xm.optimizer_step(opt, barrier=True)``, so an error surfaces at
    the step that caused it. Afterwards it reports compilations, graph
    executions, host transfers and CPU-fallback ops per step. It runs in a
    forked child (on a TPU, or on one XLA:CPU device when there is none), so the
    notebook can still launch all cores afterwards. ``steps`` default 5, ``lr``
    constant (default 1e-3), ``batch_size`` default 8. ``prepare(x)`` turns an
    input batch on the device into model input (default: uint8 NHWC images are
    normalised with ImageNet mean/std; ``fit(debug=True)`` passes the trainer's).
    """
    if isinstance(model, torch.nn.Module):
        module = model
    else:
        module = model()
    step_fn = train_step or _default_train_step
    simulate = None if runtime._tpu_present() else 1
    if simulate is not None and not runtime.xla_available():
        simulate = None  # no torch_xla: the same loop on plain torch

    def job() -> DebugReport:
        dev = runtime.device()
        net = copy.deepcopy(module).to(dev)
        opt = make_optimizer(optimizer, net.parameters(), lr=lr)
        loader = torch.utils.data.DataLoader(data, batch_size=batch_size, shuffle=False,
                                             drop_last=True)
        losses, per_step = [], []
        first = prev = runtime.metrics()
        n = 0
        for x, y in loader:
            if n == steps:
                break
            x, y = runtime.to_device((x, y), dev)
            if prepare is not None:
                x = prepare(x)
            elif is_image_batch(x):
                x = images_to_float(x)
            opt.zero_grad(set_to_none=True)
            loss_t = step_fn(net, (x, y), loss)
            loss_t.backward()
            runtime.optimizer_step(opt, barrier=True)
            losses.append(float(loss_t.detach().cpu()))
            now = runtime.metrics()
            per_step.append({k: now[k] - prev[k] for k in
                             ("compiles", "executions", "to_device", "to_host")})
            prev = now
            n += 1
        if n == 0:
            raise ValueError(f"data gave no full batch of {batch_size}; lower batch_size")
        fb = {k: v - first["fallback_ops"].get(k, 0) for k, v in prev["fallback_ops"].items()
              if v - first["fallback_ops"].get(k, 0) > 0}
        text = [f"debug_run on {runtime.backend()} device {dev}: {n} steps, "
                f"losses {', '.join(f'{v:.4g}' for v in losses)}"]
        text.append(runtime.metrics_report(first, prev, steps=n))
        if n > 2 and any(s["compiles"] for s in per_step[2:]):
            bad = [i + 1 for i, s in enumerate(per_step) if i >= 2 and s["compiles"]]
            text.append(
                f"Steps {bad} compiled again after warm-up: the graph changes between steps "
                "(a ragged last batch, a varying input shape, a Python scalar of exactly 0 or 1, "
                ".item() or a Python condition on a tensor inside the step).")
        elif n > 2:
            text.append("Steps 3.. reused the compiled graph: no recompilation.")
        return DebugReport(backend=runtime.backend(), steps=n, losses=losses, per_step=per_step,
                           fallback_ops=fb, report="\n".join(text))

    rep = runtime.launch(job, cores=1, simulate=simulate)
    if print_report:
        print(rep.report, flush=True)
    return rep
