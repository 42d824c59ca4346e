"""`PromptCache`: the prompt (KV) cache facade the engine calls from its one MLX thread.

Structure
---------
* `index.TokenIndex`: radix trie over every live entry's tokens (RAM and disk alike).
* `ram.RamTier`: host copies of payloads, LRU in a byte budget; a hot hit never reads the disk.
* `disk.DiskTier` + `writer.Writer`: one file per entry, written durably off-thread.

Entries are either **deltas** (every layer a plain KVCache: the entry stores only positions
[parent_len, n) and names its parent, the longest existing on-disk delta whose tokens are a
prefix of its own) or **snapshots** (whole per-layer state, for rotating windows, SSM layers and
mixed models; usable only when their tokens are an exact prefix of the prompt). A growing
conversation therefore writes each position once (O(N) bytes, not O(N^2)), and a shared system
prompt is stored once and reused by every conversation that branches from it.

Prefix dominance with deltas (the rule)
---------------------------------------
When `checkpoint(T)` stores entry E, every entry P whose tokens are a strict prefix of T is
looked at. P is **kept** if it is an anchor, if it has delta children (it is a link of E's chain
or of another branch's chain: its bytes are part of those states, and nothing is duplicated since
a delta holds only its own span), or if it is pinned (being restored). Otherwise P is a leaf
whose state E now covers (a snapshot, or a delta off E's chain, e.g. one whose write failed) and
it is **deleted** from index, RAM and disk. Kept links stay valid restore targets themselves.

The converse holds too: a sliceable checkpoint whose tokens are a strict prefix of an existing
delta entry is not stored (it is "dominated": that entry already serves it), unless it is an
anchor. An anchor inside an existing chain is stored as its own delta from the longest stored
prefix (duplicating at most that span, typically a system prompt) so later branches chain to it.

Parents are never merged into children: a merge rewrites O(N) bytes per turn, exactly the O(N^2)
write volume deltas exist to avoid. Chains shrink only from their leaves: budget eviction only
picks leaves, a link becomes a leaf once its children are gone and is then scored like any other
entry. `evict()` (failure) removes an entry together with everything that depends on it.

With a disk, a delta's parent must itself be on disk (written or queued), so every file on disk
has its whole chain on disk. Positions below `parent_len` come from the parent chain, not from
the live cache: identical when the live cache was restored from that chain (the normal case);
after a cold prefill they may differ in the last float bits, as any prefix cache does.

Budgets
-------
Disk: byte budget per model fingerprint directory (default min(20 GiB, 25% of the free space
plus what the cache already uses)).
After each checkpoint, leaves are evicted lowest score first, score = (1 + hits) *
2**(-age / 6 h) * own tokens / own bytes (see `entry.score`), until the budget holds. Never
evicted: the entry just written, anything pinned, and (implicitly) every chain link of those. An
entry whose chain alone exceeds the budget is refused. RAM: LRU over payload copies; with a disk
the RAM tier is a cache (dropping a copy loses nothing), without one RAM is the storage and uses
the disk rules above.

Counters and suspicion
----------------------
hits / last use / flags live in memory and in each file's 32-byte slot (see `codec`), updated
in place by the writer thread, so they survive restarts and most crashes. A run that did not end
cleanly leaves the `RUNNING` marker; at the next start the entries it wrote are flagged suspect
(persisted) until the engine verifies one (`mark_verified`) or evicts it.

Usage (engine thread)
---------------------
    m = cache.lookup(prompt)                       # m.usable <= len(prompt) - 1
    caches = make_prompt_cache(model)
    if m.hit:
        try:
            cache.restore(m, caches, tokens=prompt, dtype=kv_dtype)
        except CacheRestoreError as err:           # discard `caches`: may be half filled
            cache.evict(err.key, err.problem)      # removes it and its dependents, logs once
            caches, m = make_prompt_cache(model), MISS
    ... prefill prompt[m.usable:], calling cache.checkpoint(prompt[:k], caches, reason) whenever
    the live caches hold exactly k tokens at a boundary worth keeping ...

Threads: every public method takes one lock and is meant for the engine thread; the writer
thread only reports back through a queue drained here.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from mlx_kvserve.cache import codec, state
from mlx_kvserve.cache.codec import FLAG_ANCHOR, FLAG_SUSPECT, HostArray, Slot
from mlx_kvserve.cache.disk import DiskTier
from mlx_kvserve.cache.entry import (
    DELTA,
    DISK_NONE,
    DISK_PENDING,
    DISK_WRITTEN,
    MISS,
    SNAPSHOT,
    Entry,
    EntryInfo,
    Match,
    as_token_array,
    check_fingerprint,
    entry_key,
)
from mlx_kvserve.cache.errors import CacheError, CacheRestoreError, EntryFormatError
from mlx_kvserve.cache.fingerprint import layout_versions
from mlx_kvserve.cache.index import TokenIndex
from mlx_kvserve.cache.ram import RamTier
from mlx_kvserve.cache.writer import LoadResult, WriteJob, Writer

GiB = 1 << 30
DEFAULT_DISK_CAP = 20 * GiB
DEFAULT_DISK_FRACTION = 0.25
_DIGEST_PLACEHOLDER = "0" * 64
DTYPE_SIZES = {name: dt.itemsize for name, dt in codec.DTYPES.items()}

Layout = dict[str, tuple[str, tuple[int, ...]]]


def default_disk_budget(free_bytes: int, used_bytes: int = 0) -> int:
    """min(20 GiB, 25% of (free space + bytes the cache already occupies))."""
    return int(min(DEFAULT_DISK_CAP, (free_bytes + used_bytes) * DEFAULT_DISK_FRACTION))


class PromptCache:
    """Persistent prompt cache for one model fingerprint (see the module docstring)."""

    def __init__(
        self,
        directory: Path | None,
        fingerprint: str,
        *,
        disk_budget: int | None,
        ram_budget: int,
        logger: logging.Logger | None = None,
        read_only: bool = False,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.fingerprint = check_fingerprint(fingerprint)
        self.log = logger or logging.getLogger("mlx_kvserve.cache")
        self.read_only = read_only
        self.run_id = uuid.uuid4().hex
        self._clock = clock
        self._lock = threading.RLock()
        self._entries: dict[str, Entry] = {}
        self._index = TokenIndex()
        self._ram = RamTier(ram_budget)
        self._pins: dict[str, int] = {}
        self._pending: dict[str, WriteJob] = {}
        self._failed: set[str] = set()  # evicted for failure: never re-stored by this process
        self._live_layout: Layout | None = None
        self._last_written: str | None = None
        self._disk_bytes = 0
        self._closed = False
        self._warned_oversize = False
        self._waiting = False  # in _wait_for_writes
        self._counters = {
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
            "dominated": 0,
            "pruned": 0,
            "evictions": 0,
            "failure_evictions": 0,
            "suspect_evictions": 0,  # the part of failure_evictions an unclean-start check made
            "bytes_queued": 0,
            "bytes_read": 0,  # entry files read from disk to restore
            "write_waits": 0,
        }
        self.unclean_start = False
        self.rebuild_seconds = 0.0
        self.disk: DiskTier | None = None
        self._writer: Writer | None = None
        if directory is None:
            self.disk_budget = 0
            return
        self.disk = DiskTier(Path(directory), self.fingerprint, self.log, read_only=read_only)
        try:
            self._open_disk(disk_budget)
        except BaseException:
            self.disk.release_lock()
            raise

    # ================================================================= public API ==============
    def lookup(self, tokens: Sequence[int]) -> Match:
        """Best restorable prefix of `tokens`; `usable <= len(tokens) - 1` always."""
        with self._lock:
            self._drain()
            try:
                arr = as_token_array(tokens)
            except ValueError:
                return MISS
            n = arr.shape[0]
            self._counters["lookup_tokens"] += n
            limit = n - 1
            best: tuple[int, str] | None = None
            if limit >= 1 and self._entries:
                walk = self._index.walk(arr, limit)
                if walk.trim_key is not None:
                    best = (min(walk.trim_lcp, limit), walk.trim_key)
                for length, key in reversed(walk.prefixes):
                    if length <= limit and self._entries[key].kind == SNAPSHOT:
                        if best is None or length > best[0]:
                            best = (length, key)
                        break
            if best is None or best[0] <= 0:
                self._counters["misses"] += 1
                return MISS
            usable, key = best
            entry = self._entries[key]
            links = self._links(entry, usable)
            if any(link.suspect for link in links) and not _reaches_probe(entry, usable):
                # An unverified state is never used unchecked: when the prompt stops before
                # the entry's probe (e.g. the same prompt sent again), fall back to the
                # deepest link of its chain that ends inside the prompt, whose own probe the
                # restore does reach; the positions after it are prefilled instead.
                inside = [link for link in links[:-1] if link.n_tokens <= usable]
                if not inside:
                    self._counters["misses"] += 1
                    return MISS
                entry, usable = inside[-1], inside[-1].n_tokens
                key, links = entry.key, links[: len(inside)]
            in_ram = all(link.key in self._ram or link.key in self._pending for link in links)
            self._counters["hits"] += 1
            self._counters["cached_tokens"] += usable
            return Match(
                key=key,
                usable=usable,
                source="ram" if in_ram else "disk",
                kind=entry.kind,
                entry_tokens=entry.n_tokens,
                suspect=any(link.suspect for link in links),
                probe=entry.probe,
            )

    def restore(
        self,
        match: Match,
        fresh_caches: list,
        *,
        tokens: Sequence[int] | None = None,
        dtype: Any = None,
    ) -> list:
        """Fill the model's empty caches with `match.usable` tokens of state; return them.

        `tokens` (the prompt) re-checks the entry's ids; `dtype` (e.g. mx.float16) requires the
        stored KV to have the model's activation dtype. Raises CacheRestoreError on any problem;
        the caller then evicts `err.key` and prefills cold.
        """
        with self._lock:
            self._drain()
            if not match.hit:
                return fresh_caches
            key = match.key
            assert key is not None
            entry = self._entries.get(key)
            if entry is None:
                raise CacheRestoreError(key, "entry no longer exists")
            usable = match.usable
            if not 0 < usable <= entry.n_tokens or (
                entry.kind == SNAPSHOT and usable != entry.n_tokens
            ):
                raise CacheRestoreError(key, f"cannot restore {usable} of {entry.n_tokens} tokens")
            if tokens is not None:
                try:
                    arr = as_token_array(tokens)
                except ValueError as exc:
                    raise ValueError(f"bad prompt tokens: {exc}") from None
                if arr.shape[0] < usable + 1:
                    raise ValueError("at least one prompt token must be left to prefill")
                if not np.array_equal(arr[:usable], entry.tokens[:usable]):
                    raise CacheRestoreError(key, "entry tokens do not match the prompt")
            dtype_str = None
            if dtype is not None:
                dtype_str = dtype if isinstance(dtype, str) else state.dtype_name(dtype)
            links = self._links(entry, usable)
            for link in links:
                self._pin(link.key)
            started = time.perf_counter()
            try:
                if entry.kind == DELTA:
                    from_disk = self._restore_chain(links, fresh_caches, usable, dtype_str, key)
                else:
                    stored = entry.meta.get("kv_dtype")
                    if dtype_str is not None and stored is not None and stored != dtype_str:
                        problem = f"snapshot KV is {stored}, the model uses {dtype_str}"
                        raise self._restore_error(key, state.StateError(problem), key)
                    from_disk = self._restore_snapshot(entry, fresh_caches, key)
            finally:
                for link in links:
                    self._unpin(link.key)
            now = self._clock()
            for link in links:
                link.hits += 1
                link.last_used = now
                self._persist_slot(link)
            self._counters["restores"] += 1
            self.log.debug(
                "restored %d tokens from %d link(s), %d read from disk, in %.3f s",
                usable,
                len(links),
                len(from_disk),
                time.perf_counter() - started,
            )
            self._promote(from_disk)
            return fresh_caches

    def checkpoint(
        self,
        tokens: Sequence[int],
        caches: list,
        reason: str,
        *,
        anchor: bool = False,
        probe: Any = None,
    ) -> str | None:
        """Store the live caches' state for `tokens`; returns the new key or None.

        The caches hold exactly `tokens`, or (plain KVCache layers only) more positions of which
        `tokens` are the first.

        None means refused (length mismatch, oversize, a key that failed before, read-only)
        or duplicate (already stored; an `anchor` flag is still applied). `probe` is the
        logits row at the last position, kept to re-check behaviour after an unclean shutdown.
        """
        with self._lock:
            self._drain()
            if self.read_only or self._closed:
                return None
            try:
                arr = as_token_array(tokens)
            except ValueError as exc:
                self.log.warning("prompt-cache checkpoint refused: %s", exc)
                return None
            n = arr.shape[0]
            if n == 0 or not caches:
                return None
            offsets = state.cache_offsets(caches)
            # Sliceable caches can be checkpointed at any prefix of what they hold (a delta is
            # cut from them); other states only as the whole.
            prefix_ok = state.is_sliceable(caches)
            if any(off != n and not (prefix_ok and off > n) for off in offsets):
                self._counters["refused"] += 1
                self.log.warning(
                    "prompt-cache checkpoint refused: caches hold %s tokens, key has %d",
                    sorted(set(offsets)),
                    n,
                )
                return None
            key = entry_key(self.fingerprint, arr)
            if key in self._failed:
                self._counters["refused"] += 1
                return None
            existing = self._entries.get(key)
            if existing is not None:
                self._counters["duplicates"] += 1
                existing.last_used = self._clock()
                if anchor and not existing.anchor:
                    existing.anchor = True
                self._persist_slot(existing)
                return None
            if not anchor and state.is_sliceable(caches) and self._covered(arr):
                # A longer trimmable entry already serves these tokens: storing them again
                # would be a nested copy (invariant 4).
                self._counters["dominated"] += 1
                return None
            try:
                return self._store(arr, key, caches, reason, anchor, probe)
            except Exception as exc:  # a checkpoint must never fail the request
                self._counters["refused"] += 1
                self.log.warning("prompt-cache checkpoint of %d tokens failed: %r", n, exc)
                if key in self._entries:
                    self._remove_tree(key)
                return None

    def evict(
        self, key: str, reason: str, *, whole_chain: bool = False, first_suspect: bool = False
    ) -> list[str]:
        """Remove `key` and every entry depending on it, from RAM and disk; one log line.

        Meant for failures: the key is also barred from being stored again by this process, so
        a state that failed cannot be served twice. `whole_chain=True` evicts from the root of
        `key`'s chain instead: use it when a failure shows up only after restoring (e.g. NaN
        logits during prefill), since any restored link may be the bad one.
        `first_suspect=True` evicts from the shallowest suspect link of the chain: a failed
        behaviour check after an unclean shutdown can only blame what the dead run wrote, and
        the verified links before it (a shared system prompt) stay for other conversations.
        """
        with self._lock:
            self._drain()
            target = key
            entry = self._entries.get(key)
            if entry is not None and (whole_chain or first_suspect):
                chain = self._links(entry, entry.n_tokens)
                suspects = [link for link in chain if link.suspect] if first_suspect else []
                target = (suspects or chain)[0].key
            self._failed.add(target)
            removed = self._remove_tree(target)
            if not removed and self.disk is not None and self.disk.delete(target):
                removed = [target]
            if removed:
                self._sync_deletions()
            self._counters["failure_evictions"] += len(removed)
            if first_suspect:
                self._counters["suspect_evictions"] += len(removed)
            self.log.warning(
                "prompt-cache evicted %s%s: %s",
                target[:16],
                f" (+{len(removed) - 1} dependent)" if len(removed) > 1 else "",
                reason,
            )
            return removed

    def mark_verified(self, key: str) -> None:
        """The engine checked the behaviour of `key` after restoring it: clear suspicion."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return
            for link in self._links(entry, entry.n_tokens):
                if link.suspect:
                    link.suspect = False
                    self._persist_slot(link, durable=True)

    @contextlib.contextmanager
    def pinned(self, key: str | None) -> Iterator[None]:
        """Protect `key` and its chain from eviction and pruning for the duration."""
        with self._lock:
            entry = self._entries.get(key) if key else None
            keys = [link.key for link in self._links(entry, entry.n_tokens)] if entry else []
            for k in keys:
                self._pin(k)
        try:
            yield
        finally:
            with self._lock:
                for k in keys:
                    self._unpin(k)

    def stats(self) -> dict[str, Any]:
        with self._lock:
            self._drain()
            c = self._counters
            looked = c["hits"] + c["misses"]
            w = self._writer.stats if self._writer else None
            return {
                "fingerprint": self.fingerprint,
                "directory": str(self.disk.dir) if self.disk else None,
                "entries": len(self._entries),
                "tokens": sum(e.own_tokens for e in self._entries.values()),
                "longest_entry_tokens": max(
                    (e.n_tokens for e in self._entries.values()), default=0
                ),
                "anchors": sum(e.anchor for e in self._entries.values()),
                "suspect": sum(e.suspect for e in self._entries.values()),
                "disk_bytes": self._disk_bytes,
                "disk_budget": self.disk_budget,
                "ram_bytes": self._ram.nbytes,
                "ram_budget": self._ram.budget,
                "ram_entries": len(self._ram),
                "pending_writes": len(self._pending),
                "pending_bytes": self._pending_only_bytes(),
                "write_waits": c["write_waits"],
                "hits": c["hits"],
                "misses": c["misses"],
                "hit_rate": (c["hits"] / looked) if looked else 0.0,
                "cached_tokens": c["cached_tokens"],
                "lookup_tokens": c["lookup_tokens"],
                "token_hit_rate": (c["cached_tokens"] / c["lookup_tokens"])
                if c["lookup_tokens"]
                else 0.0,
                "restores": c["restores"],
                "restores_from_disk": c["restores_from_disk"],
                "restore_errors": c["restore_errors"],
                "checkpoints": c["checkpoints"],
                "refused": c["refused"],
                "duplicates": c["duplicates"],
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
                "disk_writes_failing": w.failing if w else False,
                "unclean_start": self.unclean_start,
                "rebuild_seconds": self.rebuild_seconds,
            }

    def counters(self) -> dict[str, int]:
        """Counters and sizes for monitoring. Unlike stats() it does not apply the writer's
        results (engine-thread work), so a metrics scrape may call it from any thread."""
        with self._lock:
            w = self._writer.stats if self._writer else None
            return {
                **self._counters,
                "entries": len(self._entries),
                "disk_bytes": self._disk_bytes,
                "disk_budget": self.disk_budget,
                "ram_bytes": self._ram.nbytes,
                "ram_budget": self._ram.budget,
                "bytes_written": w.bytes_written if w else 0,
                "write_errors": w.write_errors if w else 0,
            }

    def entries(self) -> list[EntryInfo]:
        with self._lock:
            self._drain()
            now = self._clock()
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
                    in_ram=e.key in self._ram,
                    suspect=e.suspect,
                    children=len(e.children),
                    score=e.score(now),
                )
                for e in sorted(self._entries.values(), key=lambda e: (e.created, e.n_tokens))
            ]

    def verify(self) -> list[tuple[str, str]]:
        """Fully read and check every stored file; returns (key, problem) for the bad ones."""
        self.flush()
        with self._lock:
            problems: list[tuple[str, str]] = []
            if self.disk is None:
                return problems
            for entry in list(self._entries.values()):
                if entry.disk != DISK_WRITTEN:
                    continue
                try:
                    header, arrays = self.disk.read_entry(entry.key)
                    self._check_loaded(entry, header, arrays)
                except (EntryFormatError, OSError, state.StateError, ValueError) as exc:
                    problems.append((entry.key, str(exc)))
            return problems

    def clear(self) -> int:
        """Remove every entry (RAM and disk); returns how many were removed."""
        with self._lock:
            self._drain()
            roots = [e.key for e in self._entries.values() if e.parent not in self._entries]
            removed = 0
            for key in roots:
                removed += len(self._remove_tree(key))
            if self.disk is not None and not self.read_only:
                for path in self.disk.entry_files():
                    with contextlib.suppress(FileNotFoundError):
                        path.unlink()
            self._failed.clear()
            self.log.info("prompt-cache cleared %d entries", removed)
            return removed

    def flush(self) -> None:
        """Wait for pending writes to land on disk."""
        if self._writer is not None:
            self._writer.flush()
        with self._lock:
            self._drain()

    def close(self) -> None:
        """Flush, stop the writer, mark a clean shutdown, release the directory lock."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if self._writer is not None:
            self._writer.flush()
            self._writer.stop()
        with self._lock:
            self._drain()
            if self.disk is not None and not self.read_only:
                self.disk.remove_marker()
                self.disk.release_lock()

    def __enter__(self) -> PromptCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ============================================================== opening ====================
    def _open_disk(self, disk_budget: int | None) -> None:
        disk = self.disk
        assert disk is not None
        started = time.perf_counter()
        marker = None if self.read_only else disk.read_marker()
        if marker is not None:
            self.unclean_start = True
        swept = 0 if self.read_only else disk.sweep_temp()
        scanned, bad = disk.scan()
        for key, problem in bad:
            self.log.warning("prompt-cache dropped damaged file %s: %s", key[:16], problem)
            if not self.read_only:
                disk.delete(key)
        accepted = self._rebuild(scanned)
        prev_run = marker.get("run_id") if marker else None
        suspects = 0
        for entry in self._entries.values():
            from_crashed_run = marker is not None and (not prev_run or entry.run_id == prev_run)
            if from_crashed_run and not entry.suspect:
                entry.suspect = True
                if not self.read_only:
                    # Not fsync'd: the stamp survives any process crash; only a power cut in
                    # the next instants could lose it (an fsync per entry is not worth it).
                    disk.write_slot(entry.key, self._slot(entry))
            suspects += entry.suspect
        self.rebuild_seconds = time.perf_counter() - started
        if marker is not None:
            self.log.warning(
                "prompt-cache: the previous run did not shut down cleanly; %d entries are "
                "suspect until verified",
                suspects,
            )
        if swept or bad or accepted < len(scanned):
            self.log.info(
                "prompt-cache start-up: swept %d temporary files, dropped %d damaged and %d "
                "orphaned entries",
                swept,
                len(bad),
                len(scanned) - accepted,
            )
        self.disk_budget = (
            int(disk_budget)
            if disk_budget is not None
            else default_disk_budget(disk.free_bytes(), self._disk_bytes)
        )
        self.log.info(
            "prompt-cache: %d entries (%.1f MiB) in %s, budget %.1f MiB, index rebuilt in %.3fs",
            len(self._entries),
            self._disk_bytes / 2**20,
            disk.dir,
            self.disk_budget / 2**20,
            self.rebuild_seconds,
        )
        if self.read_only:
            return
        disk.write_marker(self.run_id)
        self._writer = Writer(disk, self.log)
        self._enforce_disk_budget(protect=set())

    def _rebuild(self, scanned: list) -> int:
        """Index scanned headers; deltas whose parent is gone or incompatible are orphans."""
        disk = self.disk
        assert disk is not None
        accepted = 0
        now = self._clock()
        for item in sorted(scanned, key=lambda s: s.tokens.shape[0]):  # parents first
            h = item.header
            layout: Layout = {
                spec["name"]: (spec["dtype"], tuple(spec["shape"])) for spec in h["arrays"]
            }
            parent = h.get("parent")
            if parent is not None:
                pe = self._entries.get(parent)
                if (
                    pe is None
                    or pe.kind != DELTA
                    or pe.n_tokens != h["parent_len"]
                    or not state.compatible_delta(pe.layout, layout)
                ):
                    self.log.info("prompt-cache dropped orphan %s", item.key[:16])
                    if not self.read_only:
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
            )
            entry.digest = h.get("payload_sha256")
            self._add(entry)
            accepted += 1
        return accepted

    # ============================================================== storing ====================
    def _store(
        self, arr: np.ndarray, key: str, caches: list, reason: str, anchor: bool, probe: Any
    ) -> str | None:
        n = arr.shape[0]
        parent: Entry | None = None
        if state.is_sliceable(caches):
            live = self._layout_of(caches)
            self._live_layout = live

            def accept(k: str) -> bool:
                e = self._entries[k]
                return (
                    e.kind == DELTA
                    and (self.disk is None or e.disk != DISK_NONE)
                    and state.compatible_delta(e.layout, live)
                )

            found = self._index.longest_prefix(arr, accept, strict=True)
            parent = self._entries[found[1]] if found else None
            start = parent.n_tokens if parent else 0
            per_token = sum(
                DTYPE_SIZES[dt] * shape[0] * shape[1] * shape[3] for dt, shape in live.values()
            )
            if not self._fits(per_token * (n - start), parent, n):
                return None
            kind = DELTA
            meta: dict[str, Any] = {"n_layers": len(caches)}
            arrays = state.extract_delta(caches, start, n)
        else:
            kind = SNAPSHOT
            meta, arrays = state.extract_snapshot(caches)
            if arrays:  # the first array of layer 0's state: the rule PromptStates.kv_dtype uses
                meta["kv_dtype"] = arrays[0].dtype
        payload_bytes = sum(a.nbytes for a in arrays)
        probe_doc = state.make_probe(probe, n - 1) if probe is not None else None
        now = self._clock()
        specs, _ = codec.array_specs(arrays)
        header = {
            "format": codec.FORMAT_VERSION,
            "fingerprint": self.fingerprint,
            "key": key,
            "tokens": codec.encode_tokens(arr),
            "n_tokens": n,
            "kind": kind,
            "parent": parent.key if parent else None,
            "parent_len": parent.n_tokens if parent else 0,
            "reason": str(reason),
            "anchor": bool(anchor),
            "created": now,
            "run_id": self.run_id,
            "meta": meta,
            "arrays": specs,
            "payload_bytes": payload_bytes,
            "payload_sha256": _DIGEST_PLACEHOLDER,
            "probe": probe_doc,
            "versions": layout_versions(),
        }
        head_bytes = len(codec.pack_head(header, Slot()))
        file_bytes = head_bytes + payload_bytes
        if not self._fits(file_bytes if self.disk else payload_bytes, parent, n):
            return None
        entry = Entry(
            key=key,
            tokens=arr,
            kind=kind,
            parent=parent.key if parent else None,
            parent_len=parent.n_tokens if parent else 0,
            reason=str(reason),
            anchor=bool(anchor),
            created=now,
            run_id=self.run_id,
            layout={a.name: (a.dtype, a.shape) for a in arrays},
            meta=meta,
            payload_bytes=payload_bytes,
            probe=probe_doc,
            last_used=now,
        )
        self._add(entry)
        if payload_bytes <= self._ram.budget:
            self._ram.put(key, arrays)
        if self.disk is not None:
            job = WriteJob(key, header, tuple(arrays), self._slot(entry))
            entry.disk = DISK_PENDING
            entry.file_bytes = file_bytes
            self._disk_bytes += file_bytes
            self._pending[key] = job
            assert self._writer is not None
            self._writer.submit(job)
            self._counters["bytes_queued"] += file_bytes
        self._counters["checkpoints"] += 1
        self._last_written = key
        self._prune_dominated(entry)
        protect = {key}
        self._enforce_disk_budget(protect)
        self._enforce_ram_budget(protect)
        return key if key in self._entries else None

    def _fits(self, nbytes: int, parent: Entry | None, n: int) -> bool:
        """Refuse an entry whose chain alone would exceed the budget (warns once)."""
        chain = self._links(parent, parent.n_tokens) if parent else []
        if self.disk is not None:
            chain_bytes = nbytes + sum(link.file_bytes for link in chain)
            budget = self.disk_budget
        else:
            chain_bytes = nbytes + sum(link.payload_bytes for link in chain)
            budget = self._ram.budget
        if chain_bytes <= budget:
            return True
        self._counters["refused"] += 1
        level = logging.DEBUG if self._warned_oversize else logging.WARNING
        self._warned_oversize = True
        self.log.log(
            level,
            "prompt-cache checkpoint refused: %d tokens need %.1f MiB, the budget is %.1f MiB "
            "(raise the cache budget to cache prompts this long)",
            n,
            chain_bytes / 2**20,
            budget / 2**20,
        )
        return False

    def _covered(self, arr: np.ndarray) -> bool:
        """Is `arr` a strict prefix of some stored trimmable entry?"""
        walk = self._index.walk(arr, arr.shape[0])
        return walk.trim_lcp >= arr.shape[0] and walk.trim_key_len > arr.shape[0]

    def _prune_dominated(self, new: Entry) -> None:
        for length, pkey in self._index.prefix_entries(new.tokens):
            if length >= new.n_tokens:
                continue
            p = self._entries[pkey]
            if p.anchor or p.children or pkey in self._pins:
                continue
            self._counters["pruned"] += len(self._remove_tree(pkey))
            self.log.debug("prompt-cache pruned %s (prefix of %s)", pkey[:16], new.key[:16])

    # ============================================================== budgets ====================
    def _protected(self, extra: set[str]) -> set[str]:
        keys = set(extra) | set(self._pins)
        out: set[str] = set()
        for key in keys:
            entry = self._entries.get(key)
            while entry is not None and entry.key not in out:
                out.add(entry.key)
                entry = self._entries.get(entry.parent) if entry.parent else None
        return out

    def _pick_leaf(self, candidates: Callable[[Entry], bool], protect: set[str]) -> Entry | None:
        now = self._clock()
        best: Entry | None = None
        best_score = 0.0
        for e in self._entries.values():
            if e.children or e.key in protect or not candidates(e):
                continue
            s = e.score(now)
            if best is None or s < best_score:
                best, best_score = e, s
        return best

    def _enforce_disk_budget(self, protect: set[str]) -> None:
        if self.disk is None:
            return
        protected = self._protected(protect)
        while self._disk_bytes > self.disk_budget:
            victim = self._pick_leaf(lambda e: e.disk != DISK_NONE, protected)
            if victim is None:
                break
            self._counters["evictions"] += len(self._remove_tree(victim.key))
            self.log.debug("prompt-cache evicted %s (disk budget)", victim.key[:16])

    def _enforce_ram_budget(self, protect: set[str]) -> None:
        protected = self._protected(protect)
        if self.disk is None:
            # RAM is the storage: same leaf-first, score-ordered rule as the disk.
            while self._ram.over_budget():
                victim = self._pick_leaf(lambda e: True, protected)
                if victim is None:
                    break
                self._counters["evictions"] += len(self._remove_tree(victim.key))
            return
        # A copy whose write is pending stays in memory until the writer is done with it, in
        # the RAM tier or not: it is not a victim, and copies outside the tier count too.
        protected |= set(self._pending)
        for key in self._ram.lru_victims(protected, extra=self._pending_only_bytes()):
            entry = self._entries.get(key)
            if entry is not None and entry.disk == DISK_NONE:
                self._counters["evictions"] += len(self._remove_tree(key))
            else:
                self._ram.drop(key)
        self._wait_for_writes(protect)

    def _pending_only_bytes(self) -> int:
        """Host copies held only by queued writes (those in the RAM tier are counted there)."""
        return sum(
            sum(a.nbytes for a in job.arrays)
            for key, job in self._pending.items()
            if key not in self._ram
        )

    def _wait_for_writes(self, protect: set[str]) -> None:
        """Backpressure: while queued writes hold more than the RAM budget, wait for the
        writer. The newest checkpoint may exceed the budget on its own, alone in the queue."""
        if self._writer is None or self._waiting:
            return  # (a drain below enforces the budget again: no nested waits)
        self._waiting = True
        try:
            while (
                self._ram.over_budget(self._pending_only_bytes())
                and set(self._pending) - protect
                and self._writer.alive
            ):
                self._counters["write_waits"] += 1
                self._writer.wait_progress(0.1)
                self._drain()
        finally:
            self._waiting = False

    def _sync_deletions(self) -> None:
        """One directory fsync for the files just deleted: on the writer thread if there is
        one (after the jobs already queued), else here."""
        if self._writer is not None:
            self._writer.submit_dir_sync()
        elif self.disk is not None:
            self.disk.sync_directory()

    # ============================================================== internals ==================
    def _add(self, entry: Entry) -> None:
        self._entries[entry.key] = entry
        self._index.insert(entry.tokens, entry.key, entry.trimmable)
        if entry.parent is not None:
            self._entries[entry.parent].children.add(entry.key)
        if entry.disk in (DISK_WRITTEN, DISK_PENDING):
            self._disk_bytes += entry.file_bytes

    def _remove_tree(self, key: str, *, durable: bool = False) -> list[str]:
        """Remove `key` and its descendants (deepest first); returns the removed keys."""
        root = self._entries.get(key)
        if root is None:
            return []
        order: list[Entry] = []
        stack = [root]
        while stack:
            e = stack.pop()
            order.append(e)
            stack.extend(self._entries[c] for c in e.children if c in self._entries)
        removed = []
        for e in reversed(order):
            self._index.remove(e.tokens, e.key)
            del self._entries[e.key]
            self._ram.drop(e.key)
            if e.parent is not None and e.parent in self._entries:
                self._entries[e.parent].children.discard(e.key)
            if e.disk in (DISK_WRITTEN, DISK_PENDING):
                self._disk_bytes -= e.file_bytes
            job = self._pending.pop(e.key, None)
            if self.disk is not None:
                if job is not None:
                    with self.disk.fs_lock:
                        job.cancelled = True
                self.disk.delete(e.key, durable=durable)
            if self._last_written == e.key:
                self._last_written = None
            removed.append(e.key)
        return removed

    def _links(self, entry: Entry | None, usable: int) -> list[Entry]:
        """Chain root..entry, keeping the links that hold positions below `usable`."""
        if entry is None:
            return []
        if entry.kind == SNAPSHOT:
            return [entry]
        chain = [entry]
        while chain[-1].parent is not None:
            parent = self._entries.get(chain[-1].parent)
            if parent is None:  # pragma: no cover - parents outlive children by construction
                raise CacheRestoreError(chain[-1].key, "chain parent is missing")
            chain.append(parent)
        chain.reverse()
        return [link for link in chain if link.parent_len < usable] or chain[:1]

    def _restore_chain(
        self, links: list[Entry], caches: list, usable: int, dtype: str | None, match_key: str
    ) -> list[Entry]:
        """Delta links root..leaf into `caches`; returns the links that were read from disk.

        RAM copies are copied into place; disk links are read straight into the caches'
        buffers (see `state.DeltaBuilder`) and verified there, then promoted to RAM by the
        writer thread, off the hot path.
        """
        try:
            if self._live_layout is not None and not state.compatible_delta(
                self._live_layout, links[0].layout
            ):
                raise state.StateError("dtype or geometry differs from this model's live KV")
            builder = state.DeltaBuilder(
                caches, links[0].layout, links[-1].n_tokens, usable, dtype=dtype
            )
        except Exception as exc:
            raise self._restore_error(links[0].key, exc, match_key) from None
        from_disk = []
        for link in links:
            start, end = link.parent_len, link.n_tokens
            arrays = self._payload_in_ram(link)
            try:
                if arrays is not None:
                    builder.put(start, end, arrays)  # checks names, spans, dtypes, geometry
                    continue
                if self.disk is None or link.disk != DISK_WRITTEN:
                    raise EntryFormatError("payload is neither in RAM nor on disk")
                header = self.disk.read_entry_into(link.key, builder.read_targets(start, end))
                self._check_header(link, header)
                builder.check_finite(start, end)
            except Exception as exc:  # a bad stored entry, whatever the symptom
                raise self._restore_error(link.key, exc, match_key) from None
            from_disk.append(link)
            self._counters["bytes_read"] += link.file_bytes
        try:
            builder.finish()
        except Exception as exc:
            # Not attributable to one link: blame the chain root, so evicting it removes
            # every entry that could reproduce the failure.
            raise self._restore_error(links[0].key, exc, match_key) from None
        self._counters["restores_from_disk"] += len(from_disk)
        return from_disk

    def _restore_snapshot(self, entry: Entry, caches: list, match_key: str) -> list[Entry]:
        """A whole-state entry into `caches`; returns [entry] if it was read from disk."""
        arrays = self._payload_in_ram(entry)
        from_disk = arrays is None
        try:
            if arrays is None:
                if self.disk is None or entry.disk != DISK_WRITTEN:
                    raise EntryFormatError("payload is neither in RAM nor on disk")
                header, loaded = self.disk.read_entry(entry.key)
                self._check_loaded(entry, header, loaded)
                arrays = tuple(loaded)
            self._check_snapshot_fits(entry, caches)
        except Exception as exc:
            raise self._restore_error(entry.key, exc, match_key) from None
        try:
            state.restore_snapshot(caches, entry.meta, arrays, entry.n_tokens, check_finite=False)
        except Exception as exc:
            raise self._restore_error(entry.key, exc, match_key) from None
        if not from_disk:
            return []
        self._counters["restores_from_disk"] += 1
        self._counters["bytes_read"] += entry.file_bytes
        if sum(a.nbytes for a in arrays) <= self._ram.budget:
            self._ram.put(entry.key, arrays)  # views of the verified file bytes
            self._enforce_ram_budget({entry.key})
        return [entry]

    def _payload_in_ram(self, entry: Entry) -> tuple[HostArray, ...] | None:
        arrays = self._ram.get(entry.key)
        if arrays is None and entry.key in self._pending:
            arrays = self._pending[entry.key].arrays
        return arrays

    def _restore_error(self, key: str, exc: Exception, match_key: str) -> CacheRestoreError:
        self._counters["restore_errors"] += 1
        problem = str(exc) if isinstance(exc, (EntryFormatError, state.StateError)) else repr(exc)
        return CacheRestoreError(key, problem, match_key=match_key)

    def _promote(self, links: list[Entry]) -> None:
        """Have the writer thread read disk-restored links back into the RAM tier."""
        if self._writer is None:
            return
        for link in links:
            if link.key not in self._ram and link.payload_bytes <= self._ram.budget:
                self._writer.submit_load(link.key)

    def _check_loaded(
        self, entry: Entry, header: dict[str, Any], arrays: Sequence[HostArray]
    ) -> None:
        """A file read from disk must still be the indexed entry, with finite values."""
        self._check_header(entry, header)
        for a in arrays:
            if not codec.host_finite(a):
                raise EntryFormatError(f"{a.name} contains NaN or Inf")

    def _check_header(self, entry: Entry, header: dict[str, Any]) -> None:
        """A file read from disk must still be the entry the index knows."""
        if entry.digest and header.get("payload_sha256") != entry.digest:
            raise EntryFormatError("file content changed since it was indexed")
        if (
            header.get("kind") != entry.kind
            or header.get("parent") != entry.parent
            or header.get("parent_len") != entry.parent_len
        ):
            raise EntryFormatError("header no longer matches the indexed entry")

    def _check_snapshot_fits(self, entry: Entry, caches: list) -> None:
        """A snapshot must have the model's layer count and classes (deltas: DeltaBuilder)."""
        layers = entry.meta.get("layers") or []
        if len(layers) != len(caches):
            raise state.StateError(f"stores {len(layers)} layers, model has {len(caches)}")
        for i, (c, layer) in enumerate(zip(caches, layers, strict=True)):
            if layer.get("class") != type(c).__name__:
                raise state.StateError(
                    f"layer {i}: stored {layer.get('class')}, model uses {type(c).__name__}"
                )

    def _layout_of(self, caches: list) -> Layout:
        layout: Layout = {}
        for i, c in enumerate(caches):
            for kv, arr in (("k", c.keys), ("v", c.values)):
                shape = tuple(int(d) for d in arr.shape)
                layout[f"{kv}.{i}"] = (state.dtype_name(arr.dtype), (*shape[:2], 0, shape[3]))
        return layout

    def _slot(self, entry: Entry) -> Slot:
        flags = (FLAG_SUSPECT if entry.suspect else 0) | (FLAG_ANCHOR if entry.anchor else 0)
        return Slot(entry.hits, entry.last_used, flags)

    def _persist_slot(self, entry: Entry, *, durable: bool = False) -> None:
        if self._writer is None or entry.disk == DISK_NONE:
            return
        self._writer.submit_slot(entry.key, self._slot(entry), durable=durable)

    def _promoted(self, result: LoadResult) -> None:
        """Put a payload the writer read back (see `_promote`) into the RAM tier."""
        entry = self._entries.get(result.key)
        if (
            result.arrays is None
            or entry is None
            or entry.disk != DISK_WRITTEN
            or result.key in self._ram
            or (entry.digest is not None and result.digest != entry.digest)
        ):
            return
        self._ram.put(result.key, result.arrays)
        self._enforce_ram_budget({result.key})

    def _pin(self, key: str) -> None:
        self._pins[key] = self._pins.get(key, 0) + 1

    def _unpin(self, key: str) -> None:
        count = self._pins.get(key, 0) - 1
        if count <= 0:
            self._pins.pop(key, None)
        else:
            self._pins[key] = count

    def _drain(self) -> None:
        """Apply the writer thread's results (engine thread, under the lock)."""
        if self._writer is None:
            return
        completed = self._writer.completed
        while completed:
            result = completed.popleft()
            if isinstance(result, LoadResult):
                self._promoted(result)
                continue
            job = result.job
            if self._pending.get(job.key) is job:
                del self._pending[job.key]
            entry = self._entries.get(job.key)
            if entry is None or job.cancelled or entry.disk != DISK_PENDING:
                continue
            if result.ok:
                entry.disk = DISK_WRITTEN
                self._disk_bytes += result.file_bytes - entry.file_bytes
                entry.file_bytes = result.file_bytes
                entry.digest = result.digest
            else:
                entry.disk = DISK_NONE
                self._disk_bytes -= entry.file_bytes
                entry.file_bytes = 0
                if entry.key not in self._ram:
                    # Its bytes lived only in the failed job: the entry cannot be served.
                    self._remove_tree(entry.key)


def _reaches_probe(entry: Entry, usable: int) -> bool:
    """Does restoring `usable` tokens of `entry` reach its probe (or is there none to reach)?

    Only a delta can be cut back to re-prefill its probe position; for a snapshot or an entry
    without a probe, the payload checksum verified on load is the check.
    """
    if entry.probe is None or entry.kind != DELTA:
        return True
    position = int(entry.probe.get("position", -1))
    return position <= 0 or position < usable


__all__ = ["PromptCache", "CacheError", "default_disk_budget"]
