"""``python -m xla_utils.env``: see :func:`xla_utils.env.cli.main`."""
import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
