"""What only a Mac has, behind the seams tests replace: whether this is macOS, its fcntl
commands, its sysctls, and Metal.

The server is for Macs and is tested on Linux. Each macOS branch of the package asks
`on_macos()` and makes its macOS-only calls through `fcntl` or `sysctl_int` here, and its Metal
questions through `metal_working_set`; a test on Linux replaces those functions (and nothing
else) to run the macOS path with the kernel's answers faked. Callers use them as `macos.on_macos()`,
never imported by name, so that replacing the module's attribute reaches every caller.

Calls Linux has and macOS lacks (`os.posix_fadvise`, `os.sched_getaffinity`, ...) are looked
up with `getattr` where they are used, so that their absence takes the fallback;
tests/unit/test_platform_calls.py checks that every such call is guarded.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import fcntl as _fcntl
import functools
import sys

# <sys/fcntl.h> on macOS; Python's fcntl module names F_FULLFSYNC there but not F_RDADVISE.
F_RDADVISE = 44  # issue an advisory read (struct radvisory): the kernel starts reading now
F_FULLFSYNC = 51  # flush the drive's own cache too, as a plain fsync there does not


def on_macos() -> bool:
    """Whether this process runs on macOS."""
    return sys.platform == "darwin"


def fcntl(fd: int, command: int, arg: int | bytes = 0) -> int | bytes:
    """fcntl(2): the door the macOS-only commands (F_FULLFSYNC, F_RDADVISE) go through."""
    return _fcntl.fcntl(fd, command, arg)


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)


def sysctl_int(name: str) -> int | None:
    """An integer sysctl read with sysctlbyname(3) (no process per read); None where it cannot
    be read (no such name, or a libc without sysctlbyname: Linux's)."""
    value = ctypes.c_int(0)
    size = ctypes.c_size_t(ctypes.sizeof(value))
    try:
        failed = _libc().sysctlbyname(
            name.encode(), ctypes.byref(value), ctypes.byref(size), None, 0
        )
    except (AttributeError, OSError):
        return None
    return None if failed else value.value


def metal_working_set() -> int | None:
    """The bytes Metal recommends a process keep resident, where MLX runs on a Metal GPU;
    None elsewhere. Imports MLX: call after the BLAS preload (mlx_kvserve.blas)."""
    if not on_macos():
        return None
    import mlx.core as mx

    if not mx.metal.is_available():
        return None
    size = mx.device_info().get("max_recommended_working_set_size")
    return size if isinstance(size, int) and size > 0 else None
