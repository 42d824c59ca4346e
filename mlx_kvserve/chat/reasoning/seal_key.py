"""The reasoning seals' key file: made once per install, kept across restarts, never trusted blind.

The key is written like every small state file (mlx_kvserve.durable): a temporary file, fsynced
(F_FULLFSYNC on macOS), linked into place (the first of two starting servers wins), the
directory fsynced. A key file this install would not have written (empty or short after a power
cut on an older version, another size, a link, another user's, readable by others) is replaced
with a warning: seals made with the old key stop opening and fall back to their visible text,
and the server starts.
"""

from __future__ import annotations

import errno
import logging
import os
import secrets
import stat
from pathlib import Path

from mlx_kvserve import durable

KEY_FILE = "reasoning-seal.key"
KEY_BYTES = 32

log = logging.getLogger("mlx_kvserve.chat")


def install_key(directory: Path) -> bytes:
    """The key kept in `directory`, made or replaced as needed. Raises OSError only when the
    directory cannot hold one (the caller then keeps a key for this process alone)."""
    path = Path(directory) / KEY_FILE
    key, problem = read_key(path)
    if key is None and problem is None:  # none yet
        durable.create_file(path, secrets.token_bytes(KEY_BYTES))
        key, problem = read_key(path)
    if problem is not None:
        log.warning(
            "replacing the reasoning-seal key %s (%s): reasoning sealed with it no longer opens",
            path,
            problem,
        )
        durable.replace_file(path, secrets.token_bytes(KEY_BYTES))
        key, problem = read_key(path)
    if key is None or problem is not None:
        raise OSError(errno.EIO, f"the reasoning-seal key {path} cannot be kept: {problem}")
    return key


def read_key(path: Path) -> tuple[bytes | None, str | None]:
    """(key, None) for a good key file, (None, None) when there is none, (None, why) for one
    to replace."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
    except FileNotFoundError:
        return None, None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return None, "a symbolic link"
        raise
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            return None, "not a regular file"
        if info.st_uid != os.geteuid():
            return None, f"owned by uid {info.st_uid}"
        if info.st_mode & 0o077:
            return None, f"mode {stat.S_IMODE(info.st_mode):04o}: other users may read it"
        data = os.read(fd, KEY_BYTES + 1)
    finally:
        os.close(fd)
    if len(data) != KEY_BYTES:
        return None, "empty" if not data else f"{info.st_size} bytes, not {KEY_BYTES}"
    return data, None
