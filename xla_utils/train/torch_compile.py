"""``compile=``: the torch backend's model forward through ``torch.compile``, as plain
functions with explicit arguments and one small run object (:class:`CompiledRun`).

What is compiled: the model's forward (``torch.compile(model, mode=...)``, an
``OptimizedModule`` sharing the model's parameters), which ``train_step`` / ``eval_step``
receive in place of the model. The loss, the optimizer step (its one-cycle LR is a Python
float set every step: a compiled optimizer would recompile on each), the gradient scaler,
EMA and mixing stay eager, as in a hand-written loop with ``torch.compile(model)``. The
plain module stays the run's model: state dicts, checkpoints and the returned weights carry
no ``_orig_mod.`` prefix. ``model.compile()`` is not used: it compiles ``Module._call_impl``,
and dynamo skips the ``forward`` of torch's own containers (an ``nn.Sequential`` model ran
eagerly, measured on torch 2.8).

Several replicas (``DistributedDataParallel``): each replica compiles the inner module and
DDP's reducer averages the gradients the compiled backward produces (the same gradients as
eager). ``torch.compile(DDP(model))`` (dynamo's DDPOptimizer, which splits the graph at
bucket boundaries so communication overlaps the backward) is the faster order torch
documents; the trainer's DDP forward takes the step function as an argument, so it is left
for a measured GPU change.

Recompiles: training batches all have one shape (the loop drops the ragged tail) and
validation and ``predict`` pad their last batch, so after the first epoch (its training
graph and its validation graph) nothing compiles again. Graphs are counted with dynamo's own
counter (``counters["stats"]["unique_graphs"]``: one per compiled graph, graph breaks
included) and reported as ``compiles`` in the history, cumulative as XLA's; one that
appears after the first epoch is warned about once with dynamo's guard-failure reason.

Persistent caches: inductor's FX graph cache and AOTAutograd cache are turned on and kept
in a folder that outlives the session (:func:`cache_folder`), by setting
``TORCHINDUCTOR_CACHE_DIR`` for the run (Triton's kernels go under it too), so a fresh
process compiles the same model from the cache (hits in
``counters["inductor"]["fxgraph_cache_hit"]`` and ``counters["aot_autograd"]["autograd_cache_hit"]``).

XLA (TPU and simulated cores) is refused before any device time: XLA compiles the whole
step as one graph already. There is no ``"auto"``: compiling pays minutes up front and some
models train slower compiled on a T4 (issue 45), so it is asked for, not chosen.
"""
from __future__ import annotations

import contextlib
import copy
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import torch

from .. import runtime
from ..runtime.fresh import child_env, run_fresh
from ..utils.suggest import choice

__all__ = ["COMPILE_MODES", "BACKEND_ENV", "CompileError", "check_compile_option", "compile_mode",
           "refuse_on_xla", "cache_folder", "persistent_cache", "compile_caches", "cache_counts", "CompiledRun",
           "inference_module", "graph_breaks", "graph_breaks_report"]

COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
# torch.compile's backend: inductor; "aot_eager" (dynamo and AOTAutograd without inductor's
# code generation) separates a dynamo problem from an inductor one, and lets tests check the
# trainer's promises without a C++ compiler's minutes.
BACKEND_ENV = "XLA_UTILS_COMPILE_BACKEND"
_GRAPHS = ("stats", "unique_graphs")
_SECONDS = "_compile.compile_inner"


class CompileError(ValueError):
    """A ``compile=`` setting the run cannot use; the message says why and the fix."""


def check_compile_option(value: Any, name: str = "compile") -> bool | str:
    """``compile=`` as the run reads it: False (also None), True, or one of
    :data:`COMPILE_MODES` (any case; a near miss refused with a suggestion).

    Raises:
        ValueError: anything else.
    """
    if value is None or isinstance(value, bool):
        return bool(value)
    if isinstance(value, str):
        return choice(value, COMPILE_MODES, name, "True/False")
    raise ValueError(f"{name} must be True, False or a torch.compile mode "
                     f"({', '.join(map(repr, COMPILE_MODES))}), got {value!r}")


def compile_mode(value: bool | str) -> str | None:
    """The ``torch.compile`` mode of a checked ``compile=`` value (None: eager)."""
    if not value:
        return None
    return "default" if value is True else str(value)


def refuse_on_xla(value: bool | str, placement: runtime.Placement, *, mesh: bool) -> None:
    """Refuse ``compile=`` on XLA in the calling process, before any device time.

    Args:
        value: The checked ``compile=`` value.
        placement: Where the run happens (its backend: XLA on a TPU or simulated cores).
        mesh: A mesh strategy (``"spmd"``/``"fsdp"``, XLA only).

    Raises:
        CompileError: ``value`` is on and the run is on XLA.
    """
    if value and (placement.backend == "xla" or mesh):
        raise CompileError(
            f"compile={value!r} is for the torch backend (CUDA GPUs, the CPU): on XLA (a TPU, "
            "simulated cores, strategy 'spmd'/'fsdp') the whole training step is already one "
            "compiled XLA graph, cached by compile_cache=. Fix: drop compile= (compile=False)")


def cache_folder(option: Any, checkpoint_dir: str | os.PathLike | None) -> Path | None:
    """Where inductor's caches are kept for ``compile_cache=`` ``option``.

    A folder: ``<folder>/inductor``. ``"auto"`` / True: beside the checkpoints
    (``<checkpoint_dir>/inductor_cache``), else under
    :func:`xla_utils.runtime.default_compile_cache_root` (``/kaggle/working/...`` on Kaggle,
    kept with a saved notebook version). None / False: None (inductor's own folder under
    the temporary directory, which a new session does not have).
    """
    if option is None or option is False:
        return None
    if option in ("auto", True):
        if checkpoint_dir is not None:
            return Path(checkpoint_dir).expanduser() / "inductor_cache"
        return runtime.default_compile_cache_root() / "inductor"
    return Path(option).expanduser() / "inductor"


@contextlib.contextmanager
def persistent_cache(folder: Path | None) -> Iterator[None]:
    """Inductor's FX graph cache and AOTAutograd cache on, in ``folder`` (None: inductor's
    default folder), for the block; the caller's ``TORCHINDUCTOR_CACHE_DIR`` is restored
    after it."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    saved = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    flags = (inductor_config.fx_graph_cache, functorch_config.enable_autograd_cache)
    inductor_config.fx_graph_cache = functorch_config.enable_autograd_cache = True
    if folder is not None:
        folder.mkdir(parents=True, exist_ok=True)
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(folder)
        _clear_path_caches()
    try:
        yield
    finally:
        inductor_config.fx_graph_cache, functorch_config.enable_autograd_cache = flags
        if folder is not None:
            if saved is None:
                os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
            else:
                os.environ["TORCHINDUCTOR_CACHE_DIR"] = saved
            _clear_path_caches()


@contextlib.contextmanager
def compile_caches(value: bool | str, cache_option: Any,
                   checkpoint_dir: str | os.PathLike | None) -> Iterator[None]:
    """:func:`persistent_cache` in :func:`cache_folder`'s folder when ``compile=`` ``value``
    is on; nothing at all when it is off."""
    if compile_mode(value) is None:
        yield
        return
    with persistent_cache(cache_folder(cache_option, checkpoint_dir)):
        yield


def _clear_path_caches() -> None:
    """Inductor's in-memory caches of folder paths, forgotten after a change of folder
    (what torch's own ``temporary_cache_dir`` does; absent in some versions)."""
    try:
        from torch._inductor.utils import clear_caches
    except ImportError:
        return
    clear_caches()


def cache_counts() -> dict[str, int]:
    """This process's persistent-cache counters so far: FX graph and AOTAutograd cache hits
    and misses (dynamo's ``counters``)."""
    from torch._dynamo.utils import counters

    return {"fxgraph_hit": counters["inductor"]["fxgraph_cache_hit"],
            "fxgraph_miss": counters["inductor"]["fxgraph_cache_miss"],
            "autograd_hit": counters["aot_autograd"]["autograd_cache_hit"],
            "autograd_miss": counters["aot_autograd"]["autograd_cache_miss"]}


def _graphs() -> int:
    from torch._dynamo.utils import counters

    return counters[_GRAPHS[0]][_GRAPHS[1]]


def _seconds() -> float:
    import torch._dynamo.utils as dynamo_utils

    return float(sum(getattr(dynamo_utils, "compilation_time_metrics", {}).get(_SECONDS, ())))


def _failure_log() -> dict[Any, list[Any]]:
    """Dynamo's recompile reasons per code object (``torch._dynamo.utils.guard_failures``;
    empty where a torch version has no such record: the warning then names no reason)."""
    import torch._dynamo.utils as dynamo_utils

    return getattr(dynamo_utils, "guard_failures", {})


def _guard_failures() -> dict[Any, int]:
    return {code: len(reasons) for code, reasons in _failure_log().items()}


def _new_failures(before: dict[Any, int]) -> list[str]:
    """Dynamo's recompile reasons recorded since ``before`` (``_guard_failures()``)."""
    out = []
    for code, reasons in list(_failure_log().items()):
        for r in reasons[before.get(code, 0):]:
            out.append(f"{getattr(code, 'co_name', code)}: {str(r).strip()}")
    return out


def backend() -> str:
    """``torch.compile``'s backend: ``$XLA_UTILS_COMPILE_BACKEND`` or ``"inductor"``."""
    return os.environ.get(BACKEND_ENV, "").strip() or "inductor"


def _compile(module: torch.nn.Module, mode: str) -> torch.nn.Module:
    name = backend()
    if name != "inductor":  # modes are inductor's; other backends take none
        return torch.compile(module, backend=name)
    return torch.compile(module, mode=mode)


@dataclass
class CompiledRun:
    """The compiled forward of one fit run in one replica, and what it compiled.

    Attributes:
        mode: The ``torch.compile`` mode.
        folder: Where inductor's caches are kept (None: inductor's default folder).
        words: What was chosen and why, for the run's first line.
    """

    mode: str
    folder: Path | None
    words: str
    _graphs0: int = 0
    _seconds0: float = 0.0
    _cache0: dict[str, int] = field(default_factory=dict)
    _settled: int | None = None  # graphs after the first epoch
    _failures: dict[Any, int] = field(default_factory=dict)
    _warned: bool = False
    _last_seconds: float = 0.0
    _modules: dict[int, torch.nn.Module] = field(default_factory=dict)

    @classmethod
    def start(cls, value: bool | str, cache_option: Any, checkpoint_dir: Any,
              device: torch.device) -> "CompiledRun | None":
        """The run's compiled forward for a checked ``compile=`` ``value`` (None: eager),
        its caches in :func:`cache_folder` (enter :func:`persistent_cache` around the run)."""
        mode = compile_mode(value)
        if mode is None:
            return None
        folder = cache_folder(cache_option, checkpoint_dir)
        where = (f"inductor cache {folder}" if folder is not None else
                 "inductor cache in the temporary folder (compile_cache=None)")
        name = backend()
        words = (f"torch.compile mode {mode!r} (asked, on {device.type}; {where})"
                 if name == "inductor" else
                 f"torch.compile backend {name!r} (${BACKEND_ENV}, on {device.type})")
        run = cls(mode, folder, words)
        run._graphs0, run._seconds0, run._cache0 = _graphs(), _seconds(), cache_counts()
        run._last_seconds = run._seconds0
        return run

    def module(self, model: torch.nn.Module) -> torch.nn.Module:
        """``model``'s compiled forward (one wrapper per module, made on first use)."""
        key = id(model)
        if key not in self._modules:
            self._modules[key] = _compile(model, self.mode)
        return self._modules[key]

    def epoch_end(self, epoch: int) -> tuple[dict[str, Any], str | None]:
        """``({"compiles": graphs so far in the run, "compile_seconds": this epoch's}, the
        recompile warning or None)`` at the end of 0-based ``epoch`` (validation included).
        The warning comes once, for the first graph compiled after the first epoch."""
        graphs, seconds = _graphs() - self._graphs0, _seconds()
        fields = {"compiles": graphs, "compile_seconds": seconds - self._last_seconds}
        self._last_seconds = seconds
        if self._settled is None:
            self._settled, self._failures = graphs, _guard_failures()
            return fields, None
        if graphs <= self._settled or self._warned:
            return fields, None
        self._warned = True
        why = _new_failures(self._failures) or ["no guard failure recorded (a new code path)"]
        return fields, (f"compile: epoch {epoch + 1} compiled {graphs - self._settled} new "
                        f"graph(s) after the first epoch ({'; '.join(why[:3])}). Every batch "
                        "has one shape, so a recompile means something else changed between "
                        "steps (a Python value the model branches on, the train/eval mode, "
                        "grad mode); each costs the first epoch's compile time again, and "
                        "after torch._dynamo.config.recompile_limit graphs dynamo runs the "
                        "model eagerly")

    def summary(self) -> str:
        """One line for the history: graphs compiled, seconds, and the persistent cache's
        hits in this run."""
        now = cache_counts()
        d = {k: now[k] - self._cache0.get(k, 0) for k in now}
        where = self.folder if self.folder is not None else "inductor's temporary folder"
        return (f"torch.compile ({self.mode}): {_graphs() - self._graphs0} graph(s) in "
                f"{_seconds() - self._seconds0:.1f} s; inductor cache ({where}): "
                f"{d['fxgraph_hit']} FX graph hit(s), {d['fxgraph_miss']} miss(es), "
                f"{d['autograd_hit']} AOTAutograd hit(s), {d['autograd_miss']} miss(es)")


def inference_module(model: torch.nn.Module, value: bool | str,
                     device: torch.device) -> tuple[torch.nn.Module, str]:
    """``(model compiled for predict / evaluate, in words)``; every batch there has one padded
    shape, so on CUDA ``compile=True`` is mode ``"reduce-overhead"`` (CUDA graphs: one
    launch per batch); an explicit mode is kept; elsewhere the default mode. ``(model, "")``
    when ``value`` is off."""
    mode = compile_mode(value)
    if mode is None:
        return model, ""
    why = "asked"
    if value is True and device.type == "cuda":
        mode, why = "reduce-overhead", "compile=True: CUDA graphs, every batch has one shape"
    name = backend()
    words = (f"torch.compile mode {mode!r} ({why})" if name == "inductor" else
             f"torch.compile backend {name!r} (${BACKEND_ENV})")
    return _compile(model, mode), words


def graph_breaks(model: torch.nn.Module, x: torch.Tensor) -> str:
    """Where and why dynamo breaks ``model``'s forward into several graphs, for ``check()``:
    ``torch._dynamo.explain`` of one forward of ``x`` on a CPU copy of ``model`` (no
    compiling, no device)."""
    import torch._dynamo

    m = copy.deepcopy(model).cpu().eval()
    try:
        with torch.no_grad():
            out = torch._dynamo.explain(m)(x.cpu())
    except Exception as exc:  # explain itself failing must not stop check()
        return f"compile: graph breaks not found ({type(exc).__name__}: {str(exc)[:200]})"
    if not out.graph_break_count:
        return f"compile: the model's forward is one graph ({out.graph_count} graph, no breaks)"
    lines = [f"compile: the model's forward breaks into {out.graph_count} graphs "
             f"({out.graph_break_count} graph break(s); each break runs eagerly between graphs):"]
    for r in out.break_reasons[:10]:
        frame = r.user_stack[-1] if r.user_stack else None
        where = f"{frame.filename}:{frame.lineno} ({frame.name})" if frame is not None else "?"
        lines.append(f"  - {where}: {str(r.reason).strip().splitlines()[0][:200]}")
    return "\n".join(lines)


def graph_breaks_report(model: torch.nn.Module, x: torch.Tensor, timeout: float = 600) -> str:
    """:func:`graph_breaks` in a fresh interpreter, for ``check()`` in the notebook: dynamo's
    tracing asks torch's CUDA driver for its devices, after which this process could no
    longer fork replicas that use CUDA (measured: ``torch.cuda._is_in_bad_fork()`` in a child
    forked after ``torch._dynamo.explain``, also with ``PYTORCH_NVML_BASED_CUDA_CHECK=1``)."""
    try:
        return run_fresh(graph_breaks, (model, x.cpu()), env=child_env(), timeout=timeout,
                         what="check()'s graph-break search", echo=False)
    except Exception as exc:  # the search failing must not stop check()
        return f"compile: graph breaks not found ({type(exc).__name__}: {str(exc)[:200]})"
