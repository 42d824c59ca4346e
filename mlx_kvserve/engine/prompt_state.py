"""Where a prompt's prefill starts: the live state, a prompt-cache checkpoint, or nothing.

The live state is the KV of the previous request (its prompt plus completion), kept in place so
that the common "next turn of the same conversation" needs no copy at all. The prompt cache
(RAM and disk tiers) serves everything else. Both are trimmed back to the common prefix with the
new prompt (trimmable caches) or used only as an exact prefix (rotating / SSM caches), and both
always leave at least one prompt token to prefill, because the last token's logits are needed.

A checkpoint that fails to restore is evicted here and the request continues cold; one that
restores but fails later (prefill error, non-finite logits) raises `RestoredStateFailed` to the
caller, which evicts it and retries once from a cold prefill. No checkpoint can fail twice: the
cache refuses to store or serve an evicted key again.

Entries written by a run that died are suspect until a restore re-prefills their last position
and the logits match the probe stored with them. A use that stops short of a suspect entry's
probe (the same prompt sent again, which restores all but its last token) cannot check it, so it
restores only the longest link of the entry's chain that it can check, e.g. the conversation up
to its newest message, and prefills the rest: an unverified state is never used.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache

from mlx_kvserve.cache import MISS, CacheRestoreError, Match, PromptCache, probe_matches
from mlx_kvserve.cache.entry import DELTA

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

    def __init__(self, model, cache: PromptCache | None, *, enabled: bool = True) -> None:
        self.model = model
        self.cache = cache if enabled else None
        self.enabled = enabled
        self.kv_dtype = _kv_dtype(model)
        self._live: Start | None = None

    def fresh(self) -> list:
        return make_prompt_cache(self.model)

    def cold(self) -> Start:
        return Start(self.fresh(), [], "cold")

    def acquire(self, prompt: list[int]) -> Start:
        """Best starting state for `prompt`. The caller owns the returned caches."""
        if not self.enabled:
            return self.cold()
        live = self._take_live(prompt)
        match = self.cache.lookup(prompt) if self.cache is not None else MISS
        if live is not None and live.usable >= match.usable:
            return live
        if not match.hit:
            return self.cold()
        return self._restore(prompt, match)

    def keep(self, tokens: list[int], caches: list) -> None:
        """Make `caches` (holding exactly `tokens`) the live state for the next request."""
        if self.enabled and tokens:
            self._live = Start(caches, list(tokens), "live")

    def reset(self) -> None:
        self._live = None

    def evict(self, start: Start, problem: str) -> None:
        """Drop whatever `start` came from, after it failed during prefill."""
        self.reset()
        if start.match.hit and self.cache is not None:
            self.cache.evict(start.match.key, problem, whole_chain=True)
        else:
            log.warning("dropped the live KV state after a failure: %s", problem)

    # ----------------------------------------------------------------------------------------
    def _take_live(self, prompt: list[int]) -> Start | None:
        live, self._live = self._live, None
        if live is None:
            return None
        usable = min(common_prefix(live.tokens, prompt), len(prompt) - 1)
        if usable <= 0:
            return None
        if usable < live.usable:
            if not can_trim_prompt_cache(live.caches):
                return None  # rotating / SSM state: only an exact prefix is reusable
            trim_prompt_cache(live.caches, live.usable - usable)
        return Start(live.caches, prompt[:usable], "live")

    def _restore(self, prompt: list[int], match: Match) -> Start:
        assert self.cache is not None and match.key is not None
        if match.suspect and not _checkable(match):
            # The prompt stops before the entry's probe, so this use could not check its
            # behaviour: restore only the longest link of its chain that can be checked.
            match = self._checkable_link(prompt, match)
            if not match.hit:
                return self.cold()
        suspect = match.suspect
        target = match.for_probe() if suspect else match
        caches = self.fresh()
        try:
            self.cache.restore(target, caches, tokens=prompt, dtype=self.kv_dtype)
        except CacheRestoreError as err:
            self.cache.evict(err.key, err.problem)
            return self.cold()
        start = Start(caches, prompt[: target.usable], match.source or "disk", match)
        if suspect:
            if not self._behaves(prompt, start, target):
                self.cache.evict(
                    match.key, "behaviour check failed after an unclean shutdown", whole_chain=True
                )
                return self.cold()
            self.cache.mark_verified(match.key)
        return start

    def _checkable_link(self, prompt: list[int], match: Match) -> Match:
        """The deepest link of `match`'s chain that ends inside it, as its own match (or MISS).

        Its probe lies inside the restore (or it was verified already); the positions between
        it and `match.usable` are prefilled instead of taken from the unverified entry.
        """
        assert self.cache is not None
        infos = {info.key: info for info in self.cache.entries()}
        key = infos[match.key].parent if match.key in infos else None
        while key is not None and key in infos:
            link = infos[key]
            if link.n_tokens <= match.usable:
                found = self.cache.lookup(prompt[: link.n_tokens + 1])
                if found.key == link.key and (not found.suspect or _checkable(found)):
                    return found
                return MISS
            key = link.parent
        return MISS

    def _behaves(self, prompt: list[int], start: Start, target: Match) -> bool:
        """Prefill the probe position of a suspect entry again and compare with its logits."""
        if target.probe is None or target.usable >= start.match.usable:
            return True  # nothing to compare: the cache's checksums were the check
        pos = target.usable
        row = self.model(mx.array(prompt[pos : pos + 1])[None], cache=start.caches)[:, -1, :]
        mx.eval(row)
        start.tokens = prompt[: pos + 1]
        return bool(probe_matches(target.probe, row))


def _checkable(match: Match) -> bool:
    """Does restoring `match` reach its probe (or is its checksum the only check it has)?

    Only a delta can be cut back to re-prefill its probe position; for a snapshot or an entry
    without a probe, the payload checksum verified on load is the check.
    """
    if match.probe is None or match.kind != DELTA:
        return True
    position = int(match.probe.get("position", -1))
    return position <= 0 or position < match.usable


def _kv_dtype(model) -> mx.Dtype:
    """The dtype the model's KV cache holds, found by one tiny forward pass."""
    caches = make_prompt_cache(model)
    model(mx.array([[0]]), cache=caches)
    state = caches[0].state
    first = state[0] if isinstance(state, (list, tuple)) else state
    mx.eval(first)
    return first.dtype
