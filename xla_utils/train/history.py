"""What a fit run returns and keeps: :class:`History` (table, CSV, plot) and
:class:`BestTracker`, the best-epoch choice behind ``monitor=`` / ``patience=``.

``History`` used to live in :mod:`xla_utils.train.trainer`; ``from xla_utils.train.trainer
import History`` still works.
"""
from __future__ import annotations

import csv
import html
import io
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch

from ..utils.atomic import atomic_write
from .config import LOSS_MONITORS
from .metrics import RECORD_KEYS, lower_is_better

__all__ = ["History", "BestTracker", "monitor_mode", "write_csv_atomic", "value_kinds"]


@dataclass(repr=False)
class History:
    """What :meth:`OneCycleTrainer.fit` returns (``len``, indexing and ``str`` work too; as a
    notebook cell's last expression it shows as its table: ``_repr_html_``, ``repr``).

    Attributes:
        epochs: One dict per epoch: ``epoch``, ``train_loss``, ``val_loss`` and
            validation metrics (when ``val_data`` was given), ``lr_max`` (peak LR
            used), ``lr_last`` (LR of the epoch's last step), ``images_per_s``
            (global, this epoch including any compilation), ``seconds``; on XLA (TPU or
            simulated cores) ``compiles`` (XLA compilations so far in the run, cumulative)
            and ``host_reads_per_step`` (device->host transfers per training step in this
            process, all its replicas together: the progress-bar loss reads); with an fp16
            gradient scaler (a GPU without bf16) ``skipped_steps`` (optimizer steps it
            skipped on inf/NaN gradients); with ``compile=`` on the torch backend
            ``compiles`` (dynamo graphs so far in the run, cumulative) and
            ``compile_seconds`` (seconds compiling in this epoch); with ``grad_clip=``
            ``grad_norm`` (mean total gradient norm before clipping), ``grad_norm_max``,
            ``clipped_steps`` and ``grad_norm_clipped_max`` (:mod:`xla_utils.step.clip`).
        world_size, global_batch: Replicas (cores, GPUs or processes) and samples per step
            over all of them.
        base_lr, max_lr: The LR given (or found) and the peak LR used.
        lr_scaling, lr_note: The scaling rule and how ``max_lr`` came from ``base_lr``.
        backend: ``"xla"`` or ``"torch"``.
        device_type: The replicas' device type: ``"xla"``, ``"cuda"`` or ``"cpu"`` (names
            them in ``str(history)``: cores, GPUs, processes).
        state_dict: The final model state on the CPU (after a stop: the last
            finite epoch's; empty when no epoch ended finite). With ``monitor=``
            set: the best epoch's weights.
        stop_reason: None for a complete run, else why it stopped early (a
            non-finite loss, ``patience=`` epochs without improvement, or a pause that
            ``fit(resume="last")`` continues: ``time_limit``, a signal).
        warnings: What the run warned about (divergence, exploding validation loss).
        run_id: Names this run's checkpoint files.
        compile_cache: The persistent compilation cache in this run (master
            replica): its state and folder, how many graphs were loaded from it
            and how many compiled (see ``TrainerConfig.compile_cache``), or why
            it was off. ``str(history)`` shows it unless it was deliberately off. With
            ``compile=``: graphs, seconds and inductor's cache hits and misses.
        monitor, best_epoch, best_score: With ``monitor=``: the monitored key,
            the 1-based epoch whose weights are ``state_dict`` (and ``best.pt``)
            and its value; else None.
        ema_state_dict: The final EMA weights on the CPU (``ema`` set), else empty.
        steps: One dict per loss read (every ``log_every`` optimizer steps and at each
            epoch's last step; a resumed run's include those before it): ``epoch``
            (1-based), ``step`` (the run's optimizer step), ``train_loss`` (the epoch's
            running mean over every replica so far, as the progress bar shows it), ``lr``
            (the LR of that step). The same rows on any backend and number of replicas;
            ``steps.csv`` beside ``history.csv`` (``checkpoint_dir`` set) and
            :meth:`steps_to_csv`.
    """

    epochs: list[dict[str, Any]]
    world_size: int
    global_batch: int
    base_lr: float
    max_lr: float
    lr_scaling: str
    lr_note: str
    backend: str
    device_type: str = "xla"
    state_dict: dict[str, torch.Tensor] = field(repr=False, default_factory=dict)
    stop_reason: str | None = None
    warnings: list[str] = field(default_factory=list)
    run_id: str | None = None
    compile_cache: str | None = None
    monitor: str | None = None
    best_epoch: int | None = None
    best_score: float | None = None
    ema_state_dict: dict[str, torch.Tensor] = field(repr=False, default_factory=dict)
    steps: list[dict[str, Any]] = field(default_factory=list)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.epochs[i]

    def __len__(self) -> int:
        return len(self.epochs)

    def _cells(self) -> tuple[list[str], list[list[str]]]:
        """The table's header and its rows of formatted cells (no epochs: none)."""
        if not self.epochs:
            return [], []
        keys = [k for k in self.epochs[-1] if k != "epoch"]
        rows = [[str(e["epoch"])] + [_fmt(e.get(k)) for k in keys] for e in self.epochs]
        return ["epoch"] + keys, rows

    def table(self) -> str:
        """The per-epoch history as an aligned text table."""
        head, rows = self._cells()
        if not head:
            return "(no epochs)"
        widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
        lines = ["  ".join(h.rjust(w) for h, w in zip(head, widths))]
        lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
        return "\n".join(lines)

    def to_csv(self, path: str | os.PathLike) -> Path:
        """Write the per-epoch records to ``path`` as CSV (one row per epoch, the
        union of keys as columns, ``epoch`` first); written to a temporary file and
        renamed, so a reader never sees half a file. Returns the path."""
        return write_csv_atomic(self.epochs, path)

    def steps_to_csv(self, path: str | os.PathLike) -> Path:
        """Write the per-step records (:attr:`steps`) to ``path`` as CSV (``epoch``, ``step``,
        ``train_loss``, ``lr``), atomically as :meth:`to_csv`. Returns the path."""
        return write_csv_atomic(self.steps, path)

    def plot(self, path: str | os.PathLike | None = None, show: bool | None = None) -> Any:
        """Loss, validation metrics, LR, and counts and timings per epoch, as a matplotlib
        figure: each kind of value on its own axis (validation metrics; counts such as
        ``samples``, ``compiles``, ``seconds``, ``images_per_s`` and the gradient norms of
        ``grad_clip`` on a symmetric-log axis of their own, never on the metrics').

        Args:
            path: Also save the figure there (PNG, SVG, ... by suffix). Default None.
            show: Call ``plt.show()``; default None = only when no ``path`` is given
                and the backend is interactive (a notebook shows the returned figure).

        Returns:
            The ``matplotlib.figure.Figure`` (four panels: losses, metrics, LR, counts).

        Raises:
            ImportError: matplotlib is not installed (``pip install matplotlib``).
            ValueError: the history has no epochs.
        """
        try:
            import matplotlib
            import matplotlib.pyplot as plt
        except ImportError:
            raise ImportError("History.plot() needs matplotlib, which is not installed: "
                              "pip install matplotlib (or read history.table() / "
                              "history.to_csv(path) instead)") from None
        if not self.epochs:
            raise ValueError("History.plot(): the history has no epochs to plot")
        x = [e["epoch"] for e in self.epochs]
        fig, axes = plt.subplots(1, 4, figsize=(17, 3.6))
        for key in LOSS_MONITORS[::-1]:
            if any(key in e for e in self.epochs):
                axes[0].plot(x, [_num(e.get(key)) for e in self.epochs], marker="o", label=key)
        axes[0].set_title("loss")
        kinds = value_kinds(self.epochs)
        metrics, counts = kinds["metrics"], kinds["counts"]
        for key in metrics:
            axes[1].plot(x, [_num(e.get(key)) for e in self.epochs], marker="o", label=key)
        axes[1].set_title("validation metrics")
        axes[2].plot(x, [_num(e.get("lr_last")) for e in self.epochs], marker="o", label="lr_last")
        axes[2].plot(x, [_num(e.get("lr_max")) for e in self.epochs], ls="--", label="lr_max")
        axes[2].set_yscale("log")
        axes[2].set_title("learning rate")
        for key in counts:
            axes[3].plot(x, [_num(e.get(key)) for e in self.epochs], marker=".", label=key)
        axes[3].set_yscale("symlog", linthresh=1.0)  # 0 skipped steps to 10^4 images/s
        axes[3].set_title("counts and timings")
        if self.best_epoch is not None:
            for ax in axes[:2]:
                ax.axvline(self.best_epoch, color="grey", ls=":", label=f"best ({self.monitor})")
        for ax in axes:
            ax.set_xlabel("epoch")
            if ax.get_legend_handles_labels()[0]:
                ax.legend()
        fig.tight_layout()
        if path is not None:
            fig.savefig(path)
        if show or (show is None and path is None and matplotlib.is_interactive()):
            plt.show()
        return fig

    def _summary(self) -> str:
        """The line above the table: replicas, batch, LR and backend."""
        from .. import runtime  # loaded already: the run that made this history imported it

        cores = runtime.replicas_word(self.world_size, self.device_type)
        return (f"{cores} x {self.global_batch // self.world_size} = {self.global_batch} global "
                f"batch, max_lr {self.max_lr:.3g} (from {self.base_lr:.3g}: {self.lr_note}), "
                f"backend {self.backend}")

    def _notes(self) -> list[str]:
        """The lines below the table: best epoch, early stop."""
        out = []
        if self.best_epoch is not None and self.best_score is not None:
            out.append(f"best epoch {self.best_epoch} ({self.monitor} {self.best_score:.4g})")
        if self.stop_reason:
            out.append(f"STOPPED: {self.stop_reason}")
        return out

    def __str__(self) -> str:
        cache = (f"{self.compile_cache}\n" if self.compile_cache and not
                 self.compile_cache.startswith("compile cache off:") else "")
        return "\n".join([self._summary() + "\n" + cache + self.table(), *self._notes()])

    def __repr__(self) -> str:
        # A notebook cell or the REPL shows the table, not the dataclass' fields (the weights
        # alone would fill the screen).
        return str(self)

    def _repr_html_(self) -> str:
        """The history as a notebook shows it: the summary line, an HTML table, the notes."""
        head, rows = self._cells()
        esc = html.escape
        table = ("<p>(no epochs)</p>" if not head else
                 "<table><thead><tr>" + "".join(f"<th>{esc(h)}</th>" for h in head)
                 + "</tr></thead><tbody>"
                 + "".join("<tr>" + "".join(f"<td>{esc(c)}</td>" for c in r) + "</tr>"
                           for r in rows) + "</tbody></table>")
        notes = "".join(f"<p>{esc(n)}</p>" for n in self._notes())
        return f"<div><p>{esc(self._summary())}</p>{table}{notes}</div>"


def value_kinds(epochs: list[dict[str, Any]]) -> dict[str, list[str]]:
    """The records' numeric keys by kind, each first seen first: ``"loss"`` (train_loss,
    val_loss), ``"lr"`` (lr_last, lr_max), ``"counts"`` (samples, compiles, seconds,
    images_per_s, gradient norms: :data:`xla_utils.train.metrics.RECORD_KEYS`) and
    ``"metrics"`` (every other value: the validation metrics, a callable's included). What :meth:`History.plot` and TensorBoard's tags group by."""
    keys = dict.fromkeys(k for e in epochs for k in e if k != "epoch")
    kinds: dict[str, list[str]] = {"loss": [], "lr": [], "metrics": [], "counts": []}
    for k in keys:
        vals = [e[k] for e in epochs if isinstance(e.get(k), (int, float))
                and not isinstance(e.get(k), bool)]
        if not vals:
            continue
        kind = ("loss" if k in LOSS_MONITORS else "lr" if k in ("lr_last", "lr_max") else
                "counts" if k in RECORD_KEYS else "metrics")
        kinds[kind].append(k)
    return kinds


def _num(v: Any) -> float:
    return float(v) if isinstance(v, (int, float)) else math.nan


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return "-" if v is None else str(v)


def write_csv_atomic(records: list[dict[str, Any]], path: str | os.PathLike) -> Path:
    """Write ``records`` (dicts) to ``path`` as CSV through a temporary file in the same
    folder and an atomic rename. Missing values are empty cells. Returns the path."""
    path = Path(path)
    keys = list(dict.fromkeys(["epoch"] + [k for r in records for k in r]))
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=keys, lineterminator="\n")
    w.writeheader()
    for r in records:
        w.writerow({k: ("" if r.get(k) is None else r.get(k)) for k in keys})
    atomic_write(path, buf.getvalue())
    return path


# ----------------------------------------------------------------- best epoch
def monitor_mode(monitor: str) -> str:
    """``"min"`` for losses and error metrics (``logloss``, ``rmse``, ``mae``, names ending in
    ``loss``/``error``/``mse``/``mae``/``msle``: :func:`~xla_utils.train.metrics.lower_is_better`),
    ``"max"`` for the others (accuracy, ``top<k>``, F1, AUC, QWK, callables)."""
    return "min" if lower_is_better(monitor) else "max"


def check_monitor_data(monitor: str | None, names: Sequence[str] | None, has_val: bool) -> None:
    """Refuse, before any device time, a ``monitor`` the run will not record.

    Args:
        monitor: ``TrainerConfig.monitor``.
        names: The run's validation metrics, resolved for its data
            (:func:`xla_utils.train.metrics.check_metrics`), or None when they could not be
            (the monitor is then left to the configuration's own check).
        has_val: whether the trainer has ``val_data``.
    """
    if monitor is None or monitor == "train_loss":
        return
    if not has_val:
        raise ValueError(f"monitor={monitor!r} is a validation value but the trainer has no "
                         "val_data: pass val_data=... or monitor='train_loss'")
    if monitor == "val_loss" or names is None:
        return
    if monitor not in names:
        raise ValueError(f"monitor={monitor!r} is not among this run's validation metrics "
                         f"{list(names)}: add it to metrics=[...] or monitor one of "
                         f"{['val_loss'] + list(names)}")


@dataclass
class BestTracker:
    """The best-epoch choice of one replica (every replica sees the same reduced
    values, so all make the same choice and stop at the same epoch).

    Attributes:
        monitor: The record key watched; ``mode`` ``"min"`` or ``"max"``.
        patience: Epochs without improvement before stopping (None: never stop).
        best_epoch, best_score: The best so far (1-based epoch).
        best_state: Host copy of the best epoch's weights (master only).
        stop_reason: Why patience ran out, else None.
    """

    monitor: str
    patience: int | None = None
    best_epoch: int | None = None
    best_score: float | None = None
    best_state: dict[str, torch.Tensor] | None = None
    stop_reason: str | None = None

    @classmethod
    def resume(cls, monitor: str, patience: int | None,
               history: list[dict[str, Any]]) -> "BestTracker":
        """A tracker that has seen the epochs of a resumed run's ``history``."""
        t = cls(monitor, patience)
        for r in history:
            t.improved(r)
        return t

    def improved(self, record: dict[str, Any]) -> bool:
        """Take the epoch ``record``; True when it is the new best."""
        v = record.get(self.monitor)
        if not isinstance(v, (int, float)) or not math.isfinite(v):
            return False
        better = (self.best_score is None or
                  (v < self.best_score if monitor_mode(self.monitor) == "min" else v > self.best_score))
        if better:
            self.best_epoch, self.best_score = int(record["epoch"]), float(v)
        return better

    def should_stop(self, epoch: int) -> bool:
        """After 1-based ``epoch``: patience exhausted? Sets ``stop_reason``."""
        if self.patience is None or self.best_epoch is None or epoch - self.best_epoch < self.patience:
            return False
        self.stop_reason = (f"early stop after epoch {epoch}: {self.monitor} did not improve for "
                            f"{epoch - self.best_epoch} epoch(s) (patience={self.patience}); best "
                            f"{self.best_score:.4g} at epoch {self.best_epoch}")
        return True


def epoch_files(tracker: BestTracker | None, record: dict[str, Any], model: torch.nn.Module,
                history: list[dict[str, Any]], checkpoint_dir: str | os.PathLike | None,
                steps: list[dict[str, Any]] | None = None) -> bool:
    """The end of a fit epoch in one replica, after its checkpoint: ``history.csv`` and
    ``steps.csv`` (the per-step records ``steps``; master, when ``checkpoint_dir`` is set),
    the best-epoch choice (a host copy of the
    new best weights and ``best.pt`` on the master) and the patience test.

    Returns:
        True when the run must stop (patience exhausted; ``tracker.stop_reason`` says why).
    """
    from .. import runtime

    master = runtime.is_master()
    if checkpoint_dir is not None and master:
        write_csv_atomic(history, Path(checkpoint_dir) / "history.csv")
        if steps:
            write_csv_atomic(steps, Path(checkpoint_dir) / "steps.csv")
    if tracker is None:
        return False
    if tracker.improved(record):
        state = model.state_dict()
        if master:
            tracker.best_state = runtime.host_copy(state)
        if checkpoint_dir is not None:
            runtime.save(state, Path(checkpoint_dir) / "best.pt")  # writes on the master only
    return tracker.should_stop(int(record["epoch"]))
