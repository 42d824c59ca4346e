"""Per-API-key prompt-cache namespaces (`--isolate-cache`).

`usage.prompt_tokens_details.cached_tokens` tells a client how much of its prompt was already
cached, so on a shared cache one client can confirm a guess at another's prompt token by token.
With isolation each API key gets its own PromptCache (its own directory, RAM tier and budget
share) and its own live state; a request only ever reuses KV its own key produced. Switching
keys drops the previous key's live KV (it was checkpointed into that key's cache), so memory
stays bounded by one live state, not one per key.

The namespace travels with the request: the auth middleware sets `current_namespace` for the
request's task, and GenerationRequest takes it as its default, so no endpoint can forget it.
A request whose namespace has no cache (which isolation should make impossible) runs with no
cache at all: fail closed, never shared.
"""

from __future__ import annotations

import contextvars
import hashlib
from collections.abc import Iterator, Sequence
from typing import Protocol, TypeAlias

import mlx.nn as nn

from mlx_kvserve.cache.entry import EntryInfo
from mlx_kvserve.engine.job_states import JobStates, Votes
from mlx_kvserve.engine.prompt_state import PromptStates, Start
from mlx_kvserve.engine.protocols import ImageFeatures, PromptCacheView
from mlx_kvserve.images.spans import ImageSpan
from mlx_kvserve.json_value import JSON

current_namespace: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "mlx_kvserve_namespace", default=None
)


def namespace_of(key: str) -> str:
    """A stable, directory-safe name for an API key's namespace that does not reveal the key."""
    return hashlib.sha256(b"mlx-kvserve namespace\0" + key.encode()).hexdigest()[:16]


class CacheSet:
    """One PromptCache per namespace; looks like one cache to code that only reports on it."""

    def __init__(self, caches: dict[str, PromptCacheView]) -> None:
        self.caches = caches

    def get(self, namespace: str | None) -> PromptCacheView | None:
        return self.caches.get(namespace) if namespace is not None else None

    def __iter__(self) -> Iterator[PromptCacheView]:
        return iter(self.caches.values())

    def stats(self) -> dict[str, JSON]:
        """Numeric counters summed over the namespaces (for metrics and logs)."""
        total: dict[str, JSON] = {"namespaces": len(self.caches)}
        for cache in self.caches.values():
            for name, value in cache.stats().items():
                if isinstance(value, int | float) and not isinstance(value, bool):
                    total[name] = total.get(name, 0) + value
        return total

    def entries(self) -> list[EntryInfo]:
        return [entry for cache in self.caches.values() for entry in cache.entries()]

    def close(self) -> None:
        for cache in self.caches.values():
            cache.close()


# What an engine checkpoints to: one prompt cache, one per API key, or none (--no-cache).
Caches: TypeAlias = "PromptCacheView | CacheSet | None"


def by_namespace(prompt_cache: Caches) -> list[tuple[str | None, PromptCacheView]]:
    """Each PromptCache behind `prompt_cache` with the namespace its requests carry (None: the
    one shared cache)."""
    if prompt_cache is None:
        return []
    if isinstance(prompt_cache, CacheSet):
        return list(prompt_cache.caches.items())
    return [(None, prompt_cache)]


def caches_of(prompt_cache: Caches) -> list[PromptCacheView]:
    """Every PromptCache behind an engine's `prompt_cache` (none, one, or one per key)."""
    if prompt_cache is None:
        return []
    return list(prompt_cache) if isinstance(prompt_cache, CacheSet) else [prompt_cache]


def cache_for(prompt_cache: Caches, namespace: str | None) -> PromptCacheView | None:
    """The cache a request in `namespace` may see: the namespace's own, or the shared one."""
    return prompt_cache.get(namespace) if isinstance(prompt_cache, CacheSet) else prompt_cache


class States(Protocol):
    """The prompt states an engine holds (engine/prompt_state.py): one `PromptStates` for a
    shared cache, `NamespacedStates` for per-key caches, a job's `JobStates`."""

    def select(self, namespace: str | None) -> PromptStates:
        """The PromptStates a request in `namespace` acquires from and saves to (it keeps that
        object for its whole life, even while requests of other namespaces run beside it)."""
        ...

    @property
    def resident_bytes(self) -> int: ...

    @property
    def features(self) -> ImageFeatures | None:
        """Where a vision model's image features outlive the process (None: RAM only)."""
        ...

    def reusable(
        self, prompt: list[int], namespace: str | None, spans: Sequence[ImageSpan] = ()
    ) -> Start | None: ...

    def drop_residents(self, keep: Start | None = None) -> int: ...

    def limit_live(self, share: float, *, keep_newest: bool = True) -> None: ...


class NamespacedStates:
    """PromptStates per namespace behind one object; the engine selects one per request.

    Engine thread only, like PromptStates. Only the selected namespace keeps resident
    sessions: selecting another drops them.
    """

    def __init__(
        self, model: nn.Module, caches: CacheSet, *, enabled: bool = True, live_budget: int = 0
    ) -> None:
        self._make = lambda cache: PromptStates(
            model, cache, enabled=enabled and cache is not None, live_budget=live_budget
        )
        self._caches = caches
        self._states: dict[str, PromptStates] = {}
        self._share = 1.0  # of the live budget, while the system is short of memory
        self._none = self._make(None)  # no cache and no live reuse
        self._active = self._none
        self._active_namespace: str | None = None

    def select(self, namespace: str | None) -> PromptStates:
        """Point at `namespace`'s PromptStates and return it."""
        if namespace == self._active_namespace and self._active is not self._none:
            return self._active
        self._active.reset()  # another key's live KV must never serve this request
        cache = self._caches.get(namespace)
        if cache is None:
            self._active, self._active_namespace = self._none, None
            return self._active
        if namespace not in self._states:
            self._states[namespace] = self._make(cache)
            if self._share < 1.0:
                self._states[namespace].limit_live(self._share)
        self._active, self._active_namespace = self._states[namespace], namespace
        return self._active

    @property
    def resident_bytes(self) -> int:
        return self._active.resident_bytes

    @property
    def features(self) -> ImageFeatures | None:
        """None: with a cache per key, which key's directory would hold an image seen by two
        keys? Features stay in RAM of the vision model's own (vision/encoder.py)."""
        return None

    def reusable(
        self, prompt: list[int], namespace: str | None, spans: Sequence[ImageSpan] = ()
    ) -> Start | None:
        """Only the selected namespace has residents (selecting another drops them)."""
        if namespace != self._active_namespace or self._active is self._none:
            return None
        return self._active.reusable(prompt, spans=spans)

    def drop_residents(self, keep: Start | None = None) -> int:
        return self._active.drop_residents(keep)

    def limit_live(self, share: float, *, keep_newest: bool = True) -> None:
        """`PromptStates.limit_live` for every namespace (and those made later)."""
        self._share = share
        for states in (self._none, *self._states.values()):
            states.limit_live(share, keep_newest=keep_newest)


def make_states(
    model: nn.Module,
    prompt_cache: Caches,
    *,
    enabled: bool,
    live_budget: int = 0,
    job: Votes | None = None,
) -> States:
    """PromptStates for one shared cache, or NamespacedStates for per-key caches; JobStates
    when the model is split across the ranks of a job (`job`, engine/lockstep.py)."""
    if job is not None:
        assert not isinstance(prompt_cache, CacheSet), "a job has no per-key caches"
        return JobStates(model, prompt_cache, job, enabled=enabled, live_budget=live_budget)
    if isinstance(prompt_cache, CacheSet):
        return NamespacedStates(model, prompt_cache, enabled=enabled, live_budget=live_budget)
    return PromptStates(model, prompt_cache, enabled=enabled, live_budget=live_budget)
