"""The measurement job of :func:`xla_utils.check`: what runs in the forked child.

:class:`MeasureJob` runs a few real training steps on one XLA:CPU device (XLA's own counters
and the pending graph's IR per step, through :mod:`xla_utils.runtime`), one extra
forward/backward on the CPU under a dispatch recorder (every op's dtype, data-dependent ops
and host reads with the source line that called them, matmul/convolution shapes, saved
activations, FLOPs) and, with ``data=``, the loader's speed. It returns one dict of plain
Python values (``report.measurements``), which :mod:`xla_utils.diagnostics.findings` turns
into findings and :mod:`xla_utils.diagnostics.readiness` into the report.
"""
from __future__ import annotations

import contextlib
import copy
import math
import os
import re
import time
import traceback
from collections import Counter
from typing import Any, Callable

import torch

from .. import runtime
from .findings import DYNAMIC_OPS, pad_to
from ..utils.progress import progress_bar
from ..step.plain import PlainStep

__all__ = ["MeasureJob", "fast_xla_cpu_compile"]


def _rows(x: Any) -> int:
    if isinstance(x, torch.Tensor):
        return int(x.shape[0]) if x.dim() else 1
    if isinstance(x, dict):
        return _rows(next(iter(x.values())))
    if isinstance(x, (tuple, list)) and x:
        return _rows(x[0])
    return 0


def _param_positions(module: torch.nn.Module, opt: torch.optim.Optimizer) -> list[list[int]]:
    index = {id(p): i for i, p in enumerate(module.parameters())}
    try:
        return [[index[id(p)] for p in g["params"]] for g in opt.param_groups]
    except KeyError:
        raise ValueError("the optimizer holds parameters that are not the model's; build it "
                         "over model.parameters() or pass a name such as 'sgd'") from None


def _rebuild_optimizer(opt: torch.optim.Optimizer, module: torch.nn.Module,
                       net: torch.nn.Module) -> torch.optim.Optimizer:
    """``opt``'s class, hyper-parameters and state over ``net`` (a copy of ``module``)."""
    params = list(net.parameters())
    groups = []
    for g, pos in zip(opt.param_groups, _param_positions(module, opt)):
        ng = {k: v for k, v in g.items() if k != "params"}
        ng["params"] = [params[i] for i in pos]
        groups.append(ng)
    try:
        new = type(opt)(groups, **opt.defaults)
    except TypeError:
        new = type(opt)(groups)
    new.load_state_dict(opt.state_dict())  # moves the state to the params' device
    return new





@contextlib.contextmanager
def fast_xla_cpu_compile():
    """XLA_FLAGS for the forked child only: the caller's value is restored at once
    (the caller never starts the XLA runtime, so the flag has no effect there)."""
    old = os.environ.get("XLA_FLAGS")
    os.environ["XLA_FLAGS"] = runtime.fast_cpu_compile_flags(old)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("XLA_FLAGS", None)
        else:
            os.environ["XLA_FLAGS"] = old


# ---------------------------------------------------------------------------
# The child: CPU analysis pass + XLA steps
# ---------------------------------------------------------------------------
_TORCH_DIR = os.path.dirname(torch.__file__)
_PKG_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # xla_utils/
_HOST_READ_OPS = {"_local_scalar_dense"}


def _where() -> str:
    """``file.py:line in function`` of the innermost user code that called the
    current op, or "" when torch's own modules did (then the module name says where)."""
    frames = traceback.extract_stack()[:-1]
    while frames and frames[-1].filename == __file__:
        frames.pop()  # the recorder itself
    for fr in reversed(frames):
        f = fr.filename
        if f.startswith(_TORCH_DIR) or "/torch_xla/" in f or "/torchvision/" in f:
            continue
        if f.startswith(_PKG_DIR):
            return ""  # reached xla_utils' own step: no user code in between
        return f"{os.path.basename(f)}:{fr.lineno} in {fr.name}"
    return ""


def _place(where: str, module: str) -> str:
    """``"at file.py:12 in forward (in `layer`)"``, or the parts of it that are known."""
    parts = ([f"at {where}"] if where else []) + ([f"(in `{module}`)"] if module else [])
    return " ".join(parts)


def _storage_key(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage().data_ptr()
    except Exception:
        return id(t)


def _tiled_bytes(t: torch.Tensor) -> int:
    """Bytes of ``t`` if the TPU lays it out in (8, 128) tiles: the feature dimension
    (last; dim 1 of a 4-D/5-D conv activation) padded to 128, the next one to 8."""
    shape = list(t.shape)
    if not shape:
        return t.element_size()
    if len(shape) >= 4:
        shape[1] = pad_to(shape[1], 128)
        shape[0] = pad_to(shape[0], 8)
    else:
        shape[-1] = pad_to(shape[-1], 128)
        if len(shape) >= 2:
            shape[-2] = pad_to(shape[-2], 8)
    return math.prod(shape) * t.element_size()


def _feature_sizes(t: torch.Tensor) -> set[int]:
    """Sizes a layer width could be tied to: the last dim, and dim 1 of a 3-D+ (channels-first) tensor."""
    if t.dim() < 2:
        return set()
    return {int(t.shape[-1])} | ({int(t.shape[1])} if t.dim() >= 3 else set())



class _Recorder:
    """A dispatch recorder of the forward pass (see the module docstring)."""

    def __init__(self) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        rec = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                if rec.recording:
                    rec.record(func, args, out)
                return out

        self.mode = Mode()
        self.recording = False
        self.module_stack: list[tuple[str, str]] = []  # (name, class name), innermost last
        self.first_where: dict[str, str] = {}  # op name -> place of its first call
        self.low_precision: dict[str, dict[str, Any]] = {}
        self.dynamic: dict[str, dict[str, Any]] = {}
        self.host_reads: dict[str, int] = {}
        self.matmuls: list[dict[str, Any]] = []
        self.input_keys: set[int] = set()  # storages of the model's inputs
        self.input_widths: set[int] = set()  # their feature sizes (last dim; dim 1 of images)

    def module(self) -> str:
        return self.module_stack[-1][0] if self.module_stack else ""

    def module_kind(self) -> str:
        return self.module_stack[-1][1] if self.module_stack else ""

    def record(self, func, args, out) -> None:
        name = func.overloadpacket.__name__
        if name not in self.first_where:
            self.first_where[name] = _place(_where(), self.module())
        outs = [o for o in (out if isinstance(out, (tuple, list)) else (out,))
                if isinstance(o, torch.Tensor)]
        for o in outs:
            if o.dtype in (torch.float64, torch.float16) and o.dim() > 0:
                d = self.low_precision.setdefault(str(o.dtype).replace("torch.", ""),
                                                  {"count": 0, "examples": []})
                d["count"] += 1
                if len(d["examples"]) < 3:
                    d["examples"].append(f"{_op_label(func)} {_place(_where(), self.module())}".strip())
        label = DYNAMIC_OPS.get(name)
        if name == "index" and any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
                                   for i in (args[1] if len(args) > 1 else []) or []):
            label = "boolean-mask indexing x[mask]"
        elif name == "repeat_interleave" and args and isinstance(args[0], torch.Tensor) \
                and len(args) > 1 and isinstance(args[1], torch.Tensor):
            label = "repeat_interleave with tensor repeats"
        if label:
            d = self.dynamic.setdefault(label, {"count": 0, "place": _place(_where(), self.module())})
            d["count"] += 1
        if name in _HOST_READ_OPS:
            w = _place(_where(), self.module())
            self.host_reads[w] = self.host_reads.get(w, 0) + 1
        if name in ("mm", "addmm", "bmm", "baddbmm", "convolution"):
            self._matmul(name, args, outs[0] if outs else None)

    def _matmul(self, name: str, args, out) -> None:
        groups, depthwise = 1, False
        if name == "convolution":
            inp, w = args[0], args[1]
            transposed = bool(args[6]) if len(args) > 6 else False
            groups = int(args[8]) if len(args) > 8 else 1
            cin = int(inp.shape[1])
            cout = int(w.shape[1]) * groups if transposed else int(w.shape[0])
            # As a matmul (im2col): rows = output pixels, contraction = input channels x
            # kernel taps, columns = output channels.
            taps = math.prod(int(s) for s in w.shape[2:])
            k, n, width_in = cin // groups * taps, cout // groups, cin
            m = int(out.shape[0]) * math.prod(int(s) for s in out.shape[2:]) if out is not None else 0
            depthwise = groups > 1 and cin // groups == 1
            kind = self.module_kind() or f"Conv{len(w.shape) - 2}d"
            k_fixed = _storage_key(inp) in self.input_keys or cin // groups <= 4
        else:
            a, b = (args[1], args[2]) if name in ("addmm", "baddbmm") else (args[0], args[1])
            m, k, n = int(a.shape[-2]), int(a.shape[-1]), int(b.shape[-1])
            width_in = k
            if a.dim() == 3:
                groups = int(a.shape[0])
            kind = self.module_kind() if self.module_kind() in ("Linear", "Bilinear") else f"aten::{name}"
            k_fixed = _storage_key(a) in self.input_keys or k in self.input_widths
        self.matmuls.append({"module": self.module(), "kind": kind, "op": name, "m": m, "k": k,
                             "n": n, "width_in": width_in, "groups": groups, "depthwise": depthwise,
                             "k_fixed": k_fixed, "n_fixed": False,
                             "out_key": _storage_key(out) if out is not None else None,
                             "where": _where()})


def _op_label(func) -> str:
    name = func.overloadpacket.__name__
    return "a dtype conversion" if name in ("_to_copy", "to", "copy_") else f"aten::{name}"


def _flat_tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        obj = list(obj.values())
    if isinstance(obj, (tuple, list)):
        return [t for o in obj for t in _flat_tensors(o)]
    return []


def _dtype_names(obj: Any) -> list[str]:
    return sorted({str(t.dtype).replace("torch.", "") for t in _flat_tensors(obj)
                   if t.is_floating_point()})


def _default_step(model: torch.nn.Module, batch: tuple, loss_fn: Callable) -> torch.Tensor:
    x, y = batch
    out = model(x)
    return loss_fn(out) if y is None else loss_fn(out, y)


class MeasureJob:
    """The function run in the forked child; returns plain-Python measurements."""

    def __init__(self, module, x, y, loss_fn, optimizer, steps, data, prepare, train_step, bf16,
                 verbose):
        self.module, self.x, self.y, self.loss_fn = module, x, y, loss_fn
        self.optimizer, self.steps, self.data = optimizer, steps, data
        self.prepare, self.train_step, self.bf16, self.verbose = prepare, train_step, bf16, verbose
        self.compile_cache: runtime.CompileCacheOption = "auto"
        self.make_step: Callable | None = None  # a step factory (xla_utils.train.steps)

    def _prep(self, x):
        return self.prepare(x) if self.prepare is not None else x

    def __call__(self) -> dict[str, Any]:
        cache = runtime.enable_compile_cache(self.compile_cache)  # before anything compiles
        meas: dict[str, Any] = {"batch_rows": _rows(self.x), "compile_cache": cache.state}
        meas["input_dtypes"] = _dtype_names(self.x)
        meas["param_dtypes"] = {}
        for n, p in self.module.named_parameters():
            meas["param_dtypes"].setdefault(str(p.dtype).replace("torch.", ""), []).append(n)
        meas["param_bytes"] = sum(p.numel() * p.element_size() for p in self.module.parameters())
        meas["grad_bytes"] = sum(p.numel() * p.element_size() for p in self.module.parameters()
                                 if p.requires_grad)
        if self.data is not None:
            meas["loader"] = _measure_loader(self.data, max(meas["batch_rows"], 1))
        meas.update(self._cpu_pass())
        meas.update(self._xla_steps())
        return meas

    # -- one forward/backward on the CPU under the recorder -------------------
    def _cpu_pass(self) -> dict[str, Any]:
        from torch.utils.flop_counter import FlopCounterMode

        res: dict[str, Any] = {"cpu_error": None}
        rec = _Recorder()
        net = copy.deepcopy(self.module).cpu().train()
        handles = []

        def enter(label: str):
            def hook(module, args) -> None:
                rec.module_stack.append((label, type(module).__name__))
            return hook

        def leave(module, args, out) -> None:
            if rec.module_stack:
                rec.module_stack.pop()

        def model_inputs(module, args, kwargs) -> None:
            for t in _flat_tensors((args, kwargs)):
                rec.input_keys.add(_storage_key(t))
                rec.input_widths.update(_feature_sizes(t))

        for name, mod in net.named_modules():
            handles.append(mod.register_forward_pre_hook(enter(name or "model")))
            handles.append(mod.register_forward_hook(leave))
        handles.append(net.register_forward_pre_hook(model_inputs, with_kwargs=True))
        param_keys = {_storage_key(p) for p in net.parameters()}
        saved: dict[int, tuple[int, int]] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            key = _storage_key(t)
            if key not in param_keys and key not in saved:
                try:
                    nbytes = t.untyped_storage().nbytes()
                except Exception:
                    nbytes = t.numel() * t.element_size()
                saved[key] = (nbytes, _tiled_bytes(t))
            return t

        step = self.train_step or _default_step
        autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.bf16)
        try:
            x = self._prep(self.x)
            with FlopCounterMode(display=False) as flops:
                with rec.mode, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast:
                    rec.recording = True
                    out_keys: set[int] = set()
                    out_widths: set[int] = set()

                    def model_outputs(module, args, out) -> None:
                        for t in _flat_tensors(out):
                            out_keys.add(_storage_key(t))
                            out_widths.update(_feature_sizes(t))

                    hook = net.register_forward_hook(model_outputs)
                    try:
                        loss = step(net, (x, self.y), self.loss_fn)
                    finally:
                        hook.remove()
                        rec.recording = False
                loss.backward()
            for mm in rec.matmuls:
                # the model's output width (classes, targets) is set by the task
                mm["n_fixed"] = mm.pop("out_key") in out_keys or mm["n"] in out_widths
            res.update(flops=int(flops.get_total_flops()),
                       activation_bytes=sum(v[0] for v in saved.values()),
                       activation_bytes_tiled=sum(v[1] for v in saved.values()),
                       low_precision=rec.low_precision, dynamic=rec.dynamic,
                       host_read_places=rec.host_reads, matmuls=rec.matmuls,
                       op_places=rec.first_where)
        except Exception as exc:  # the XLA steps still give the counters
            res["cpu_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        finally:
            for h in handles:
                h.remove()
        return res

    # -- the measured XLA steps ------------------------------------------------
    def _stepper(self) -> Any:
        """The step to measure (:mod:`xla_utils.train.steps`): the given factory's, else a
        :class:`~xla_utils.step.plain.PlainStep` of this check's optimizer, loss and step."""
        runtime.set_seed(0)
        if self.make_step is not None:
            return self.make_step(self.module)
        net = copy.deepcopy(self.module).to(runtime.device()).train()
        if isinstance(self.optimizer, torch.optim.Optimizer):
            opt = _rebuild_optimizer(self.optimizer, self.module, net)
        else:
            from ..step.optim import make_optimizer

            opt = make_optimizer(self.optimizer, net.parameters(), lr=1e-3)
        return PlainStep(net, opt, loss_fn=self.loss_fn, train_step=self.train_step or _default_step,
                         prepare=self.prepare, bf16=self.bf16)

    def _xla_steps(self) -> dict[str, Any]:
        dev = runtime.device()
        stepper = self._stepper()
        shapes: list[dict[str, list]] = []  # per step: "name (Kind)" -> input shapes per call

        def input_shapes(label: str):
            def hook(module, args) -> None:
                shapes[-1].setdefault(label, []).append([tuple(t.shape) for t in _flat_tensors(args)])
            return hook

        for name, mod in stepper.model.named_modules():
            mod.register_forward_pre_hook(input_shapes(f"{name or 'model'} ({type(mod).__name__})"))
        x = runtime.to_device(self.x, dev)
        y = runtime.to_device(self.y, dev) if self.y is not None else None
        per_step, texts, losses = [], [], []
        bar = range(self.steps)
        if self.verbose and runtime.is_master():
            bar = progress_bar(self.steps, console=runtime.text_progress(),
                               title=f"check: {self.steps} training steps on one XLA:CPU device")
        prev = runtime.xla_counters()
        for i in bar:
            shapes.append({})
            t0 = time.perf_counter()
            for j in range(stepper.accum_steps):  # the same batch for every micro-batch
                loss = stepper.micro_batch(x, y)
                if j < stepper.accum_steps - 1:
                    runtime.sync()
            texts.append(runtime.graph_text([loss] + stepper.tensors()))
            runtime.sync()
            losses.append(loss.detach())
            now = runtime.xla_counters()
            d = {k: now[k] - prev[k] for k in ("compiles", "executions", "to_device", "to_host")}
            d["fallback_ops"] = {k: v - prev["fallback_ops"].get(k, 0)
                                 for k, v in now["fallback_ops"].items()
                                 if v - prev["fallback_ops"].get(k, 0) > 0}
            d["seconds"] = time.perf_counter() - t0
            per_step.append(d)
            prev = now
            if hasattr(bar, "comment"):
                bar.comment = f"step {i + 1}: {d['compiles']} compiles"
        opt_bytes = sum(t.numel() * t.element_size() for s in stepper.optimizer.state.values()
                        for t in s.values() if isinstance(t, torch.Tensor))
        changes = []
        for i in range(1, self.steps):
            if per_step[i]["compiles"]:
                changes.append({"step": i + 1, "shapes": _shape_changes(shapes[i - 1], shapes[i]),
                                "graph": _graph_changes(texts[i - 1], texts[i])})
        lowp = Counter()
        for t in texts:
            for m in re.finditer(r"= (f64|f16)\[\d", t):  # not scalars: Python numbers are f64
                lowp[m.group(1)] += 1
        return {"per_step": per_step, "losses": [float(v.cpu()) for v in losses],
                "optimizer_state_bytes": opt_bytes, "recompile_changes": changes,
                "step": stepper.description,
                "ir_low_precision": {"float64" if k == "f64" else "float16": v // len(texts)
                                     for k, v in lowp.items()}}


def _shape_changes(before: dict[str, list], after: dict[str, list], limit: int = 2) -> list[str]:
    out = []
    for name, shapes in after.items():
        if name in before and before[name] != shapes:
            a, b = before[name][0], shapes[0]
            out.append(f"{name} input {_fmt_shapes(a)} -> {_fmt_shapes(b)}")
        elif name not in before:
            out.append(f"{name} ran in this step only")
        if len(out) >= limit:
            break
    if len(out) < limit:
        out += [f"{n} did not run in this step" for n in before if n not in after][: limit - len(out)]
    return out


def _fmt_shapes(shapes: list[tuple]) -> str:
    s = ", ".join("[" + ",".join(str(d) for d in sh) + "]" for sh in shapes)
    return s or "[]"


_IR_LINE = re.compile(r"^\s*%\d+\s*=\s*(.*?)(?:, xla_shape=[^,]*)?(?:, ROOT=\d+)?\s*$")


def _graph_lines(text: str) -> Counter:
    lines = Counter()
    for line in text.splitlines():
        m = _IR_LINE.match(line)
        if m:
            lines[re.sub(r"%\d+", "%", m.group(1))] += 1
    return lines


def _graph_changes(before: str, after: str, limit: int = 3) -> dict[str, list[str]]:
    """IR nodes (ids stripped) only in ``before`` / only in ``after``."""
    a, b = _graph_lines(before), _graph_lines(after)
    return {"removed": list((a - b).elements())[:limit], "added": list((b - a).elements())[:limit]}


def _batch_len(b: Any) -> int:
    return _rows(b[0] if isinstance(b, (tuple, list)) else b)


def _measure_loader(data: Any, batch_size: int, seconds: float = 3.0,
                    max_batches: int = 64) -> dict[str, Any]:
    """Samples/s of ``data``'s loader (the trainer's :func:`~xla_utils.data.iterate_batches`
    for a dataset, or the iterable itself) over up to ``seconds`` after one warm-up batch,
    and what it read (``kind``: ``"cache"``, ``"tensors"`` (a ``TensorDataset``), ``"dataset"``
    or ``"iterable"``; ``workers``:
    its ``num_workers``, for a cache the threads it uses; None when unknown)."""
    from ..data import CachedImageDataset, iterate_batches
    from ..step.inputs import HostFeed

    if isinstance(data, (str, os.PathLike)):
        data = CachedImageDataset(data)
    workers = getattr(data, "num_workers", None)
    if hasattr(data, "__len__") and hasattr(data, "__getitem__"):
        if len(data) == 0:
            raise ValueError("data= is empty")
        batches = iterate_batches(data, min(batch_size, len(data)), shuffle=True, drop_last=True)
        source, inner = f"{type(data).__name__} of {len(data)} samples through iterate_batches", data
    else:
        batches, source = data, type(data).__name__
        inner = getattr(data, "dataset", None)  # a BatchIterable's or a DataLoader's dataset
        if inner is not None and hasattr(inner, "__len__"):
            source = f"{type(inner).__name__} of {len(inner)} samples through {source}"
    if isinstance(inner, HostFeed):  # PIL or dict samples, made collatable on the host
        inner = inner.data
    kind = ("cache" if isinstance(inner, CachedImageDataset) else
            "tensors" if isinstance(inner, torch.utils.data.TensorDataset) else
            "iterable" if inner is None else "dataset")
    if kind == "cache" and workers is None:  # iterate_batches' automatic loader threads
        workers = min(4, os.cpu_count() or 1)
    it = iter(batches)
    try:
        t0 = time.perf_counter()
        try:
            first = next(it)
        except StopIteration:
            raise ValueError("data= yielded no batch") from None
        t1 = time.perf_counter()
        n = k = 0
        for b in it:
            n += _batch_len(b)
            k += 1
            if k >= max_batches or time.perf_counter() - t1 > seconds:
                break
        if k == 0:  # a single batch: time it, warm-up included
            n, t1 = _batch_len(first), t0
        elapsed = max(time.perf_counter() - t1, 1e-9)
    finally:
        close = getattr(it, "close", None)
        if close is not None:
            close()
    return {"samples_per_s": n / elapsed, "samples": n, "seconds": elapsed, "source": source,
            "host_cpus": os.cpu_count(), "kind": kind, "workers": workers}
