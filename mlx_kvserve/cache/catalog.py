"""`Catalog`: what one `PromptCache` holds, and the only ways entries come and go.

The entry records, the token index over them, the RAM tier of payloads, the writes queued for
the writer thread, the pins of in-flight restores and the disk byte count change together, so
they live together: `add` and `remove_tree` are the only edits of the entry set, which keeps the
index, RAM, write queue, disk and byte count in agreement about which entries exist.

Chains: an entry names its parent, and a parent always outlives its children (`remove_tree`
removes the descendants first). `links` walks a chain root to leaf.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from mlx_kvserve.cache import plan
from mlx_kvserve.cache.codec import FLAG_ANCHOR, FLAG_DEPARTURE, FLAG_SUSPECT, HostArray, Slot
from mlx_kvserve.cache.counters import new_counters
from mlx_kvserve.cache.disk import DiskTier
from mlx_kvserve.cache.entry import DISK_NONE, DISK_PENDING, DISK_WRITTEN, Entry
from mlx_kvserve.cache.exceptions import CacheRestoreError
from mlx_kvserve.cache.index import TokenIndex
from mlx_kvserve.cache.ram import RamTier
from mlx_kvserve.cache.writer import WriteJob, Writer


class Catalog:
    """Entries, index, RAM tier, queued writes and pins of one model fingerprint.

    Not thread-safe: the owning `PromptCache` holds its lock around every use.
    """

    def __init__(
        self,
        fingerprint: str,
        *,
        ram_budget: int,
        log: logging.Logger,
        clock: Callable[[], float],
    ) -> None:
        self.fingerprint = fingerprint
        self.log = log
        self.clock = clock
        self.entries: dict[str, Entry] = {}
        self.index = TokenIndex()
        self.ram = RamTier(ram_budget)
        self.pins: dict[str, int] = {}
        self.pending: dict[str, WriteJob] = {}
        self.live_signature: str | None = None  # of the last live caches checkpointed
        self.disk_bytes = 0
        self.counters = new_counters()
        self.disk: DiskTier | None = None
        self.writer: Writer | None = None

    # ------------------------------------------------------------------ entry set ----------
    def add(self, entry: Entry) -> None:
        if not entry.signature:
            entry.signature = plan.signature(entry.meta.get("layers") or [], entry.layout)
        self.entries[entry.key] = entry
        self.index.insert(entry.tokens, entry.key, entry.trimmable)
        if entry.parent is not None:
            self.entries[entry.parent].children.add(entry.key)
        if entry.disk in (DISK_WRITTEN, DISK_PENDING):
            self.disk_bytes += entry.file_bytes

    def remove_tree(self, key: str, *, durable: bool = False) -> list[str]:
        """Remove `key` and its descendants (deepest first); returns the removed keys.

        Each goes from the index, RAM and disk; a queued write is cancelled under the disk's
        lock, so it can never land after its entry is gone. The entries leave memory first,
        all of them, then their files: a file that cannot be deleted never stops the rest, and
        the disk tier voids it so that no later start indexes it again (`DiskTier.delete`).
        """
        root = self.entries.get(key)
        if root is None:
            return []
        order: list[Entry] = []
        stack = [root]
        while stack:
            e = stack.pop()
            order.append(e)
            stack.extend(self.entries[c] for c in e.children if c in self.entries)
        order.reverse()
        jobs = []
        for e in order:
            self.index.remove(e.tokens, e.key)
            del self.entries[e.key]
            self.ram.drop(e.key)
            if e.parent is not None and e.parent in self.entries:
                self.entries[e.parent].children.discard(e.key)
            if e.disk in (DISK_WRITTEN, DISK_PENDING):
                self.disk_bytes -= e.file_bytes
            jobs.append(self.pending.pop(e.key, None))
        if self.disk is not None:
            for e, job in zip(order, jobs, strict=True):
                if job is not None:
                    with self.disk.fs_lock:
                        job.cancelled = True
                try:
                    self.disk.delete(e.key, durable=durable)
                except Exception:  # pragma: no cover - delete reports its own failures
                    self.log.exception("prompt-cache could not delete %s", e.key[:16])
        return [e.key for e in order]

    def keep_off_disk(self, key: str) -> None:
        """Cancel the queued write of `key`, a leaf, and keep it as a RAM-only entry (a file the
        writer may have finished meanwhile is deleted: the cancelled result is not applied)."""
        entry = self.entries[key]
        job = self.pending.pop(key, None)
        self.disk_bytes -= entry.file_bytes
        entry.disk, entry.file_bytes = DISK_NONE, 0
        if self.disk is not None:
            if job is not None:
                with self.disk.fs_lock:
                    job.cancelled = True
            self.disk.delete(key)

    def links(self, entry: Entry | None, usable: int) -> list[Entry]:
        """Chain root..entry, keeping the links that hold positions below `usable`."""
        if entry is None:
            return []
        chain = [entry]
        while chain[-1].parent is not None:
            parent = self.entries.get(chain[-1].parent)
            if parent is None:  # pragma: no cover - parents outlive children by construction
                raise CacheRestoreError(chain[-1].key, "chain parent is missing")
            chain.append(parent)
        chain.reverse()
        return [link for link in chain if link.parent_len < usable] or chain[:1]

    # ------------------------------------------------------------------ pins ---------------
    def pin(self, key: str) -> None:
        self.pins[key] = self.pins.get(key, 0) + 1

    def unpin(self, key: str) -> None:
        count = self.pins.get(key, 0) - 1
        if count <= 0:
            self.pins.pop(key, None)
        else:
            self.pins[key] = count

    def protected(self, extra: set[str]) -> set[str]:
        """`extra` and every pinned key, with all their chain links (a link's bytes are part
        of its children's states, so protecting an entry protects its chain)."""
        keys = set(extra) | set(self.pins)
        out: set[str] = set()
        for key in keys:
            entry = self.entries.get(key)
            while entry is not None and entry.key not in out:
                out.add(entry.key)
                entry = self.entries.get(entry.parent) if entry.parent else None
        return out

    # ------------------------------------------------------------------ payloads -----------
    def payload_in_ram(self, entry: Entry) -> tuple[HostArray, ...] | None:
        """The entry's host arrays from the RAM tier or from its queued write, if either."""
        arrays = self.ram.get(entry.key)
        if arrays is None and entry.key in self.pending:
            arrays = self.pending[entry.key].arrays
        return arrays

    def pending_only_bytes(self) -> int:
        """Host copies held only by queued writes (those in the RAM tier are counted there)."""
        return sum(
            sum(a.nbytes for a in job.arrays)
            for key, job in self.pending.items()
            if key not in self.ram
        )

    # ------------------------------------------------------------------ disk side ----------
    def persist_slot(self, entry: Entry, *, durable: bool = False) -> None:
        """Have the writer rewrite the entry's 32-byte slot (hits, last use, flags) in place."""
        if self.writer is None or entry.disk == DISK_NONE:
            return
        self.writer.submit_slot(entry.key, slot_of(entry), durable=durable)

    def sync_deletions(self) -> None:
        """One directory fsync for the files just deleted: on the writer thread if there is
        one (after the jobs already queued), else here."""
        if self.writer is not None:
            self.writer.submit_dir_sync()
        elif self.disk is not None:
            self.disk.sync_directory()


def slot_of(entry: Entry) -> Slot:
    """The mutable per-file record (see `codec`) of an entry's counters and flags."""
    flags = (FLAG_SUSPECT if entry.suspect else 0) | (FLAG_ANCHOR if entry.anchor else 0)
    flags |= FLAG_DEPARTURE if entry.departure else 0
    return Slot(entry.hits, entry.last_used, flags)
