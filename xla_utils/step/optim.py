"""Optimizer construction and per-step hyper-parameter setting.

The one-cycle schedule and the LR finder change the learning rate and the
momentum of an optimizer every step. On XLA a Python float that reaches an op
is uploaded as device data, so a changing value costs nothing, except the
special scalars 0.0 and ±1.0, which torch_xla bakes into the graph as constants:
hitting one of them compiles a new graph. The check happens after the value is
rounded to float32 (measured on torch_xla 2.9: a momentum of
``math.nextafter(1.0, 0.0)`` recompiles, ``1 - 2**-24`` does not, also for
bfloat16 parameters), so :func:`set_hparams` keeps every value it writes away
from 0.0 and ±1.0 *in float32* (see :func:`avoid_special`).
"""
from __future__ import annotations

import inspect
import math
from typing import Any, Callable, Iterable, Union

import numpy as np
import torch

from ..utils.suggest import did_you_mean

__all__ = ["OPTIMIZERS", "Adam", "avoid_special", "avoid_special_momentum", "make_optimizer",
           "optimizer_label", "resolve_optimizer", "set_hparams", "get_hparams"]

OPTIMIZERS = ("sgd", "adam", "adamw")
# How every message names them (the first line of a run, resume, check(), debug()).
_LABELS = {"sgd": "SGD", "adam": "Adam", "adamw": "AdamW"}
SGD_MOMENTUM = 0.9
ADAM_BETAS = (0.9, 0.999)

OptimizerSpec = Union[str, Callable[..., torch.optim.Optimizer]]

_F32_BELOW_ONE = 1.0 - 2.0**-24  # largest float32 below 1.0
_F32_TINY = 2.0**-126  # smallest normal float32
# Smallest momentum m for which neither m nor 1 - m (Adam's lerp weight) rounds
# to 0.0 or 1.0 in float32.
_F32_TINY_MOMENTUM = 2.0**-24


def _f32(x: float) -> float:
    return float(np.float32(x))


def avoid_special(x: float) -> float:
    """``x``, or its nearest safe neighbour if it rounds to 0.0 or ±1.0 in float32.

    For learning rates: 0 becomes 2**-126 (the smallest normal float32), ±1
    becomes ±(1 - 2**-24). Any other value is returned unchanged (as a float).
    """
    x = float(x)
    r = _f32(x)
    if r == 0.0:
        return math.copysign(_F32_TINY, x) if x else _F32_TINY
    if abs(r) == 1.0:
        return math.copysign(_F32_BELOW_ONE, x)
    return x


def avoid_special_momentum(m: float) -> float:
    """Momentum ``m`` such that neither ``m`` nor ``1 - m`` rounds to 0.0 or 1.0 in float32.

    Adam uses ``1 - beta1`` as a lerp weight, so a momentum just above 0 would
    still produce the constant 1.0. Values near 0 become 2**-24, values near 1
    become 1 - 2**-24; others are unchanged.
    """
    m = float(m)
    if _f32(m) == 0.0 or _f32(1.0 - m) == 1.0:
        return _F32_TINY_MOMENTUM
    if _f32(m) == 1.0 or _f32(1.0 - m) == 0.0:
        return _F32_BELOW_ONE
    return m


def _params_of(params: Any) -> Any:
    return params.parameters() if isinstance(params, torch.nn.Module) else params


def resolve_optimizer(spec: OptimizerSpec) -> OptimizerSpec:
    """The canonical form of an optimizer spec: a lower-case name from
    :data:`OPTIMIZERS` (names are case-insensitive and may carry surrounding
    spaces: ``"SGD"``, ``" AdamW"``), or the callable unchanged.

    Raises:
        ValueError: an unknown name; the message lists the valid ones.
        TypeError: neither a string nor a callable (e.g. an optimizer instance).
    """
    if isinstance(spec, str):
        name = spec.strip().lower()
        if name in OPTIMIZERS:
            return name
        raise ValueError(f"unknown optimizer {spec!r}{did_you_mean(name, OPTIMIZERS)}; valid names "
                         f"(any case): {', '.join(repr(o) for o in OPTIMIZERS)}, or a callable "
                         "spec(params, lr=..., weight_decay=...) such as torch.optim.RMSprop")
    if isinstance(spec, torch.optim.Optimizer) or not callable(spec):
        raise TypeError(f"optimizer must be a name {OPTIMIZERS} or a callable "
                        f"spec(params, lr=..., weight_decay=...), got {type(spec).__name__}; "
                        "pass the class (e.g. torch.optim.SGD), not an optimizer instance")
    return spec


def optimizer_label(spec: OptimizerSpec | torch.optim.Optimizer) -> str:
    """The one name messages give an optimizer: ``"SGD"``, ``"Adam"``, ``"AdamW"`` for a name
    (any case) or an optimizer :func:`make_optimizer` built from one, else the class or
    callable's own name (``"RMSprop"``)."""
    if isinstance(spec, str):
        return _LABELS.get(spec.strip().lower(), spec)
    if isinstance(spec, Adam):
        return "AdamW" if spec.defaults.get("decoupled") else "Adam"
    if isinstance(spec, torch.optim.Optimizer):
        return type(spec).__name__
    inner = getattr(spec, "func", spec)  # functools.partial(torch.optim.RMSprop, ...)
    return getattr(inner, "__qualname__", None) or getattr(inner, "__name__", None) or repr(spec)


def make_optimizer(spec: OptimizerSpec, params: Iterable[Any] | torch.nn.Module, lr: float,
                   weight_decay: float = 0.0) -> torch.optim.Optimizer:
    """Build an optimizer that the one-cycle schedule and the LR finder can drive.

    Parameters
    ----------
    spec:
        ``"sgd"``: ``torch.optim.SGD`` with momentum 0.9, ``nesterov=False`` (the
        schedule then cycles the momentum). ``"adam"`` / ``"adamw"``:
        ``torch.optim.Adam`` / ``AdamW`` with betas (0.9, 0.999) (the schedule
        cycles ``betas[0]``). Case-insensitive (see :func:`resolve_optimizer`).
        A callable is called as ``spec(params, lr=lr, weight_decay=weight_decay)``
        when its signature accepts those keywords (``torch.optim.SGD``,
        ``functools.partial(torch.optim.RMSprop, alpha=0.9)``, ...), as
        ``spec(params, lr=lr)`` when it accepts only ``lr``, and otherwise as
        ``spec(params)``, after which ``lr`` (and a non-zero ``weight_decay``) is
        written into every param group.
    params:
        Parameters, param-group dicts, or an ``nn.Module`` (its ``parameters()``).
    lr:
        Initial learning rate (per-sample-mean loss units; the schedule usually
        overwrites it before the first step).
    weight_decay:
        L2 penalty (SGD, Adam) or decoupled decay (AdamW). Default 0.0 for all
        three, including AdamW (whose torch default is 0.01).
    """
    spec = resolve_optimizer(spec)
    params = _params_of(params)
    lr = avoid_special(lr)
    if spec == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=SGD_MOMENTUM, nesterov=False,
                               weight_decay=weight_decay)
    if spec in ("adam", "adamw"):
        return Adam(params, lr=lr, betas=ADAM_BETAS, weight_decay=weight_decay,
                    decoupled=spec == "adamw")

    accepted = _keywords(spec)
    kwargs: dict[str, float] = {}
    if "lr" in accepted:
        kwargs["lr"] = lr
    if "weight_decay" in accepted:
        kwargs["weight_decay"] = weight_decay
    opt = spec(params, **kwargs)
    if not isinstance(opt, torch.optim.Optimizer):
        raise TypeError(f"optimizer callable returned {type(opt).__name__}, not a torch.optim.Optimizer")
    for group in opt.param_groups:
        group["lr"] = lr
        if "weight_decay" not in kwargs and weight_decay:
            if "weight_decay" not in group:
                raise ValueError(f"{type(opt).__name__} has no weight_decay; pass weight_decay=0.0")
            group["weight_decay"] = weight_decay
    return opt


class Adam(torch.optim.Optimizer):
    """Adam (``decoupled=False``) and AdamW (``decoupled=True``) that never recompile on XLA.

    The update is torch's (``torch.optim.Adam`` / ``AdamW`` with ``foreach=False``),
    but every per-step Python scalar goes through :func:`avoid_special`. torch's
    versions compute ``1 - beta1**step``, ``sqrt(1 - beta2**step)`` and (AdamW)
    ``1 - lr * weight_decay`` as Python floats; these reach exactly 1.0 in float32
    (after ~160 steps, ~16,000 steps, and when a one-cycle LR gets small), and
    XLA compiles a new graph for that constant. ``capturable=True`` avoids that
    but recompiles every step once ``betas[0]`` is scheduled. The difference to
    torch's result is at most one float32 ulp of those factors.

    Parameters: ``lr`` (default 1e-3), ``betas`` (default (0.9, 0.999)), ``eps``
    (default 1e-8), ``weight_decay`` (default 0: L2 added to the gradient, or
    decoupled decay ``p -= lr * weight_decay * p`` when ``decoupled``).
    """

    def __init__(self, params: Iterable[Any], lr: float = 1e-3,
                 betas: tuple[float, float] = ADAM_BETAS, eps: float = 1e-8,
                 weight_decay: float = 0.0, decoupled: bool = False):
        if lr <= 0 or eps <= 0 or weight_decay < 0 or not all(0 <= b < 1 for b in betas):
            raise ValueError(f"invalid Adam settings: lr={lr}, betas={betas}, eps={eps}, "
                             f"weight_decay={weight_decay}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps,
                                      weight_decay=weight_decay, decoupled=decoupled))

    @torch.no_grad()
    def step(self, closure=None):  # noqa: D102 (documented on the class)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, (beta1, beta2) = float(group["lr"]), group["betas"]
            wd, eps = group["weight_decay"], group["eps"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                state["step"] += 1
                t = state["step"]
                if wd:
                    if group["decoupled"]:
                        p.add_(p, alpha=avoid_special(-lr * wd))
                    else:
                        grad = grad.add(p, alpha=wd)
                state["exp_avg"].lerp_(grad, avoid_special(1 - beta1))
                state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                step_size = avoid_special(lr / (1 - beta1 ** t))
                bias2_sqrt = avoid_special(math.sqrt(1 - beta2 ** t))
                denom = (state["exp_avg_sq"].sqrt() / bias2_sqrt).add_(eps)
                p.addcdiv_(state["exp_avg"], denom, value=-step_size)
        return loss


def _keywords(fn: Callable[..., Any]) -> set[str]:
    """Names of ``lr`` / ``weight_decay`` that ``fn`` accepts as keywords."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # builtins without a signature
        return set()
    ps = sig.parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in ps):
        return {"lr", "weight_decay"}
    return {p.name for p in ps
            if p.name in ("lr", "weight_decay")
            and p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)}


def set_hparams(optimizer: torch.optim.Optimizer, lr: float, momentum: float | None = None) -> None:
    """Set the learning rate and (optionally) the momentum of every param group.

    The momentum goes to ``group["momentum"]`` where the group has one (SGD,
    RMSprop) and to ``group["betas"][0]`` where it has betas (Adam, AdamW,
    NAdam, ...); groups with neither keep none. Values exactly 0.0 or 1.0 are
    nudged (:func:`avoid_special`, :func:`avoid_special_momentum`) so that a
    scheduled value never forces an XLA recompile. A group with an ``lr_mult`` key
    gets ``lr * lr_mult`` (layer groups of :mod:`xla_utils.train.finetune`).
    """
    lr = avoid_special(lr)
    m = None if momentum is None else avoid_special_momentum(momentum)
    for group in optimizer.param_groups:
        # lr_mult: discriminative LRs of a layer group (xla_utils.train.finetune)
        group["lr"] = lr if "lr_mult" not in group else avoid_special(lr * group["lr_mult"])
        if m is None:
            continue
        if "momentum" in group:
            group["momentum"] = m
        elif "betas" in group:
            group["betas"] = (m, *tuple(group["betas"])[1:])


def get_hparams(optimizer: torch.optim.Optimizer) -> tuple[float, float | None]:
    """``(lr, momentum)`` of the first param group (momentum ``None`` if it has none)."""
    group = optimizer.param_groups[0]
    if "momentum" in group:
        return float(group["lr"]), float(group["momentum"])
    if "betas" in group:
        return float(group["lr"]), float(group["betas"][0])
    return float(group["lr"]), None
