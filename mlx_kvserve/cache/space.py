"""How much disk the prompt cache may use now: its budget, adapted to the space really there.

The budget the user set (`--cache-budget`), or by default min(20 GiB, 25% of the free space plus
what the cache holds), would otherwise be a number computed once at start, which a disk that
other programs fill, or that fills up under the cache, cannot keep. `SpaceWatch` re-reads the
file system's free space (statvfs, on macOS too) when a write fails with ENOSPC, about once a
second while the disk is short, and every 30 s otherwise, and sets the effective budget to

    min(the configured budget (by default: the fraction of the space now),
        what the cache has written + the free space - a reserve left to everything else)

The policy then evicts to fit (lowest score first, never what is pinned), and a checkpoint
whose chain does not fit the effective budget stays in RAM without a disk write
(`Policy.fits_disk_now`). When space returns, the budget grows back and writes resume. The
checkpoints the configured budget refuses (`Policy.fits`) are still refused: only the user can
raise that one.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from mlx_kvserve.cache.catalog import Catalog
from mlx_kvserve.cache.policy import GiB, Policy, default_disk_budget

RESERVE_FRACTION = 0.01  # of the file system, left to everything else on it ...
RESERVE_CAP = GiB // 4  # ... up to this much
SHORT_PERIOD = 1.0  # seconds between reads while the disk limits the budget
PERIOD = 30.0  # otherwise
SLACK = 16  # a budget within 1/16 of the configured one is not "short" (no warning, no flapping)


def cache_room(written: int, free: int, total: int) -> int:
    """The most the cache may occupy now: what it has written plus the free space, less the
    reserve."""
    reserve = min(RESERVE_CAP, int(total * RESERVE_FRACTION))
    return max(0, written + free - reserve)


def adapted_budget(requested: int | None, written: int, free: int, total: int) -> tuple[int, int]:
    """(effective budget, configured budget) for a file system with `free` of `total` bytes
    free, of which the cache has `written` (a `requested` budget of None: the default)."""
    limit = requested if requested is not None else default_disk_budget(free, written)
    return min(limit, cache_room(written, free, total)), limit


class SpaceWatch:
    """Keeps `policy.disk_budget` (the effective budget) and `policy.disk_limit` (the
    configured one, which refuses oversize checkpoints) in line with the free space."""

    def __init__(
        self,
        catalog: Catalog,
        policy: Policy,
        requested: int | None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.catalog = catalog
        self.policy = policy
        self.requested = requested
        self.clock = clock
        self.free: int | None = None  # at the last read
        self.short = False  # the budget in force is well below the configured one
        self._checked_at = -float("inf")
        self._full_seen = 0

    def check(self) -> None:
        """Re-read the free space if a write failed with ENOSPC since the last read, or if
        the last read is old enough (engine thread, under the cache's lock)."""
        full = self.catalog.counters["disk_full"]
        period = SHORT_PERIOD if self.short else PERIOD
        if full == self._full_seen and self.clock() - self._checked_at < period:
            return
        self._full_seen = full
        self.refresh()

    def refresh(self) -> None:
        """Read the free space now and adapt the budgets; evict to fit if it shrank."""
        cat, policy = self.catalog, self.policy
        usage = cat.disk.usage() if cat.disk is not None else None
        self._checked_at = self.clock()
        if usage is None:
            if policy.disk_limit == 0:  # never read: the configured budget, or the default's
                free_unknown = default_disk_budget(0, cat.disk_bytes)
                policy.disk_limit = policy.disk_budget = (
                    self.requested if self.requested is not None else free_unknown
                )
            return
        total, free = usage
        budget, limit = adapted_budget(self.requested, self._written(), free, total)
        before = policy.disk_budget
        self.free = free
        policy.disk_budget = budget
        # A default budget may grow with the space; the configured one refuses checkpoints,
        # so it never shrinks below what start-up allowed.
        policy.disk_limit = limit if self.requested is not None else max(limit, policy.disk_limit)
        self._log(budget, policy.disk_limit, free, before)
        if budget < before and cat.writer is not None:
            policy.enforce_disk_budget(protect=set())

    def _written(self) -> int:
        """Bytes of the entries on disk (the queued ones are not there yet)."""
        cat = self.catalog
        queued = sum(cat.entries[k].file_bytes for k in cat.pending if k in cat.entries)
        return max(0, cat.disk_bytes - queued)

    def _log(self, budget: int, limit: int, free: int, before: int) -> None:
        log = self.catalog.log
        short = budget < limit - limit // SLACK
        disk = self.catalog.disk
        if disk is not None and disk.read_only:  # a view (`cache ls`): nothing to warn about
            self.short = short
            return
        if short and not self.short:
            # one warning per episode: a failed write has already said the disk is full
            writer = self.catalog.writer
            level = logging.INFO if writer is not None and writer.stats.failing else logging.WARNING
            log.log(
                level,
                "prompt-cache: %.1f MiB free on the cache's disk; disk budget lowered to "
                "%.1f MiB (configured %.1f MiB): checkpoints that do not fit stay in RAM until "
                "space returns",
                free / 2**20,
                budget / 2**20,
                limit / 2**20,
            )
        elif self.short and not short:
            log.info("prompt-cache: disk space is back; disk budget %.1f MiB", budget / 2**20)
        elif budget != before:
            log.debug("prompt-cache disk budget %.1f MiB", budget / 2**20)
        self.short = short
