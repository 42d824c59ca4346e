"""The reasoning section during decoding: a thinking budget, and grammars kept out of it.

`ReasoningGate` is a token constraint (the engine's `TokenConstraint`) that follows the model in
and out of its reasoning by the marker token ids (the start state comes from the end of the
prompt, see chat.reasoning.thinking). While the model reasons, nothing is masked and the
answer's grammar (tool calls, JSON output), if any, waits: text that looks like a call inside
the reasoning is not a call. Once `budget` reasoning tokens are spent, the gate forces the
end-of-thinking tokens (as llama.cpp and oMLX do) and the answer follows; from then on the
grammar applies.

Forced tokens are handed to the engine through `forced()` (they share one forward pass); when
the engine does not ask for them (a request with logprobs), `allowed()` masks all but the next
one, so the budget holds either way.
"""

from __future__ import annotations

import copy

import numpy as np

from mlx_kvserve.chat.grammar import Constraint
from mlx_kvserve.chat.reasoning.thinking import ThinkMarkers


class ReasoningGate:
    """One request's reasoning state, used on the engine thread only."""

    def __init__(
        self,
        markers: ThinkMarkers,
        *,
        reasoning: bool,
        budget: int | None = None,
        inner: Constraint | None = None,
    ) -> None:
        self.markers = markers
        self.reasoning = reasoning
        self.budget = budget
        self.inner = inner  # the answer's grammar (chat.grammar.Constraint), or None
        self.spent = 0  # reasoning tokens generated so far (all sections together)
        self.closing: list[int] = []  # end-of-thinking tokens still to force
        self._recent: list[int] = []  # the last tokens, to spot a multi-token marker

    def allowed(self, n_logits: int) -> np.ndarray | None:
        """None: no mask. While closing, only the next end-of-thinking token."""
        if self.closing:
            mask = np.zeros(n_logits, dtype=bool)
            mask[self.closing[0]] = True
            return mask
        if self.reasoning or self.inner is None:
            return None
        return self.inner.allowed(n_logits)

    def advance(self, token: int) -> None:
        if self.closing:
            if token == self.closing[0]:
                self._take(self.closing.pop(0))
                return
            self.closing = []  # cannot happen under the mask; fall back to following the model
        if not self.reasoning and self.inner is not None:
            self.inner.advance(token)
        self._take(token)

    def forced(self, limit: int) -> list[int]:
        """The end-of-thinking tokens once the budget is spent, else the grammar's (consumed)."""
        if self.closing:
            out: list[int] = []
            while self.closing and len(out) < limit:
                out.append(self.closing.pop(0))  # popped first: the budget check sees it gone
                self._take(out[-1])
            return out
        if self.reasoning or self.inner is None:
            return []
        return self.inner.forced(limit)

    def fork(self) -> ReasoningGate:
        """A copy in this state, its answer grammar's too: speculation walks drafts through
        it (engine/decode.py `Decoder.walk`)."""
        twin = copy.copy(self)
        twin.closing, twin._recent = list(self.closing), list(self._recent)
        twin.inner = None if self.inner is None else self.inner.fork()
        return twin

    @property
    def lazy(self) -> bool:
        """The answer's grammar starts in free text (tool_choice "auto"), so the engine may keep
        it pipelined there, as it does through the reasoning, which masks nothing."""
        return self.inner is not None and self.inner.lazy

    @property
    def finished(self) -> bool:
        return not self.reasoning and self.inner is not None and self.inner.finished

    def _take(self, token: int) -> None:
        """Follow one token in or out of the reasoning; start closing when the budget is spent."""
        m = self.markers
        self._recent = (self._recent + [token])[-max(len(m.start_ids), len(m.end_ids)) :]
        if self.reasoning:
            if tuple(self._recent[-len(m.end_ids) :]) == m.end_ids:
                self.reasoning = False  # forced tokens after the marker (if any) still follow
                return
            self.spent += 1
            if self.budget is not None and self.spent >= self.budget and not self.closing:
                self.closing = list(m.close_ids)
        elif tuple(self._recent[-len(m.start_ids) :]) == m.start_ids:
            self.reasoning = True
