"""The cache's own directory inside a root the user chose, made private without touching the root.

`--cache-dir /tmp` must not turn /tmp into a 0700 directory, so the root is only created (0700)
when missing and is otherwise left as it is. What the server creates, its per-model (and
per-key) sub-directory, is private; an existing one must be a real directory owned by this user,
and a root that any user can write to without the sticky bit is refused, because anyone could
replace the sub-directory in it between two runs.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

DIR_MODE = 0o700


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
