"""Stop-string detection on streamed text.

Text that might be the start of a stop string is held back until it is known not to be one, so a
client never sees part of a stop sequence.
"""

from __future__ import annotations


class StopMatcher:
    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = tuple(s for s in stops if s)
        self._pending = ""
        self.matched: str | None = None  # the stop string that was hit

    def feed(self, text: str) -> tuple[str, bool]:
        """Add new text; return (text safe to emit, whether a stop string was hit)."""
        self._pending += text
        if not self.stops:
            out, self._pending = self._pending, ""
            return out, False
        hits = [(i, s) for s in self.stops if (i := self._pending.find(s)) >= 0]
        if hits:
            at, self.matched = min(hits)
            out = self._pending[:at]
            self._pending = ""
            return out, True
        hold = self._longest_partial_suffix()
        cut = len(self._pending) - hold
        out, self._pending = self._pending[:cut], self._pending[cut:]
        return out, False

    def flush(self) -> str:
        """At the end of generation, whatever was held back is ordinary text."""
        out, self._pending = self._pending, ""
        return out

    def _longest_partial_suffix(self) -> int:
        best = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(self._pending)), best, -1):
                if self._pending.endswith(stop[:n]):
                    best = n
                    break
        return best
