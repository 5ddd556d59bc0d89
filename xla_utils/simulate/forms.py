"""Which launch form a script or a function is: spawn, SPMD or torchrun.

A script's form is read from its tokens (:func:`detect_form`); a function's from the
names its code, and the code of the user functions and classes it names, uses
(:func:`fn_uses_spmd`). The runner (:mod:`.runner`) and the caller
(:func:`~.caller.run_replicas`) ask here before they start anything.
"""
from __future__ import annotations

import io
import os
import tokenize
import types
from pathlib import Path
from typing import Any, Callable

__all__ = ["FORMS", "SPMD_NAMES", "TORCHRUN_NAMES", "detect_form", "fn_uses_spmd"]

# Names whose presence in a script's code (not its comments or strings) marks SPMD.
SPMD_NAMES = ("use_spmd", "mark_sharding", "Mesh", "HybridMesh", "get_1d_mesh",
              "SpmdFullyShardedDataParallel", "input_sharding", "enable_spmd")
# Names whose presence in a script's code marks the torchrun form.
TORCHRUN_NAMES = ("is_torchelastic_launched",)
FORMS = ("auto", "spawn", "spmd", "torchrun")


def detect_form(path: str | os.PathLike) -> tuple[str, str]:
    """``("spmd", why)`` if the script's code names an SPMD API, ``("torchrun", why)``
    if it checks that torchrun launched it, else ``("spawn", why)``."""
    text = Path(path).read_text(encoding="utf-8", errors="replace")
    torchrun = None
    try:
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            if tok.type == tokenize.NAME and tok.string in SPMD_NAMES:
                return "spmd", f"it uses `{tok.string}` (line {tok.start[0]})"
            if tok.type == tokenize.NAME and tok.string in TORCHRUN_NAMES and not torchrun:
                torchrun = f"it checks `{tok.string}` (line {tok.start[0]})"
    except (tokenize.TokenError, SyntaxError, IndentationError):
        pass
    if torchrun:
        return "torchrun", torchrun
    return "spawn", ("it names no SPMD API (use_spmd, Mesh, mark_sharding, ...) and does not "
                     "check is_torchelastic_launched")


# Modules whose code is library code, not the user's program (not scanned).
_LIBRARY_PREFIXES = ("torch", "torch_xla", "torchvision", "xla_utils", "numpy", "builtins")


def _code_names(code: types.CodeType) -> list[tuple[str, types.CodeType]]:
    """``(name, code)`` for every global/attribute name of ``code`` and its nested code."""
    out = [(n, code) for n in code.co_names]
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            out.extend(_code_names(const))
    return out


def _user_code(obj: Any) -> list[tuple[types.CodeType, dict]]:
    """``(code, globals)`` of a user function, or of each method of a user class."""
    mod = getattr(obj, "__module__", "") or ""
    if mod.split(".")[0] in _LIBRARY_PREFIXES:
        return []
    if isinstance(obj, types.FunctionType):
        return [(obj.__code__, obj.__globals__)]
    if isinstance(obj, types.MethodType):
        return _user_code(obj.__func__)
    if isinstance(obj, type):
        found = []
        for value in vars(obj).values():
            value = getattr(value, "__func__", value)
            if isinstance(value, types.FunctionType):
                found.append((value.__code__, value.__globals__))
        return found
    call = getattr(type(obj), "__call__", None)  # functools.partial, callable objects
    inner = getattr(obj, "func", None)
    return _user_code(inner) if inner is not None else (
        _user_code(call) if isinstance(call, types.FunctionType) else [])


def fn_uses_spmd(fn: Callable[..., Any], depth: int = 4) -> str | None:
    """Why ``fn`` is an SPMD program (``"it uses `mark_sharding` (file:line)"``), or
    ``None``. Follows the user functions and classes ``fn`` names, ``depth`` deep."""
    seen: set[int] = set()
    todo = [(c, g, 0) for c, g in _user_code(fn)]
    while todo:
        code, glb, level = todo.pop()
        if id(code) in seen:
            continue
        seen.add(id(code))
        for name, where in _code_names(code):
            if name in SPMD_NAMES:
                return (f"it uses `{name}` ({where.co_filename}:"
                        f"{where.co_firstlineno}, in {where.co_name})")
            if level < depth and name in glb:
                try:
                    found = _user_code(glb[name])
                except Exception:  # an object whose attributes cannot be read: not code
                    found = []
                todo.extend((c, g, level + 1) for c, g in found)
    return None
