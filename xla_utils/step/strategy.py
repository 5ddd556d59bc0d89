"""How the trainer spreads a model over the devices: ``TrainerConfig.strategy``.

* ``"spawn"`` (default): one replica process per core (``xmp.spawn``), each holding
  the whole model; gradients are averaged by ``xm.optimizer_step``. Unchanged, and
  not handled here.
* ``"spmd"``: one process owns every device (``xr.use_spmd()``); the model is
  replicated, each global batch is split over a 1-D mesh (axis ``"data"``) and XLA's
  partitioner inserts the gradient all-reduce. One compilation, one copy of the
  host-side data.
* ``"fsdp"``: FSDPv2 (``SpmdFullyShardedDataParallel``) on a 1-D mesh with axis
  ``"fsdp"``: parameters, gradients and optimizer state are sharded over it, the batch
  too. ``fsdp_wrap`` picks the units (module classes or names, or a minimum parameter
  count; None: the whole model), ``activation_checkpointing`` recomputes each unit's
  activations in the backward pass.

For one model, seed and global batch the three give the same loss curve: the
global batch ``k`` is the same samples in the same order (rank ``r``'s block of
spawn is device ``r``'s shard here). Epoch checkpoints are consolidated (full tensors,
the unwrapped model's parameter names), so an epoch checkpoint of one strategy
resumes under another with the same number of devices, and ``final.pt`` loads into
the plain model anywhere; beside each, ``epoch_<nnn>-<run id>.dcp/`` holds the same
state sharded (torch.distributed.checkpoint with torch_xla's SPMD planners, the
unwrapped names, and the resume metadata in ``xla_utils_meta.pt``): ``fit(resume=<the
.dcp folder>)`` continues from it alone under ``"spmd"`` or ``"fsdp"``
(:meth:`MeshRun.resume_sharded`, :func:`load_sharded_checkpoint`). Under ``"fsdp"``
the model goes from the host straight into its shards, one parameter at a time
(:func:`xla_utils.runtime.spmd.shard_to_device`): no device ever holds it whole. The
EMA copy (``ema=``) is placed like the model's parameters.

This module plans on the host (every check before device time), launches a callable it
is given in the SPMD process (:func:`launch`) and enters the mesh there
(:func:`enter_mesh`); the SPMD process's side of ``fit`` / ``predict`` / ``evaluate`` is
:func:`xla_utils.train.replica_loops.fit_on_mesh` / ``inference_on_mesh``, which run
:mod:`xla_utils.train.loop` with a :class:`MeshRun`. Every torch_xla call is
:mod:`xla_utils.runtime.spmd`'s.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable

import torch

from .. import runtime
from ..data import iterate_batches

if TYPE_CHECKING:
    from ..train.config import DataSettings, DeviceSettings

__all__ = ["STRATEGIES", "StrategyPlan", "MeshRun", "plan_strategy",
           "resolve_wrap", "check_global_batch", "consolidated_state_dict", "launch",
           "load_sharded_checkpoint", "enter_mesh"]

STRATEGIES = ("spawn", "spmd", "fsdp")
AXIS = {"spmd": "data", "fsdp": "fsdp"}


def check_global_batch(global_batch: int, devices: int, setting: str = "batch_size") -> None:
    """Refuse a global batch the mesh cannot split evenly (before any device time)."""
    if global_batch % devices:
        raise ValueError(
            f"the global batch {global_batch} does not divide over the mesh's {devices} "
            f"devices: every device must get the same number of samples. Fix: set {setting} "
            f"to a multiple of {devices} (e.g. {max(devices, global_batch // devices * devices)})")


def resolve_wrap(model: torch.nn.Module, wrap: Any) -> tuple[type, ...] | int | None:
    """The FSDP unit policy for ``model``: classes (names resolved against the model's
    own submodules), a parameter count, or None.

    Raises:
        ValueError: the policy matches no submodule of ``model`` (the model's own
            class does not count: the root is always a unit), naming what it has.
    """
    if wrap is None:
        return None
    children = [m for name, m in model.named_modules() if name]
    if isinstance(wrap, int):
        biggest = max((sum(p.numel() for p in m.parameters()) for m in children), default=0)
        if biggest < wrap:
            raise ValueError(
                f"fsdp_wrap={wrap} (minimum parameters per FSDP unit) matches no submodule of "
                f"{type(model).__name__}: its largest has {biggest:,} parameters. Fix: lower "
                f"fsdp_wrap (<= {biggest}), name the block class, or fsdp_wrap=None")
        return wrap
    wanted = [wrap] if isinstance(wrap, (str, type)) else list(wrap)
    have = {type(m).__name__: type(m) for m in children}
    classes, unmatched = set(), []
    for w in wanted:
        cls = have.get(w) if isinstance(w, str) else (w if w in have.values() else None)
        if cls is None:
            unmatched.append(w if isinstance(w, str) else w.__name__)
        else:
            classes.add(cls)
    if unmatched:
        raise ValueError(
            f"fsdp_wrap names {unmatched}, which match no submodule of {type(model).__name__}; "
            f"its submodule classes are {sorted(have)[:20]}. Fix: name one of those (the "
            "repeated block, e.g. a transformer layer), a parameter count, or fsdp_wrap=None")
    return tuple(sorted(classes, key=lambda c: c.__name__))


@dataclass
class StrategyPlan:
    """What the SPMD process runs, decided on the host.

    Attributes:
        strategy: ``"spmd"`` or ``"fsdp"``.
        devices: Devices in the mesh (the simulated count, or the TPU's).
        simulate: Simulated XLA:CPU devices, or None on a TPU.
        wrap: FSDP units: classes, a parameter count, or None (``"fsdp"`` only).
        checkpointing: Activation checkpointing per unit (``"fsdp"`` only).
    """

    strategy: str
    devices: int
    simulate: int | None
    wrap: tuple[type, ...] | int | None = None
    checkpointing: bool = False

    @property
    def axis(self) -> str:
        """The mesh's one axis name (``"data"`` or ``"fsdp"``)."""
        return AXIS[self.strategy]


def plan_strategy(settings: DeviceSettings, batch_size: int, model: torch.nn.Module,
                  placement: runtime.Placement) -> StrategyPlan:
    """Check everything ``settings.strategy`` needs (with ``batch_size`` per device) before
    any device time; return the plan of a mesh of ``placement``'s devices (its world size:
    the simulated count, or the TPU's).

    Raises:
        ValueError: this torch_xla has no SPMD/FSDPv2, the wrap policy matches
            nothing, or the global batch does not divide over the mesh.
    """
    from ..runtime.spmd import spmd_support

    why = spmd_support()
    if why is not None:
        raise ValueError(f"strategy={settings.strategy!r}: {why}")
    devices, simulate = placement.replicas, placement.simulated
    if placement.joined == "pod":
        raise ValueError(
            f"strategy={settings.strategy!r} on a rehearsed pod slice of {placement.hosts} hosts: "
            "one SPMD program spanning several hosts (one process per host over a global mesh) is "
            "not simulated. Fix: rehearse the mesh on one host (python -m xla_utils.simulate "
            f"--hosts 1 --cores {devices}, or simulate={devices} without --hosts), and the "
            "several hosts with strategy='spawn'")
    if simulate is None and not runtime.tpu_present():
        raise ValueError(f"strategy={settings.strategy!r} needs the devices of a TPU, and this "
                         "machine has none. Fix: pass simulate=8 (8 XLA:CPU devices) to try it here")
    check_global_batch(batch_size * devices, devices)
    wrap = resolve_wrap(model, settings.fsdp_wrap) if settings.strategy == "fsdp" else None
    return StrategyPlan(strategy=settings.strategy, devices=devices, simulate=simulate, wrap=wrap,
                        checkpointing=settings.activation_checkpointing)


def launch(fn: Callable, args: tuple, plan: StrategyPlan, timeout: float | None) -> Any:
    """Run ``fn(plan, *args)`` in a fresh process owning the plan's devices."""
    from ..simulate.devices import run_on_devices

    return run_on_devices(fn, (plan, *args), plan.simulate, timeout=timeout)


def consolidated_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` under the unwrapped model's names (FSDPv2 and
    checkpoint wrappers removed from the keys); tensors as they are (device, sharded)."""
    from ..runtime.spmd import FSDP_WRAPPER_PARTS

    return {".".join(p for p in k.split(".") if p not in FSDP_WRAPPER_PARTS): v
            for k, v in model.state_dict().items()}


@dataclass
class MeshRun:
    """The SPMD process's side of a plan: mesh, model wrapping, batches, state.

    :func:`xla_utils.train.loop.set_up` takes one as ``strategy=`` and the loop asks it
    for the global loader, the sharded device batches and the consolidated state.
    """

    plan: StrategyPlan
    mesh: Any

    @property
    def devices(self) -> int:
        return self.plan.devices

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """The model (on the host, or on the device already) as this strategy runs it:
        ``"spmd"`` replicated on every device, ``"fsdp"`` wrapped by FSDPv2 with each
        parameter moved straight into its shards (the device never holds the model whole)."""
        if self.plan.strategy == "spmd":
            return model.to(runtime.device())
        from ..runtime.spmd import fsdp_wrap_model

        return fsdp_wrap_model(model, self.mesh, self.plan.wrap, self.plan.checkpointing)

    def place(self, module: torch.nn.Module) -> torch.nn.Module:
        """A host module on the devices sharded as this strategy shards the model's
        parameters, unwrapped (the EMA copy): replicated (``"spmd"``) or each parameter
        straight into its FSDPv2 shards (``"fsdp"``)."""
        if self.plan.strategy == "spmd":
            return module.to(runtime.device())
        from ..runtime.spmd import shard_to_device

        return shard_to_device(module, self.mesh)

    def loader(self, data, settings: DataSettings, epoch: int, train: bool, start: int = 0):
        """Global batches (``batch_size``, validation ``val_batch_size``, x devices): one
        process feeds every device; training batches through ``settings.transform``; from the
        epoch's batch ``start`` on (a resumed run)."""
        bs = settings.batch_size if train else settings.val_batch_size(len(data), self.devices)
        return iterate_batches(data, bs * self.devices, shuffle=train, seed=settings.seed,
                               epoch=epoch, drop_last=train, num_workers=settings.num_workers,
                               transform=settings.transform if train else None, start=start)

    def feed(self, batches: Iterable):
        """Host batches as device tensors split over the mesh's axis."""
        from ..runtime.spmd import sharded_batches

        return sharded_batches(batches, self.mesh, self.plan.axis)

    def state_dict(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        return consolidated_state_dict(model)

    def save_sharded(self, model: torch.nn.Module, opt: torch.optim.Optimizer, directory: Any,
                     epoch: int, run_id: str, keep: int, meta: dict | None = None,
                     ema: Any = None) -> Path:
        """Beside the consolidated epoch file, its sharded twin
        ``epoch_<nnn>-<run id>.dcp/`` (torch.distributed.checkpoint, SPMD planner:
        each device's shards of the model and optimizer state); this run's older twins
        beyond ``keep`` are deleted. Parameters are stored under the unwrapped model's
        names, so a twin loads under either strategy and any wrap policy. ``meta``
        (:func:`xla_utils.train.checkpoint.sharded_meta`) makes it resumable on its own:
        ``fit(resume=<folder>)``. Load one with :func:`load_sharded_checkpoint`."""
        import shutil

        from ..runtime.spmd import save_sharded

        runtime.sync()
        folder = Path(directory) / f"epoch_{epoch:03d}-{run_id}.dcp"
        state = {"model": consolidated_state_dict(model), "optim": opt.state_dict()}
        if ema is not None:  # a DeviceEMA: its weights, sharded like the model's
            state["ema"] = ema.state_dict()
        save_sharded(state, folder, meta)
        mine = sorted(Path(directory).glob(f"epoch_*-{run_id}.dcp"))
        for old in mine[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
        return folder


    def resume_sharded(self, model: torch.nn.Module, opt: torch.optim.Optimizer,
                       ckpt: dict, ema: Any = None) -> None:
        """Resume from a ``.dcp`` folder (``ckpt``: its meta, ``ckpt["sharded"]`` the
        folder): the optimizer state is first created on the devices, sharded like its
        parameters (zeros), then both are filled from the shards; nothing is gathered."""
        from ..runtime.spmd import zeros_like_param

        skel, devs = ckpt["optimizer"], ckpt["optimizer_devices"]
        ids = [i for g in skel["param_groups"] for i in g["params"]]
        params = [p for g in opt.param_groups for p in g["params"]]
        if len(ids) != len(params):
            raise RuntimeError(f"the sharded checkpoint {ckpt['sharded']} has {len(ids)} optimizer "
                               f"parameters, this model {len(params)}")
        by_id = dict(zip(ids, params))

        def make(i: int, k: str, v: Any) -> Any:
            if not isinstance(v, torch.Tensor):
                return v
            if devs[i][k] != "xla":
                return torch.zeros(v.shape, dtype=v.dtype)
            return zeros_like_param(by_id[i], self.mesh, v.shape, v.dtype)

        opt.load_state_dict({"param_groups": skel["param_groups"],
                             "state": {i: {k: make(i, k, v) for k, v in e.items()}
                                       for i, e in skel["state"].items()}})
        load_sharded_checkpoint(model, opt, ckpt["sharded"], ema=ema)


def load_sharded_checkpoint(model: torch.nn.Module, opt: torch.optim.Optimizer | None,
                            folder: Any, ema: Any = None) -> None:
    """Load a ``.dcp`` twin into ``model`` (on the mesh, wrapped by any strategy or
    policy: the twin holds the unwrapped names; its parameters keep their shardings) and
    ``opt`` (whose state must exist: after one step, a consolidated ``load_state_dict``
    or :meth:`MeshRun.resume_sharded`), in place, in the SPMD process."""
    from ..runtime.spmd import FSDP_WRAPPER_PARTS, load_sharded

    plain = consolidated_state_dict(model)
    wrapped = {".".join(p for p in k.split(".") if p not in FSDP_WRAPPER_PARTS): k
               for k in model.state_dict()}
    state = {"model": plain}
    if opt is not None:
        state["optim"] = opt.state_dict()
    if ema is not None:  # a DeviceEMA: the twin of a run with ema set
        state["ema"] = ema.state_dict()
    load_sharded(state, folder)
    model.load_state_dict({wrapped[k]: v for k, v in state["model"].items()})
    if ema is not None:
        ema.module.load_state_dict(state["ema"])
    if opt is not None:
        opt.load_state_dict(state["optim"])


def enter_mesh(plan: StrategyPlan, compile_cache: Any) -> tuple[Any, MeshRun]:
    """First thing in the SPMD process: compile cache, ``use_spmd``, mesh. Returns
    ``(compile cache status, the plan's MeshRun)``."""
    from ..runtime import spmd

    cache = runtime.enable_compile_cache(compile_cache)  # before anything compiles
    spmd.enable_spmd()
    n = spmd.device_count()
    if n != plan.devices:
        raise RuntimeError(f"strategy={plan.strategy!r} planned {plan.devices} devices but this "
                           f"process has {n}")
    run = MeshRun(plan=plan, mesh=spmd.make_mesh(n, plan.axis))
    units = ("the whole model" if plan.wrap is None else
             f"submodules of {plan.wrap:,}+ parameters" if isinstance(plan.wrap, int) else
             ", ".join(c.__name__ for c in plan.wrap))
    runtime.master_print(
        f"strategy {plan.strategy!r}: one process feeds {n} devices, mesh ({plan.axis}={n})"
        + (f"; FSDPv2 units: {units}" + (", activation checkpointing" if plan.checkpointing else "")
           if plan.strategy == "fsdp" else "; model replicated, batch split"))
    return cache, run
