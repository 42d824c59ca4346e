"""The prompt cache's counters: plain integers the policies bump as they act (`Catalog.counters`),
read by the reports in `stats`. Apart from both so that neither imports the other."""

from __future__ import annotations


def new_counters() -> dict[str, int]:
    """Every counter at zero (the keys are also the names `counters()` reports)."""
    return {
        "hits": 0,
        "misses": 0,
        "cached_tokens": 0,
        "lookup_tokens": 0,
        "restores": 0,
        "restores_from_disk": 0,
        "restore_errors": 0,
        "checkpoints": 0,
        "refused": 0,
        "duplicates": 0,
        "folded": 0,  # departure points folded into an entry a few tokens before them
        "dominated": 0,
        "pruned": 0,
        "evictions": 0,
        "failure_evictions": 0,
        "suspect_evictions": 0,  # the part of failure_evictions an unclean-start check made
        "bytes_queued": 0,
        "bytes_read": 0,  # entry files read from disk to restore
        "write_waits": 0,
        "disk_full": 0,  # write results that failed for want of space (ENOSPC, or skipped)
        "disk_skipped": 0,  # checkpoints kept off the disk: its budget, lowered, had no room
    }
