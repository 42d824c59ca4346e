"""`PromptCache`: the prompt (KV) cache facade the engine calls from its one MLX thread.

Structure
---------
* `catalog.Catalog`: the entries, their token-trie index (`index.TokenIndex`), the RAM tier of
  host copies (`ram.RamTier`: a hot hit never reads the disk), queued writes and pins.
* `disk.DiskTier` + `writer.Writer`: one file per entry, written durably off-thread;
  `persistence` queues the writes and applies their results.
* `lookup`: the best restorable prefix of a prompt. `restore`: fill the model's caches from it.
* `admission`: checkpoints become chain links (`plan`: what each layer stores; `layers` and
  `chain`: how). `policy`: prefix dominance, budgets, eviction. `recovery`: the index rebuilt
  from the files at start-up, crash suspicion. `header`: the checks of a file's header.
* `counters` and `stats`: counters, and what the cache reports (`stats.Reports`: the stats
  report, memory, disk state, the entries listing, the chain ends' tokens).

This class holds the lock, applies the writer's results before each call, and delegates.

Usage (engine thread)
---------------------
    m = cache.lookup(prompt)                       # m.usable <= len(prompt) - 1
    caches = make_prompt_cache(model)
    if m.hit:
        try:
            cache.restore(m, caches, tokens=prompt, dtype=kv_dtype)
        except CacheRestoreError as err:           # discard `caches`: may be half filled
            cache.evict(err.key, err.problem)      # removes it and its dependents, logs once
            caches, m = make_prompt_cache(model), cache.lookup(prompt)  # what is left
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

import mlx.core as mx

from mlx_kvserve.cache import state
from mlx_kvserve.cache.catalog import Catalog
from mlx_kvserve.cache.checkpointing import admit_checkpoint
from mlx_kvserve.cache.disk import DiskTier, fault_point
from mlx_kvserve.cache.entry import (
    DISK_WRITTEN,
    Match,
    check_fingerprint,
    entry_key,
)
from mlx_kvserve.cache.exceptions import CacheError, EntryFormatError
from mlx_kvserve.cache.features import FEATURE_SHARE, FeatureCache
from mlx_kvserve.cache.kinds import LayerCache
from mlx_kvserve.cache.lookup import find_match
from mlx_kvserve.cache.mtp_part import MTPRestored, MTPState
from mlx_kvserve.cache.persistence import apply_writer_results
from mlx_kvserve.cache.policy import Policy, default_disk_budget
from mlx_kvserve.cache.recovery import open_directory
from mlx_kvserve.cache.restore import check_loaded, restore_match
from mlx_kvserve.cache.space import SpaceWatch
from mlx_kvserve.cache.stats import Reports
from mlx_kvserve.cache.writer import Writer


class PromptCache(Reports):
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
        self._lock = threading.RLock()
        self._closed = False
        self._catalog = Catalog(self.fingerprint, ram_budget=ram_budget, log=self.log, clock=clock)
        self._policy = Policy(self._catalog, drain=self._drain)
        self._full_ram_budget = self._catalog.ram.budget
        self.unclean_start = False
        self.rebuild_seconds = 0.0
        self.disk: DiskTier | None = None
        self._space: SpaceWatch | None = None
        on_disk = directory is not None and not read_only
        if directory is not None:
            self.disk = DiskTier(Path(directory), self.fingerprint, self.log, read_only=read_only)
            self._catalog.disk = self.disk
        # the vision encoder's outputs by image digest, beside the entries (cache/features.py)
        self.features = FeatureCache(
            self.disk.dir if on_disk and self.disk is not None else None,
            self.fingerprint,
            ram_budget=ram_budget // FEATURE_SHARE,
            disk_budget=lambda: self._policy.disk_budget,
            logger=self.log,
        )
        self._policy.beside = self.features.disk_bytes
        if self.disk is None:
            return
        self._space = SpaceWatch(self._catalog, self._policy, disk_budget)
        try:
            recovered = open_directory(
                self._catalog, self._policy, self._space, read_only=read_only, run_id=self.run_id
            )
        except BaseException:
            self.disk.release_lock()
            raise
        self.unclean_start = recovered.unclean_start
        self.rebuild_seconds = recovered.rebuild_seconds

    @property
    def disk_budget(self) -> int:
        """Byte budget of the disk tier in force (0 without a directory): the configured one,
        lowered while the disk has less room (see `space`)."""
        return self._policy.disk_budget

    def refresh_disk_space(self) -> None:
        """Read the free space of the cache's disk now and adapt the budget to it (this also
        happens by itself: after a write fails for want of space, and periodically)."""
        with self._lock:
            self._drain()
            if self._space is not None:
                self._space.refresh()

    # -- a job across machines: every rank's cache holds the same entries (engine/job_states.py)
    def follow_evictions(self) -> None:
        """A rank > 0: the disk budget evicts what rank 0's evicts (`drop_alike`), nothing else."""
        self._policy.follower = True

    def take_budget_evictions(self) -> list[str]:
        """Rank 0: the entries its disk budget evicted since the last call, by content."""
        with self._lock:
            taken, self._policy.budget_evicted = self._policy.budget_evicted, []
        return [entry_key("", tokens) for tokens in taken]

    def drop_alike(self, contents: list[str]) -> int:
        """Remove the entries (and their dependents) holding these contents; how many went."""
        wanted = set(contents)
        if not wanted:
            return 0
        with self._lock:
            self._drain()
            cat = self._catalog
            found = [e.key for e in cat.entries.values() if entry_key("", e.tokens) in wanted]
            removed = sum(len(cat.remove_tree(key)) for key in found if key in cat.entries)
            cat.counters["evictions"] += removed
        return removed

    def limit_ram(self, share: float) -> int:
        """Shrink the RAM tier to `share` of its configured budget (1.0 restores it) when the
        system is short of memory; copies beyond it leave at once (the disk keeps them, or,
        without a disk tier, they are evicted). The new budget in bytes."""
        self.features.limit_ram(share)
        with self._lock:
            self._drain()
            budget = int(self._full_ram_budget * max(0.0, min(1.0, share)))
            self._catalog.ram.budget = budget
            self._policy.enforce_ram_budget(set())
            return budget

    @property
    def _writer(self) -> Writer | None:
        return self._catalog.writer

    # ================================================================= public API ==============
    def lookup(self, tokens: Sequence[int], *, at_most: int | None = None) -> Match:
        """Best restorable prefix of `tokens`; `usable <= len(tokens) - 1` always, and
        `usable <= at_most` if given (a retry that must stay below a link that failed)."""
        with self._lock:
            self._drain()
            return find_match(self._catalog, tokens, at_most)

    def links(self, key: str, usable: int) -> list[tuple[str, int]]:
        """(key, first position) of each link a restore of `usable` tokens of `key` reads,
        root first; [] if `key` is gone. The last is the newest: the first blamed when what
        was restored fails (engine/blame.py)."""
        with self._lock:
            entry = self._catalog.entries.get(key)
            if entry is None:
                return []
            return [(link.key, link.parent_len) for link in self._catalog.links(entry, usable)]

    def restore(
        self,
        match: Match,
        fresh_caches: list[LayerCache],
        *,
        tokens: Sequence[int] | None = None,
        dtype: mx.Dtype | None = None,
        mtp: MTPRestored | None = None,
    ) -> list[LayerCache]:
        """Fill the model's empty caches with `match.usable` tokens of state; return them.

        `tokens` (the prompt) re-checks the entry's ids; `dtype` (e.g. mx.float16) requires the
        stored KV to have the model's activation dtype; `mtp` receives the MTP layers' state
        the chain carries, if any (cache/mtp_part.py). Raises CacheRestoreError on any problem;
        the caller then evicts `err.key` and prefills cold.
        """
        with self._lock:
            self._drain()
            return restore_match(
                self._catalog, match, fresh_caches, tokens=tokens, dtype=dtype, mtp=mtp
            )

    def checkpoint(
        self,
        tokens: Sequence[int],
        caches: list[LayerCache],
        reason: str,
        *,
        anchor: bool = False,
        probe: mx.array | None = None,
        mtp: MTPState | None = None,
    ) -> str | None:
        """Store the live caches' state for `tokens`; returns the new key or None.

        The caches hold exactly `tokens`, or (plain KVCache layers only) more positions of which
        `tokens` are the first.

        None means refused (length mismatch, oversize, read-only), duplicate (already stored;
        an `anchor` flag is still applied) or failed (logged). It never raises: a checkpoint
        that fails costs one checkpoint, never the request storing it (a prefill that raised
        here was blamed on the links it restored, and evicted them). `probe` is the logits row
        at the last position, kept to re-check behaviour after an unclean shutdown. `mtp`: the
        MTP layers' state over exactly `tokens` (cache/mtp_part.py), stored beside the layers.
        """
        with self._lock:
            if self.read_only or self._closed:
                return None
            try:
                fault_point("checkpoint")  # test seam (engine.faults)
                self._drain()
                if self._space is not None:
                    self._space.check()  # the disk's free space, when due: the budget follows
                return admit_checkpoint(
                    self._catalog,
                    self._policy,
                    tokens,
                    caches,
                    reason,
                    anchor=anchor,
                    probe=probe,
                    run_id=self.run_id,
                    mtp=mtp,
                )
            except Exception as exc:
                self._catalog.counters["refused"] += 1
                self.log.warning(
                    "prompt-cache checkpoint of %d tokens failed: %r", len(tokens), exc
                )
                return None

    def evict(self, key: str, reason: str, *, first_suspect: bool = False) -> list[str]:
        """Remove `key` and every entry depending on it, from RAM and disk; one log line.

        Meant for failures; nothing is barred: the same tokens' state, computed afresh, may be
        stored again. Which link to blame is the caller's choice (the newest restored link
        first: engine/blame.py). `first_suspect=True` evicts from the shallowest suspect link of
        `key`'s chain instead: a failed behaviour check after an unclean shutdown can only blame
        what the dead run wrote, and the verified links before it (a shared system prompt) stay
        for other conversations.
        """
        with self._lock:
            self._drain()
            return self._policy.evict_failed(key, reason, first_suspect=first_suspect)

    def mark_verified(self, key: str) -> None:
        """The engine checked the behaviour of `key` after restoring it: clear suspicion."""
        with self._lock:
            entry = self._catalog.entries.get(key)
            if entry is None:
                return
            for link in self._catalog.links(entry, entry.n_tokens):
                if link.suspect:
                    link.suspect = False
                    self._catalog.persist_slot(link, durable=True)

    @contextlib.contextmanager
    def pinned(self, key: str | None) -> Iterator[None]:
        """Protect `key` and its chain from eviction and pruning for the duration."""
        cat = self._catalog
        with self._lock:
            entry = cat.entries.get(key) if key else None
            keys = [link.key for link in cat.links(entry, entry.n_tokens)] if entry else []
            for k in keys:
                cat.pin(k)
        try:
            yield
        finally:
            with self._lock:
                for k in keys:
                    cat.unpin(k)

    def release_ram(self, nbytes: int) -> int:
        """Drop at least `nbytes` of the RAM tier if it can (least recently used first; copies
        still queued for the disk stay) so running requests get the memory; returns the bytes
        freed. Entries that live only in RAM (no disk) leave the cache."""
        with self._lock:
            self._drain()
            ram = self._catalog.ram
            before, budget = ram.nbytes, ram.budget
            ram.budget = max(0, before - max(0, int(nbytes)))
            try:
                self._policy.enforce_ram_budget(set())
            finally:
                ram.budget = budget
            freed = before - ram.nbytes
        return freed + self.features.release_ram(max(0, int(nbytes)) - freed)

    def verify(self) -> list[tuple[str, str]]:
        """Fully read and check every stored file; returns (key, problem) for the bad ones."""
        self.flush()
        with self._lock:
            problems: list[tuple[str, str]] = []
            if self.disk is None:
                return problems
            for entry in list(self._catalog.entries.values()):
                if entry.disk != DISK_WRITTEN:
                    continue
                try:
                    header, arrays = self.disk.read_entry(entry.key)
                    check_loaded(entry, header, arrays)
                except (EntryFormatError, OSError, state.StateError, ValueError) as exc:
                    problems.append((entry.key, str(exc)))
            return problems

    def clear(self) -> int:
        """Remove every entry (RAM and disk); returns how many were removed."""
        with self._lock:
            self._drain()
            cat = self._catalog
            roots = [e.key for e in cat.entries.values() if e.parent not in cat.entries]
            removed = 0
            for key in roots:
                removed += len(cat.remove_tree(key))
            if self.disk is not None and not self.read_only:
                for path in self.disk.entry_files():
                    with contextlib.suppress(FileNotFoundError):
                        path.unlink()
            self.log.info("prompt-cache cleared %d entries", removed)
        self.features.clear()
        return removed

    def flush(self) -> None:
        """Wait for pending writes to land on disk (the image features' too)."""
        if self._writer is not None:
            self._writer.flush()
        self.features.flush()
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
        self.features.close()
        with self._lock:
            self._drain()
            if self.disk is not None and not self.read_only:
                self.disk.remove_marker()
                self.disk.release_lock()

    def __enter__(self) -> PromptCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _drain(self) -> None:
        """Apply the writer thread's results (engine thread, under the lock)."""
        if apply_writer_results(self._catalog, self._policy.admit_to_ram):
            self._policy.trim_ram(set())


__all__ = ["PromptCache", "CacheError", "default_disk_budget"]
