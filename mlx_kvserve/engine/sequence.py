"""One request between its prefill and its Done: what it has sampled, said and fed.

A `Sequence` never runs the model itself. The decode batch (engine/batch.py) runs one forward
pass for all its sequences and hands each its row of logits; the sequence samples from it, reads
tokens back, detokenizes, checks stop strings, EOS, its grammar and `max_tokens`, and emits text.

Invariant: the KV caches of a sequence hold exactly `live.tokens`, between any two batch steps.
A token joins `live.tokens` when it is fed, not when it is sampled, so a sequence that ends or is
cancelled between steps has a consistent state to checkpoint.

Each sequence's next token is in one of two places between steps:
- `step`: sampled on the device, not read back yet. Free sampling reads it only after the next
  forward pass has been queued (pipelining, as mlx-lm's `generate_step` does);
- `feed`: token ids already read (and emitted) but not yet fed: a grammar needs token k to
  compute the mask for k+1, so a constrained sequence reads first, and the tokens its grammar
  forces (no alternative, so no sampling) queue up behind it.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import mlx.core as mx

from mlx_kvserve.engine.decode import Decoder, Step, keep_leading_space
from mlx_kvserve.engine.requests import GenerationRequest, TextChunk, TokenLogprob
from mlx_kvserve.engine.stops import StopMatcher

if TYPE_CHECKING:
    from mlx_kvserve.engine.generate import Live, Timings


class Sequence:
    """The decode state of one request; see the module docstring for the token flow."""

    def __init__(
        self,
        req: GenerationRequest,
        tokenizer: Any,
        live: Live,
        logits: mx.array,
        timings: Timings,
        states: Any,
    ) -> None:
        self.req = req
        self.live = live
        self.timings = timings
        self.states = states  # the PromptStates (namespace) this request acquired from
        self.decoder = Decoder(req)
        self.eos = set(tokenizer.eos_token_ids)
        self.detok = tokenizer.detokenizer
        if req.kind == "text":
            keep_leading_space(self.detok)
        self.stops = StopMatcher(req.params.stop)
        self.limit = req.params.max_tokens
        self.pending: list[TokenLogprob] = []  # logprobs of tokens whose text is held back
        self.decode_started = time.perf_counter()
        self.finish: str | None = None  # set once the sequence has ended
        self.stop_sequence: str | None = None
        self.last_logits = logits  # the prediction after the last token of live.tokens
        self.feed: list[int] = []
        self.step: Step | None = self.decoder.start(logits)
        self.unread: Step | None = None  # a step fed by the current pass, read after it

    # -- what the batch asks ---------------------------------------------------------------
    @property
    def pipelined(self) -> bool:
        return self.decoder.pipelined

    @property
    def done(self) -> bool:
        return self.finish is not None

    def wants_forward(self) -> bool:
        """False when the only thing left is to read a step that ends the sequence anyway."""
        if self.step is not None and self.pipelined:
            return self.timings.completion_tokens + 1 < self.limit
        return True

    def read_first(self) -> None:
        """A constrained sequence reads its sampled token before the pass (its mask needs it)."""
        if self.step is not None and not self.pipelined:
            step, self.step = self.step, None
            self._accept(step)

    def inputs(self, one: bool) -> mx.array:
        """The token(s) this sequence feeds to the next pass: all it has, or just one."""
        if self.step is not None:  # pipelined: feed the sampled token before reading it
            self.unread, self.step = self.step, None
            return self.unread.token.reshape(-1)
        fed = self.feed[:1] if one else list(self.feed)
        self.live.tokens.extend(fed)
        del self.feed[: len(fed)]
        return mx.array(fed, dtype=mx.uint32)

    def after_pass(self, row: mx.array) -> None:
        """`row` is this sequence's prediction after what it just fed: sample from it."""
        self.last_logits = row
        last_token_unread = (
            self.unread is not None and self.timings.completion_tokens + 1 >= self.limit
        )
        if not self.feed and not last_token_unread:
            self.step = self.decoder.start(row)

    def read_after(self) -> None:
        """Read the step fed by this pass (pipelined sequences), now that the next is queued."""
        if self.unread is not None:
            step, self.unread = self.unread, None
            self._accept(step, fed=True)

    def read_unfed(self) -> None:
        """No pass ran (every sequence was at its last token): read what was sampled."""
        if self.step is not None:
            step, self.step = self.step, None
            self._accept(step)

    def cancel(self) -> None:
        self.finish = self.timings.finish_reason = "cancelled"
        self.timings.decode_seconds = time.perf_counter() - self.decode_started
        self.step = self.unread = None

    # -- one token -------------------------------------------------------------------------
    def _accept(self, step: Step, *, fed: bool = False) -> None:
        token, logprob = self.decoder.read(step)
        if fed:
            self.live.tokens.append(token)  # its KV was computed by the pass that just ran
        else:
            self.last_logits = step.logits
        timings = self.timings
        if timings.completion_tokens == 0:
            timings.ttft_seconds = time.perf_counter() - self.req.started
            self.decode_started = time.perf_counter()
        if token in self.eos:
            timings.completion_tokens += 1
            self._end("stop")
            return
        if logprob is not None:
            self.pending.append(logprob)
        forced = self.decoder.forced_tokens(self.limit - timings.completion_tokens - 1)
        for item in [token, *forced]:
            timings.completion_tokens += 1
            self.req.sampled.append(item)
            self.detok.add_token(item)
            text, hit = self.stops.feed(self.detok.last_segment)
            if text:
                self._emit(text)
            if hit:
                self._emit("")
                self._end("stop", flush=False)
                return
        if self.decoder.grammar_complete:
            self._end("stop")
        elif timings.completion_tokens >= self.limit:
            self._end("length")
        elif not fed:
            self.feed = [token, *forced]

    def _end(self, finish: str, *, flush: bool = True) -> None:
        if flush:
            self.detok.finalize()
            text, hit = self.stops.feed(self.detok.last_segment)
            text += "" if hit else self.stops.flush()
            self._emit(text)
            finish = "stop" if hit else finish
        self.finish = finish
        self.stop_sequence = self.stops.matched
        self.timings.finish_reason, self.timings.stop_sequence = finish, self.stops.matched
        self.timings.decode_seconds = time.perf_counter() - self.decode_started
        self.step = self.unread = None

    def _emit(self, text: str) -> None:
        if text or self.pending:
            self.req.emit(TextChunk(text, tuple(self.pending)))
            self.pending.clear()
