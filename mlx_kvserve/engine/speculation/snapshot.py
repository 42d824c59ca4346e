"""Rollback of the caches that cannot give positions back: a snapshot before the verify pass,
then a replay of each row's accepted prefix (docs/speculation.md, "Rolling back each cache
kind").

A recurrent state (`ArraysCache`: GatedDeltaNet, Mamba) has no positions to trim (plain KV and
windows do: engine/speculation/rewind.py). It is free to snapshot before a pass of more than
one token: the recurrent layers rebind their state to new arrays every pass, and a window's
wide pass goes through its `_update_concat`, which builds new arrays, so keeping the references
keeps the state (the small index arrays that mlx-lm updates in place, `left_padding -= n`, are
copied). When a row rejects part of its draft, every layer goes back to its snapshot (plain KV
layers by trimming the whole pass) and each row's kept prefix is fed again: one more pass
(its logits are dropped, so MLX computes the caches' arrays only), counted in the step's
time, so the depth controller weighs it.

Merged rows keep different numbers of tokens, so the replay is right-padded to the longest and
each layer told the rows' lengths the way mlx-lm's batched prefill of right-padded prompts
does: the recurrent kernels advance each row by its own length (`ArraysCache.lengths`), the
windows roll each row's padding to its left (`prepare`/`finalize`), and plain KV gives the
padding slots back as holes (engine/speculation/holes.py). Not every architecture honours
those lengths, so the model is asked once (`replay_agrees`) before its merged rows replay.
"""

from __future__ import annotations

import logging

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import (
    ArraysCache,
    BatchKVCache,
    BatchRotatingKVCache,
    CacheList,
    KVCache,
    RotatingKVCache,
    make_prompt_cache,
)

from mlx_kvserve.cache.kinds import leaves
from mlx_kvserve.engine.speculation.holes import HoleKVCache
from mlx_kvserve.engine.speculation.rewind import PLAIN, rewinds

log = logging.getLogger("mlx_kvserve.engine")

Part = int | tuple | list


def restorable(cache: object) -> bool:
    """Whether `Snapshot` can take this cache back to before a pass."""
    if isinstance(cache, CacheList):
        return all(restorable(c) for c in cache.caches)
    return type(cache) in PLAIN or isinstance(
        cache, RotatingKVCache | BatchRotatingKVCache | ArraysCache
    )


def needs_snapshot(caches: list) -> bool:
    """Some layer that `rewind.roll_back` cannot give positions back to (a recurrent state)."""
    return not all(rewinds(c) for c in caches)


class Snapshot:
    """The layers' state before a pass of more than one token."""

    def __init__(self, caches: list) -> None:
        self.caches = caches
        self.parts = [_take(c) for c in caches]

    def restore(self) -> None:
        for cache, part in zip(self.caches, self.parts, strict=True):
            _restore(cache, part)


def replay(model: nn.Module, caches: list, rows: list[list[int]]) -> mx.array:
    """Feed each row its own tokens (after `Snapshot.restore`); the pass's logits (lazy: a
    caller that drops them never computes the output head, only the caches' arrays)."""
    lengths = [len(row) for row in rows]
    width = max(lengths)
    if min(lengths) == width:
        return model(mx.array(rows, dtype=mx.uint32), cache=caches)
    padded = [row + [row[-1]] * (width - len(row)) for row in rows]
    for c in caches:
        _prepare(c, lengths, width)
    logits = model(mx.array(padded, dtype=mx.uint32), cache=caches)
    for c in caches:
        _finish(c, lengths, width)
    return logits


def _copy(a: mx.array | None) -> mx.array | None:
    return None if a is None else mx.array(a)


def _take(cache: object) -> Part:
    if isinstance(cache, CacheList):
        return [_take(c) for c in cache.caches]
    if isinstance(cache, RotatingKVCache):
        return cache.state  # arrays by reference (the wide pass concatenates), and its indices
    if isinstance(cache, BatchRotatingKVCache):
        keys, values, offset, left_padding, *rest = cache.state
        return (keys, values, offset, _copy(left_padding), *rest)
    if isinstance(cache, ArraysCache):
        return list(cache.cache), _copy(cache.left_padding), _copy(cache.lengths)
    assert type(cache) in PLAIN
    return cache._idx if isinstance(cache, BatchKVCache) else cache.offset


def _restore(cache: object, part: Part) -> None:
    if isinstance(cache, CacheList):
        assert isinstance(part, list)
        for c, p in zip(cache.caches, part, strict=True):
            _restore(c, p)
    elif isinstance(cache, RotatingKVCache | BatchRotatingKVCache):
        cache.state = part
    elif isinstance(cache, ArraysCache):
        assert isinstance(part, tuple)
        states, cache.left_padding, cache.lengths = part
        cache.cache = list(states)
    elif isinstance(cache, BatchKVCache):
        assert isinstance(part, int)
        cache.trim(cache._idx - part)
    else:
        assert isinstance(cache, KVCache) and isinstance(part, int)
        cache.trim(cache.offset - part)


def _prepare(cache: object, lengths: list[int], width: int) -> None:
    if isinstance(cache, CacheList):
        for c in cache.caches:
            _prepare(c, lengths, width)
    elif isinstance(cache, ArraysCache):
        cache.lengths = mx.array(lengths)
    elif isinstance(cache, BatchRotatingKVCache):
        cache.prepare(lengths=lengths, right_padding=[width - n for n in lengths])


def _finish(cache: object, lengths: list[int], width: int) -> None:
    if isinstance(cache, CacheList):
        for c in cache.caches:
            _finish(c, lengths, width)
    elif isinstance(cache, ArraysCache):
        cache.lengths = None
    elif isinstance(cache, BatchRotatingKVCache):
        cache.finalize()
    elif isinstance(cache, BatchKVCache):
        HoleKVCache.adopt(cache).rollback([width - n for n in lengths])


# Two rows of different lengths, a 4-wide pass, the rows keeping 3 and 1 of its tokens.
PROMPTS = ([1, 5, 9, 2, 7, 3, 11, 4, 6, 8, 10, 12], [3, 7, 5])
FED = ([13, 2, 4, 6], [14, 8, 10, 12])
KEPT = (3, 1)
NEXT = (15, 16)
LONGEST = 4096  # windows up to this are wrapped by the check's prompts
FLOOR = 1e-3  # nats: the least disagreement allowed
SLACK = 4.0  # times what a plain merged step moves a row (bf16 rounding on Metal)
RTOL = 0.05  # of a recurrent state's largest entry: a state advanced by padding is far off


def replay_agrees(model: nn.Module) -> bool:
    """Whether merged rows replayed with their own lengths end where each row alone does: the
    recurrent states, and the next token's log-probabilities, as close as a plain merged step
    is to a solo one. The prompts wrap the model's windows. Asked once per model."""
    try:
        return _agrees(model)
    except Exception as exc:  # noqa: BLE001 - an architecture whose layers cannot replay
        log.warning("merged rows of this model do not speculate: a replay failed (%r)", exc)
        return False


def _prompts(model: nn.Module) -> list[list[int]]:
    """The first row fills its window to 2 short of full, so the wide pass wraps it."""
    windows = [c.max_size for c in leaves(make_prompt_cache(model)) if hasattr(c, "max_size")]
    window = max([w for w in windows if w and w <= LONGEST], default=0)
    if window <= len(PROMPTS[0]) + 2:
        return [list(p) for p in PROMPTS]
    return [[PROMPTS[0][j % 12] for j in range(window - 2)], list(PROMPTS[1])]


def _prefilled(model: nn.Module, prompts: list[list[int]]) -> list[list]:
    rows = []
    for prompt in prompts:
        caches = make_prompt_cache(model)
        mx.eval(model(mx.array([prompt]), cache=caches))
        rows.append(caches)
    return rows


def _merge(rows: list[list]) -> list:
    return [type(layer[0]).merge(list(layer)) for layer in zip(*rows, strict=True)]


def _agrees(model: nn.Module) -> bool:
    prompts = _prompts(model)
    # what a plain merged step moves a row by, against the same row alone
    rows = _prefilled(model, prompts)
    together = _logprobs(model(mx.array([[f[0]] for f in FED]), cache=_merge(rows)))
    alone = [
        _logprobs(model(mx.array([[f[0]]]), cache=c))[0] for f, c in zip(FED, rows, strict=True)
    ]
    plain = max(mx.max(mx.abs(together[i] - a)).item() for i, a in enumerate(alone))
    tolerance = max(FLOOR, SLACK * plain)

    rows = _prefilled(model, prompts)
    merged = _merge(rows)
    snapshot = Snapshot(merged)
    mx.eval(model(mx.array(FED), cache=merged))
    snapshot.restore()
    replay(model, merged, [list(fed[:n]) for fed, n in zip(FED, KEPT, strict=True)])
    for i, (caches, fed, n) in enumerate(zip(rows, FED, KEPT, strict=True)):
        model(mx.array([list(fed[:n])]), cache=caches)
        for mine, theirs in zip(_states(merged), _states(caches), strict=True):
            if mine is None or theirs is None:
                continue
            gap = mx.max(mx.abs(mine[i : i + 1] - theirs)).item()
            if not gap <= RTOL * mx.max(mx.abs(theirs)).item() + 1e-6:
                log.warning(
                    "merged rows of this model do not speculate: a replayed row's recurrent "
                    "state is off by %.3g (the architecture ignores the rows' lengths)",
                    gap,
                )
                return False
    together = _logprobs(model(mx.array([[t] for t in NEXT]), cache=merged))
    for i, (caches, token) in enumerate(zip(rows, NEXT, strict=True)):
        alone_next = _logprobs(model(mx.array([[token]]), cache=caches))[0]
        gap = mx.max(mx.abs(together[i] - alone_next)).item()
        if not gap <= tolerance:  # NaN counts as a disagreement
            log.warning(
                "merged rows of this model do not speculate: after a replay a row's next-token "
                "log-probabilities move by %.3g nats (a plain merged step: %.3g)",
                gap,
                plain,
            )
            return False
    return True


def _states(caches: list) -> list[mx.array | None]:
    """Every recurrent state array of the layers, in order."""
    out: list[mx.array | None] = []
    for c in leaves(caches):
        if isinstance(c, ArraysCache):
            out += [None if s is None else s.astype(mx.float32) for s in c.cache]
    return out


def _logprobs(logits: mx.array) -> mx.array:
    last = logits[:, -1, :].astype(mx.float32)
    return last - mx.logsumexp(last, axis=-1, keepdims=True)
