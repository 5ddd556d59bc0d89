"""The command line: ``python -m xla_utils.env`` prints a short report and the one next step
(an exact, pinned ``pip install`` line, or "ready"); ``--json`` prints the
:class:`~.info.EnvInfo` fields as JSON and ``--root DIR`` reads a faked machine tree."""
from __future__ import annotations

import argparse
from typing import Sequence

from .actions import report
from .detection import detect

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m xla_utils.env [--json] [--root DIR] [--no-import-check]``; returns the exit code (0)."""
    parser = argparse.ArgumentParser(
        prog="python -m xla_utils.env",
        description="Report platform, accelerator and torch/torch_xla versions, and the one next step.",
    )
    parser.add_argument("--json", action="store_true", help="print the EnvInfo fields as JSON")
    parser.add_argument("--root", default="/", help="file-system root to scan (default /; for faked trees)")
    parser.add_argument("--no-import-check", action="store_true",
                        help="trust the package metadata instead of importing torch_xla in a subprocess "
                        "(faster; misses a pair that fails to load)")
    args = parser.parse_args(argv)
    info = detect(root=args.root, check_import=not args.no_import_check)
    print(info.to_json() if args.json else report(info))
    return 0

