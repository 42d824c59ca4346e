"""Start-up: rebuild the catalog from the files' own headers, and recover from a crash.

There is no index file to go stale: the index is rebuilt from the headers at every start.
Temporary files of interrupted writes are swept, damaged files are dropped, and a delta whose
parent is gone or stores its layers differently is an orphan and is dropped too.

Counters and suspicion
----------------------
hits / last use / flags live in memory and in each file's 32-byte slot (see `codec`), updated
in place by the writer thread, so they survive restarts and most crashes. A run that did not end
cleanly leaves the `RUNNING` marker; at the next start the entries it wrote are flagged suspect
(persisted) until the engine verifies one (`mark_verified`) or evicts it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from mlx_kvserve.cache import plan
from mlx_kvserve.cache.catalog import Catalog, slot_of
from mlx_kvserve.cache.codec import FLAG_ANCHOR, FLAG_DEPARTURE, FLAG_SUSPECT
from mlx_kvserve.cache.entry import DEPARTURE_REASONS, DISK_WRITTEN, Entry, Layout
from mlx_kvserve.cache.policy import Policy
from mlx_kvserve.cache.scan import scan, sweep_temp
from mlx_kvserve.cache.space import SpaceWatch
from mlx_kvserve.cache.writer import Writer


@dataclass(frozen=True)
class Recovered:
    unclean_start: bool  # the previous run left its marker: its entries are suspect
    rebuild_seconds: float


def open_directory(
    catalog: Catalog, policy: Policy, space: SpaceWatch, *, read_only: bool, run_id: str
) -> Recovered:
    """Index `catalog.disk`, set the disk budget (`space`), then (unless read-only) mark this
    run as running, start the writer and bring the directory within its budget."""
    disk = catalog.disk
    assert disk is not None
    log = catalog.log
    started = time.perf_counter()
    marker = None if read_only else disk.read_marker()
    swept = 0 if read_only else sweep_temp(disk)
    scanned, bad = scan(disk)
    for key, problem in bad:
        log.warning("prompt-cache dropped damaged file %s: %s", key[:16], problem)
        if not read_only:
            disk.delete(key)
    accepted = _rebuild(catalog, scanned, read_only=read_only)
    prev_run = marker.get("run_id") if marker else None
    suspects = 0
    for entry in catalog.entries.values():
        from_crashed_run = marker is not None and (not prev_run or entry.run_id == prev_run)
        if from_crashed_run and not entry.suspect:
            entry.suspect = True
            if not read_only:
                # Not fsync'd: the stamp survives any process crash; only a power cut in
                # the next instants could lose it (an fsync per entry is not worth it).
                disk.write_slot(entry.key, slot_of(entry))
        suspects += entry.suspect
    rebuild_seconds = time.perf_counter() - started
    if marker is not None:
        log.warning(
            "prompt-cache: the previous run did not shut down cleanly; %d entries are "
            "suspect until verified",
            suspects,
        )
    if swept or bad or accepted < len(scanned):
        log.info(
            "prompt-cache start-up: swept %d temporary files, dropped %d damaged and %d "
            "orphaned entries",
            swept,
            len(bad),
            len(scanned) - accepted,
        )
    space.refresh()
    log.info(
        "prompt-cache: %d entries (%.1f MiB) in %s, budget %.1f MiB, index rebuilt in %.3fs",
        len(catalog.entries),
        catalog.disk_bytes / 2**20,
        disk.dir,
        policy.disk_budget / 2**20,
        rebuild_seconds,
    )
    recovered = Recovered(unclean_start=marker is not None, rebuild_seconds=rebuild_seconds)
    if read_only:
        return recovered
    disk.write_marker(run_id)
    catalog.writer = Writer(disk, log)
    policy.enforce_disk_budget(protect=set())
    return recovered


def _rebuild(catalog: Catalog, scanned: list, *, read_only: bool) -> int:
    """Index scanned headers; deltas whose parent is gone or incompatible are orphans."""
    disk = catalog.disk
    assert disk is not None
    accepted = 0
    now = catalog.clock()
    for item in sorted(scanned, key=lambda s: s.tokens.shape[0]):  # parents first
        h = item.header
        layout: Layout = {
            spec["name"]: (spec["dtype"], tuple(spec["shape"])) for spec in h["arrays"]
        }
        parent = h.get("parent")
        docs = h["meta"]["layers"]
        signature = plan.signature(docs, layout)
        if parent is not None:
            pe = catalog.entries.get(parent)
            if (
                pe is None
                or pe.n_tokens != h["parent_len"]
                or pe.signature != signature
                or not plan.parent_fits(pe.meta.get("layers") or [], plan.span_starts(docs))
            ):
                catalog.log.info("prompt-cache dropped orphan %s", item.key[:16])
                if not read_only:
                    disk.delete(item.key)
                continue
        slot = item.slot
        flags = slot.flags if slot else FLAG_SUSPECT
        created = float(h["created"]) if isinstance(h.get("created"), (int, float)) else now
        entry = Entry(
            key=item.key,
            tokens=item.tokens,
            kind=h["kind"],
            parent=parent,
            parent_len=h["parent_len"],
            reason=str(h.get("reason", "")),
            anchor=bool(h.get("anchor")) or bool(flags & FLAG_ANCHOR),
            created=created,
            run_id=str(h.get("run_id", "")),
            layout=layout,
            meta=h.get("meta") or {},
            payload_bytes=h["payload_bytes"],
            probe=h.get("probe"),
            file_bytes=item.file_bytes,
            disk=DISK_WRITTEN,
            hits=slot.hits if slot else 0,
            last_used=slot.last_used if slot and slot.last_used else created,
            suspect=bool(flags & FLAG_SUSPECT),
            departure=h.get("reason") in DEPARTURE_REASONS or bool(flags & FLAG_DEPARTURE),
            signature=signature,
        )
        entry.digest = h.get("payload_sha256")
        catalog.add(entry)
        accepted += 1
    return accepted
