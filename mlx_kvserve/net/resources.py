"""Open-file limits, and logging that stays small when resources run out.

A server holding thousands of connections runs out of file descriptors; asyncio then logs a
traceback for every failed `accept()` (hundreds of thousands in seconds, hundreds of MB of log).
At start-up the soft limit is raised as far as the hard limit allows, connections are capped
below it (`connection_cap`), and such messages are let through once per interval with a count.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import resource
import threading
import time
from collections.abc import Callable, Iterator

from mlx_kvserve import macos

FD_TARGET = 65536
DARWIN_FD_MAX = 10240  # OPEN_MAX: macOS refuses a higher soft limit even when hard is unlimited
FD_RESERVE = 64  # model and cache files, the writer, pipes, logs: everything but connections
MAX_BACKLOG = 2048  # uvicorn's default
MIN_CONNECTIONS = 16
LOG_INTERVAL_SECONDS = 60.0

log = logging.getLogger("mlx_kvserve.net")

_EXHAUSTED = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)


def raise_fd_limit(target: int = FD_TARGET) -> int:
    """Raise the soft open-file limit towards `target` within the hard limit; return the soft."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    ceiling = fd_ceiling(target, hard)
    if soft != resource.RLIM_INFINITY and soft < ceiling:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (ceiling, hard))
            soft = ceiling
        except (ValueError, OSError) as exc:
            log.warning("could not raise the open-file limit from %d to %d: %s", soft, ceiling, exc)
    return soft


def fd_ceiling(target: int, hard: int) -> int:
    """The highest soft open-file limit to ask for: `target` within the hard limit, and on
    macOS within OPEN_MAX, which setrlimit refuses to exceed even under an unlimited hard one."""
    ceiling = target if hard == resource.RLIM_INFINITY else min(target, hard)
    return min(ceiling, DARWIN_FD_MAX) if macos.on_macos() else ceiling


@contextlib.contextmanager
def keep_open_file_limits() -> Iterator[None]:
    """Import mlx_lm inside this: `mlx_lm.utils` sets RLIMIT_NOFILE to (2048, 4096) at import,
    which lowers a higher hard limit for good (capping every later raise) and fails outright,
    killing start-up, where the hard limit is below 4096. Meanwhile only raising the soft limit
    within the hard one is let through."""
    original = resource.setrlimit

    def within_hard_limit(which: int, limits: tuple[int, int]) -> None:
        if which != resource.RLIMIT_NOFILE:
            original(which, limits)
            return
        soft, hard = resource.getrlimit(which)
        wanted = limits[0] if hard == resource.RLIM_INFINITY else min(limits[0], hard)
        if soft != resource.RLIM_INFINITY and wanted > soft:
            original(which, (wanted, hard))

    resource.setrlimit = within_hard_limit
    try:
        yield
    finally:
        resource.setrlimit = original


def connection_cap(requested: int, soft_limit: int) -> tuple[int, int]:
    """(most connections, accept backlog) that fit in `soft_limit` descriptors.

    asyncio accepts up to `backlog` connections at each readiness of the listening socket, and
    a connection reaches the cap's check (connection_made) only a few loop iterations later, so
    a burst briefly holds the cap plus a few backlogs of descriptors. Half of what the rest of
    the server leaves (FD_RESERVE) goes to connections and an eighth to each accept batch.
    """
    if soft_limit == resource.RLIM_INFINITY:
        return requested, MAX_BACKLOG
    spare = max(2 * MIN_CONNECTIONS, soft_limit - FD_RESERVE)
    cap = min(requested, max(MIN_CONNECTIONS, spare // 2))
    return cap, max(MIN_CONNECTIONS, min(MAX_BACKLOG, spare // 8))


class Throttle:
    """Allow one event per key per interval; count the ones held back."""

    def __init__(
        self, interval: float = LOG_INTERVAL_SECONDS, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.interval = interval
        self.clock = clock
        self._lock = threading.Lock()
        self._last: dict[str, float] = {}
        self._held: dict[str, int] = {}

    def allow(self, key: str) -> tuple[bool, int]:
        """(whether to emit now, how many were held back since the last one)."""
        now = self.clock()
        with self._lock:
            last = self._last.get(key)
            if last is not None and now - last < self.interval:
                self._held[key] = self._held.get(key, 0) + 1
                return False, 0
            self._last[key] = now
            return True, self._held.pop(key, 0)


class ResourceExhaustionFilter(logging.Filter):
    """Let 'out of file descriptors / memory' records through once per interval, briefly."""

    def __init__(self, throttle: Throttle | None = None) -> None:
        super().__init__()
        self.throttle = throttle or Throttle()

    def filter(self, record: logging.LogRecord) -> bool:
        if not _is_exhaustion(record):
            return True
        exc = record.exc_info[1] if record.exc_info else None
        emit, held = self.throttle.allow(f"{record.name}:{getattr(exc, 'errno', None)}")
        if not emit:
            return False
        record.msg = (
            f"{record.getMessage()}: {exc or 'resources exhausted'} (resources exhausted; "
            f"{held} similar messages suppressed; repeats are logged once per "
            f"{self.throttle.interval:g} s)"
        )
        record.args = ()
        record.exc_info = None  # one line, not a traceback per failed accept()
        record.exc_text = None
        return True


def _is_exhaustion(record: logging.LogRecord) -> bool:
    exc = record.exc_info[1] if record.exc_info else None
    if isinstance(exc, OSError) and exc.errno in _EXHAUSTED:
        return True
    return "out of system resource" in str(record.msg)


def install_log_filters() -> ResourceExhaustionFilter:
    """Throttle resource-exhaustion messages from asyncio and uvicorn."""
    flt = ResourceExhaustionFilter()
    for name in ("asyncio", "uvicorn.error", "mlx_kvserve.net"):
        logging.getLogger(name).addFilter(flt)
    return flt
