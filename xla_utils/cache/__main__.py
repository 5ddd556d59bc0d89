"""``python -m xla_utils.cache ...``: the ``tpu_cache_ds`` command (see :mod:`xla_utils.cli`)."""
import sys

from xla_utils.cli import main

sys.exit(main())
