"""XLA counters: what compiled, ran and crossed the host/device boundary.

(Validation scores are :mod:`xla_utils.train.metrics`; the word "metrics" means only those.)
"""
from __future__ import annotations

from typing import Any

from .world import backend
from .xla import load_xla

__all__ = ["xla_counters", "xla_counters_report"]


def xla_counters() -> dict[str, Any]:
    """A snapshot of this process's XLA counters (zeros on the torch backend).

    Returns:
        ``compiles`` (graphs compiled, ``UncachedCompile``), ``compile_s``
        (seconds compiling), ``executions`` (graphs run), ``to_device`` and
        ``to_host`` (transfers), ``fallback_ops`` (``{"aten::op": count}`` run
        on the host CPU); from the persistent compilation cache
        (:mod:`~xla_utils.runtime.compile_cache`): ``cache_hits`` (graphs loaded
        instead of compiled, ``PersistentCacheHit``), ``cache_misses`` (looked up,
        not there) and ``cache_load_failures`` (found but not loadable,
        ``PersistentCacheDeserializeFailure``: every entry on XLA:CPU).
    """
    snap = {"compiles": 0, "compile_s": 0.0, "executions": 0, "to_device": 0,
            "to_host": 0, "fallback_ops": {}, "cache_hits": 0, "cache_misses": 0,
            "cache_load_failures": 0}
    if backend() != "xla":
        return snap
    met = load_xla()["met"]

    def count(name: str) -> int:
        v = met.counter_value(name)
        return int(v) if v is not None else 0

    def metric_count_sum(name: str) -> tuple[int, float]:
        data = met.metric_data(name)
        return (int(data[0]), float(data[1])) if data else (0, 0.0)

    snap["compiles"] = count("UncachedCompile")
    snap["cache_hits"] = count("PersistentCacheHit")
    snap["cache_misses"] = count("PersistentCacheMiss")
    snap["cache_load_failures"] = count("PersistentCacheDeserializeFailure")
    snap["compile_s"] = metric_count_sum("CompileTime")[1] / 1e9
    # one process owning every device (SPMD) runs its graphs as ExecuteReplicated
    snap["executions"] = (metric_count_sum("ExecuteTime")[0]
                          + metric_count_sum("ExecuteReplicatedTime")[0])
    snap["to_device"] = metric_count_sum("TransferToDeviceTime")[0]
    snap["to_host"] = metric_count_sum("TransferFromDeviceTime")[0]
    snap["fallback_ops"] = {
        n: count(n) for n in met.counter_names() if n.startswith("aten::")
    }
    return snap


def xla_counters_report(before: dict[str, Any], after: dict[str, Any], steps: int) -> str:
    """Explain in words what happened between two :func:`xla_counters` snapshots.

    Args:
        before, after: Snapshots from :func:`xla_counters`.
        steps: Training steps between them (at least 1 is assumed).
    """
    d = {k: after[k] - before[k] for k in ("compiles", "compile_s", "executions",
                                          "to_device", "to_host")}
    steps = max(int(steps), 1)
    lines = [
        f"{steps} steps: {d['compiles']} XLA compilations "
        f"({d['compile_s']:.1f} s compiling), {d['executions']} graph executions "
        f"({d['executions'] / steps:.1f} per step), {d['to_device']} host->device and "
        f"{d['to_host']} device->host transfers ({d['to_host'] / steps:.1f} per step)."
    ]
    fb = {k: after["fallback_ops"].get(k, 0) - before["fallback_ops"].get(k, 0)
          for k in after["fallback_ops"]}
    fb = {k: v for k, v in fb.items() if v > 0}
    if fb:
        ops = ", ".join(f"{k} x{v}" for k, v in sorted(fb.items(), key=lambda kv: -kv[1]))
        lines.append(f"CPU fallbacks (ops XLA could not lower, run on the host): {ops}.")
    else:
        lines.append("No CPU-fallback ops.")
    if d["to_host"] > steps:
        lines.append(
            "More than one device->host transfer per step: a .item(), print or "
            "Python condition on a tensor forces the host to wait every step."
        )
    return "\n".join(lines)
