"""Exact verification of drafts: which drafted tokens each row keeps, from one forward pass.

A row that drafted d_1..d_k feeds [t, d_1..d_k] (t: its token not yet fed) in one pass and gets
k+1 positions of logits; position i is the model's prediction after d_i (after t for i = 0).

The rule, for every row, is "sample, then match": draw s_i from position i with the row's own
sampler, keep d_{i+1} while it equals s_i, and emit s_i at the first mismatch (or s_k, the
bonus token, when every draft was kept). A row thus emits s_0..s_n where n is the number of
drafts kept. Why this one rule is exact for both kinds of row:

- Greedy rows: the sampler is the argmax, so this is greedy acceptance (the longest draft prefix
  equal to the target's argmax, plus the target's next token): the tokens plain decoding gives.
- Sampled rows with a deterministic draft (lookup, argmax heads): speculative sampling accepts d
  with probability min(1, p(d)/q(d)) = p(d) when q is a point mass, and on rejection draws from
  p with d removed, renormalised. Matching is that: P(s = d) = p(d), and s given s != d is p
  without d, renormalised (the argument of oMLX's dflash_grammar.py and mlx-swift-lm PR #426).

Drawing through the row's own sampler means p is its processed distribution by construction
(top-p, top-k, temperature, grammar mask): there is no second copy of the sampler to drift from
it. A seeded row draws position i from the seed of its token number `draws + i`, the seed that
token would have had without speculation (engine/sampling.py `draw_seed`), so a seeded request's
tokens are the same with and without speculation, given the same logits, and reproduce. The
caller advances `draws` by the tokens emitted. Logprobs are the target's, before any mask, as
plain decoding reports them (engine/decode.py).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import mlx.core as mx

from mlx_kvserve.engine import faults
from mlx_kvserve.engine.sampling import draw_seed


class Drawer(Protocol):
    """What verification asks of a row's decoder (engine/decode.py's `Decoder` is one)."""

    sampler: Callable[[mx.array], mx.array]
    key: tuple  # rows with equal keys share one sampler call
    seeded: bool
    seed: int | None
    draws: int  # seeded tokens drawn so far: the index of the next


def draw(rows: Sequence[Drawer], candidates: mx.array, lengths: Sequence[int]) -> mx.array:
    """(B, W) tokens: row b's sampler at its positions 0..lengths[b] (the rest are 0).

    `candidates` (B, W, V): log probabilities, masked tokens at -inf. Unseeded rows that sample
    alike share one sampler call over all their positions; a seeded row draws each position from
    its own seed, then MLX's global state is reseeded from the OS, as engine/sampling.py does.
    """
    n, width, vocab = candidates.shape
    groups: dict[tuple, list[int]] = {}
    seeded: list[int] = []
    for i, row in enumerate(rows):
        (seeded if row.seeded else groups.setdefault(row.key, [])).append(i)
    parts: list[mx.array] = []
    order: list[int] = []
    for idx in groups.values():
        some = candidates if len(idx) == n else candidates[mx.array(idx)]
        parts.append(rows[idx[0]].sampler(some.reshape(-1, vocab)).reshape(len(idx), width))
        order += idx
    for i in seeded:
        row = rows[i]
        assert row.seed is not None
        drawn = []
        for p in range(lengths[i] + 1):
            mx.random.seed(draw_seed(row.seed, row.draws + p))
            drawn.append(row.sampler(candidates[i, p : p + 1]).astype(mx.uint32))
        drawn.append(mx.zeros((width - len(drawn),), dtype=mx.uint32))
        parts.append(mx.concatenate(drawn)[None])
        order.append(i)
    if seeded:  # MLX's random state is global: unseeded requests must stay random
        mx.random.seed(int.from_bytes(os.urandom(8), "little"))
    tokens = mx.concatenate([p.astype(mx.uint32) for p in parts])
    if order != list(range(n)):
        tokens = tokens[mx.array(sorted(range(n), key=order.__getitem__))]
    if faults.fires("draw_otherwise"):  # a rank that draws otherwise (tests), verifying too
        tokens = (tokens + 1) % vocab
    return tokens


def accepted_lengths(samples: mx.array, drafts: mx.array, lengths: mx.array) -> mx.array:
    """(B,) the number of drafts each row keeps: the leading drafts equal to the row's samples.

    `samples` (B, W), `drafts` (B, W-1) (any value past a row's length), `lengths` (B,).
    """
    width = drafts.shape[1]
    if width == 0:
        return mx.zeros((samples.shape[0],), dtype=mx.int32)
    match = samples[:, :width] == drafts.astype(samples.dtype)
    match = mx.logical_and(match, mx.arange(width)[None] < lengths[:, None])
    return mx.cumprod(match.astype(mx.int32), axis=1).sum(axis=1)


@dataclass
class Verified:
    """A verify pass's outcome, still on the device: row b emits tokens[b, : accepted[b] + 1]."""

    tokens: mx.array  # (B, W) uint32
    accepted: mx.array  # (B,) drafts kept per row
    logprobs: mx.array  # (B, W, V) the target's, normalised, before any mask

    def read(self) -> list[list[int]]:
        """Each row's emitted tokens, in one readback."""
        n, width = self.tokens.shape
        flat = mx.concatenate([self.tokens.reshape(-1), self.accepted.astype(mx.uint32)]).tolist()
        counts = flat[n * width :]
        return [flat[b * width : b * width + counts[b] + 1] for b in range(n)]


def verify(
    rows: Sequence[Drawer],
    logits: mx.array,
    drafts: Sequence[Sequence[int]],
    *,
    vocab: int | None = None,
    masks: mx.array | None = None,
) -> Verified:
    """Verify every row's draft against the logits of the pass that fed it (nothing read back).

    `logits` (B, W, V'): position i of row b follows its i-th fed token; W - 1 is the longest
    draft, shorter drafts' extra positions are ignored. `vocab`: the ids the tokenizer writes
    (logits past it are a checkpoint's padding, never drawn). `masks` (B, W, vocab), optional:
    the tokens each position may take (a grammar advanced through the draft).
    """
    n, width, _ = logits.shape
    if vocab is not None and vocab < logits.shape[-1]:
        logits = logits[..., :vocab]
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    candidates = logprobs if masks is None else mx.where(masks, logprobs, -mx.inf)
    lengths = [len(d) for d in drafts]
    assert len(drafts) == n and max(lengths, default=0) < width
    padded = mx.array([list(d) + [0] * (width - 1 - len(d)) for d in drafts], dtype=mx.uint32)
    samples = draw(rows, candidates, lengths)
    accepted = accepted_lengths(samples, padded.reshape(n, width - 1), mx.array(lengths))
    mx.async_eval(samples, accepted)
    return Verified(samples, accepted, logprobs)
