"""``python -m xla_utils.env``: see :func:`xla_utils.env.main`."""
import sys

from . import main

if __name__ == "__main__":
    sys.exit(main())
