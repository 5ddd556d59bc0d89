"""``python -m xla_utils.simulate``: see :func:`xla_utils.simulate.main`."""
import sys

from .runner import main

if __name__ == "__main__":
    sys.exit(main())
