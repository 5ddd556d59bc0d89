"""xla_utils.step: what one training step is made of, below the trainer and the diagnostics.

:mod:`xla_utils.train` builds its runs from these parts and :mod:`xla_utils.diagnostics` measures
steps made of the same parts; neither is imported from here, so ``train`` imports
``diagnostics`` (the trainer's ``check()`` and ``debug()``) and never the reverse.

* ``inputs``: Checks on datasets and targets, done in the calling process before any device
  time
* ``device_plan``: How a run uses its device
* ``clip``: Gradient clipping by the global norm (``grad_clip=``), inside the step's graph
* ``optim``: Optimizer construction and per-step hyper-parameter setting
* ``strategy``: How a step is spread over the devices (``"spawn"``, ``"spmd"``, ``"fsdp"``)
* ``plain``: The plain step :func:`xla_utils.check` and :func:`xla_utils.debug_run` measure by
  default, and the trainer's default ``train_step`` / ``eval_step``

Importing this package runs nothing else; it exports no names of its own (import them from
their modules).
"""
