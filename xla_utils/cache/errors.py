"""The cache builder's exceptions, and the one-line description of a failure it records."""
from __future__ import annotations

__all__ = ["BuildError", "BadImageError", "Cancelled", "describe"]


class BuildError(RuntimeError):
    """The build cannot start or finish (bad source, config clash, locked output...)."""


class BadImageError(ValueError):
    """One source image cannot be cached.

    Attributes:
        path: the image's name (relative path, CSV value or ``dataset[i]``).
        reason: why it cannot be cached.
        index: its position in the source order (``None`` when unknown).
    """

    def __init__(self, path: str, reason: str, index: int | None = None):
        super().__init__(f"{path}: {reason}")
        self.path, self.reason, self.index = path, reason, index

    def __reduce__(self):  # keep every field across the process-pool boundary
        return (type(self), (self.path, self.reason, self.index))


class Cancelled(Exception):
    """A worker stopped because the coordinator asked it to."""


def describe(e: BaseException) -> str:
    """One line (at most 300 characters) saying why an image failed, for reports and the manifest."""
    if isinstance(e, FileNotFoundError):
        return "file not found"
    if isinstance(e, IsADirectoryError):
        return "is a directory"
    msg = str(e).replace("\n", " ")
    return f"{type(e).__name__}: {msg}"[:300]
