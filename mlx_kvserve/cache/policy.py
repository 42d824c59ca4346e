"""What the cache keeps: prefix dominance, the disk and RAM budgets, and eviction.

Prefix dominance with deltas (the rule)
---------------------------------------
When `checkpoint(T)` stores entry E, every entry P whose tokens are a strict prefix of T is
looked at. P is **kept** if it is an anchor, if it has delta children (it is a link of E's chain
or of another branch's chain: its bytes are part of those states, and nothing is duplicated since
a delta holds only its own span), or if it is pinned (being restored). Otherwise P is a leaf
whose state E now covers (a snapshot, or a delta off E's chain, e.g. one whose write failed) and
it is **deleted** from index, RAM and disk. Kept links stay valid restore targets themselves.
One exception, for snapshots where a later request is expected to depart (a snapshot cannot
be cut back, so nothing longer serves those requests): a departure point (`Entry.departure`) is
never pruned. That is a "message" snapshot (the conversation before one of its messages), where
a retried or edited message, or an agent's rewind, departs; a "prompt" snapshot (one token
before a chat prompt's end, or at its `<think>`; see engine.generate), where a retried request
departs, and the next turn when its template re-renders the answer differently (past reasoning
stripped); and an entry such a point was folded into (see `admission.FOLD_TOKENS`: usually the
previous answer's checkpoint, a few tokens before the next turn's "message" point). A chain of
deltas keeps every such point in its links for free, and so do a hybrid model's links. Budget
eviction still applies to them.

The converse holds too: a sliceable checkpoint whose tokens are a strict prefix of an existing
delta entry is not stored (it is "dominated": that entry already serves it), unless it is an
anchor. An anchor inside an existing chain is stored as its own delta from the longest stored
prefix (duplicating at most that span, typically a system prompt) so later branches chain to it.

Parents are never merged into children: a merge rewrites O(N) bytes per turn, exactly the O(N^2)
write volume deltas exist to avoid. Chains shrink only from their leaves: budget eviction only
picks leaves, a link becomes a leaf once its children are gone and is then scored like any other
entry. A failure eviction removes an entry together with everything that depends on it
(the engine blames the newest link of a chain first: engine/blame.py).

Budgets
-------
Disk: byte budget per model fingerprint directory (default min(20 GiB, 25% of the free space
plus what the cache already uses)), lowered while the disk itself has less room (`space`).
After each checkpoint, leaves are evicted lowest score first, score = (1 + hits) *
2**(-age / 6 h) * own tokens / own bytes (see `entry.score`), until the budget holds. Never
evicted: the entry just written, anything pinned, and (implicitly) every chain link of those. An
entry whose chain alone exceeds the configured budget is refused; one that only exceeds the
lowered budget is kept in RAM without a disk write. RAM: LRU over payload copies; with a disk
the RAM tier is a cache (dropping a copy loses nothing), without one RAM is the storage and uses
the disk rules above. Copies held by queued writes count against the RAM budget too, and the
engine waits for the writer while they alone exceed it (backpressure).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import numpy as np

from mlx_kvserve.cache.catalog import Catalog
from mlx_kvserve.cache.codec import HostArray
from mlx_kvserve.cache.entry import DISK_NONE, DISK_PENDING, Entry

GiB = 1 << 30
DEFAULT_DISK_CAP = 20 * GiB
DEFAULT_DISK_FRACTION = 0.25


def default_disk_budget(free_bytes: int, used_bytes: int = 0) -> int:
    """min(20 GiB, 25% of (free space + bytes the cache already occupies))."""
    return int(min(DEFAULT_DISK_CAP, (free_bytes + used_bytes) * DEFAULT_DISK_FRACTION))


class Policy:
    """Applies the rules above to a catalog; `drain` applies the writer's results (the RAM
    budget waits on the writer and must see its progress)."""

    def __init__(self, catalog: Catalog, drain: Callable[[], None]) -> None:
        self.catalog = catalog
        self.drain = drain
        self.disk_budget = 0  # in force now (see `space.SpaceWatch`)
        self.disk_limit = 0  # as configured: the bound of `fits`
        # bytes other files of the directory hold (the encoder outputs, cache/features.py):
        # the entries leave them that much of the budget
        self.beside: Callable[[], int] = lambda: 0
        # in a job across machines: rank 0 records what its disk budget evicts, and the other
        # ranks (`follower`) evict only that (PromptCache.drop_alike)
        self.follower = False
        self.budget_evicted: list[np.ndarray] = []
        self._warned_oversize = False
        self._waiting = False  # in wait_for_writes

    # ------------------------------------------------------------------ admission ----------
    def _chain_bytes(self, nbytes: int, parent: Entry | None) -> int:
        """The bytes a new entry of `nbytes` and its parent's chain take in their tier."""
        cat = self.catalog
        chain = cat.links(parent, parent.n_tokens) if parent else []
        if cat.disk is not None:
            return nbytes + sum(link.file_bytes for link in chain)
        return nbytes + sum(link.payload_bytes for link in chain)

    def fits_disk_now(self, nbytes: int, parent: Entry | None) -> bool:
        """Does a new entry's chain fit the disk budget in force (lowered while the disk is
        short of space)? If not, the entry is kept in RAM only."""
        return self._chain_bytes(nbytes, parent) <= self.entries_budget()

    def entries_budget(self) -> int:
        """The disk budget in force less what the files beside the entries hold."""
        return max(0, self.disk_budget - self.beside())

    def fits(self, nbytes: int, parent: Entry | None, n: int) -> bool:
        """Refuse an entry whose chain alone would exceed the configured budget (warns once)."""
        cat = self.catalog
        chain_bytes = self._chain_bytes(nbytes, parent)
        budget = self.disk_limit if cat.disk is not None else cat.ram.budget
        if chain_bytes <= budget:
            return True
        cat.counters["refused"] += 1
        level = logging.DEBUG if self._warned_oversize else logging.WARNING
        self._warned_oversize = True
        cat.log.log(
            level,
            "prompt-cache checkpoint refused: %d tokens need %.1f MiB, the budget is %.1f MiB "
            "(raise the cache budget to cache prompts this long)",
            n,
            chain_bytes / 2**20,
            budget / 2**20,
        )
        return False

    def is_dominated(self, arr: np.ndarray) -> bool:
        """Is `arr` a strict prefix of some stored trimmable entry?"""
        walk = self.catalog.index.walk(arr, arr.shape[0])
        return walk.trim_lcp >= arr.shape[0] and walk.trim_key_len > arr.shape[0]

    def prune_dominated(self, new: Entry) -> None:
        """Delete the stored strict prefixes of `new` that it makes redundant (see above)."""
        cat = self.catalog
        for length, pkey in cat.index.prefix_entries(new.tokens):
            if length >= new.n_tokens:
                continue
            p = cat.entries[pkey]
            if p.anchor or p.children or pkey in cat.pins:
                continue
            if p.departure and not new.trimmable:
                continue  # a longer snapshot does not serve a request that departs at p's end
            cat.counters["pruned"] += len(cat.remove_tree(pkey))
            cat.log.debug("prompt-cache pruned %s (prefix of %s)", pkey[:16], new.key[:16])

    # ------------------------------------------------------------------ budgets ------------
    def pick_leaf(self, candidates: Callable[[Entry], bool], protect: set[str]) -> Entry | None:
        """The lowest-scored leaf outside `protect` that `candidates` accepts."""
        now = self.catalog.clock()
        best: Entry | None = None
        best_score = 0.0
        for e in self.catalog.entries.values():
            if e.children or e.key in protect or not candidates(e):
                continue
            s = e.score(now)
            if best is None or s < best_score:
                best, best_score = e, s
        return best

    def enforce_disk_budget(self, protect: set[str]) -> None:
        cat = self.catalog
        if cat.disk is None or self.follower:
            return
        protected = cat.protected(protect)
        lowered = self.disk_budget < self.disk_limit
        budget = self.entries_budget()
        while cat.disk_bytes > budget:
            victim = self.pick_leaf(lambda e: e.disk != DISK_NONE, protected)
            if victim is None:
                break
            if lowered and victim.disk == DISK_PENDING and victim.key in cat.ram:
                # The disk is short, and this one is queued, not yet written, and in RAM: it
                # stays there (as a checkpoint made once the disk is known short does); only
                # its write is cancelled.
                cat.keep_off_disk(victim.key)
                cat.counters["disk_skipped"] += 1
                continue
            self.budget_evicted.append(victim.tokens)
            cat.counters["evictions"] += len(cat.remove_tree(victim.key))
            cat.log.debug("prompt-cache evicted %s (disk budget)", victim.key[:16])

    def enforce_ram_budget(self, protect: set[str]) -> None:
        cat = self.catalog
        protected = cat.protected(protect)
        if cat.disk is None:
            # RAM is the storage: same leaf-first, score-ordered rule as the disk.
            while cat.ram.over_budget():
                victim = self.pick_leaf(lambda e: True, protected)
                if victim is None:
                    break
                cat.counters["evictions"] += len(cat.remove_tree(victim.key))
            return
        self.trim_ram(protect)
        if self.wait_for_writes(protect):
            self.trim_ram(protect)  # copies whose writes landed meanwhile may go now

    def trim_ram(self, protect: set[str]) -> None:
        """Drop least recently used copies over the RAM budget. A copy whose write is pending
        stays in memory until the writer is done with it, in the RAM tier or not: it is not a
        victim, and copies outside the tier count too. Called again once writes land, so the
        tier is back within its budget as soon as the writer lets it."""
        cat = self.catalog
        if cat.disk is None:
            return
        protected = cat.protected(protect) | set(cat.pending)
        for key in cat.ram.lru_victims(protected, extra=cat.pending_only_bytes()):
            entry = cat.entries.get(key)
            if entry is not None and entry.disk == DISK_NONE:
                cat.counters["evictions"] += len(cat.remove_tree(key))
            else:
                cat.ram.drop(key)

    def admit_to_ram(self, key: str, arrays: Sequence[HostArray]) -> None:
        """Keep a copy read from disk in the RAM tier, within its budget."""
        self.catalog.ram.put(key, arrays)
        self.enforce_ram_budget({key})

    def wait_for_writes(self, protect: set[str]) -> bool:
        """Backpressure: while queued writes hold more than the RAM budget, wait for the
        writer. The newest checkpoint may exceed the budget on its own, alone in the queue.
        True if it waited."""
        cat = self.catalog
        if cat.writer is None or self._waiting:
            return False  # (a drain below enforces the budget again: no nested waits)
        self._waiting = True
        waited = False
        try:
            while (
                cat.ram.over_budget(cat.pending_only_bytes())
                and set(cat.pending) - protect
                and cat.writer.alive
            ):
                cat.counters["write_waits"] += 1
                waited = True
                cat.writer.wait_progress(0.1)
                self.drain()
        finally:
            self._waiting = False
        return waited

    # ------------------------------------------------------------------ failures -----------
    def evict_failed(self, key: str, reason: str, *, first_suspect: bool) -> list[str]:
        """Remove a failed entry and its dependents (see `PromptCache.evict` for the link
        `first_suspect` blames). Nothing is barred: a sound state for the same tokens, computed
        again, is stored again."""
        cat = self.catalog
        target = key
        entry = cat.entries.get(key)
        if entry is not None and first_suspect:
            suspects = [link for link in cat.links(entry, entry.n_tokens) if link.suspect]
            target = suspects[0].key if suspects else key
        removed = cat.remove_tree(target)
        if not removed and cat.disk is not None and cat.disk.delete(target):
            removed = [target]
        if removed:
            cat.sync_deletions()
        cat.counters["failure_evictions"] += len(removed)
        if first_suspect:
            cat.counters["suspect_evictions"] += len(removed)
        cat.log.warning(
            "prompt-cache evicted %s%s: %s",
            target[:16],
            f" (+{len(removed) - 1} dependent)" if len(removed) > 1 else "",
            reason,
        )
        return removed
