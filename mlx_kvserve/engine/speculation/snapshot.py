"""Solo rollback of the caches trimming cannot undo: a snapshot before the verify pass, then a
replay of the accepted prefix (docs/speculation.md, "Rolling back each cache kind").

A sliding window (`RotatingKVCache`) that has wrapped keeps rejected keys visible after a
`trim`, and a recurrent state (`ArraysCache`: GatedDeltaNet, Mamba) has no positions to trim.
Both are free to snapshot before a pass of more than one token: such a pass goes through the
window's `_update_concat`, which builds new arrays, and the recurrent layers rebind their state
to new arrays every pass, so keeping the references keeps the state. When a row rejects part of
its draft, every layer goes back to its snapshot (plain `KVCache` layers by trimming the whole
pass) and the accepted prefix is fed again: one more pass, counted in the step's time, so the
depth controller weighs it.
"""

from __future__ import annotations

from mlx_lm.models.cache import ArraysCache, CacheList, KVCache, RotatingKVCache

Part = int | tuple | list


def restorable(cache: object) -> bool:
    """Whether `Snapshot` can take this cache back to before a pass."""
    if isinstance(cache, CacheList):
        return all(restorable(c) for c in cache.caches)
    return type(cache) is KVCache or isinstance(cache, RotatingKVCache | ArraysCache)


def needs_snapshot(caches: list) -> bool:
    """Some layer that trimming does not roll back (all plain KV: `trim` serves)."""
    return any(type(c) is not KVCache for c in caches)


class Snapshot:
    """The layers' state before a pass of more than one token."""

    def __init__(self, caches: list) -> None:
        self.caches = caches
        self.parts = [_take(c) for c in caches]

    def restore(self) -> None:
        for cache, part in zip(self.caches, self.parts, strict=True):
            _restore(cache, part)


def _take(cache: object) -> Part:
    if isinstance(cache, CacheList):
        return [_take(c) for c in cache.caches]
    if isinstance(cache, RotatingKVCache):
        return cache.state  # arrays by reference (the wide pass concatenates), and its indices
    if isinstance(cache, ArraysCache):
        return list(cache.cache), cache.left_padding, cache.lengths
    assert type(cache) is KVCache
    return cache.offset


def _restore(cache: object, part: Part) -> None:
    if isinstance(cache, CacheList):
        assert isinstance(part, list)
        for c, p in zip(cache.caches, part, strict=True):
            _restore(c, p)
    elif isinstance(cache, RotatingKVCache):
        cache.state = part
    elif isinstance(cache, ArraysCache):
        assert isinstance(part, tuple)
        states, cache.left_padding, cache.lengths = part
        cache.cache = list(states)
    else:
        assert isinstance(cache, KVCache) and isinstance(part, int)
        cache.trim(cache.offset - part)
