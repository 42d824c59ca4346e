"""Fault injection for the crash-safety tests: a thin, named boundary, off unless asked for.

`MLX_KVSERVE_FAULTS` is a comma-separated list of rules:

* `point:N` fails the first N times the point is reached (0 = never; `point` alone = `point:1`);
* `point@K` fails only the K-th time (1-based), e.g. to crash in the middle of a workload.

What "fails" means depends on the point's name: `*_enospc` raises OSError(ENOSPC) as a full disk
would, `*_kill` logs one line and SIGKILLs the whole process on the spot (a crash at an exact
instant, e.g. halfway through writing a cache file), anything else raises `InjectedFault`.

Points: `prefill`, `prefill_after_restore` (engine.generate); `disk_write_enospc`,
`disk_write_kill` (cache.disk, while an entry's temporary file is being written). Production
code only ever calls `maybe_fail`, which does nothing when the variable is unset.
"""

from __future__ import annotations

import errno
import logging
import os
import signal
import threading

ENV = "MLX_KVSERVE_FAULTS"

_lock = threading.Lock()
_rules: dict[str, tuple[str, int]] | None = None
_calls: dict[str, int] = {}


class InjectedFault(RuntimeError):
    """Raised at a fault point chosen by MLX_KVSERVE_FAULTS."""


def _load() -> dict[str, tuple[str, int]]:
    spec = os.environ.get(ENV, "")
    out: dict[str, tuple[str, int]] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        if "@" in item:
            name, _, at = item.partition("@")
            out[name] = ("@", int(at))
        else:
            name, _, count = item.partition(":")
            out[name] = (":", int(count or 1))
    return out


def maybe_fail(point: str) -> None:
    global _rules
    with _lock:
        if _rules is None:
            _rules = _load()
        rule = _rules.get(point)
        if rule is None:
            return
        n = _calls[point] = _calls.get(point, 0) + 1
        kind, value = rule
        if not (n <= value if kind == ":" else n == value):
            return
    if point.endswith("_enospc"):
        raise OSError(errno.ENOSPC, f"No space left on device (injected fault at {point})")
    if point.endswith("_kill"):
        logging.getLogger("mlx_kvserve").warning("injected fault at %s: SIGKILL", point)
        os.kill(os.getpid(), signal.SIGKILL)
        os._exit(128 + signal.SIGKILL)  # not reached: SIGKILL to oneself lands at once
    raise InjectedFault(f"injected fault at {point}")
