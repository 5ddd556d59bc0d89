"""TensorBoard event files of a fit run (``tensorboard=``): the master replica writes each
epoch's record as it ends, and the run's per-step rows (``History.steps``, when the history
has them) when it ends.

One folder per run under the configured one (``<folder>/<run id>``; ``fine_tune``'s phases
are two, ``<run>+frozen`` and ``<run>+unfrozen``), so ``tensorboard --logdir <folder>``
shows every run beside the others. Tags group the values as :meth:`History.plot
<xla_utils.train.history.History.plot>` does (:func:`~xla_utils.train.history.value_kinds`):
``loss/train_loss``, ``metrics/accuracy``, ``lr/lr_last``, ``counts/images_per_s``, ... at the
epoch number; per-step rows as ``step/train_loss`` and ``step/lr`` at the optimizer step.
Writing needs the ``tensorboard`` package (``pip install tensorboard``), checked when the
option is set (:func:`xla_utils.train.config.DiagnosticsSettings`), before any device time.
"""
from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

from .config import TENSORBOARD_MISSING
from .history import value_kinds

__all__ = ["EpochBoard", "board_folder"]


def board_folder(setting: bool | str | os.PathLike | None,
                 checkpoint_dir: str | os.PathLike | None) -> Path | None:
    """The folder ``tensorboard=`` names: a folder, ``checkpoint_dir/tensorboard`` for True,
    None when off (None or False)."""
    if setting is None or setting is False:
        return None
    if setting is True:
        return None if checkpoint_dir is None else Path(checkpoint_dir) / "tensorboard"
    return Path(setting).expanduser()


class EpochBoard:
    """The event writer of one run (the master replica's; :meth:`open` gives None elsewhere).

    Args:
        folder: The run's own folder (``<tensorboard folder>/<run id>``).
    """

    def __init__(self, folder: Path) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise ImportError(TENSORBOARD_MISSING) from None
        self.folder = folder
        self._writer = SummaryWriter(log_dir=str(folder))

    @classmethod
    def open(cls, setting: Any, checkpoint_dir: Any, run_id: str, master: bool
             ) -> "EpochBoard | None":
        """The run's writer: on the master replica when ``setting`` (``tensorboard=``) is on,
        else None."""
        folder = board_folder(setting, checkpoint_dir)
        return cls(folder / run_id) if master and folder is not None else None

    def epoch(self, record: dict[str, Any]) -> None:
        """Write one epoch's record (its numeric values, at its epoch number) and flush."""
        for kind, keys in value_kinds([record]).items():
            for k in keys:
                self._writer.add_scalar(f"{kind}/{k}", float(record[k]), int(record["epoch"]))
        self._writer.flush()

    def close(self, history: Any = None) -> None:
        """Write ``history``'s per-step rows (``steps``: ``{"step", "train_loss", "lr", ...}``
        dicts; none when it has no such attribute), then close the files."""
        for row in getattr(history, "steps", None) or []:
            if not isinstance(row, dict) or not isinstance(row.get("step"), int):
                continue
            for key, tag in (("train_loss", "step/train_loss"), ("lr", "step/lr")):
                v = row.get(key)
                if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                    self._writer.add_scalar(tag, float(v), row["step"])
        self._writer.close()
