"""One request between its prefill and its Done: what it has sampled, said and fed.

A `Sequence` never runs the model itself. The decode batch (engine/batch.py) runs one forward
pass for all its sequences and hands each its row of logits; the sequence samples from it, reads
tokens back, detokenizes, checks stop strings, EOS, its grammar and `max_tokens`, and emits text.

Invariant: the KV caches of a sequence hold exactly `live.tokens`, between any two batch steps.
A token joins `live.tokens` when it is fed, not when it is sampled, so a sequence that ends or is
cancelled between steps has a consistent state to checkpoint.

Each sequence's next token is in one of two places between steps:
- `step`: sampled on the device, not read back yet. Free sampling reads it only after the next
  forward pass has been queued (pipelining, as mlx-lm's `generate_step` does); so does a lazy
  grammar while it is in its free text (engine/decode.py);
- `feed`: token ids already read (and emitted) but not yet fed: a grammar needs token k to
  compute the mask for k+1, so a constrained sequence reads its token in the readback of the
  pass that produced it, before the next pass, and the tokens its grammar forces (no
  alternative, so no sampling) queue up behind it.

The batch, not the sequence, samples and reads back: one sampler call and one readback per step
for all its rows (engine/sampling.py). The sequence says what it needs (`sample_row`,
`to_read`) and takes the results (`take`).
"""

from __future__ import annotations

import time

import mlx.core as mx
from mlx_lm.tokenizer_utils import TokenizerWrapper

from mlx_kvserve.engine import sampling
from mlx_kvserve.engine.decode import Decoder, keep_leading_space
from mlx_kvserve.engine.live import Live, Timings
from mlx_kvserve.engine.prompt_state import PromptStates
from mlx_kvserve.engine.requests import GenerationRequest, TextChunk, TokenLogprob
from mlx_kvserve.engine.sampling import Step
from mlx_kvserve.engine.stops import StopMatcher


class Sequence:
    """The decode state of one request; see the module docstring for the token flow."""

    def __init__(
        self,
        req: GenerationRequest,
        tokenizer: TokenizerWrapper,
        live: Live,
        logits: mx.array,
        timings: Timings,
        states: PromptStates,
        vocab: int | None = None,
    ) -> None:
        """`vocab`: the ids `tokenizer` writes (mlx_kvserve/vocabulary.py)."""
        self.req = req
        self.live = live
        self.timings = timings
        self.states = states  # the PromptStates (namespace) this request acquired from
        self.eos = set(tokenizer.eos_token_ids)
        self.decoder = Decoder(req, self.eos, vocab)
        # position minus token index past its images (Qwen's M-RoPE; engine/positions.py)
        self.rope_delta = 0
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
        (self.step,) = sampling.sample([(self.decoder, False)], logits)
        self.unread: Step | None = None  # a step fed by the current pass, read after it
        self.forks: list[Sequence] = []  # the other choices, forked from this prefill

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

    def first_read(self) -> Step | None:
        """The step to read before the next pass: a constrained sequence's (its mask and the
        tokens its grammar forces need it), if not read yet (a newcomer's first token)."""
        return self.step if self.step is not None and not self.pipelined else None

    def inputs(self, one: bool) -> mx.array:
        """The token(s) this sequence feeds to the next pass: all it has, or just one."""
        if self.step is not None:  # pipelined: feed the sampled token before reading it
            self.unread, self.step = self.step, None
            return self.unread.token.reshape(-1)
        fed = self.feed[:1] if one else list(self.feed)
        self.live.tokens.extend(fed)
        del self.feed[: len(fed)]
        return mx.array(fed, dtype=mx.uint32)

    def wants_sample(self) -> bool:
        """After a pass: whether to sample from its row (not while tokens wait to be fed, nor
        past the token that is the last one allowed)."""
        last_token_unread = (
            self.unread is not None and self.timings.completion_tokens + 1 >= self.limit
        )
        return not self.feed and not last_token_unread

    def sample_row(self) -> tuple[Decoder, bool]:
        """(decoder, speculative) for `sampling.sample`: a grammar's sample is speculative while
        the token before it is unread (free sampling needs no check)."""
        return self.decoder, self.unread is not None and self.decoder.constraint is not None

    def to_read(self) -> Step | None:
        """After a pass: the step this step's readback reads, the fed one or a constrained
        sequence's new sample."""
        if self.unread is not None:
            return self.unread
        return self.first_read()

    def take(self, step: Step, token: int) -> None:
        """`token` is `step`'s value, read back."""
        if step is self.unread:
            self.unread = None
            self._accept(step, token, fed=True)
        else:
            self.step = None
            self._accept(step, token)

    def take_run(
        self, tokens: list[int], logits: mx.array, logprobs: mx.array, fed: int = 1
    ) -> int:
        """A verify pass's emitted `tokens` (engine/speculation/step.py): this row fed its `fed`
        pending tokens, then `tokens[:-1]` as its kept drafts (each with the tokens its grammar
        forces after it), then what was rejected; `logits`/`logprobs` are at its sample slots.
        Each is taken as a sampled token (EOS, stop strings, `max_tokens` end it early; forced
        tokens follow as in a plain step); the last left becomes the one to feed. Returns the
        positions of the pass that stay in the caches: the pending tokens and the kept drafts
        with their forced tokens (`live.tokens` grows by as many, less the pending ones the
        caller already added)."""
        kept = fed
        for j, token in enumerate(tokens):
            step = Step(mx.array([token], dtype=mx.uint32), logprobs[j : j + 1], logits[j : j + 1])
            self._accept(step, token)
            if self.done or j == len(tokens) - 1:
                break
            kept += len(self.feed)  # fed as the next draft and its forced tokens: KV is there
            self.live.tokens.extend(self.feed)
            self.feed = []
        return kept

    def redraw(self) -> None:
        """The speculative sample did not stand (a tool call begins): draw it again from the
        same row with the grammar's real mask, before anything was fed."""
        (self.step,) = sampling.sample([(self.decoder, False)], self.last_logits)

    def out_of_memory(self) -> None:
        """Alone in the server, it has filled the KV budget: it ends as at the end of the
        context window (engine/ledger.py)."""
        self._end("length")

    def cancel(self) -> None:
        self.finish = self.timings.finish_reason = "cancelled"
        self.timings.decode_seconds = time.perf_counter() - self.decode_started
        self.step = self.unread = None

    # -- one token -------------------------------------------------------------------------
    def _accept(self, step: Step, token: int, *, fed: bool = False) -> None:
        logprob = self.decoder.accept(step, token)
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
        elif forced:  # a lazy grammar's call began and it chose what follows: no sample
            if self.step is not None:
                self.decoder.discard(self.step)
            self.step, self.feed = None, forced
        elif self._speculation_failed():
            self.redraw()

    def _speculation_failed(self) -> bool:
        """A fed token was read: a successor sampled speculatively must match the real mask."""
        step = self.step
        if step is None or not step.speculative:
            return False
        return not self.decoder.confirm(step, step.logprobs.shape[-1])  # the width drawn at

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
