"""Where a prompt's prefill starts when the model is split across the ranks of a job.

ENGINE THREAD. Every rank keeps its own slice of each checkpoint (its heads, or its layers) in
a prompt cache of its own (named by the model's fingerprint, the split, the world size and the
rank), and its own resident sessions. A prefill must start at the same token on every rank, or
their passes would not match, so a start is agreed (engine/lockstep.py's collectives):

1. every rank looks up its own residents and its own cache and says what each offers (a
   resident of n tokens; a checkpoint of n tokens, and whether it is suspect); the longest that
   every rank offers alike is used. A checkpoint that some rank found and another did not is
   evicted where it was found (it could never serve the job), and the ranks look again, since
   they may agree on a shorter one; residents that differ (rank 0 alone drops them when memory
   runs short) are only passed over;
2. every rank restores its slice; unless all restored, all start cold, and the link a rank
   found damaged is evicted on every rank: the link at the same positions (a damaged file on
   one rank is a miss on all). A rank that ran out of memory restoring makes every rank raise
   it, evicting nothing: each frees memory and tries again alike (engine/blame.py);
3. a suspect entry (written by a run that died) is checked by prefilling its probe position on
   every rank together; unless the logits match on all, it is evicted everywhere.
Failures that follow a start (non-finite logits) are the same on every rank, since the logits
are: engine/blame.py blames the newest link on each alike and the next try's start, at most
below it (`at_most`), is agreed here again.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Protocol

import mlx.nn as nn

from mlx_kvserve.cache import CacheRestoreError, Match
from mlx_kvserve.cache.exceptions import out_of_memory
from mlx_kvserve.engine.positions import Shift
from mlx_kvserve.engine.prompt_state import Prompt, PromptStates, Start
from mlx_kvserve.engine.protocols import PromptCacheView
from mlx_kvserve.images.spans import ImageSpan
from mlx_kvserve.json_value import JSON

LOOKUP_ROUNDS = 3  # lookups before a cold start, each after evicting what some rank lacked


class Votes(Protocol):
    """What the ranks of a job answer together (engine/lockstep.py: `Lockstep`)."""

    def gather(self, value: JSON, what: str) -> list[JSON]: ...  # in rank order
    def all_true(self, flag: bool, what: str) -> bool: ...


class JobStates(PromptStates):
    """PromptStates whose every start is agreed by the ranks of the job (`job`: a Lockstep)."""

    def __init__(
        self,
        model: nn.Module,
        cache: PromptCacheView | None,
        job: Votes,
        *,
        enabled: bool = True,
        live_budget: int = 0,
    ) -> None:
        super().__init__(model, cache, enabled=enabled, live_budget=live_budget)
        self.job = job

    def acquire(
        self,
        prompt: list[int],
        *,
        at_most: int | None = None,
        spans: Sequence[ImageSpan] = (),
        shift: Shift | None = None,  # a job's requests hold no images: always None
    ) -> Start:
        if not self.enabled or at_most == 0:
            return self.cold()
        p = Prompt(prompt, tuple(spans))
        for _ in range(LOOKUP_ROUNDS):
            match = self._lookup(p, at_most)
            best, live_usable = self._best_live(p, match, at_most)
            mine = {
                "live": live_usable if best is not None else None,
                "disk": [match.usable, bool(match.suspect)] if match.hit else None,
            }
            seen = self.job.gather(mine, "a cache lookup")
            live_agreed = mine["live"] is not None and all(s["live"] == mine["live"] for s in seen)
            disk_agreed = mine["disk"] is not None and all(s["disk"] == mine["disk"] for s in seen)
            if (
                best is not None
                and live_agreed
                and not (disk_agreed and match.usable > live_usable)
            ):
                return self._take_resident(best, live_usable, prompt)
            if disk_agreed:
                return self._restore_together(p, match)
            if all(s["disk"] == seen[0]["disk"] for s in seen):
                return self.cold()  # no rank holds more than the others: nothing to evict
            shortest = min(s["disk"][0] if s["disk"] else 0 for s in seen)
            if match.hit and match.usable > shortest:
                self._evict(match, "another rank of the job holds no such entry")
            # and look again: the ranks may agree on a shorter entry (a shared system prompt)
        return self.cold()

    def _restore_together(self, prompt: Prompt, match: Match) -> Start:
        assert self.cache is not None
        target = match.for_probe() if match.suspect else match
        caches = self.fresh()
        started = time.perf_counter()
        outcome: list[JSON] = ["restored"]
        error: Exception | None = None
        try:
            self.cache.restore(target, caches, tokens=prompt.key, dtype=self.kv_dtype)
        except CacheRestoreError as err:
            links = dict(self.cache.links(match.key, target.usable))
            self.cache.evict(err.key, err.problem)
            outcome = ["damaged", links.get(err.key, 0)]
        except Exception as exc:
            if not out_of_memory(exc):
                raise
            outcome, error = ["memory"], exc
        seen = self.job.gather(outcome, "a restore")
        damaged = [s[1] for s in seen if s[0] == "damaged"]
        if damaged:
            if outcome[0] != "damaged":
                first = min(damaged)
                why = "another rank of the job could not restore its slice"
                self._evict_at(match.key, target.usable, first, why)
            return self.cold()
        if error is not None:
            raise error
        if any(s[0] == "memory" for s in seen):
            raise MemoryError("another rank of the job ran out of memory restoring its slice")
        start = Start(caches, prompt.tokens[: target.usable], match.source or "disk", match)
        start.restore_seconds = time.perf_counter() - started
        if match.suspect:
            behaves = self._behaves(prompt, start, target)  # a pass on every rank together
            if not self.job.all_true(behaves, "a behaviour check"):
                self.cache.evict(
                    match.key,
                    "behaviour check failed after an unclean shutdown (on some rank of the job)",
                    first_suspect=True,
                )
                return self.cold()
            self.cache.mark_verified(match.key)
        return start

    def _evict(self, match: Match, why: str) -> None:
        assert self.cache is not None
        self.cache.evict(match.key, why)

    def _evict_at(self, key: str, usable: int, first: int, why: str) -> None:
        """Evict the link of `key`'s chain holding position `first` (where another rank's
        link was damaged), with what depends on it."""
        assert self.cache is not None
        links = [k for k, start in self.cache.links(key, usable) if start <= first]
        if links:
            self.cache.evict(links[-1], why)


__all__ = ["JobStates"]
