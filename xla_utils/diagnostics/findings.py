"""What :func:`xla_utils.check` found, in words a user can act on.

The verdict and its findings: :class:`Finding` (code, severity, message, fix),
:class:`ReadinessReport` (what ``check`` returns: ``"READY"``, ``"READY, could be
faster (n suggestions)"`` or ``"NOT READY (...)"``) and the rules that turn the
measurements of :mod:`xla_utils.diagnostics.readiness`'s forked child into findings, with the TPU
figures they are judged against (:data:`TPU_CHIPS`). Pure Python: nothing here runs a
step or imports torch_xla.

Severities, most serious first: ``"error"`` (the run would fail or be many times
slower), ``"warning"`` (TPU time wasted every step by something in the user's step:
recompiles, host syncs, CPU fallbacks, dynamic shapes, float64/float16), ``"suggestion"``
(it runs well and could run faster: matrix-unit padding of the architecture's widths, a
loader slower than the chip) and ``"info"`` (a measurement, nothing to do). Errors or
warnings make the verdict ``NOT READY``; suggestions alone ``READY, could be faster``.
"""
from __future__ import annotations

import re
import textwrap
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from .memory import strategy_advice
from ..env.tpus import TPU_CHIPS, TPUChip
from ..utils.units import format_bytes

__all__ = ["Finding", "ReadinessReport", "ReadinessError", "CODES",
           "SEVERITIES", "UTILIZATION", "HBM_USABLE", "WARMUP_STEPS", "DYNAMIC_OPS",
           "resolve_tpu", "findings_from", "padding_finding", "memory_finding", "input_finding",
           "pad_to"]


CODES = ("recompile", "host_sync", "cpu_fallback", "dynamic_shape", "f64", "f16", "padding",
         "memory", "input_bound", "strategy")
SEVERITIES = ("error", "warning", "suggestion", "info")
# Steps 1 and 2 warm up, as in fit: step 1 compiles the step; step 2 may compile it once
# more, because the optimizer's state and the model's buffers are now the outputs of
# step 1 (an int64 counter such as BatchNorm's num_batches_tracked, copied from the host,
# cannot be donated to step 1's graph but can to step 2's). Every step from 3 on must
# reuse those graphs: that is what "recompile" and debug() judge.
WARMUP_STEPS = 2

# Fraction of the chip's bf16 peak a well-fed training step reaches; the TPU step
# rate behind ``input_bound`` assumes it (typical for convnets / small transformers).
UTILIZATION = 0.4
# Share of HBM a step may use; XLA keeps the rest for its own temporaries.
HBM_USABLE = 0.9
# Padding waste (FLOP-weighted over all matmuls/convolutions) that makes a
# suggestion, and the smaller share that makes an info note.
PADDING_SUGGEST = 0.25
PADDING_INFO = 0.10
# A loader (not a uint8 cache) that would keep the chip waiting at least this share of
# the time makes a warning; a slower-than-the-chip loader otherwise is a suggestion.
INPUT_WAIT_WARN = 0.5


@dataclass(frozen=True)
class Finding:
    """One problem (or note) found by :func:`check`.

    Attributes:
        code: one of :data:`CODES` (``"recompile"``, ``"host_sync"``, ...).
        severity: ``"error"`` (the run would fail or be many times slower),
            ``"warning"`` (TPU time wasted every step by the step itself),
            ``"suggestion"`` (it runs; this would make it faster) or ``"info"`` (a
            measurement, no action needed). See the module docstring.
        message: what was measured and where, in words.
        fix: what to change.
    """

    code: str
    severity: str
    message: str
    fix: str

    def __post_init__(self) -> None:
        if self.severity not in SEVERITIES:
            raise ValueError(f"severity must be one of {SEVERITIES}, got {self.severity!r}")

    def __str__(self) -> str:
        head = f"[{self.severity}] {self.code}: "
        body = textwrap.fill(self.message, 100, initial_indent=head, subsequent_indent="    ")
        if self.fix:
            body += "\n" + textwrap.fill(self.fix, 100, initial_indent="    fix: ",
                                         subsequent_indent="         ")
        return body


@dataclass
class ReadinessReport:
    """What :func:`check` returns. :func:`check` prints :attr:`report` (the verdict and the
    findings) once when it is ready; ``str(report)`` is the one-line verdict, so
    ``print(xla_utils.check(...))`` does not show the report twice.

    Attributes:
        findings: the :class:`Finding` list, errors first.
        tpu: the TPU generation the estimates are for (``"v5e"``, ...).
        batch_size: per-core batch (rows of the checked batch).
        steps: training steps run on XLA:CPU.
        per_step: XLA counter deltas of every step (``compiles``, ``executions``,
            ``to_device``, ``to_host``, ``fallback_ops``).
        losses: the loss of every step (read after the last step).
        seconds: wall time of the whole check.
        measurements: the raw numbers behind the findings (FLOPs per sample,
            bytes of parameters / gradients / optimizer state / activations,
            loader samples/s, ...).
        inputs: the input layout seen and what is done with it, in words
            (``"inputs: uint8 [B,3,32,32] channels-first images (torch.Tensor),
            normalised and flipped on the device"``); empty when ``prepare`` was given
            without a description.
        step: the training step that ran, in words (the trainer's: optimizer, one-cycle
            LR and momentum, accumulation, EMA, mixing).
        device_check: ``trainer.check()``'s report on the GPU or CPU this notebook trains
            on (a :class:`~xla_utils.diagnostics.device_check.DeviceCheckReport`), or None.
    """

    findings: list[Finding]
    tpu: str = "v5e"
    batch_size: int = 0
    steps: int = 0
    per_step: list[dict[str, Any]] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    seconds: float = 0.0
    measurements: dict[str, Any] = field(default_factory=dict, repr=False)
    inputs: str = ""
    step: str = ""
    device_check: Any = None

    @property
    def ok(self) -> bool:
        """True when no finding is an error or a warning (suggestions may remain)."""
        return not any(f.severity in ("error", "warning") for f in self.findings)

    @property
    def codes(self) -> list[str]:
        """Codes of all findings, in report order (info notes included)."""
        return [f.code for f in self.findings]

    @property
    def errors(self) -> list[Finding]:
        """Findings of severity ``"error"``."""
        return [f for f in self.findings if f.severity == "error"]

    @property
    def suggestions(self) -> list[Finding]:
        """Findings of severity ``"suggestion"``: it would run faster with them."""
        return [f for f in self.findings if f.severity == "suggestion"]

    @property
    def verdict(self) -> str:
        """``"NOT READY (1 error, 2 warnings)"`` (errors or warnings), ``"READY, could be
        faster (2 suggestions)"`` (suggestions only) or ``"READY"``."""
        n = Counter(f.severity for f in self.findings)
        if not self.ok:
            return "NOT READY (" + ", ".join(_count(n[s], s) for s in ("error", "warning")
                                            if n[s]) + ")"
        if n["suggestion"]:
            return f"READY, could be faster ({_count(n['suggestion'], 'suggestion')})"
        return "READY"

    def __str__(self) -> str:
        return f"xla_utils.check for TPU {self.tpu}: {self.verdict}"

    @property
    def report(self) -> str:
        """The whole report as text: the verdict, what ran and every finding."""
        losses = ""
        if self.losses:
            losses = f"; loss {self.losses[0]:.4g} -> {self.losses[-1]:.4g}"
        compiles = [s["compiles"] for s in self.per_step]
        late = any(compiles[WARMUP_STEPS:])
        lines = [f"xla_utils.check for TPU {self.tpu}: {self.verdict}",
                 f"  per-core batch {self.batch_size}, {self.steps} training steps on one XLA:CPU "
                 f"device in {self.seconds:.0f} s{losses}"]
        if self.step:
            lines.append(f"  step: {self.step}")
        if self.inputs:
            lines.append(f"  {self.inputs}")
        if len(compiles) > WARMUP_STEPS:
            lines.append(f"  compiles per step {compiles}: steps 1-{WARMUP_STEPS} warm up, "
                         + ("later steps compiled again (see recompile)" if late else
                            f"steps {WARMUP_STEPS + 1}.. reused the compiled graph"))
        lines += [textwrap.indent(str(f), "  ") for f in self.findings]
        return "\n".join(lines)

    def __repr__(self) -> str:  # the report itself is printed by check()
        return (f"<ReadinessReport for TPU {self.tpu}: {self.verdict}; codes {self.codes}; "
                "print(report.report) for the findings>")


def _count(n: int, what: str) -> str:
    return f"{n} {what}{'s' if n != 1 else ''}"


class ReadinessError(RuntimeError):
    """Raised by ``OneCycleTrainer.fit(check=True)`` when :func:`check` found errors.

    ``report`` is the :class:`ReadinessReport`.
    """

    def __init__(self, report: ReadinessReport):
        self.report = report
        codes = ", ".join(sorted({f.code for f in report.errors}))
        errors = "\n".join(textwrap.indent(str(f), "  ") for f in report.errors)
        super().__init__(  # check() printed the whole report already: the errors only
            f"xla_utils.check found errors that would waste TPU time ({codes}):\n{errors}\n"
            "Fix them (the whole report is printed above and in error.report.report), or call "
            "fit(check=False) to train anyway.")



def resolve_tpu(tpu: str | TPUChip | None) -> TPUChip:
    """The :class:`TPUChip` for ``tpu`` (None: this machine's TPU, else v5e; a
    :class:`TPUChip` is used as given, e.g. for a generation not listed here)."""
    if isinstance(tpu, TPUChip):
        return tpu
    if tpu is None:
        try:
            from .. import env

            info = env.detect()
            gen = info.tpu_generation if info.accelerator == "tpu" else None
        except Exception:  # detection must never block a check
            gen = None
        if gen == "v2/v3":
            gen = "v2"  # the smaller HBM: the memory verdict stays safe
        return TPU_CHIPS.get(gen or "v5e", TPU_CHIPS["v5e"])
    m = re.fullmatch(r"\s*(v\d+[a-z]*)(?:-\d+)?\s*", str(tpu).lower())
    if not m or m.group(1) not in TPU_CHIPS:
        raise ValueError(f"unknown TPU {tpu!r}; known generations: {', '.join(TPU_CHIPS)} "
                         "(a slice name such as 'v5e-8' also works)")
    return TPU_CHIPS[m.group(1)]



DYNAMIC_OPS = {"nonzero": "nonzero", "argwhere": "nonzero", "masked_select": "masked_select",
                "_unique": "unique", "_unique2": "unique", "unique_dim": "unique",
                "unique_consecutive": "unique_consecutive", "nonzero_static": None}


def pad_to(n: int, m: int) -> int:
    return -(-int(n) // m) * m


# ---------------------------------------------------------------------------
# Findings from measurements (pure Python, runs in the caller)
# ---------------------------------------------------------------------------
def findings_from(meas: dict[str, Any], chip: TPUChip) -> list[Finding]:
    """Every finding the measurements of one check support, errors first."""
    found: list[Finding] = []
    found += _recompile_findings(meas)
    found += _op_findings(meas)
    found += _dtype_findings(meas)

    # padding ----------------------------------------------------------------
    if meas.get("matmuls"):
        f = padding_finding(meas["matmuls"], meas["batch_rows"], chip)
        if f is not None:
            found.append(f)

    # memory -----------------------------------------------------------------
    if meas.get("activation_bytes") is not None:
        found.append(memory_finding(meas, chip))

    # input_bound --------------------------------------------------------------
    if meas.get("loader") is not None:
        found.append(input_finding(meas, chip))

    if meas.get("cpu_error"):
        found.append(Finding(
            "memory", "info",
            f"the CPU analysis pass failed ({meas['cpu_error']}), so activation memory, FLOPs, "
            "padding and intermediate dtypes were not measured; the XLA counters above still were.",
            "make the model run on the CPU too (it must for this check), or read the other findings."))
    order = {s: i for i, s in enumerate(SEVERITIES)}
    found.sort(key=lambda f: order[f.severity])
    return found


def _recompile_findings(meas: dict[str, Any]) -> list[Finding]:
    """Steps after the warm-up (:data:`WARMUP_STEPS`) that compiled a new graph, and what changed."""
    per_step = meas["per_step"]
    steady = per_step[WARMUP_STEPS:]
    bad = [i + WARMUP_STEPS + 1 for i, s in enumerate(steady) if s["compiles"]]
    if not bad:
        return []
    why = []
    for ch in [c for c in meas["recompile_changes"] if c["step"] in bad][:2]:
        g = ch["graph"]
        if ch["shapes"]:
            why.append(f"step {ch['step']}: " + "; ".join(ch["shapes"]))
        elif g["added"] or g["removed"]:
            why.append(f"step {ch['step']}: graph nodes changed, e.g. "
                       + "; ".join([f"now {l}" for l in g["added"][:2]]
                                   + [f"was {l}" for l in g["removed"][:1]]))
        else:
            why.append(f"step {ch['step']}: same ops and shapes, so a compiled-in constant "
                       "changed: a Python number in the step (XLA bakes 0, 1 and -1 into the "
                       "graph; other values only when they reach it as constants)")
    every = len(bad) == len(steady)
    n_after = sum(per_step[i - 1]["compiles"] for i in bad)
    after = f"after the {WARMUP_STEPS} warm-up steps"
    return [Finding(
        "recompile", "error" if every else "warning",
        (f"every step from {WARMUP_STEPS + 1} on compiled a new XLA graph ({n_after} compilations "
         f"{after}): the step's graph changes every step, and on a TPU each compilation of a "
         "real model takes tens of seconds, so every step would."
         if every else
         f"step{'s' if len(bad) > 1 else ''} {', '.join(map(str, bad))} compiled a new XLA graph "
         f"{after} ({_count(n_after, 'compilation')}; later steps reused them): the step has "
         "several graph variants, each compiled once on the TPU (tens of seconds each).")
        + (" What changed: " + " | ".join(why) + "." if why else ""),
        "keep every shape and Python value in the step fixed: pad or drop ragged batches, use "
        "fixed crop/resize sizes (or a few buckets), no step counters or random sizes inside "
        "forward, never let a scalar hit exactly 0 or 1, no Python branches on tensor values.")]


def _op_findings(meas: dict[str, Any]) -> list[Finding]:
    """Dynamic shapes, CPU-fallback ops and host syncs inside the step."""
    found: list[Finding] = []
    steady = meas["per_step"][1:]
    n_steady = max(len(steady), 1)
    places = meas.get("op_places") or {}
    fb_total: Counter = Counter()
    for s in steady:
        fb_total.update(s["fallback_ops"])
    dynamic_fb = {k: v for k, v in fb_total.items() if _fallback_base(k) in DYNAMIC_OPS}
    item_reads = fb_total.get("aten::_local_scalar_dense", 0)
    other_fb = {k: v for k, v in fb_total.items()
                if k not in dynamic_fb and k != "aten::_local_scalar_dense"}
    dyn = meas.get("dynamic") or {}
    if dyn or dynamic_fb:
        parts = [f"{label} {d['place']}".strip() for label, d in dyn.items()]
        parts += [f"{k} fell back to the CPU {v / n_steady:.0f}x per step" for k, v in dynamic_fb.items()]
        found.append(Finding(
            "dynamic_shape", "warning",
            "ops whose output shape depends on the values: " + "; ".join(parts) + ". XLA needs static "
            "shapes: each one stops the step, copies the data to the host and continues with a shape "
            "that may differ (and recompile) next step.",
            "keep the shape fixed: multiply by the mask or use torch.where(mask, x, 0) instead of "
            "x[mask]; masked sums/means (mask.sum()) instead of selecting; for unique/nonzero use a "
            "fixed-size alternative (one-hot, bincount with minlength, topk) or move it out of the step."))
    if other_fb:
        names = ", ".join(f"{k} ({v / n_steady:.0f}x per step"
                          + (f", {places[_fallback_base(k)]}" if places.get(_fallback_base(k)) else "")
                          + ")" for k, v in sorted(other_fb.items(), key=lambda kv: -kv[1]))
        found.append(Finding(
            "cpu_fallback", "warning",
            f"ops with no XLA lowering ran on the host CPU: {names}. Each one copies its inputs to "
            "the host, computes there and copies back, in the middle of the step.",
            "replace the op with one XLA lowers (e.g. lgamma/digamma via a series, median via "
            "sort/kthvalue, histc/bincount via one-hot sums), or compute it outside the training step."))
    transfers = sum(s["to_host"] for s in steady)
    explained = sum(v for k, v in fb_total.items() if k != "aten::_local_scalar_dense")
    syncs = max(transfers - explained, item_reads)
    if syncs:
        reads = meas.get("host_read_places") or {}
        where = (" Host reads (.item(), float(), `if tensor:`): "
                 + ", ".join(w for w in list(reads)[:3] if w) + ".") if any(reads) else \
            " No .item() was seen: look for print(tensor), .cpu(), .tolist() or .numpy() in the step."
        found.append(Finding(
            "host_sync", "warning",
            f"{syncs / n_steady:.0f} device-to-host transfer(s) per step inside the step: the host "
            "waits for the device, then traces the rest of the step as a separate graph, so the TPU "
            f"idles every step.{where}",
            "keep values on the device inside the step: no .item(), float(t), print(t), or Python "
            "`if`/`while` on tensors; accumulate metrics as tensors and read them every N steps "
            "(the trainer's log_every), check for NaN after the epoch."))
    return found


def _dtype_findings(meas: dict[str, Any]) -> list[Finding]:
    """float64 and float16 in parameters, inputs or intermediate results."""
    found: list[Finding] = []
    lowp = meas.get("low_precision") or {}
    ir_lowp = meas.get("ir_low_precision") or {}
    for dtype, code, fix in (
        ("float64", "f64", "use float32 (and bfloat16 for speed on the TPU): model.float(), "
                           "x.float() / torch.from_numpy(a).float() for NumPy data (NumPy's default "
                           "is float64), dtype=torch.float32 in torch.tensor/arange/zeros; train in "
                           "bfloat16 with torch.autocast('xla', dtype=torch.bfloat16) or precision='bf16'."),
        ("float16", "f16", "TPUs have no float16 units: use bfloat16 (model.to(torch.bfloat16) or "
                           "torch.autocast('xla', dtype=torch.bfloat16), the trainer's precision='bf16') "
                           "and drop .half(), torch.cuda.amp and GradScaler (bfloat16 needs no loss "
                           "scaling)."),
    ):
        parts = []
        pnames = (meas.get("param_dtypes") or {}).get(dtype, [])
        if pnames:
            parts.append(f"{len(pnames)} parameter tensor(s) ({', '.join(pnames[:3])}"
                         f"{', ...' if len(pnames) > 3 else ''})")
        if dtype in meas.get("input_dtypes", []):
            parts.append("the input batch")
        d = lowp.get(dtype)
        if d:
            ex = "; ".join(d["examples"])
            parts.append(f"{d['count']} intermediate result(s) in the forward pass, e.g. {ex}")
        elif ir_lowp.get(dtype):
            parts.append(f"{ir_lowp[dtype]} node(s) of the XLA graph")
        if parts:
            slow = "TPUs emulate float64 in software, many times slower" if code == "f64" else \
                "TPUs have no native float16: XLA converts around every op"
            found.append(Finding(code, "warning", f"{dtype} in " + "; ".join(parts) + f". {slow}.",
                                 fix))
    return found


def _fallback_base(counter: str) -> str:
    return counter.split("::", 1)[-1].split(".", 1)[0]


def _nearest_efficient(n: int, unit: int) -> str:
    lo, hi = (n // unit) * unit, pad_to(n, unit)
    if lo and n - lo <= hi - n:
        return f"{lo}"
    return f"{hi}" if not lo else f"{lo} or {hi}"


def padding_finding(matmuls: list[dict[str, Any]], batch_rows: int, chip: TPUChip) -> Finding | None:
    lanes = chip.mxu
    actual_total = padded_total = 0.0
    layers: dict[str, dict[str, Any]] = {}
    for mm in matmuls:
        if mm["depthwise"]:
            continue  # depthwise convolutions run on the vector unit, not the MXU
        m, k, n = mm["m"], mm["k"], mm["n"]
        pk = k if mm["k_fixed"] else pad_to(k, lanes)
        pn = n if mm["n_fixed"] else pad_to(n, lanes)
        scale = 2.0 * mm["groups"]
        actual = scale * m * k * n
        padded = scale * pad_to(m, 8) * pk * pn
        actual_total += actual
        padded_total += padded
        key = mm["module"] or mm["where"]
        lay = layers.setdefault(key, {"actual": 0.0, "padded": 0.0, "mm": mm})
        lay["actual"] += actual
        lay["padded"] += padded
    if padded_total <= 0:
        return None
    waste = 1.0 - actual_total / padded_total
    if waste < PADDING_INFO:
        return None
    # Layers of one shape and waste are reported together, worst wasted FLOPs first.
    groups: dict[tuple, dict[str, Any]] = {}
    for name, lay in layers.items():
        w = 1.0 - lay["actual"] / lay["padded"]
        mm = lay["mm"]
        g = groups.setdefault((mm["kind"], mm["width_in"], mm["n"], round(w, 2)),
                              {"names": [], "wasted": 0.0, "waste": w, "mm": mm})
        g["names"].append(name)
        g["wasted"] += lay["padded"] - lay["actual"]
    parts = []
    for g in sorted(groups.values(), key=lambda g: -g["wasted"]):
        if g["waste"] < 0.2 or len(parts) >= 3:
            continue
        mm = g["mm"]
        dims = []
        if not mm["n_fixed"] and mm["n"] % lanes:
            dims.append(f"{mm['n']} output features fill {mm['n']} of {pad_to(mm['n'], lanes)} lanes "
                        f"(nearest efficient: {_nearest_efficient(mm['n'], lanes)})")
        if not mm["k_fixed"] and mm["k"] % lanes:
            what = "input features" if mm["k"] == mm["width_in"] else \
                f"inputs per output ({mm['width_in']} channels x {mm['k'] // max(mm['width_in'] // mm['groups'], 1)} taps)"
            dims.append(f"{mm['k']} {what} fill {mm['k']} of {pad_to(mm['k'], lanes)}"
                        + (f" (nearest efficient: {_nearest_efficient(mm['k'], lanes)})"
                           if mm["k"] == mm["width_in"] else ""))
        if mm["m"] % 8:
            dims.append(f"{mm['m']} rows pad to {pad_to(mm['m'], 8)}")
        names = f"`{g['names'][0]}`" + (f" and {len(g['names']) - 1} more like it"
                                        if len(g["names"]) > 1 else "")
        parts.append(f"{names} ({mm['kind']} {mm['width_in']}->{mm['n']}): {g['waste']:.0%} "
                     "padding; " + ", ".join(dims))
    batch_note = ""
    if batch_rows % 8:
        batch_note = (f" The per-core batch {batch_rows} is not a multiple of 8 (rows are padded to "
                      f"{pad_to(batch_rows, 8)}).")
    # The architecture's widths: it runs as it is, it could run faster (not "NOT READY").
    sev = "suggestion" if waste >= PADDING_SUGGEST else "info"
    return Finding(
        "padding", sev,
        f"about {waste:.0%} of the matrix-unit work ({lanes}x{lanes} on {chip.name}) would be padding "
        "(FLOP-weighted over all matmuls and convolutions; dimensions set by the data or the number "
        f"of classes not counted). Worst layers: " + ("; ".join(parts) or "spread over many layers")
        + "." + batch_note,
        f"make layer widths (features, channels, attention head dims x heads) multiples of {lanes} "
        f"and the per-core batch a multiple of 8 (ideally {lanes}); widths below {lanes} waste the "
        "rest of the unit.")


def memory_finding(meas: dict[str, Any], chip: TPUChip) -> Finding:
    rows = max(meas["batch_rows"], 1)
    fixed = meas["param_bytes"] + meas["grad_bytes"] + meas["optimizer_state_bytes"]
    act, act_tiled = meas["activation_bytes"], meas["activation_bytes_tiled"]
    hbm = chip.hbm_per_device
    usable = hbm * HBM_USABLE
    total, total_tiled = fixed + act, fixed + act_tiled

    def largest(per_sample: float) -> int:
        if per_sample <= 0:
            return 0
        b = int((usable - fixed) // per_sample)
        return b - b % 8 if b >= 8 else max(b, 0)

    fit, fit_tiled = largest(act / rows), largest(act_tiled / rows)
    msg = (f"one step at per-core batch {rows} needs about {format_bytes(total)} (parameters "
           f"{format_bytes(meas['param_bytes'])} + gradients {format_bytes(meas['grad_bytes'])} + optimizer state "
           f"{format_bytes(meas['optimizer_state_bytes'])} + activations saved for backward {format_bytes(act)}; "
           f"{format_bytes(total_tiled)} if every activation is padded to TPU (8, 128) tiles) of "
           f"{format_bytes(hbm)} HBM per {chip.name} core. ")
    sharded_fix = None
    if (meas.get("tpu_devices") or 0) > 1 and meas.get("param_shapes"):  # per strategy (memory.py)
        states = round(meas["optimizer_state_bytes"] / max(meas["param_bytes"], 1))
        line, sharded_fix = strategy_advice(meas["param_shapes"], meas["param_bytes"], act, states,
                                            meas["tpu_devices"], usable, chip.name)
        msg += line + " "
    if fixed > usable:
        msg += "Parameters, gradients and optimizer state alone do not fit one core."
        return Finding("memory", "error", msg, sharded_fix or
                       "shrink the model, train in bfloat16 (model.to(torch.bfloat16)), use SGD "
                       "(one state tensor per parameter) instead of Adam (two), or pick a TPU with "
                       f"more HBM per core (v5p: {TPU_CHIPS['v5p'].hbm_gib:g} GiB).")
    def show(b: int) -> str:
        return "more than 65,536" if b > 65536 else f"about {b:,}"

    msg += f"Largest per-core batch that fits: {show(fit)}" + (
        f" ({show(fit_tiled)} with tile padding)." if show(fit_tiled) != show(fit) else ".")
    fix = ("lower the per-core batch (and raise the LR less), train in bfloat16 (halves "
           "activations: the trainer's precision='bf16'), or use activation checkpointing "
           "(torch.utils.checkpoint).")
    if total > usable:
        return Finding("memory", "error", msg + " The run would stop with an out-of-memory error.",
                       sharded_fix or fix)
    if total_tiled > usable:
        return Finding("memory", "warning", msg + " It may not fit once XLA pads the activations.", fix)
    return Finding("memory", "info", msg, "")


def _fmt_flops(n: float) -> str:
    for unit, scale in (("GFLOPs", 1e9), ("MFLOPs", 1e6), ("kFLOPs", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} FLOPs"


def input_finding(meas: dict[str, Any], chip: TPUChip) -> Finding:
    """``input_bound``: the loader's samples/s on this host against one TPU core's step rate,
    with a fix that fits the data seen (``meas["loader"]["kind"]``: ``"cache"`` for a uint8
    :class:`~xla_utils.data.CachedImageDataset`, ``"tensors"`` for a ``TensorDataset``,
    ``"dataset"``, ``"iterable"``)."""
    ld = meas["loader"]
    rate = ld["samples_per_s"]
    flops = meas.get("flops") or 0
    rows = max(meas["batch_rows"], 1)
    if not flops:
        return Finding("input_bound", "info",
                       f"the loader gives {rate:,.0f} samples/s here; the model's FLOPs could not be "
                       "counted (no matmul or convolution ran on the CPU), so no TPU rate to compare.",
                       "")
    per_sample = flops / rows
    tpu_rate = chip.flops_per_device * UTILIZATION / per_sample
    cpus = ld["host_cpus"]
    head = (f"the loader ({ld['source']}) gives {rate:,.0f} samples/s in one process on this "
            f"host ({cpus} vCPUs); one {chip.name} core would train about "
            f"{tpu_rate:,.0f} samples/s ({_fmt_flops(per_sample)} per sample forward+backward "
            f"at {UTILIZATION:.0%} of its {chip.flops_per_device / 1e12:.0f} bf16 TFLOP/s).")
    if rate >= tpu_rate:
        return Finding("input_bound", "info", head + " The host keeps up.", "")
    wait = 1 - rate / tpu_rate
    head += f" The TPU would wait for the host about {wait:.0%} of the time."
    workers = ld.get("workers")
    there = ("the TPU machine's own host (its vCPUs, not these) sets the real rate: run check() "
             "there to see it.")
    if ld.get("kind") in ("cache", "tensors"):  # nothing to decode: a cache would not help
        more = workers is None or workers < (cpus or 1)
        what = ("The data already is a uint8 cache: nothing is decoded per sample, the loader "
                "only copies batches." if ld["kind"] == "cache" else
                "The samples are tensors in memory (a TensorDataset): nothing is decoded, the "
                "loader only indexes and collates them.")
        return Finding(
            "input_bound", "suggestion", f"{head} {what}",
            (f"more loader workers: num_workers={cpus} (now {workers or 'none'}); " if more else
             f"nothing to change in the data or the loader ({workers} workers on {cpus} "
             "vCPUs); ") + there)
    return Finding(
        "input_bound", "warning" if wait >= INPUT_WAIT_WARN else "suggestion", head,
        "decode and resize once: build a uint8 cache with tpu_cache_ds / build_cache and train "
        "from CachedImageDataset; move normalisation, flips and casts onto the device "
        "(images_to_float); use more loader workers (num_workers) or smaller images; " + there)
