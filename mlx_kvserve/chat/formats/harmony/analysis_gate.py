"""A thinking budget for gpt-oss: its analysis messages ended when the budget is spent.

The harmony counterpart of chat.reasoning.reasoning_gate (whose markers are a fixed start and
end pair): a gpt-oss message opens with `<|channel|>NAME ...<|message|>` and ends with `<|end|>`,
so the gate reads each header's channel from its tokens and counts the tokens of analysis messages.
Once `budget` are spent it forces `<|end|>`, as llama.cpp and oMLX force the end of thinking;
the answer's grammar (harmony.answer_grammar), when there is one, sees every token and goes on
from there (its analysis rule ends at that same token).

Speculation walks drafts through a copy of the gate (`fork`, its answer grammar's copy
inside), as through chat.reasoning.reasoning_gate's: the row's own gate takes only the tokens
the row emits.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import numpy as np

from mlx_kvserve.chat.formats.harmony import channels
from mlx_kvserve.chat.grammar import Constraint
from mlx_kvserve.chat.tokenizer import Tokenizer
from mlx_kvserve.vocabulary import token_ids


class HarmonyGate:
    """One request's analysis budget (the engine's token constraint), on the engine thread."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        budget: int,
        inner: Constraint | None = None,
        decode: Callable[[list[int]], str] | None = None,
    ) -> None:
        vocab = token_ids(tokenizer)
        self.channel = vocab[channels.CHANNEL]
        self.message = vocab[channels.MESSAGE]
        self.end = vocab[channels.END]
        self.stops = {
            vocab[t] for t in (channels.START, channels.CALL, channels.RETURN) if t in vocab
        }
        self.decode = decode or tokenizer.decode
        self.budget = budget
        self.inner = inner  # the answer's grammar (chat.grammar.Constraint), or None
        self.spent = 0
        self.closing = False
        self._header: list[int] | None = None  # a header's tokens since <|channel|>
        self._analysis = False

    def allowed(self, n_logits: int) -> np.ndarray | None:
        if self.closing:
            mask = np.zeros(n_logits, dtype=bool)
            mask[self.end] = True
            return mask
        return None if self.inner is None else self.inner.allowed(n_logits)

    def advance(self, token: int) -> None:
        if self.inner is not None:
            self.inner.advance(token)
        self._take(token)

    def forced(self, limit: int) -> list[int]:
        if self.closing and limit > 0:
            if self.inner is not None:
                self.inner.advance(self.end)
            self._take(self.end)
            return [self.end]
        tokens = [] if self.inner is None else self.inner.forced(limit)
        for token in tokens:  # the grammar's forced tokens: a header's, often
            self._take(token)
        return tokens

    def fork(self) -> HarmonyGate:
        """A copy in this state, its answer grammar's too: speculation walks drafts through
        it (engine/decode.py `Decoder.walk`)."""
        twin = copy.copy(self)
        twin._header = None if self._header is None else list(self._header)
        twin.inner = None if self.inner is None else self.inner.fork()
        return twin

    @property
    def finished(self) -> bool:
        return self.inner is not None and self.inner.finished

    def _take(self, token: int) -> None:
        if token == self.channel:
            self._header, self._analysis = [], False
        elif token == self.message:
            header = self.decode(self._header or [])
            self._analysis = header.strip().startswith("analysis") and "to=" not in header
            self._header = None
        elif token == self.end or token in self.stops:
            self._analysis, self.closing, self._header = False, False, None
        elif self._header is not None:
            self._header.append(token)
        elif self._analysis:
            self.spent += 1
            if self.spent >= self.budget:
                self.closing = True
