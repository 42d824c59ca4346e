"""Fault injection for the crash-safety tests: a thin, named boundary, off unless asked for.

`MLX_KVSERVE_FAULTS="prefill_after_restore:1,prefill:0"` makes the named points raise
`InjectedFault` that many times (0 = never). Production code only ever calls `maybe_fail`.
"""

from __future__ import annotations

import os
import threading

_lock = threading.Lock()
_remaining: dict[str, int] | None = None


class InjectedFault(RuntimeError):
    """Raised at a fault point chosen by MLX_KVSERVE_FAULTS."""


def _load() -> dict[str, int]:
    spec = os.environ.get("MLX_KVSERVE_FAULTS", "")
    out: dict[str, int] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        name, _, count = item.partition(":")
        out[name] = int(count or 1)
    return out


def maybe_fail(point: str) -> None:
    global _remaining
    with _lock:
        if _remaining is None:
            _remaining = _load()
        if _remaining.get(point, 0) > 0:
            _remaining[point] -= 1
            raise InjectedFault(f"injected fault at {point}")
