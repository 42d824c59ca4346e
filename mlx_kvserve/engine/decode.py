"""What one request samples with: sampler settings, grammar mask, logprobs, its seed.

Like mlx-lm's `generate_step`, free sampling is queued on the device (`mx.async_eval`) and read
back later, so the batch can queue step k+1 before reading token k (engine/sequence.py says how
the tokens flow); the batch samples all its rows in one call (engine/sampling.py). A grammar
(tool calls, JSON output) needs token k to compute the mask for k+1, so constrained sequences
read first; tokens the grammar forces skip sampling.

A lazy grammar (tool_choice "auto": free text until the call's opening marker) allows the same
tokens at every step of its free text, and a reasoning section masks nothing. While a grammar
is in such a free state its sequence stays pipelined: token k+1 is sampled with that state's
mask before token k is read, and once k is read the grammar says the real mask; if it is still
the same the sample stands (it is exactly what the constrained path would have drawn), else (a
call begins, the reasoning ends) it is drawn again with the real mask before anything was fed,
and the sequence reads first until the grammar is back in a free state.

A seeded request draws each token from a seed derived from its own seed and the token's index,
so its output does not depend on which other requests share the batch (MLX's random state is
global). The global state is then reseeded from the OS, so unseeded requests stay random.

A request with `ignore_eos` never samples an end-of-sequence id while anything else is allowed
(llama.cpp's meaning): its length is the client's to choose, as tests of a random model need.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np
from mlx_lm.sample_utils import make_sampler
from mlx_lm.tokenizer_utils import (
    BPEStreamingDetokenizer,
    SPMStreamingDetokenizer,
    StreamingDetokenizer,
)

from mlx_kvserve.engine.requests import (
    Forkable,
    GenerationRequest,
    TokenConstraint,
    TokenLogprob,
)
from mlx_kvserve.engine.sampling import Step


@dataclass
class Walk:
    """A draft walked through a row's grammar (`Decoder.walk`)."""

    drafts: list[int] = field(default_factory=list)  # checked against the row's samples
    forced: list[list[int]] = field(default_factory=list)  # after each draft: fed, not sampled
    masks: list[mx.array | None] = field(default_factory=list)  # per slot: len(drafts) + 1


class Cancelled(Exception):
    """The client went away; stop work at the next step boundary."""


class Decoder:
    """Samples one request's tokens: grammar mask, sampler, logprobs."""

    def __init__(
        self, req: GenerationRequest, eos: Iterable[int] = (), vocab: int | None = None
    ) -> None:
        """`eos`: the end ids (masked under `ignore_eos`); `vocab`: the ids the tokenizer
        writes, logits past them never drawn."""
        params = req.params
        self.req = req
        self.vocab = vocab
        self.sampler = make_sampler(temp=params.temperature, top_p=params.top_p, top_k=params.top_k)
        # rows with equal keys share one sampler call (make_sampler ignores the rest at temp 0)
        self.key: tuple = (
            ("greedy",)
            if params.temperature == 0
            else (params.temperature, params.top_p, params.top_k)
        )
        self.constraint = req.constraint
        self.want_logprobs = params.logprobs or params.top_logprobs > 0
        self.seed = params.seed
        self.seeded = params.seed is not None and params.temperature > 0
        self.draws = 0
        self.lazy = bool(getattr(self.constraint, "lazy", False))
        self.speculating = False  # the grammar is in a free state: the sequence is pipelined
        self._free: np.ndarray | None = None  # a lazy grammar's free-text mask (its first)
        self._free_mx: mx.array | None = None
        self._spec: mx.array | None = None  # the free state's mask (None: no mask at all)
        self._eos = sorted(set(eos)) if params.ignore_eos else []
        self._no_eos: mx.array | None = None  # every id but the end-of-sequence ones

    @property
    def pipelined(self) -> bool:
        return self.constraint is None or self.speculating

    def mask(self, n_logits: int, speculative: bool) -> mx.array | None:
        """The tokens the next sample may take (None: any). `speculative`: the token before it
        is not read yet, so the mask of the free state the grammar was in stands in (checked by
        `confirm`)."""
        allowed = self._grammar_mask(n_logits, speculative)
        return self._without_eos(allowed, n_logits) if self._eos else allowed

    def _without_eos(self, allowed: mx.array | None, n_logits: int) -> mx.array:
        """`allowed` less the end-of-sequence ids, unless they are all it allows (a grammar that
        must end): decided on the device, so no readback."""
        if self._no_eos is None or self._no_eos.shape[0] != n_logits:
            keep = np.ones(n_logits, dtype=bool)
            keep[[i for i in self._eos if i < n_logits]] = False
            self._no_eos = mx.array(keep)
        if allowed is None:
            return self._no_eos
        both = mx.logical_and(allowed, self._no_eos)
        return mx.where(mx.any(both), both, allowed)

    def _grammar_mask(self, n_logits: int, speculative: bool) -> mx.array | None:
        """The grammar's mask (None: no grammar, or no mask at this step)."""
        if self.constraint is None:
            return None
        if speculative:
            assert self.speculating
            return self._spec
        real = self.constraint.allowed(n_logits)
        real = None if real is None else np.asarray(real)
        if real is not None and self.lazy and self._free is None:
            self._free, self._free_mx = real, mx.array(real)
        self.speculating = self._is_free(real)
        if real is None:
            self._spec = None
            return None
        if self.speculating:
            self._spec = self._free_mx
            return self._free_mx
        return mx.array(real)

    def confirm(self, step: Step, n_logits: int) -> bool:
        """After the token before the speculative `step` was read: does `step` stand (the
        grammar's real mask is the one it was drawn with)? If not, the sequence leaves the
        pipelined path and `step`'s draw is handed back."""
        assert self.constraint is not None
        real = self.constraint.allowed(n_logits)
        same = real is None if self._spec is None else self._same_as_free(real)
        if same:
            return True
        self.discard(step)
        return False

    def discard(self, step: Step) -> None:
        """`step` will not be used: its draw index goes back, and the real mask is asked next."""
        self.speculating = False
        if self.seeded and step.speculative:
            self.draws -= 1

    def _is_free(self, real: np.ndarray | None) -> bool:
        """A state whose mask is the same at every step: no mask (a reasoning section, a gate
        without a grammar), or a lazy grammar's free text."""
        return real is None or self._same_as_free(real)

    def _same_as_free(self, real: np.ndarray | None) -> bool:
        return real is not None and self._free is not None and np.array_equal(real, self._free)

    def accept(self, step: Step, token: int) -> TokenLogprob | None:
        """`token` (read back from `step`) is the sequence's: advance the grammar, its logprob."""
        if self.constraint is not None:
            self.constraint.advance(token)
        return self._logprob(step.logprobs[0], token) if self.want_logprobs else None

    def forced_tokens(self, room: int, grammar: TokenConstraint | None = None) -> list[int]:
        """Tokens the grammar (`grammar`: a copy being walked) allows no alternative to (e.g. a
        JSON key), at most `room`; they need no sampling, so they share the next forward pass.
        Not with logprobs, which would need a distribution for each."""
        grammar = grammar or self.constraint
        if grammar is None or self.want_logprobs or room <= 0:
            return []
        return grammar.forced(room)

    @property
    def walkable(self) -> bool:
        """A grammar speculation can walk drafts through (a copy of it), or none."""
        return self.constraint is None or isinstance(self.constraint, Forkable)

    def walk(
        self, proposal: list[int], n_logits: int, depth: int, left: int, eos: set[int]
    ) -> Walk:
        """A grammar row's draft, checked token by token as plain decoding would take it.

        `proposal`: a source's guess of the tokens to come (they include what the grammar will
        force); `left`: tokens the row may still emit. Each drafted token must be allowed by the
        mask of its position (a refused one, or an end id, ends the draft); after it, the tokens
        the grammar then forces (`forced_tokens`, as `Sequence._accept` takes them) are fed
        without a sample or a search, and the proposal goes on only if it agrees with them.
        The draft is walked through a copy of the grammar (`fork`, made at its first token), so
        the row's own grammar takes only the tokens the row then emits (its accept), and a
        draft the library refuses after all (a parser limit) just ends there."""
        assert isinstance(self.constraint, Forkable)
        out = Walk()
        grammar: TokenConstraint = self.constraint
        while True:
            allowed = grammar.allowed(n_logits)  # None: no mask (reasoning)
            mask = None if allowed is None else mx.array(allowed)
            out.masks.append(self._without_eos(mask, n_logits) if self._eos else mask)
            done = grammar.finished or left <= 1
            if done or len(out.drafts) >= depth or not proposal:
                break
            token = proposal[0]
            if token in eos or token >= n_logits or (allowed is not None and not allowed[token]):
                break
            if grammar is self.constraint:
                grammar = self.constraint.fork()
            try:
                grammar.advance(token)
                forced = self.forced_tokens(left - 1, grammar)
            except RuntimeError:  # llguidance in error: the copy is dropped, the row's intact
                break
            out.drafts.append(token)
            out.forced.append(forced)
            left -= 1 + len(forced)
            agrees = proposal[1 : 1 + len(forced)] == forced
            proposal = proposal[1 + len(forced) :] if agrees else []
        return out

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


def keep_leading_space(detok: StreamingDetokenizer) -> None:
    """mlx-lm's streaming detokenizers drop the first token's leading space, which suits a chat
    answer but not a text completion ("The capital is" + " Paris")."""
    if isinstance(detok, SPMStreamingDetokenizer):
        detok.trim_space = False
    elif isinstance(detok, BPEStreamingDetokenizer):
        detok.text, detok.offset = "\0", 1  # the trim applies only while the text is empty
