"""What a `PromptCache` reports: the `stats()` report, the counters, its memory and disk state,
the entries listing and the tokens of its chain ends (`Reports`, a mixin of `PromptCache`).

The counters are plain integers bumped by the policies as they act; the reports here only read
them and the catalog, so they can be built under the cache's lock without side effects. Kept
apart from the facade (cache/store.py) because reading the cache is a different job from
changing it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np

from mlx_kvserve.cache.catalog import Catalog
from mlx_kvserve.cache.counters import new_counters
from mlx_kvserve.cache.disk import DiskTier
from mlx_kvserve.cache.entry import EntryInfo
from mlx_kvserve.cache.features import FeatureCache
from mlx_kvserve.cache.policy import Policy
from mlx_kvserve.cache.space import SpaceWatch
from mlx_kvserve.cache.writer import Writer
from mlx_kvserve.json_value import JSON

__all__ = ["Reports", "counters_report", "entry_infos", "new_counters", "stats_report"]


def stats_report(
    catalog: Catalog,
    policy: Policy,
    space: SpaceWatch | None,
    *,
    unclean_start: bool,
    rebuild_seconds: float,
) -> dict[str, JSON]:
    """The full report of `PromptCache.stats()` (call after applying the writer's results)."""
    c = catalog.counters
    entries = catalog.entries.values()
    looked = c["hits"] + c["misses"]
    w = catalog.writer.stats if catalog.writer else None
    return {
        "fingerprint": catalog.fingerprint,
        "directory": str(catalog.disk.dir) if catalog.disk else None,
        "entries": len(catalog.entries),
        "tokens": sum(e.own_tokens for e in entries),
        "longest_entry_tokens": max((e.n_tokens for e in entries), default=0),
        "anchors": sum(e.anchor for e in entries),
        "suspect": sum(e.suspect for e in entries),
        "disk_bytes": catalog.disk_bytes,
        "disk_budget": policy.disk_budget,
        "disk_budget_configured": policy.disk_limit,
        "disk_free": space.free if space else None,
        "disk_short": space.short if space else False,  # the free space lowered the budget
        "ram_bytes": catalog.ram.nbytes,
        "ram_budget": catalog.ram.budget,
        "ram_entries": len(catalog.ram),
        "pending_writes": len(catalog.pending),
        "pinned": len(catalog.pins),  # entries an in-flight restore is reading
        "pending_bytes": catalog.pending_only_bytes(),
        "write_waits": c["write_waits"],
        "hits": c["hits"],
        "misses": c["misses"],
        "hit_rate": (c["hits"] / looked) if looked else 0.0,
        "cached_tokens": c["cached_tokens"],
        "lookup_tokens": c["lookup_tokens"],
        "token_hit_rate": (c["cached_tokens"] / c["lookup_tokens"]) if c["lookup_tokens"] else 0.0,
        "restores": c["restores"],
        "restores_from_disk": c["restores_from_disk"],
        "restore_errors": c["restore_errors"],
        "checkpoints": c["checkpoints"],
        "refused": c["refused"],
        "duplicates": c["duplicates"],
        "folded": c["folded"],
        "dominated": c["dominated"],
        "pruned": c["pruned"],
        "evictions": c["evictions"],
        "failure_evictions": c["failure_evictions"],
        "suspect_evictions": c["suspect_evictions"],
        "bytes_queued": c["bytes_queued"],
        "bytes_read": c["bytes_read"],
        "bytes_written": w.bytes_written if w else 0,
        "files_written": w.files_written if w else 0,
        "write_errors": w.write_errors if w else 0,
        "write_skips": w.write_skips if w else 0,
        "disk_full": c["disk_full"],
        "disk_skipped": c["disk_skipped"],
        "disk_writes_failing": w.failing if w else False,
        "last_write_error": w.last_error if w and w.failing else None,
        "undeleted_files": len(catalog.disk.undeleted) if catalog.disk else 0,
        "unclean_start": unclean_start,
        "rebuild_seconds": rebuild_seconds,
    }


def counters_report(catalog: Catalog, *, disk_budget: int) -> dict[str, int]:
    """Counters and sizes for monitoring, without applying the writer's results."""
    w = catalog.writer.stats if catalog.writer else None
    return {
        **catalog.counters,
        "entries": len(catalog.entries),
        "disk_bytes": catalog.disk_bytes,
        "disk_budget": disk_budget,
        "ram_bytes": catalog.ram.nbytes,
        "ram_budget": catalog.ram.budget,
        "bytes_written": w.bytes_written if w else 0,
        "write_errors": w.write_errors if w else 0,
        "disk_writes_failing": int(w.failing) if w else 0,
    }


def entry_infos(catalog: Catalog) -> list[EntryInfo]:
    """Every entry as a read-only `EntryInfo`, oldest first (ties: shorter first)."""
    now = catalog.clock()
    return [
        EntryInfo(
            key=e.key,
            n_tokens=e.n_tokens,
            kind=e.kind,
            parent=e.parent,
            parent_len=e.parent_len,
            reason=e.reason,
            anchor=e.anchor,
            created=e.created,
            last_used=e.last_used,
            hits=e.hits,
            payload_bytes=e.payload_bytes,
            file_bytes=e.file_bytes,
            disk=e.disk,
            in_ram=e.key in catalog.ram,
            suspect=e.suspect,
            children=len(e.children),
            score=e.score(now),
        )
        for e in sorted(catalog.entries.values(), key=lambda e: (e.created, e.n_tokens))
    ]


class Reports:
    """`stats`, `memory`, `disk_state`, `counters`, `entries` and `token_streams` for
    `PromptCache`, which defines the attributes used."""

    _lock: threading.RLock
    _catalog: Catalog
    _policy: Policy
    _space: SpaceWatch | None
    _writer: Writer | None
    _drain: Callable[[], None]
    disk: DiskTier | None
    disk_budget: int
    features: FeatureCache
    unclean_start: bool
    rebuild_seconds: float

    def stats(self) -> dict[str, JSON]:
        with self._lock:
            self._drain()
            report = stats_report(
                self._catalog,
                self._policy,
                self._space,
                unclean_start=self.unclean_start,
                rebuild_seconds=self.rebuild_seconds,
            )
        return {**report, **self.features.stats()}

    def memory(self) -> dict[str, int]:
        """Host bytes this cache keeps in (unified) memory: the RAM tier, and copies queued for
        the disk that are not in it. Any thread (for the engine's memory ledger)."""
        features, queued = self.features.memory()  # the image features count with the tier
        with self._lock:
            cat = self._catalog
            return {
                "ram_tier": cat.ram.nbytes + features,
                "pending_writes": cat.pending_only_bytes() + queued,
            }

    def disk_state(self) -> dict[str, JSON] | None:
        """The disk tier as the writer last saw it, read without the lock (any thread, e.g.
        /health while the engine thread waits for the disk); None without a writable disk."""
        writer, space = self._writer, self._space
        if self.disk is None or writer is None or space is None:
            return None
        failing = writer.stats.failing
        return {
            "writes_failing": failing,
            "error": writer.stats.last_error if failing else None,
            "budget_lowered": space.short,
            "undeleted_files": len(self.disk.undeleted),
        }

    def counters(self) -> dict[str, int]:
        """Counters and sizes for monitoring. Unlike stats() it does not apply the writer's
        results (engine-thread work), so a metrics scrape may call it from any thread."""
        with self._lock:
            report = counters_report(self._catalog, disk_budget=self.disk_budget)
        return {**report, **self.features.stats()}

    def entries(self) -> list[EntryInfo]:
        with self._lock:
            self._drain()
            return entry_infos(self._catalog)

    def token_streams(self, limit: int) -> list[np.ndarray]:
        """The tokens of the most recently used chain ends (entries no other entry extends),
        at most `limit` tokens in all, oldest first: what earlier requests' prompts and outputs
        held (speculation's continuations start from them, engine/speculation/continuations.py).
        """
        with self._lock:
            ends = [e for e in self._catalog.entries.values() if not e.children]
            ends.sort(key=lambda e: e.last_used, reverse=True)
            out: list[np.ndarray] = []
            total = 0
            for entry in ends:
                if total >= limit:
                    break
                out.append(entry.tokens)
                total += entry.n_tokens
            return out[::-1]
