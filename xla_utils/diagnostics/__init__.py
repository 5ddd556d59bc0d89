"""xla_utils.diagnostics: is a model ready for a TPU: check(), findings, memory, debug_run

Importing this package runs nothing else; import the module you need. The names
users import are exported by :mod:`xla_utils` itself.

* ``readiness``: Will this model run well on a TPU? Answered on a CPU, before any TPU quota
  is spent
* ``findings``: What :func:`xla_utils.check` found, in words a user can act on
* ``memory``: Per-device memory of a training step under each strategy
* ``debug``: Single-core debug mode
"""
