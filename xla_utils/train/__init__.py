"""xla_utils.train: the trainer and the parts of a run: loops, strategies, schedule, LR finder, ...

The parts of a step that :mod:`xla_utils.diagnostics` runs too (inputs, device plan,
optimizers, strategies, the plain step) are in :mod:`xla_utils.step`, below both.

Importing this package runs nothing else: the names below load from their modules on first
use (``from xla_utils.train import CVResult``), the same objects :mod:`xla_utils` exports.

* ``config``: The trainer's configuration
* ``trainer``: One-cycle training on every TPU core
* ``loop``: The training loop as plain functions with explicit arguments (as timm's
  ``train.py``)
* ``replica_loops``: What each replica of a fit or an inference run does, as plain functions
  with explicit arguments (as timm's ``train_one_epoch`` / ``validate``)
* ``mesh_tasks``: ``find_lr``, ``check`` and ``debug`` of a mesh strategy
  (``"spmd"``/``"fsdp"``) as mesh runs
* ``finetune``: Fine-tuning a pretrained backbone, fastai style
* ``crossval``: Splits of one cache
* ``history``: What a fit run returns and keeps
* ``board``: TensorBoard event files of a fit run (``tensorboard=``)
* ``checkpoint``: Epoch checkpoints of :class:`~xla_utils.train.trainer.OneCycleTrainer`
* ``schedule``: One-cycle learning-rate and momentum schedule (Smith 2018), per optimizer
  step
* ``metrics``: Validation metrics: device sums reduced once per pass, and whole-set metrics
  computed on the host from every validation row, gathered once
* ``ema``: Weight EMA on the device, as timm's ``ModelEmaV3(model, decay, use_warmup=True)``
* ``mixup``: Mixup, cutmix and label smoothing on the device, as timm's ``Mixup``
  (``mode="batch"``)
* ``steps``: The trainer's own step, as :func:`xla_utils.check` and
  :func:`xla_utils.debug_run` measure it for ``check()`` and ``debug()``
* ``lr_finder``: Learning-rate range test ("LR finder") on one core
* ``lr_rules``: The LR finder's reading of a sweep
* ``submission``: Kaggle submission files
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from ..utils.lazy import lazy_exports

if TYPE_CHECKING:  # what editors see; at run time __getattr__ loads these on first use
    from .trainer import OneCycleTrainer
    from .config import TrainerConfig
    from .history import History
    from .schedule import OneCycleSchedule
    from .lr_finder import LRFinderResult, lr_find
    from .crossval import CVResult, cross_validate, split
    from .submission import write_submission

# public name -> the module of this package that defines it (tests/test_import.py checks
# that the TYPE_CHECKING imports agree and that xla_utils exports the same objects)
_EXPORTS = {
    "OneCycleTrainer": "trainer",
    "TrainerConfig": "config",
    "History": "history",
    "OneCycleSchedule": "schedule",
    "lr_find": "lr_finder",
    "LRFinderResult": "lr_finder",
    "cross_validate": "crossval",
    "CVResult": "crossval",
    "split": "crossval",
    "write_submission": "submission",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
