"""Empty the page cache for some files, so that the next read of them comes from the device.

Shared by the benchmarks that compare a restore with a cold read of the same bytes
(`bench_agents.py`, `bench_restore.py`).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path


def evict_page_cache(paths: list[Path]) -> str:
    """Drop `paths` from the page cache; returns how ("drop_caches" or "fadvise DONTNEED").

    As root: sync + /proc/sys/vm/drop_caches (the whole page cache). Otherwise (or if that
    fails) posix_fadvise(DONTNEED) on each file, which needs no privilege for clean pages.
    """
    method = "fadvise DONTNEED"
    if os.geteuid() == 0:
        with contextlib.suppress(OSError):
            os.sync()
            Path("/proc/sys/vm/drop_caches").write_text("1\n")
            method = "drop_caches"
    for p in paths:
        with contextlib.suppress(OSError), open(p, "rb") as f:  # checkpoints are fsynced
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    return method
