"""Per-row rollback of a merged KV batch without moving any KV: rejected slots become holes.

`BatchKVCache` keeps its rows right-aligned in one buffer and can only `trim` every row alike.
After a verify pass, rows that kept different numbers of drafts must each give back their own
newest slots. mlx-lm's right-padding roll (`prepare` + `finalize`) moves every row's whole
history to do it, a copy of every layer's KV per round (about one decode pass on this machine,
docs/speculation.md); `HoleKVCache` instead marks those slots invalid in a (rows, slots) mask
that its `make_mask` ANDs into the attention mask, and steps the row's `offset` (its RoPE
position) back, so the row's next tokens get the positions plain decoding gives them. Every
mlx-lm attention model asks the cache for its mask; the architecture matrix checks them all
(tests/unit/test_speculation_architectures.py).

The holes stay until the batch copies anyway: `extract` gathers a leaving row's valid slots,
`filter`, `extend` and `trim` carry the mask along. The class is a `BatchKVCache` in every
other respect; the decode batch's merged caches become one at their first rollback (`adopt`).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import BatchKVCache, KVCache


class HoleKVCache(BatchKVCache):
    """A `BatchKVCache` whose rows can give back their newest slots one by one."""

    valid: mx.array | None = None  # (rows, slots) bool over [0, _idx); None: no holes

    @classmethod
    def adopt(cls, cache: BatchKVCache) -> HoleKVCache:
        """The same cache, able to hold holes (no copy)."""
        if not isinstance(cache, cls):
            cache.__class__ = cls
            cache.valid = None
        return cache  # type: ignore[return-value]

    def rollback(self, rejected: list[int]) -> None:
        """Row i gives back its `rejected[i]` newest slots (a uniform part is trimmed)."""
        least = min(rejected)
        if least:
            self.trim(least)
        rest = [r - least for r in rejected]
        if not any(rest):
            return
        r = mx.array(rest)
        gone = mx.arange(self._idx)[None] >= self._idx - r[:, None]
        self.valid = ~gone if self.valid is None else self._valid() & ~gone
        self.offset = self.offset - r

    def _valid(self) -> mx.array:
        """The mask over [0, _idx): slots written since the last rollback are valid."""
        assert self.valid is not None
        rows, known = self.valid.shape
        if known >= self._idx:
            return self.valid[:, : self._idx]
        fresh = mx.ones((rows, self._idx - known), dtype=mx.bool_)
        return mx.concatenate([self.valid, fresh], axis=1)

    def make_mask(self, N: int, return_array: bool = False, **kwargs):  # type: ignore[override]
        mask = create_causal_mask(N, offset=self._idx, left_padding=self.left_padding, **kwargs)
        if self.valid is None:
            return mask
        rows = self.valid.shape[0]
        valid = mx.concatenate([self._valid(), mx.ones((rows, N), dtype=mx.bool_)], axis=1)
        return mask & valid[:, None, None, :]

    def trim(self, n: int) -> int:
        n = super().trim(n)
        if self.valid is not None:
            self.valid = self.valid[:, : self._idx]
        return n

    def filter(self, batch_indices) -> None:  # type: ignore[no-untyped-def]
        before = self._idx
        valid = None if self.valid is None else self._valid()[batch_indices]
        super().filter(batch_indices)
        if valid is not None:
            self.valid = valid[:, before - self._idx :]  # filter drops common left padding

    def extend(self, other: BatchKVCache) -> None:  # type: ignore[override]
        mine, theirs = self._idx, other._idx
        rows_mine, rows_theirs = self.offset.shape[0], other.offset.shape[0]
        holes = self.valid is not None or getattr(other, "valid", None) is not None
        if holes:
            a = self._valid() if self.valid is not None else mx.ones((rows_mine, mine), mx.bool_)
            b = other._valid() if getattr(other, "valid", None) is not None else None
            b = mx.ones((rows_theirs, theirs), mx.bool_) if b is None else b
        super().extend(other)
        if holes:  # both were right-aligned to the longer: pad the shorter mask on the left
            a = mx.pad(a, [(0, 0), (self._idx - mine, 0)], constant_values=True)
            b = mx.pad(b, [(0, 0), (self._idx - theirs, 0)], constant_values=True)
            self.valid = mx.concatenate([a, b])

    def extract(self, idx: int) -> KVCache:
        if self.valid is None:
            return super().extract(idx)
        padding = int(self.left_padding[idx].item())
        slots = np.flatnonzero(np.array(self._valid()[idx]))
        slots = mx.array(slots[slots >= padding])
        cache = KVCache()
        cache.keys = mx.contiguous(self.keys[idx : idx + 1, :, slots])
        cache.values = mx.contiguous(self.values[idx : idx + 1, :, slots])
        cache.offset = cache.keys.shape[2]
        return cache
