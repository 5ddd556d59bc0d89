"""Runs that outlive the session: when a fit run writes a checkpoint inside an epoch and when it
stops before its end (:class:`StopPlan` decided on the host, :class:`RunSession` asked by each
replica at the loop's loss reads).

Three triggers, all answered at the loop's loss reads (every ``log_every`` optimizer steps and
at an epoch's last step), where the replicas already exchange the loss on the host: there they
also exchange what each wants (:meth:`RunSession.at_read`), so every replica checkpoints or
stops at the same step without a host sync of its own.

* ``checkpoint_every`` (``config.checkpoints``): an in-epoch checkpoint every N optimizer steps
  or every duration (``"30min"``), at the first read past it.
* ``fit(time_limit=...)``: a duration, or ``"auto"`` on Kaggle/Colab (the session's limit less
  its age and :data:`AUTO_MARGIN_S`). A replica stops at the read where the next log window
  (as long as the last one) would end past the limit.
* SIGTERM and SIGINT (the notebook's interrupt) while ``fit`` waits: :func:`stop_signals` (in
  the process that called ``fit``) and each forked replica (:meth:`RunSession.catch_sigterm`)
  touch the run's stop file; every replica sees it (or a peer that saw it) at its next read.

After a stop the replicas write a checkpoint at that step and return; ``fit(resume="last")``
continues the same run at that step (:mod:`xla_utils.train.loop`'s exact resume).
"""
from __future__ import annotations

import contextlib
import math
import os
import re
import signal
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from .. import runtime

__all__ = ["StopPlan", "RunSession", "Decision", "parse_duration", "check_checkpoint_every",
           "checkpoint_interval", "resolve_time_limit", "run_deadline", "session_age_s",
           "stop_signals",
           "SESSION_LIMITS_S", "AUTO_MARGIN_S", "AUTO_CHECKPOINT_S", "TIME_LIMIT_REASON"]

# The platforms' session limits (seconds): Kaggle's TPU and GPU sessions (9 h; 12 h for CPU
# and GPU notebooks, 9 for TPU: the smaller one is used), Colab's longest (12 h; free
# sessions are often cut sooner, without notice).
SESSION_LIMITS_S = {"kaggle": 9 * 3600.0, "colab": 12 * 3600.0}
# time_limit="auto" leaves this much of the session for the checkpoint and the cells after
# fit (predict, the submission).
AUTO_MARGIN_S = 20 * 60.0
# checkpoint_every="auto" on a platform with a session limit: an in-epoch checkpoint every
# 30 minutes (measured: resnet50 with AdamW and EMA, 293 MiB, writes in 1.2-2.4 s: ~0.1%).
AUTO_CHECKPOINT_S = 30 * 60.0

TIME_LIMIT_REASON = 'stopped at the time limit; fit(resume="last") continues'

_UNITS = {"s": 1.0, "sec": 1.0, "secs": 1.0, "second": 1.0, "seconds": 1.0,
          "m": 60.0, "min": 60.0, "mins": 60.0, "minute": 60.0, "minutes": 60.0,
          "h": 3600.0, "hr": 3600.0, "hrs": 3600.0, "hour": 3600.0, "hours": 3600.0}


def parse_duration(value: Any, name: str) -> float:
    """Seconds of a duration: a number of seconds, or a string such as ``"30min"``,
    ``"1.5h"``, ``"90s"``, ``"8h30min"``.

    Raises:
        ValueError: not a positive duration; names ``name`` and the forms it takes.
    """
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if math.isfinite(value) and value > 0:
            return float(value)
    elif isinstance(value, str):
        text = value.strip().lower().replace(" ", "")
        parts = re.findall(r"(\d+(?:\.\d+)?)([a-z]+)", text)
        if parts and "".join(n + u for n, u in parts) == text and all(u in _UNITS for _, u in parts):
            total = sum(float(n) * _UNITS[u] for n, u in parts)
            if total > 0:
                return total
    raise ValueError(f"{name}={value!r} is not a duration: use seconds (a number) or a string "
                     "such as '30min', '1.5h', '90s', '8h30min'")


def check_checkpoint_every(value: Any) -> Any:
    """``checkpoint_every`` as stored: None, ``"auto"``, an int of optimizer steps >= 1, or a
    duration string (checked here, read by :func:`checkpoint_interval`).

    Raises:
        ValueError: anything else, with the forms it takes.
    """
    if value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
        return value
    if isinstance(value, str):
        value = value.strip().lower()
        if value == "auto":
            return value
        parse_duration(value, "checkpoint_every")
        return value
    raise ValueError(f"checkpoint_every={value!r}: use None (epoch checkpoints only), 'auto' "
                     "(every 30 minutes on Kaggle and Colab, else off), an int of optimizer "
                     "steps (e.g. 500) or a duration (e.g. '30min')")


def checkpoint_interval(value: Any, platform: str | None) -> tuple[int | None, float | None]:
    """``(steps, seconds)`` between in-epoch checkpoints for ``checkpoint_every`` (as
    :func:`check_checkpoint_every` keeps it) on ``platform`` (``"kaggle"``, ``"colab"`` or
    None): ``"auto"`` is :data:`AUTO_CHECKPOINT_S` where a session has a limit, else off."""
    if value is None:
        return None, None
    if value == "auto":
        return (None, AUTO_CHECKPOINT_S) if platform in SESSION_LIMITS_S else (None, None)
    if isinstance(value, int):
        return value, None
    return None, parse_duration(value, "checkpoint_every")


def session_age_s(proc: str = "/proc") -> float | None:
    """Seconds since this session's machine or container started: the age of PID 1 (in a
    container, its init: Kaggle's and Colab's sessions each start one), read from
    ``/proc/1/stat`` and ``/proc/uptime``; None where they cannot be read."""
    try:
        uptime = float(Path(proc, "uptime").read_text().split()[0])
        fields = Path(proc, "1", "stat").read_text().rsplit(")", 1)[1].split()
        start_ticks = float(fields[19])  # field 22 of stat: start time, in clock ticks
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


def resolve_time_limit(value: Any, platform: str | None = None,
                       age_s: float | None = None) -> tuple[float | None, str]:
    """``(seconds, words)`` of ``fit(time_limit=...)``: None = no limit; ``"auto"`` = the
    platform's session limit (:data:`SESSION_LIMITS_S`) less the session's age
    (:func:`session_age_s`) and :data:`AUTO_MARGIN_S`.

    Raises:
        ValueError: not a duration, or ``"auto"`` where no session limit is known (the fix:
            give a duration).
    """
    if value is None:
        return None, ""
    if isinstance(value, str) and value.strip().lower() == "auto":
        if platform not in SESSION_LIMITS_S:
            raise ValueError("time_limit='auto' needs a platform with a known session limit "
                             f"(Kaggle, Colab); this is {platform or 'neither'}. Fix: give a "
                             "duration, e.g. time_limit='8h'")
        age = session_age_s() if age_s is None else age_s
        left = SESSION_LIMITS_S[platform] - (age or 0.0) - AUTO_MARGIN_S
        if left <= 0:
            raise ValueError(f"time_limit='auto': the {platform} session has run "
                             f"{(age or 0) / 3600:.1f} h of its {SESSION_LIMITS_S[platform] / 3600:g} "
                             "h; no time is left for training")
        return left, (f"{platform} session limit {SESSION_LIMITS_S[platform] / 3600:g} h less "
                      f"{(age or 0) / 60:.0f} min already run and a {AUTO_MARGIN_S / 60:.0f}-min "
                      "margin")
    return parse_duration(value, "time_limit"), ""


def run_deadline(time_limit: Any, checkpoint_dir: Any, platform: str | None) -> float | None:
    """When (``time.time()``) a run under ``fit(time_limit=...)`` must have stopped (None: no
    limit; :func:`resolve_time_limit` on ``platform``), said in a line.

    Raises:
        ValueError: a time limit without ``checkpoint_dir`` (the run stops with a checkpoint
            to resume from), or one :func:`resolve_time_limit` refuses.
    """
    started = time.time()
    limit, words = resolve_time_limit(time_limit, platform)
    if limit is None:
        return None
    if checkpoint_dir is None:
        raise ValueError("fit(time_limit=...) stops the run with a checkpoint to resume from, and "
                         "needs checkpoint_dir=... (e.g. OneCycleTrainer(..., "
                         "checkpoint_dir='checkpoints'))")
    print(f"time limit {limit / 3600:.2f} h ({limit:,.0f} s" + (f": {words}" if words else "")
          + "): the run stops in time with a checkpoint", flush=True)
    return started + limit


@dataclass(frozen=True)
class StopPlan:
    """What the replicas of one fit run are told about stopping (decided on the host).

    Attributes:
        deadline: Wall-clock time (``time.time()``) by which the run must have stopped, or
            None (no time limit).
        every_steps, every_s: In-epoch checkpoint interval, in optimizer steps and/or seconds
            (None: not by that measure).
        stop_file: A file whose existence asks every replica to stop (a signal arrived), or
            None.
        caller_pid: The process that called ``fit`` (it handles the signals itself; a
            replica in another process catches SIGTERM), or None.
    """

    deadline: float | None = None
    every_steps: int | None = None
    every_s: float | None = None
    stop_file: str | None = None
    caller_pid: int | None = None

    @property
    def active(self) -> bool:
        """Whether anything can ask for an in-epoch checkpoint or a stop."""
        return any(v is not None for v in (self.deadline, self.every_steps, self.every_s,
                                           self.stop_file))


@dataclass(frozen=True)
class Decision:
    """What every replica does at a loss read: write an in-epoch checkpoint, stop (the
    reason, else None)."""

    checkpoint: bool = False
    stop: str | None = None


_CKPT, _TIME, _SIGNAL = 1, 2, 3  # the wants, in bits


class RunSession:
    """One replica's view of a :class:`StopPlan`: asked at every loss read.

    Args:
        plan: The run's :class:`StopPlan`.
        step: Optimizer steps done when the run (or its resumed part) starts.
    """

    def __init__(self, plan: StopPlan, step: int):
        self.plan = plan
        self._last_ckpt_step, self._last_ckpt_t = step, time.monotonic()
        self._last_read_t: float | None = None
        self._window_s = 0.0
        self._signalled = False

    def catch_sigterm(self) -> None:
        """In a replica process of its own (forked, with a main thread): SIGTERM touches
        the stop file instead of killing it, so the run stops at its next read with a
        checkpoint (no-op where this process is the caller's or a thread)."""
        if self.plan.stop_file is None or threading.current_thread() is not threading.main_thread():
            return
        if self.plan.caller_pid in (None, os.getpid()):
            return

        def handler(signum: int, _frame: Any) -> None:
            self._signalled = True
            _touch(self.plan.stop_file, signal.Signals(signum).name)

        signal.signal(signal.SIGTERM, handler)

    def at_read(self, step: int) -> Decision:
        """At a loss read after optimizer step ``step`` (counted over the run): what every
        replica does, agreed through one host exchange when the plan is active."""
        plan = self.plan
        if not plan.active:
            return Decision()
        now = time.monotonic()
        if self._last_read_t is not None:
            self._window_s = now - self._last_read_t
        self._last_read_t = now
        want = 0
        if (plan.every_steps is not None and step - self._last_ckpt_step >= plan.every_steps) or \
                (plan.every_s is not None and now - self._last_ckpt_t >= plan.every_s):
            want |= 1 << _CKPT
        if plan.deadline is not None and time.time() + self._window_s >= plan.deadline:
            want |= 1 << _TIME
        if self._signalled or (plan.stop_file is not None and os.path.exists(plan.stop_file)):
            want |= 1 << _SIGNAL
        agreed = _agree(want)
        if agreed & (1 << _SIGNAL):
            return Decision(checkpoint=True, stop=self.signal_reason())
        if agreed & (1 << _TIME):
            return Decision(checkpoint=True, stop=TIME_LIMIT_REASON)
        return Decision(checkpoint=bool(agreed & (1 << _CKPT)))

    def checkpointed(self, step: int) -> None:
        """An in-epoch (or epoch) checkpoint holds step ``step``: the interval starts again."""
        self._last_ckpt_step, self._last_ckpt_t = step, time.monotonic()

    def time_left_words(self) -> str | None:
        """``"1:23:45 left"`` under a time limit (for the progress bar), else None."""
        if self.plan.deadline is None:
            return None
        left = max(0, int(self.plan.deadline - time.time()))
        return f"{left // 3600}:{left // 60 % 60:02d}:{left % 60:02d} left"

    def signal_reason(self) -> str:
        """The stop reason of a signal, naming it (read from the stop file)."""
        name = "a signal"
        with contextlib.suppress(OSError):
            name = Path(self.plan.stop_file).read_text().strip() or name
        return f'stopped by {name}; fit(resume="last") continues'


def _agree(want: int) -> int:
    """The bitwise OR of every replica's ``want`` (3 bits), through one host sum: each bit
    is counted in its own base-(world + 1) digit."""
    n = runtime.world_size()
    if n == 1:
        return want
    base = n + 1
    total = int(round(runtime.all_reduce(sum(((want >> b) & 1) * base ** b for b in range(4)))))
    return sum(1 << b for b in range(4) if (total // base ** b) % base)


def _touch(path: str, what: str) -> None:
    with contextlib.suppress(OSError):
        with open(path, "w") as f:
            f.write(what)


@contextlib.contextmanager
def stop_signals(enabled: bool = True) -> Iterator[StopPlanSignals]:
    """While ``fit`` waits for its replicas (in the main thread of the process that called
    it): the first SIGTERM or SIGINT touches the run's stop file (every replica stops at
    its next read and writes a checkpoint); a second SIGINT interrupts at once (the
    replicas are killed, as before). Yields the stop file's holder; the handlers that were
    there are restored on exit, and the file removed."""
    folder = tempfile.mkdtemp(prefix="xla_utils-stop-")
    holder = StopPlanSignals(os.path.join(folder, "stop"))
    main = threading.current_thread() is threading.main_thread()
    old: dict[int, Any] = {}
    if enabled and main:
        def handler(signum: int, _frame: Any) -> None:
            if signum == signal.SIGINT and holder.received is not None:
                raise KeyboardInterrupt  # a second interrupt: no waiting for the checkpoint
            holder.received = signal.Signals(signum).name
            _touch(holder.path, holder.received)
            print(f"\n{holder.received}: stopping every replica at its next step boundary "
                  "(a checkpoint is written); interrupt again to stop at once", flush=True)

        for sig in (signal.SIGTERM, signal.SIGINT):
            old[sig] = signal.signal(sig, handler)
    try:
        yield holder
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)
        with contextlib.suppress(OSError):
            os.unlink(holder.path)
        with contextlib.suppress(OSError):
            os.rmdir(folder)


class StopPlanSignals:
    """The stop file of one fit run and the signal the caller's process received (None:
    none)."""

    def __init__(self, path: str):
        self.path, self.received = path, None
