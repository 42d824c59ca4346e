"""fsync helpers shared by the prompt cache and the model store.

On macOS `fsync` only pushes data to the drive's cache; `F_FULLFSYNC` asks the drive to make it
durable, which is what a crash-safe rename protocol needs. Directories are fsynced by path so
that a rename inside them survives a power cut.
"""

from __future__ import annotations

import fcntl
import os
import sys
from pathlib import Path


def fsync_fd(fd: int) -> None:
    """Make an open file's data durable (F_FULLFSYNC where the platform has it)."""
    if sys.platform == "darwin" and hasattr(fcntl, "F_FULLFSYNC"):
        try:
            fcntl.fcntl(fd, fcntl.F_FULLFSYNC)
            return
        except OSError:  # some file systems refuse it: plain fsync is the best left
            pass
    os.fsync(fd)


def fsync_path(path: Path) -> None:
    """fsync a file or a directory by path (a directory: makes renames inside it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        fsync_fd(fd)
    finally:
        os.close(fd)
