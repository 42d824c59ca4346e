"""Where a prompt's prefill starts: a resident session, a prompt-cache checkpoint, or nothing.

Resident sessions are the live KV of recent requests (prompt plus completion), kept in place so
that the next turn of any recent conversation needs no copy at all: the newest always, older
ones while they fit in the live budget (several agents take turns; each finds its own KV). The
prompt cache
(RAM and disk tiers) serves everything else. Both are trimmed back to the common prefix with the
new prompt (trimmable caches) or used only as an exact prefix (rotating / SSM caches), and both
always leave at least one prompt token to prefill, because the last token's logits are needed.

A checkpoint that fails to restore is evicted here and the request continues from the longest
prefix the cache still holds (typically the shared system prompt), or cold; one that
restores but fails later (prefill error, non-finite logits) raises `RestoredStateFailed` to the
caller, which evicts it and retries once from a cold prefill. No checkpoint can fail twice: the
cache refuses to store or serve an evicted key again.

Entries written by a run that died are suspect until a restore re-prefills their last position
and the logits match the probe stored with them. A use that stops short of a suspect entry's
probe (the same prompt sent again, which restores all but its last token) cannot check it, so
the cache's lookup offers only the longest link of the entry's chain that it can check, e.g. the
conversation up to its newest message, and the rest is prefilled: an unverified state is never
used.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

from mlx_kvserve.cache import MISS, CacheRestoreError, Match, PromptCache, probe_matches
from mlx_kvserve.cache.kinds import can_cut_back, describe_model

log = logging.getLogger("mlx_kvserve.engine")


class RestoredStateFailed(Exception):
    """Prefill from reused state failed; the state must be dropped and the request retried."""

    def __init__(self, start: Start, problem: str) -> None:
        super().__init__(problem)
        self.start = start
        self.problem = problem


@dataclass
class Start:
    """KV caches holding the first `usable` prompt tokens, and where they came from."""

    caches: list
    tokens: list[int]
    source: str  # "cold", "live", "ram" or "disk"
    match: Match = MISS
    restore_seconds: float = 0.0

    @property
    def usable(self) -> int:
        return len(self.tokens)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class PromptStates:
    """Owns the live KV state and the prompt cache; engine thread only."""

    def __init__(
        self, model, cache: PromptCache | None, *, enabled: bool = True, live_budget: int = 0
    ) -> None:
        self.model = model
        self.cache = cache if enabled else None
        self.enabled = enabled
        self.live_budget = live_budget  # bytes for resident sessions beside the newest
        self._full_live_budget = live_budget
        self.kv_dtype = _kv_dtype(model)
        self._residents: list[Start] = []  # newest first

    @property
    def residents(self) -> int:
        return len(self._residents)

    def fresh(self) -> list:
        return make_prompt_cache(self.model)

    def cold(self) -> Start:
        return Start(self.fresh(), [], "cold")

    def acquire(self, prompt: list[int]) -> Start:
        """Best starting state for `prompt`. The caller owns the returned caches."""
        if not self.enabled:
            return self.cold()
        match = self.cache.lookup(prompt) if self.cache is not None else MISS
        live = self._take_live(prompt, match)
        if live is not None and live.usable >= match.usable:
            return live
        if not match.hit:
            return self.cold()
        return self._restore(prompt, match)

    def keep(self, tokens: list[int], caches: list) -> None:
        """Make `caches` (holding exactly `tokens`) the newest resident session; the oldest
        ones leave while the others exceed the live budget (their KV is in the prompt cache)."""
        if not (self.enabled and tokens):
            return
        self._residents.insert(0, Start(caches, list(tokens), "live"))
        older = self._residents[1:]
        while older and sum(_nbytes(r.caches) for r in older) > self.live_budget:
            older.pop()
        self._residents[1:] = older

    def reset(self) -> None:
        self._residents = []

    @property
    def resident_bytes(self) -> int:
        """KV the resident sessions hold (the engine's memory ledger counts it)."""
        return sum(_nbytes(r.caches) for r in self._residents)

    def limit_live(self, share: float, *, keep_newest: bool = True) -> None:
        """Keep resident sessions beside the newest within `share` of the configured live
        budget (1.0 restores it); their KV is in the prompt cache. Without `keep_newest` the
        newest goes too (the system is critically short of memory)."""
        self.live_budget = int(self._full_live_budget * max(0.0, min(1.0, share)))
        if not keep_newest:
            self.reset()
            return
        older = self._residents[1:]
        while older and sum(_nbytes(r.caches) for r in older) > self.live_budget:
            older.pop()
        self._residents[1:] = older

    def evict(self, start: Start, problem: str) -> None:
        """Drop whatever `start` came from, after it failed during prefill."""
        self.reset()
        if start.match.hit and self.cache is not None:
            self.cache.evict(start.match.key, problem, whole_chain=True)
        else:
            log.warning("dropped the live KV state after a failure: %s", problem)

    # ----------------------------------------------------------------------------------------
    def _take_live(self, prompt: list[int], match: Match) -> Start | None:
        """The resident that covers most of `prompt`, taken out of the residents (the caller
        owns it)."""
        best, best_usable = self._best_live(prompt, match)
        return None if best is None else self._take_resident(best, best_usable, prompt)

    def _take_resident(self, resident: Start, usable: int, prompt: list[int]) -> Start:
        """`resident` out of the residents, cut back to the first `usable` tokens of `prompt`."""
        self._residents = [r for r in self._residents if r is not resident]
        if usable < resident.usable:
            trim_prompt_cache(resident.caches, resident.usable - usable)
        return Start(resident.caches, prompt[:usable], "live")

    def _best_live(self, prompt: list[int], match: Match) -> tuple[Start | None, int]:
        """The resident `_take_live` takes and the prompt tokens it covers. A resident cut back
        to less than half of itself is most likely another conversation that shares a prefix (a
        system prompt) with this one: it is taken only if it beats the prompt cache; else it
        stays for its own conversation and the cache's copy serves this prompt. A retry or an
        edited last message keeps most of its resident."""
        best, best_usable = None, 0
        for resident in self._residents:
            usable = min(common_prefix(resident.tokens, prompt), len(prompt) - 1)
            if usable < resident.usable and not can_cut_back(resident.caches, usable):
                continue  # a full window, an SSM state: only an exact prefix is reusable
            if 2 * usable < resident.usable and usable <= match.usable:
                continue
            if usable > best_usable:
                best, best_usable = resident, usable
        return best, best_usable

    def _restore(self, prompt: list[int], match: Match, *, again: bool = True) -> Start:
        assert self.cache is not None and match.key is not None
        suspect = match.suspect
        target = match.for_probe() if suspect else match
        caches = self.fresh()
        started = time.perf_counter()
        try:
            self.cache.restore(target, caches, tokens=prompt, dtype=self.kv_dtype)
        except CacheRestoreError as err:
            self.cache.evict(err.key, err.problem)
            return self._after_eviction(prompt, again)
        source = match.source or "disk"
        start = Start(caches, prompt[: target.usable], source, match)
        start.restore_seconds = time.perf_counter() - started
        if suspect:
            if not self._behaves(prompt, start, target):
                self.cache.evict(
                    match.key,
                    "behaviour check failed after an unclean shutdown",
                    first_suspect=True,
                )
                return self._after_eviction(prompt, again)
            self.cache.mark_verified(match.key)
        return start

    def _after_eviction(self, prompt: list[int], again: bool) -> Start:
        """The longest prefix the cache still has once the failed part is gone (one more try:
        e.g. the shared system prompt before a damaged conversation), else a cold start."""
        assert self.cache is not None
        if again:
            match = self.cache.lookup(prompt)
            if match.hit:
                return self._restore(prompt, match, again=False)
        return self.cold()

    def _behaves(self, prompt: list[int], start: Start, target: Match) -> bool:
        """Prefill the probe position of a suspect entry again and compare with its logits."""
        if target.probe is None or target.usable >= start.match.usable:
            return True  # nothing to compare: the cache's checksums were the check
        pos = target.usable
        row = self.model(mx.array(prompt[pos : pos + 1])[None], cache=start.caches)[:, -1, :]
        mx.eval(row)
        start.tokens = prompt[: pos + 1]
        return bool(probe_matches(target.probe, row))


def _nbytes(caches: list) -> int:
    return sum(int(getattr(c, "nbytes", 0) or 0) for c in caches)


def _kv_dtype(model) -> mx.Dtype:
    """The dtype the model's KV cache holds, asked of its caches after a one-token pass (the
    rule checkpoints record theirs by, see `cache.kinds.kv_dtype`)."""
    return describe_model(model).kv_dtype
