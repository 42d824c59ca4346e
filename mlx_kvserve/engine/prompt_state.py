"""Where a prompt's prefill starts: a resident session, a prompt-cache checkpoint, or nothing.

Resident sessions are the live KV of recent requests (prompt plus completion), kept in place so
that the next turn of any recent conversation needs no copy at all: the newest always, older
ones while they fit in the live budget (several agents take turns; each finds its own KV). The
prompt cache
(RAM and disk tiers) serves everything else. Both are trimmed back to the common prefix with the
new prompt (trimmable caches) or used only as an exact prefix (rotating / SSM caches), and both
always leave at least one prompt token to prefill, because the last token's logits are needed.

A checkpoint that fails to restore is evicted here (the link the cache names) and the request
continues from the longest prefix the cache still holds (typically the shared system prompt),
or cold. A failure after the restore (a prefill error, non-finite logits) is the caller's to
blame (engine/blame.py): it asks for the newest link of what was restored (`newest_link`), tries
again from below it (`acquire(..., at_most=)`) and evicts it once that worked (`evict_link`).

Entries written by a run that died are suspect until a restore re-prefills their last position
and the logits match the probe stored with them. A use that stops short of a suspect entry's
probe (the same prompt sent again, which restores all but its last token) cannot check it, so
the cache's lookup offers only the longest link of the entry's chain that it can check, e.g. the
conversation up to its newest message, and the rest is prefilled: an unverified state is never
used.

A prompt with images is looked up, restored and kept under its key (`Prompt.key`: each image's
span keyed by its pixels' hash, images/spans.py) while its real ids are what the model is fed
and what a `Start` holds; a reused length never ends inside an image (`whole_spans`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

from mlx_kvserve.cache import MISS, CacheRestoreError, Match, MTPRestored, MTPState, probe_matches
from mlx_kvserve.cache.kinds import LayerCache, can_cut_back, describe_model
from mlx_kvserve.engine import faults
from mlx_kvserve.engine.positions import Shift, shifted_by
from mlx_kvserve.engine.protocols import ImageFeatures, PromptCacheView
from mlx_kvserve.images.spans import ImageSpan, key_tokens, whole_spans

if TYPE_CHECKING:
    from mlx_kvserve.engine.speculation.mtp import MTPDraft


@dataclass
class Start:
    """KV caches holding the first `usable` prompt tokens, and where they came from."""

    caches: list[LayerCache]
    tokens: list[int]
    source: str  # "cold", "live", "ram" or "disk"
    match: Match = MISS
    restore_seconds: float = 0.0
    mtp: MTPDraft | None = None  # a resident session's MTP source, over the same tokens
    # the MTP layers' state a restored entry kept (cache/mtp_part.py): the row's source starts
    # from it (engine/speculation/mtp.py `prefill_source`)
    restored_mtp: MTPState | None = None

    @property
    def usable(self) -> int:
        return len(self.tokens)

    @property
    def nbytes(self) -> int:
        return _nbytes(self.caches)


@dataclass(frozen=True)
class Prompt:
    """A prompt's ids as the model is fed them (`tokens`) and as the cache keys them (`key`);
    `shift`: the rope shift of a position (Qwen's M-RoPE after an image), None where all are 0."""

    tokens: list[int]
    spans: tuple[ImageSpan, ...] = ()
    shift: Shift | None = None
    key: list[int] = field(init=False)

    def __post_init__(self) -> None:
        key = key_tokens(self.tokens, self.spans) if self.spans else self.tokens
        object.__setattr__(self, "key", key)

    def whole(self, length: int) -> int:
        """`length` cut back to the start of an image it would split."""
        return whole_spans(length, self.spans)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class PromptStates:
    """Owns the live KV state and the prompt cache; engine thread only."""

    def __init__(
        self,
        model: nn.Module,
        cache: PromptCacheView | None,
        *,
        enabled: bool = True,
        live_budget: int = 0,
    ) -> None:
        self.model = model
        self.cache = cache if enabled else None
        self.enabled = enabled
        self.live_budget = live_budget  # bytes for resident sessions beside the newest
        self._full_live_budget = live_budget
        self.kv_dtype = _kv_dtype(model)
        self._residents: list[Start] = []  # newest first

    @property
    def features(self) -> ImageFeatures | None:
        """The vision encoder's outputs by image digest, kept beside this cache (None with the
        cache off): a vision model looks an image up here before it runs its tower."""
        return self.cache.features if self.cache is not None else None

    @property
    def residents(self) -> int:
        return len(self._residents)

    def fresh(self) -> list[LayerCache]:
        return make_prompt_cache(self.model)

    def cold(self) -> Start:
        return Start(self.fresh(), [], "cold")

    def acquire(
        self,
        prompt: list[int],
        *,
        at_most: int | None = None,
        spans: Sequence[ImageSpan] = (),
        shift: Shift | None = None,
    ) -> Start:
        """Best starting state for `prompt` (whose images sit at `spans`, `shift` their rope
        shift at a position), holding at most `at_most` tokens if given (a try again below a
        link that failed; 0: cold). The caller owns the returned caches."""
        if not self.enabled or at_most == 0:
            return self.cold()
        p = Prompt(prompt, tuple(spans), shift)
        match = self._lookup(p, at_most)
        live = self._take_live(p, match, at_most)
        if live is not None and live.usable >= match.usable:
            return live
        if not match.hit:
            return self.cold()
        return self._restore(p, match, at_most)

    def keep(
        self, tokens: list[int], caches: list[LayerCache], mtp: MTPDraft | None = None
    ) -> None:
        """Make `caches` (holding exactly `tokens`, as the cache keys them: `Live.key`) the
        newest resident session, with its row's MTP source if it had one (the next turn
        drafts from the whole conversation); the oldest ones leave while the others exceed the
        live budget (their KV is in the prompt cache)."""
        if not (self.enabled and tokens):
            return
        self._residents.insert(0, Start(caches, list(tokens), "live", mtp=mtp))
        older = self._residents[1:]
        while older and sum(_nbytes(r.caches) for r in older) > self.live_budget:
            older.pop()
        self._residents[1:] = older

    def reset(self) -> None:
        self._residents = []

    def select(self, namespace: str | None) -> PromptStates:
        """The states a request in `namespace` uses: these (one shared cache)."""
        return self

    def reusable(
        self, prompt: list[int], namespace: str | None = None, spans: Sequence[ImageSpan] = ()
    ) -> Start | None:
        """The resident session `acquire(prompt)` would take now, if any: under contention
        admission counts it once (it becomes the request's own KV) and does not shed it."""
        if not self.enabled or not self._residents:
            return None
        p = Prompt(prompt, tuple(spans))
        match = self.cache.lookup(p.key) if self.cache is not None else MISS
        return self._best_live(p, match)[0]

    def drop_residents(self, keep: Start | None = None) -> int:
        """Drop the resident sessions but `keep` (their KV is in the prompt cache, which serves
        their conversations' next turns); the bytes freed."""
        before = self.resident_bytes
        self._residents = [r for r in self._residents if r is keep]
        return before - self.resident_bytes

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

    def newest_link(self, start: Start) -> tuple[str, int] | None:
        """(key, first position) of the newest cache link `start` was restored from: the
        first to blame when it fails; None for a resident session or a cold start."""
        if self.cache is None or start.source == "live" or not start.match.hit:
            return None
        assert start.match.key is not None
        links = self.cache.links(start.match.key, start.usable)
        return links[-1] if links else None

    def evict_link(self, key: str, why: str) -> None:
        """Evict a link that was blamed for a failure, with everything depending on it."""
        if self.cache is not None:
            self.cache.evict(key, why)

    def free_memory(self) -> None:
        """After running out of memory: drop what goes without losing a state (resident
        sessions, RAM-tier copies that are also on disk, MLX's buffer cache)."""
        self.reset()
        if self.cache is not None and self.cache.disk is not None:
            self.cache.release_ram(self.cache.memory()["ram_tier"])
        mx.clear_cache()

    # ----------------------------------------------------------------------------------------
    def _lookup(self, prompt: Prompt, at_most: int | None) -> Match:
        faults.maybe_fail("lookup")
        return self._find(prompt, at_most)

    def _find(self, prompt: Prompt, at_most: int | None) -> Match:
        """The cache's best prefix of `prompt`'s key, cut back to the start of an image it
        would split (looked up again below it: a shorter entry may serve what a longer one
        cannot)."""
        if self.cache is None:
            return MISS
        match = self.cache.lookup(prompt.key, at_most=at_most)
        whole = prompt.whole(match.usable)
        if match.hit and whole < match.usable:
            match = self.cache.lookup(prompt.key, at_most=whole) if whole else MISS
        return match

    def _take_live(self, prompt: Prompt, match: Match, at_most: int | None) -> Start | None:
        """The resident that covers most of `prompt`, taken out of the residents (the caller
        owns it)."""
        best, best_usable = self._best_live(prompt, match, at_most)
        return None if best is None else self._take_resident(best, best_usable, prompt.tokens)

    def _take_resident(self, resident: Start, usable: int, prompt: list[int]) -> Start:
        """`resident` out of the residents, cut back to the first `usable` tokens of `prompt`
        (its real ids: a resident's own `tokens` are its key)."""
        self._residents = [r for r in self._residents if r is not resident]
        if usable < resident.usable:
            trim_prompt_cache(resident.caches, resident.usable - usable)
        mtp = resident.mtp.cut(prompt[:usable]) if resident.mtp is not None else None
        return Start(resident.caches, prompt[:usable], "live", mtp=mtp)

    def _best_live(
        self, prompt: Prompt, match: Match, at_most: int | None = None
    ) -> tuple[Start | None, int]:
        """The resident `_take_live` takes and the prompt tokens it covers. A resident cut back
        to less than half of itself is most likely another conversation that shares a prefix (a
        system prompt) with this one: it is taken only if it beats the prompt cache; else it
        stays for its own conversation and the cache's copy serves this prompt. A retry or an
        edited last message keeps most of its resident."""
        best, best_usable = None, 0
        n = len(prompt.tokens)
        most = n - 1 if at_most is None else min(n - 1, at_most)
        for resident in self._residents:
            usable = prompt.whole(min(common_prefix(resident.tokens, prompt.key), most))
            if usable < resident.usable and not can_cut_back(resident.caches, usable):
                continue  # a full window, an SSM state: only an exact prefix is reusable
            if 2 * usable < resident.usable and usable <= match.usable:
                continue
            if usable > best_usable:
                best, best_usable = resident, usable
        return best, best_usable

    def _restore(
        self, prompt: Prompt, match: Match, at_most: int | None, *, again: bool = True
    ) -> Start:
        assert self.cache is not None and match.key is not None
        suspect = match.suspect
        target = match.for_probe() if suspect else match
        caches = self.fresh()
        started = time.perf_counter()
        mtp = MTPRestored()
        try:
            self.cache.restore(target, caches, tokens=prompt.key, dtype=self.kv_dtype, mtp=mtp)
        except CacheRestoreError as err:
            self.cache.evict(err.key, err.problem)
            return self._after_eviction(prompt, at_most, again)
        source = match.source or "disk"
        start = Start(caches, prompt.tokens[: target.usable], source, match)
        start.restored_mtp = mtp.state
        start.restore_seconds = time.perf_counter() - started
        if suspect:
            if not self._behaves(prompt, start, target):
                self.cache.evict(
                    match.key,
                    "behaviour check failed after an unclean shutdown",
                    first_suspect=True,
                )
                return self._after_eviction(prompt, at_most, again)
            self.cache.mark_verified(match.key)
        return start

    def _after_eviction(self, prompt: Prompt, at_most: int | None, again: bool) -> Start:
        """The longest prefix the cache still has once the failed part is gone (one more try:
        e.g. the shared system prompt before a damaged conversation), else a cold start."""
        assert self.cache is not None
        if again:
            match = self._find(prompt, at_most)
            if match.hit:
                return self._restore(prompt, match, at_most, again=False)
        return self.cold()

    def _behaves(self, prompt: Prompt, start: Start, target: Match) -> bool:
        """Prefill the probe position of a suspect entry again (at its rope position) and
        compare with its logits."""
        if target.probe is None or target.usable >= start.match.usable:
            return True  # nothing to compare: the cache's checksums were the check
        pos = target.usable
        fed = mx.array(prompt.tokens[pos : pos + 1])[None]
        with shifted_by(self.model, [prompt.shift(pos) if prompt.shift else 0]):
            row = self.model(fed, cache=start.caches)[:, -1, :]
        mx.eval(row)
        start.tokens = prompt.tokens[: pos + 1]
        return bool(probe_matches(target.probe, row))


def _nbytes(caches: list[LayerCache]) -> int:
    return sum(int(getattr(c, "nbytes", 0) or 0) for c in caches)


def _kv_dtype(model: nn.Module) -> mx.Dtype | None:
    """The dtype the model's KV cache holds, asked of its caches after a one-token pass (the
    rule checkpoints record theirs by, see `cache.kinds.kv_dtype`)."""
    return describe_model(model).kv_dtype
