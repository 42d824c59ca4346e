"""macOS's Python on Linux: the names CPython on macOS does not have, removed from this process.

CPython's documentation marks these "not macOS" (or Linux only) and macOS's builds lack them:
a call to one there is an AttributeError, a 500 on every Mac, that no Linux run sees. With
`MLX_KVSERVE_TEST_MACOS_OS=1` tests/unit/conftest.py removes them before any test runs, so the
in-process suites exercise the fallbacks the package takes on a Mac. The static check
(tests/unit/test_platform_calls.py) reads the same table.

Only the surface changes: `sys.platform` stays "linux" and the macOS-only paths keep their own
tests through the seams in `mlx_kvserve.macos`; a whole process pretending to be darwin would
take paths (launchd, quantized default models, F_FULLFSYNC) this machine cannot run.
"""

from __future__ import annotations

import fcntl
import importlib
import os
import select
import selectors
import shutil
from pathlib import Path

ENV = "MLX_KVSERVE_TEST_MACOS_OS"

# module -> names macOS's CPython lacks (functions, and the constants that go with them)
LINUX_ONLY: dict[str, tuple[str, ...]] = {
    "os": (
        "posix_fadvise",
        "POSIX_FADV_NORMAL",
        "POSIX_FADV_SEQUENTIAL",
        "POSIX_FADV_RANDOM",
        "POSIX_FADV_NOREUSE",
        "POSIX_FADV_WILLNEED",
        "POSIX_FADV_DONTNEED",
        "posix_fallocate",
        "sched_getaffinity",
        "sched_setaffinity",
        "sched_getparam",
        "sched_setparam",
        "sched_getscheduler",
        "sched_setscheduler",
        "sched_rr_get_interval",
        "pipe2",
        "memfd_create",
        "eventfd",
        "eventfd_read",
        "eventfd_write",
        "splice",
        "copy_file_range",
        "fdatasync",
        "getxattr",
        "setxattr",
        "listxattr",
        "removexattr",
        "getresuid",
        "getresgid",
        "setresuid",
        "setresgid",
        "pidfd_open",
        "getrandom",
        "O_DIRECT",
        "O_TMPFILE",
        "O_PATH",
        "O_NOATIME",
        "O_LARGEFILE",
    ),
    "select": ("epoll", "EPOLLIN", "EPOLLOUT", "EPOLLERR", "EPOLLHUP", "EPOLLET"),
    "fcntl": ("F_SETPIPE_SZ", "F_GETPIPE_SZ", "F_OFD_GETLK", "F_OFD_SETLK", "F_OFD_SETLKW"),
}

# Files macOS does not have, read by the package through a module-level constant.
PROC_PATHS = {"mlx_kvserve.models.pressure": "PSI_PATH"}

removed: list[str] = []  # what apply() took away, for the run's header and its own check


def requested() -> bool:
    """Whether this run asked for macOS's surface."""
    return os.environ.get(ENV, "").strip().lower() in {"1", "true", "yes"}


def apply() -> list[str]:
    """Remove the Linux-only names from this process; return the ones removed."""
    modules = {"os": os, "select": select, "fcntl": fcntl}
    for module_name, names in LINUX_ONLY.items():
        module = modules[module_name]
        for name in names:
            if hasattr(module, name):
                delattr(module, name)
                removed.append(f"{module_name}.{name}")
    # `selectors` chose epoll when it was imported: asyncio on a Mac gets kqueue; poll is the
    # nearest this kernel has.
    if hasattr(selectors, "EpollSelector"):
        del selectors.EpollSelector
        selectors.DefaultSelector = selectors.PollSelector
        removed.append("selectors.EpollSelector")
    # `shutil` chose its extended-attribute copy when it was imported; on a Mac it has none
    # (CPython defines `_copyxattr` as a no-op where `os.listxattr` is missing).
    if getattr(shutil, "_copyxattr", None) is not None and not hasattr(os, "listxattr"):
        shutil._copyxattr = lambda *args, **kwargs: None
        removed.append("shutil._copyxattr")
    for module_name, attr in PROC_PATHS.items():
        module = importlib.import_module(module_name)
        setattr(module, attr, Path("/nonexistent-on-macos") / Path(getattr(module, attr)).name)
        removed.append(f"{module_name}.{attr}")
    return removed
