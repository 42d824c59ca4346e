"""What a gate around a grammar remembers so that speculation can take tokens back.

The reasoning gate and Harmony's analysis gate (engine/requests.py: `Rewindable`) each keep one
record per consuming call (`advance`, or a run of `forced` tokens): how many tokens it took,
the gate's state before it, and how many of those tokens went on to the answer's grammar. A
rollback pops whole calls, restores the earliest popped state and hands the grammar its share.
"""

from __future__ import annotations

from collections import deque
from typing import Generic, TypeVar

State = TypeVar("State")

HISTORY = 1024  # consuming calls a rollback may reach back over (a draft takes a few dozen)


class CallHistory(Generic[State]):
    def __init__(self, maxlen: int = HISTORY) -> None:
        self._calls: deque[tuple[int, State, int]] = deque(maxlen=maxlen)

    def record(self, tokens: int, before: State, share: int) -> None:
        """A consuming call took `tokens` from `before`; `share` of them went to the grammar."""
        self._calls.append((tokens, before, share))

    def unwind(self, n: int) -> tuple[State | None, int]:
        """Pop the calls of the last `n` tokens: the state before the earliest of them (None
        for n = 0) and how many tokens the grammar must take back."""
        inner, state = 0, None
        while n > 0:
            tokens, state, share = self._calls.pop()
            assert tokens <= n, "a rollback splits a forced run"
            n -= tokens
            inner += share
        return state, inner
