#!/usr/bin/env python
"""The predecessor's ``tpu_cache_ds_utils.py`` name, now a thin wrapper around ``tpu_cache_ds``.

    python scripts/tpu_cache_ds_utils.py build train_images/ cache/train --size 224 --variants 4

Same subcommands and options as ``tpu_cache_ds`` (see ``--help``). Works from a
checkout without installing xla_utils.
"""
import sys
from pathlib import Path

try:
    from xla_utils.cli import main
except ImportError:  # a checkout that is not installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from xla_utils.cli import main

if __name__ == "__main__":
    sys.exit(main())
