"""Sampling for one sequence: grammar mask, sampler, logprobs, a per-request seed.

Like mlx-lm's `generate_step`, free sampling is queued on the device (`mx.async_eval`) and read
back later, so the batch can queue step k+1 before reading token k (engine/sequence.py says how
the tokens flow). A grammar (tool calls, JSON output) needs token k to compute the mask for
k+1, so constrained sequences read first; tokens the grammar forces skip sampling.

A seeded request draws each token from a seed derived from its own seed and the token's index,
so its output does not depend on which other requests share the batch (MLX's random state is
global). The global state is then reseeded from the OS, so unseeded requests stay random.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.sample_utils import make_sampler
from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, SPMStreamingDetokenizer

from mlx_kvserve.engine.requests import GenerationRequest, TokenLogprob

_MIX = 0x9E3779B97F4A7C15  # spreads consecutive token indexes over the seed space


class Cancelled(Exception):
    """The client went away; stop work at the next step boundary."""


@dataclass
class Step:
    """A token sampled on the device, not yet read back."""

    token: mx.array
    logprobs: mx.array
    logits: mx.array  # what it was sampled from: the prediction after the last token fed


class Decoder:
    """Samples one request's tokens: grammar mask, sampler, logprobs."""

    def __init__(self, req: GenerationRequest) -> None:
        params = req.params
        self.req = req
        self.sampler = make_sampler(temp=params.temperature, top_p=params.top_p, top_k=params.top_k)
        self.constraint = req.constraint
        self.want_logprobs = params.logprobs or params.top_logprobs > 0
        self.seed = params.seed
        self.draws = 0

    @property
    def pipelined(self) -> bool:
        return self.constraint is None

    def start(self, logits: mx.array) -> Step:
        """Queue the sampling of the next token on the device (lazy: nothing is read back)."""
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        candidates = logprobs
        mask = None if self.constraint is None else self.constraint.allowed(logits.shape[-1])
        if mask is not None:  # None: the constraint lets every token through at this step
            candidates = mx.where(mx.array(mask), logprobs, -mx.inf)
        if self.seed is not None and self.req.params.temperature > 0:
            mx.random.seed((self.seed + self.draws * _MIX) % 2**64)
            self.draws += 1
            step = Step(self.sampler(candidates), logprobs, logits)
            mx.random.seed(int.from_bytes(os.urandom(8), "little"))
        else:
            step = Step(self.sampler(candidates), logprobs, logits)
        mx.async_eval(step.token, step.logprobs)
        return step

    def read(self, step: Step) -> tuple[int, TokenLogprob | None]:
        """The token as a Python int (waits for the device), advancing the grammar."""
        token = int(step.token.item())
        if self.constraint is not None:
            self.constraint.advance(token)
        return token, (self._logprob(step.logprobs[0], token) if self.want_logprobs else None)

    def forced_tokens(self, room: int) -> list[int]:
        """Tokens the grammar allows no alternative to (e.g. a JSON key), at most `room`; they
        need no sampling, so they share the next forward pass. Not with logprobs, which would
        need a distribution for each."""
        if self.constraint is None or self.want_logprobs or room <= 0:
            return []
        return self.constraint.forced(room)

    @property
    def grammar_complete(self) -> bool:
        return self.constraint is not None and self.constraint.finished

    def _logprob(self, logprobs: mx.array, token: int) -> TokenLogprob:
        """The sampled token's log probability (the model's own, before any grammar mask)."""
        name = self.req.token_bytes or (lambda t: str(t).encode())
        top: tuple[tuple[bytes, float], ...] = ()
        n = self.req.params.top_logprobs
        if n > 0:
            ids = mx.argpartition(-logprobs, kth=n - 1)[:n]
            values = logprobs[ids]
            order = mx.argsort(-values)
            ids, values = ids[order].tolist(), values[order].tolist()
            top = tuple((name(int(i)), float(v)) for i, v in zip(ids, values, strict=True))
        return TokenLogprob(name(token), float(logprobs[token].item()), top)


def keep_leading_space(detok: Any) -> None:
    """mlx-lm's streaming detokenizers drop the first token's leading space, which suits a chat
    answer but not a text completion ("The capital is" + " Paris")."""
    if isinstance(detok, SPMStreamingDetokenizer):
        detok.trim_space = False
    elif isinstance(detok, BPEStreamingDetokenizer):
        detok.text, detok.offset = "\0", 1  # the trim applies only while the text is empty
