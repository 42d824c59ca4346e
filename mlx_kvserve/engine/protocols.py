"""What the engine asks of the prompt cache and of the objects that hold KV: small Protocols.

The engine holds its collaborators by what it calls on them, not by their class, so that a
reader sees the surface it depends on in one place and a test can hand it a stand-in. The
concrete ones are `cache.store.PromptCache` (one model's prompt cache) and mlx-lm's per-layer
cache objects (`mlx_lm.models.cache`: `KVCache`, `RotatingKVCache`, `ArraysCache`,
`CacheList`, ...). ENGINE THREAD, like everything they describe.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Protocol

import mlx.core as mx
import numpy as np

from mlx_kvserve.cache.entry import EntryInfo, Match
from mlx_kvserve.cache.kinds import LayerCache
from mlx_kvserve.cache.mtp_part import MTPRestored, MTPState
from mlx_kvserve.json_value import JSON


class ImageFeatures(Protocol):
    """The vision encoder's outputs by image digest, per model (cache/features.py:
    `FeatureCache`): what a vision model looks up before it runs its tower on an image."""

    def get(self, digest: str) -> mx.array | None: ...

    def put(self, digest: str, features: mx.array) -> None: ...


class PromptCacheView(Protocol):
    """One model's prompt cache as the engine uses it (cache/store.py: `PromptCache`)."""

    features: ImageFeatures

    def lookup(self, tokens: Sequence[int]) -> Match: ...

    def restore(
        self,
        match: Match,
        fresh_caches: list[LayerCache],
        *,
        tokens: Sequence[int] | None = None,
        dtype: mx.Dtype | None = None,
        mtp: MTPRestored | None = None,
    ) -> list[LayerCache]: ...

    def checkpoint(
        self,
        tokens: Sequence[int],
        caches: list[LayerCache],
        reason: str,
        *,
        anchor: bool = False,
        probe: mx.array | None = None,
        mtp: MTPState | None = None,
    ) -> str | None: ...

    def evict(
        self, key: str, reason: str, *, whole_chain: bool = False, first_suspect: bool = False
    ) -> list[str]: ...

    def mark_verified(self, key: str) -> None: ...

    def pinned(self, key: str | None) -> AbstractContextManager[None]: ...

    # -- memory: what the KV ledger counts beside the requests (engine/room.py)
    def memory(self) -> dict[str, int]: ...

    def release_ram(self, nbytes: int) -> int: ...

    def limit_ram(self, share: float) -> int: ...

    def flush(self) -> None: ...

    def close(self) -> None: ...

    # -- reports (JSON for /v1/cache and the status page)
    def stats(self) -> dict[str, JSON]: ...

    def entries(self) -> list[EntryInfo]: ...

    def token_streams(self, limit: int) -> list[np.ndarray]: ...

    # -- a job across machines: every rank's cache evicts alike (engine/lockstep.py)
    def follow_evictions(self) -> None: ...

    def take_budget_evictions(self) -> list[str]: ...

    def drop_alike(self, contents: list[str]) -> int: ...


__all__ = ["ImageFeatures", "LayerCache", "PromptCacheView"]
