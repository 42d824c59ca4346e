"""fsync helpers, and small files written so that a power cut leaves the old or the new whole.

On macOS `fsync` only pushes data to the drive's cache; `F_FULLFSYNC` asks the drive to make it
durable, which is what a crash-safe rename protocol needs. Directories are fsynced by path so
that a rename inside them survives a power cut.

Small state files (the seal key, the config file, service files) are written to a temporary file
in the same directory, fsynced, moved into place and the directory fsynced: without that a power
cut can leave an empty file under the final name, which is how a key file comes back short.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import os
from pathlib import Path

from mlx_kvserve import macos

_temp_names = itertools.count()


def fsync_fd(fd: int) -> None:
    """Make an open file's data durable (F_FULLFSYNC on macOS)."""
    if macos.on_macos():
        try:
            macos.fcntl(fd, macos.F_FULLFSYNC)
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


def write_all(fd: int, data: bytes | memoryview) -> None:
    """Write all of `data` to `fd` (os.write may write less than it is given)."""
    view = memoryview(data).cast("B")
    while view.nbytes:
        written = os.write(fd, view)
        if written <= 0:  # pragma: no cover - os.write raises instead
            raise OSError(errno.EIO, "short write")
        view = view[written:]


def _written_temp(path: Path, data: bytes, mode: int) -> Path:
    """`data` in a new, fsynced file beside `path` with exactly `mode` (whatever the umask)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{next(_temp_names)}.tmp")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
    fd = os.open(tmp, flags, mode)
    try:
        os.fchmod(fd, mode)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        fsync_fd(fd)
    except BaseException:
        os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    os.close(fd)
    return tmp


def replace_file(path: Path, data: bytes, mode: int = 0o600) -> None:
    """Make `path` hold `data`, durably: a reader sees the old file or the new one, whole."""
    path = Path(path)
    tmp = _written_temp(path, data, mode)
    try:
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_path(path.parent)


def create_file(path: Path, data: bytes, mode: int = 0o600) -> bool:
    """Create `path` holding `data`, durably, unless it exists: the first writer wins (the
    file appears whole, never half written). True when this call created it."""
    path = Path(path)
    tmp = _written_temp(path, data, mode)
    try:
        os.link(tmp, path)
        created = True
    except FileExistsError:
        created = False
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
    if created:
        fsync_path(path.parent)
    return created
