"""Rollback of a verify pass's rejected positions without another pass.

After a pass of more than one token, each row gives back its rejected (newest) positions:

- plain KV: `trim` solo; merged, a uniform `trim` of what every row rejects and holes for the
  rest (engine/speculation/holes.py);
- a sliding window (`RotatingKVCache` solo, `BatchRotatingKVCache` merged): a wide pass goes
  through mlx-lm's `_update_concat`, which puts the window in temporal order and appends the
  pass, so the rejected keys are the buffer's last columns. Solo, they are cut off (mlx-lm's own
  `trim` cannot do this once the window has wrapped: its next one-token step would rotate over
  the oldest key and leave the rejected ones visible). Merged, what every row rejects is cut
  off and each row's remaining rejected keys are rolled to its left, into its padding, as
  mlx-lm's `finalize` does after a right-padded prefill. The keys kept are the ones the verify
  pass computed for the kept tokens, which a replay would compute again: causal attention makes
  a position's keys depend on it and what precedes it only.

Recurrent states (GatedDeltaNet, Mamba) have no positions to give back: they take a snapshot
and a replay (engine/speculation/snapshot.py).
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import (
    BatchKVCache,
    BatchRotatingKVCache,
    KVCache,
    RotatingKVCache,
    dynamic_roll,
)

from mlx_kvserve.engine.speculation.holes import HoleKVCache

PLAIN = (KVCache, BatchKVCache, HoleKVCache)  # trimming rolls these back
WINDOWS = (RotatingKVCache, BatchRotatingKVCache)


def rewinds(cache: object) -> bool:
    """Whether `roll_back` gives this cache's rejected positions back after a wide pass."""
    return type(cache) in PLAIN or type(cache) in WINDOWS


def roll_back(caches: list, rejected: list[int]) -> None:
    """Give back each row's `rejected[i]` newest positions of the pass that just ran (more
    than one token wide, so that windows are in the concatenated layout)."""
    for c in caches:
        if isinstance(c, BatchKVCache):
            HoleKVCache.adopt(c).rollback(rejected)
        elif isinstance(c, BatchRotatingKVCache):
            _window_rows(c, rejected)
        elif isinstance(c, RotatingKVCache):
            (r,) = rejected
            _window(c, r)
        else:
            (r,) = rejected
            c.trim(r)


def _window(cache: RotatingKVCache, n: int) -> None:
    if n <= 0:
        return
    assert cache.keys is not None and cache._idx == cache.keys.shape[2], "not after a wide pass"
    keep = cache._idx - n
    cache.keys = cache.keys[..., :keep, :]
    cache.values = cache.values[..., :keep, :]
    cache.offset -= n
    cache._idx = keep


def _window_rows(cache: BatchRotatingKVCache, rejected: list[int]) -> None:
    assert cache.keys is not None and not cache.rotated, "not after a wide pass"
    assert cache._idx == cache.keys.shape[2], "not after a wide pass"
    least = min(rejected)
    if least:
        keep = cache._idx - least
        cache.keys = cache.keys[..., :keep, :]
        cache.values = cache.values[..., :keep, :]
        cache._idx = keep
        cache._offset -= least
        cache.offset = cache.offset - least
    rest = [r - least for r in rejected]
    if not any(rest):
        return
    roll = mx.array(rest)
    cache.keys = dynamic_roll(cache.keys, roll[:, None], axis=2)
    cache.values = dynamic_roll(cache.values, roll[:, None], axis=2)
    cache.left_padding = cache.left_padding + roll
    cache.offset = cache.offset - roll
