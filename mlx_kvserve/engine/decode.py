"""Decode for one request: sampling, grammar masks, logprobs, stop strings, pipelining.

Like mlx-lm's `generate_step`, the free-sampling path queues step k+1 on the device
(`mx.async_eval`) before it reads token k back to Python, so detokenizing, stop-string checks and
handing text to the event loop overlap the next forward pass instead of stalling the device.
The token that step k+1 feeds is in the KV cache from then on, so it joins `live.tokens` at once,
even if the request then ends on it (an EOS, a stop string): the cache and its token list never
disagree, and the next turn, which resends that end-of-turn token, reuses it.

A grammar (tool calls, JSON output) needs token k to compute the mask for k+1, so constrained
requests run one step at a time; tokens the grammar forces skip sampling and share one pass.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import mlx.core as mx
from mlx_lm.sample_utils import make_sampler
from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, SPMStreamingDetokenizer

from mlx_kvserve.engine.requests import GenerationRequest, TextChunk, TokenLogprob
from mlx_kvserve.engine.stops import StopMatcher

if TYPE_CHECKING:
    from mlx_kvserve.engine.generate import Live, Timings


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

    @property
    def pipelined(self) -> bool:
        return self.constraint is None

    def start(self, logits: mx.array) -> Step:
        """Queue the sampling of the next token on the device (lazy: nothing is read back)."""
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        candidates = logprobs
        if self.constraint is not None:
            allowed = mx.array(self.constraint.allowed(logits.shape[-1]))
            candidates = mx.where(allowed, logprobs, -mx.inf)
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


def decode(
    model: Any,
    tokenizer: Any,
    logits: mx.array,
    live: Live,
    req: GenerationRequest,
    timings: Timings,
    check: Callable[[], None],
) -> tuple[str, str | None, mx.array]:
    """Sample until EOS, a stop string, a completed grammar or max_tokens.

    Returns (finish reason, the stop string that ended it or None, and the logits after the
    last token in `live.tokens`, the probe of the after-generation checkpoint).
    """
    eos = set(tokenizer.eos_token_ids)
    detok = tokenizer.detokenizer
    if req.kind == "text":
        _keep_leading_space(detok)
    stops = StopMatcher(req.params.stop)
    decoder = Decoder(req)
    limit = req.params.max_tokens
    pending: list[TokenLogprob] = []  # logprobs of tokens whose text is still held back
    started = time.perf_counter()
    finish = "length"

    def emit(text: str) -> None:
        if text or pending:
            req.emit(TextChunk(text, tuple(pending)))
            pending.clear()

    def forward(tokens: list[int] | mx.array) -> mx.array:
        batch = tokens[None] if isinstance(tokens, mx.array) else mx.array([tokens])
        return model(batch, cache=live.caches)[:, -1, :]

    step = decoder.start(logits)
    while timings.completion_tokens < limit:
        check()
        ahead = None
        if decoder.pipelined and timings.completion_tokens + 1 < limit:
            ahead = decoder.start(forward(step.token))  # step k+1 queued before k is read
        token, logprob = decoder.read(step)
        if ahead is not None:
            live.tokens.append(token)  # its KV is being computed by the queued step
            logits = ahead.logits
        if timings.completion_tokens == 0:
            timings.ttft_seconds = time.perf_counter() - req.started
            started = time.perf_counter()
        if token in eos:
            timings.completion_tokens += 1
            finish = "stop"
            break
        if logprob is not None:
            pending.append(logprob)
        forced = decoder.forced_tokens(limit - timings.completion_tokens - 1)
        for item in [token, *forced]:
            timings.completion_tokens += 1
            detok.add_token(item)
            text, hit = stops.feed(detok.last_segment)
            if text:
                emit(text)
            if hit:
                emit("")
                timings.decode_seconds = time.perf_counter() - started
                return "stop", stops.matched, logits
        if decoder.grammar_complete:
            finish = "stop"
            break
        if ahead is not None:
            step = ahead
        elif timings.completion_tokens < limit:
            logits = forward([token, *forced])  # forced tokens share the sampled one's pass
            live.tokens.extend([token, *forced])
            step = decoder.start(logits)
    detok.finalize()
    text, hit = stops.feed(detok.last_segment)
    text += "" if hit else stops.flush()
    emit(text)
    timings.decode_seconds = time.perf_counter() - started
    return ("stop" if hit else finish), stops.matched, logits


def _keep_leading_space(detok: Any) -> None:
    """mlx-lm's streaming detokenizers drop the first token's leading space, which suits a chat
    answer but not a text completion ("The capital is" + " Paris")."""
    if isinstance(detok, SPMStreamingDetokenizer):
        detok.trim_space = False
    elif isinstance(detok, BPEStreamingDetokenizer):
        detok.text, detok.offset = "\0", 1  # the trim applies only while the text is empty
