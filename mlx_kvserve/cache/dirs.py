"""The cache's own directory inside a root the user chose, made private without touching the root.

`--cache-dir /tmp` must not turn /tmp into a 0700 directory, so the root is only created (0700)
when missing and is otherwise left as it is. What the server creates, its per-model (and
per-key) sub-directory, is private; an existing one must be a real directory owned by this user,
and a root that any user can write to without the sticky bit is refused, because anyone could
replace the sub-directory in it between two runs.

Once open, the directory is guarded (`DirectoryGuards`, a mixin of cache/disk.py's `DiskTier`):
`lock` carries an exclusive, non-blocking `flock`, so one writer process uses it, and the
`RUNNING` marker, created at open and removed at a clean close, tells the next run whether this
one died.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import stat
import time
from pathlib import Path

from mlx_kvserve.cache.exceptions import CacheLockedError
from mlx_kvserve.durable import fsync_fd, fsync_path, write_all
from mlx_kvserve.json_value import JSON

DIR_MODE = 0o700
FILE_MODE = 0o600
TMP_PREFIX = ".tmp."  # files being written: start-up sweeps the ones a crash left
LOCK_NAME = "lock"
MARKER_NAME = "RUNNING"


class UnsafeCacheDirectory(PermissionError):
    """A directory other users could write to, or one that is not ours."""


def private_subdir(root: Path, name: str) -> Path:
    """`root/name` as a private directory owned by us; the root is created if missing, never
    chmod'ed. Raises OSError (PermissionError, UnsafeCacheDirectory) when it cannot be used."""
    root = Path(root)
    _make_dir(root, parents=True)
    info = os.stat(root)
    if info.st_mode & stat.S_IWOTH and not info.st_mode & stat.S_ISVTX:
        raise UnsafeCacheDirectory(
            f"{root} is writable by every user and has no sticky bit; choose another directory"
        )
    path = root / name
    _make_dir(path, parents=False)
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode):
        raise UnsafeCacheDirectory(f"{path} is not a directory (a symlink or a file)")
    if info.st_uid != os.geteuid():
        raise UnsafeCacheDirectory(f"{path} belongs to another user (uid {info.st_uid})")
    if stat.S_IMODE(info.st_mode) != DIR_MODE:
        os.chmod(path, DIR_MODE)  # ours, made by an earlier run or another umask: keep it private
    return path


def _make_dir(path: Path, *, parents: bool) -> None:
    try:
        path.mkdir(mode=DIR_MODE, parents=parents)
    except FileExistsError:
        return
    os.chmod(path, DIR_MODE)  # we created it: private whatever the umask


class DirectoryGuards:
    """The directory's `lock` and `RUNNING` marker for `DiskTier`, which sets `dir` and
    `_lock_fd`."""

    dir: Path
    _lock_fd: int | None

    def _acquire_lock(self) -> None:
        path = self.dir / LOCK_NAME
        fd = os.open(path, os.O_RDWR | os.O_CREAT, FILE_MODE)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = ""
            with contextlib.suppress(OSError):
                holder = os.pread(fd, 64, 0).decode(errors="replace").strip()
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                who = f" (pid {holder})" if holder else ""
                raise CacheLockedError(
                    f"prompt cache directory {self.dir} is in use by another process{who}; "
                    "stop it or give this server its own --cache-dir"
                ) from None
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._lock_fd = fd

    def release_lock(self) -> None:
        if self._lock_fd is not None:
            fd, self._lock_fd = self._lock_fd, None
            with contextlib.suppress(OSError):
                fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    def read_marker(self) -> dict[str, JSON] | None:
        """The previous run's marker if it did not end cleanly, else None."""
        path = self.dir / MARKER_NAME
        if not path.exists():
            return None
        try:
            data = json.loads(path.read_text())
            return data if isinstance(data, dict) else {}
        except (OSError, ValueError):
            return {}

    def write_marker(self, run_id: str) -> None:
        body = json.dumps({"run_id": run_id, "pid": os.getpid(), "started": time.time()})
        self._atomic_small_write(self.dir / MARKER_NAME, body.encode())

    def remove_marker(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            (self.dir / MARKER_NAME).unlink()
        with contextlib.suppress(OSError):
            fsync_path(self.dir)

    def _atomic_small_write(self, path: Path, data: bytes) -> None:
        tmp = self.dir / f"{TMP_PREFIX}{path.name}.{os.getpid()}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, FILE_MODE)
        try:
            write_all(fd, data)
            fsync_fd(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        fsync_path(self.dir)
