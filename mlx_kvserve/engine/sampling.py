"""A decode step's sampling and readback for every row at once, as mlx-lm's batch generator does.

On Metal each call into MLX queues kernels and each readback waits for the device, so a batch
that sampled and read its rows one by one would pay both per row. Here a step is one sampler
call per group of rows that sample alike (mlx-lm's `GenerationBatch._step` makes one call when
the batch shares a sampler, one per row otherwise), grammar masks applied as one matrix, and one
readback (`read`) for the tokens of every row.

Rows group by their sampler settings: every greedy row shares one `argmax`, rows with equal
temperature / top-p / top-k share one categorical draw. A seeded row (temperature above 0) is
drawn on its own, from its own seed and token index, so its tokens do not depend on its company
(engine/decode.py); greedy rows need no seed.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import mlx.core as mx

from mlx_kvserve.engine import faults

_MIX = 0x9E3779B97F4A7C15  # spreads consecutive token indexes over the seed space


def draw_seed(seed: int, index: int) -> int:
    """The seed a seeded row's token number `index` is drawn from (speculation's verify draws
    each position from the seed that position would have had without it)."""
    return (seed + index * _MIX) % 2**64


@dataclass
class Step:
    """A token sampled on the device, not yet read back."""

    token: mx.array  # shape (1,)
    logprobs: mx.array  # (1, the tokenizer's ids): what the token was drawn from, normalised
    logits: mx.array  # the model's whole row (padded ids too): the prediction after the last
    # token fed, kept as the cache's behaviour probe
    speculative: bool = False  # masked as free text before the previous token was read


class Decoder(Protocol):
    """What sampling asks of a row's decoder (engine/decode.py's `Decoder`)."""

    sampler: Callable[[mx.array], mx.array]
    key: tuple  # rows with equal keys share one sampler call
    seeded: bool
    seed: int | None
    draws: int  # seeded tokens drawn so far: the next one's index
    vocab: int | None  # the ids its tokenizer writes (None: every logit is a token)

    def mask(self, n_logits: int, speculative: bool) -> mx.array | None: ...


def sample(rows: Sequence[tuple[Decoder, bool]], logits: mx.array) -> list[Step]:
    """Queue the next token of each row on the device (nothing is read back).

    `rows[i]` is (decoder, speculative) for `logits[i]`; speculative: the row's previous token
    is still on the device, so its grammar (if any) cannot say its mask yet (engine/decode.py).
    Logits past the tokenizer's ids (a checkpoint's padded embedding rows) belong to no token:
    they are cut off before anything is drawn, so the log probabilities are over real tokens.
    """
    full = logits
    n, vocab = logits.shape
    known = min((d.vocab for d, _ in rows if d.vocab is not None), default=vocab)
    if known < vocab:
        logits, vocab = logits[:, :known], known
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    masks = [decoder.mask(vocab, speculative) for decoder, speculative in rows]
    candidates = logprobs
    if any(m is not None for m in masks):
        if n == 1:
            candidates = mx.where(masks[0], logprobs, -mx.inf)
        else:
            every = mx.ones((vocab,), dtype=mx.bool_)
            matrix = mx.stack([every if m is None else m for m in masks])
            candidates = mx.where(matrix, logprobs, -mx.inf)

    groups: dict[tuple, list[int]] = {}
    seeded: list[int] = []
    for i, (decoder, _) in enumerate(rows):
        if decoder.seeded:
            seeded.append(i)
        else:
            groups.setdefault(decoder.key, []).append(i)
    parts: list[mx.array] = []
    order: list[int] = []
    for idx in groups.values():
        sampler = rows[idx[0]][0].sampler
        parts.append(sampler(candidates if len(idx) == n else candidates[mx.array(idx)]))
        order += idx
    for i in seeded:
        decoder = rows[i][0]
        assert decoder.seed is not None
        mx.random.seed(draw_seed(decoder.seed, decoder.draws))
        decoder.draws += 1
        parts.append(decoder.sampler(candidates[i : i + 1]))
        order.append(i)
    if seeded:  # MLX's random state is global: unseeded requests must stay random
        mx.random.seed(int.from_bytes(os.urandom(8), "little"))
    tokens = parts[0] if len(parts) == 1 else mx.concatenate(parts)
    if order != list(range(n)):
        inverse = sorted(range(n), key=order.__getitem__)
        tokens = tokens[mx.array(inverse)]
    if faults.fires("draw_otherwise"):  # a rank that draws otherwise than the others (tests)
        tokens = (tokens + 1) % vocab
    mx.async_eval(tokens, logprobs)
    if n == 1:
        return [Step(tokens, logprobs, full, rows[0][1])]
    return [
        Step(tokens[i : i + 1], logprobs[i : i + 1], full[i : i + 1], rows[i][1]) for i in range(n)
    ]


def read(steps: Sequence[Step]) -> list[int]:
    """The tokens of `steps` as Python ints, in one readback (waits for the device)."""
    if len(steps) == 1:
        return steps[0].token.tolist()
    return mx.concatenate([step.token for step in steps]).tolist()
