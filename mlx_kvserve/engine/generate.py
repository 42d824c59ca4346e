"""Prefill and decode for one request, on the engine thread.

Prefill runs in chunks of `prefill_step` tokens and checks for cancellation between chunks; decode
checks after every token. Only the last prompt token's logits are computed: earlier chunks evaluate
just the KV state, so MLX's lazy graph never runs the vocabulary projection for them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import make_sampler

from mlx_kvserve.engine.requests import Done, GenerationRequest, TextChunk
from mlx_kvserve.engine.stops import StopMatcher

log = logging.getLogger("mlx_kvserve.engine")


class Cancelled(Exception):
    """The client went away; stop work at the next step boundary."""


@dataclass
class Timings:
    """What the per-request log line reports."""

    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    ttft_seconds: float = 0.0
    finish_reason: str = ""

    def log_line(self, req: GenerationRequest) -> str:
        prefilled = self.prompt_tokens - self.cached_tokens
        prefill_tps = prefilled / self.prefill_seconds if self.prefill_seconds else 0.0
        decode_tps = (
            (self.completion_tokens - 1) / self.decode_seconds
            if self.decode_seconds and self.completion_tokens > 1
            else 0.0
        )
        return (
            f"{req.kind} id={req.request_id} prompt_tokens={self.prompt_tokens} "
            f"cached_tokens={self.cached_tokens} completion_tokens={self.completion_tokens} "
            f"ttft={self.ttft_seconds:.3f}s prefill={prefill_tps:.1f} tok/s "
            f"decode={decode_tps:.1f} tok/s finish={self.finish_reason}"
        )


def prefill(
    model, cache: list, tokens: list[int], step: int, check: Callable[[], None]
) -> mx.array:
    """Run `tokens` through the model into `cache`; return the last position's logits."""
    if not tokens:
        raise ValueError("prefill needs at least one token")
    body, last = tokens[:-1], tokens[-1:]
    for start in range(0, len(body), step):
        check()
        model(mx.array(body[start : start + step])[None], cache=cache)
        mx.eval([c.state for c in cache])
    check()
    logits = model(mx.array(last)[None], cache=cache)[:, -1, :]
    mx.eval(logits)
    return logits


def _sample(sampler, logits: mx.array) -> int:
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    token = sampler(logprobs)
    mx.eval(token)
    return int(token.item())


def _decode(model, tokenizer, logits, cache, req, sampler, timings, check) -> str:
    """Sample until EOS, a stop string or max_tokens; return the finish reason."""
    eos = set(tokenizer.eos_token_ids)
    detok = tokenizer.detokenizer
    stops = StopMatcher(req.params.stop)
    started = time.perf_counter()
    finish = "length"
    while timings.completion_tokens < req.params.max_tokens:
        check()
        token = _sample(sampler, logits)
        timings.completion_tokens += 1
        if timings.completion_tokens == 1:
            timings.ttft_seconds = time.perf_counter() - req.started
            started = time.perf_counter()
        if token in eos:
            finish = "stop"
            break
        detok.add_token(token)
        text, hit = stops.feed(detok.last_segment)
        if text:
            req.emit(TextChunk(text))
        if hit:
            timings.decode_seconds = time.perf_counter() - started
            return "stop"
        if timings.completion_tokens < req.params.max_tokens:
            logits = model(mx.array([[token]]), cache=cache)[:, -1, :]
    detok.finalize()
    text, hit = stops.feed(detok.last_segment)
    text += "" if hit else stops.flush()
    if text:
        req.emit(TextChunk(text))
    timings.decode_seconds = time.perf_counter() - started
    return "stop" if hit else finish


def run_request(model, tokenizer, req: GenerationRequest, prefill_step: int) -> Timings:
    """Generate for `req`, emitting TextChunk events and a final Done event."""
    params = req.params
    timings = Timings(prompt_tokens=len(req.prompt_tokens))

    def check() -> None:
        if req.cancelled.is_set():
            raise Cancelled

    if params.seed is not None:
        mx.random.seed(params.seed)
    sampler = make_sampler(temp=params.temperature, top_p=params.top_p)
    cache = make_prompt_cache(model)

    t0 = time.perf_counter()
    try:
        logits = prefill(model, cache, req.prompt_tokens, prefill_step, check)
        timings.prefill_seconds = time.perf_counter() - t0
        timings.finish_reason = _decode(
            model, tokenizer, logits, cache, req, sampler, timings, check
        )
    except Cancelled:
        timings.finish_reason = "cancelled"
        timings.prefill_seconds = timings.prefill_seconds or time.perf_counter() - t0
    req.emit(
        Done(
            finish_reason=timings.finish_reason,
            prompt_tokens=timings.prompt_tokens,
            completion_tokens=timings.completion_tokens,
            cached_tokens=timings.cached_tokens,
        )
    )
    return timings
