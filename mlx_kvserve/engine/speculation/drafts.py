"""Draft sources: guesses of a row's next tokens that cost no forward pass.

Agents re-emit what they have seen (files, diffs, paths, JSON arguments, tool output), so the
cheapest useful guess is a copy: prompt lookup finds the latest earlier place where the row's
last n tokens occurred (n from `n_max` down to `n_min`, the longest match first) and proposes
the tokens that followed it there. It goes down to one token, as Hugging Face's prompt lookup
does: after a copy parts from its source (a renamed function, a changed word) the next match is
often a single token long, and a lone row's one-token guess costs a few percent of a pass; the
depth controller learns per match length what such guesses are worth (depth.py `SourcePriors`).

Drafting runs every decode step for every row, and a row's context can be a 30k-token prompt,
so nothing here scans it. `PromptLookup` keeps, for each n, a dict from a hash of every n-gram
to the position just after its latest occurrence, updated as tokens arrive: a proposal costs
O(n_max + k) (hash the suffix, check the match, slice the continuation), a new token O(n_max).
A prompt is indexed in bulk with numpy (one vectorised rolling hash per n). Hash collisions are
harmless: a hit is checked against the tokens before it is used.

Sources see only committed tokens (the prompt, then accepted output), so none needs rolling
back. The prompt cache's continuations (continuations.py: what finished requests' tokens went
on with, SuffixDecoding-style) implement the same `DraftSource` protocol and join a row's
`Drafter` beside it, as a checkpoint's MTP heads do (mtp.py) and a draft model will.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

_MASK = (1 << 64) - 1
_BASE = 0x100000001B3  # odd, so the rolling hash is a bijection of each token per position
_BULK = 64  # appends at least this long are indexed with numpy
REACH = 64  # how far back a match is extended to measure it (tokens past the n-gram)
LONG = 8  # a draft's evidence is its match's length up to this: longer ones count alike


@dataclass(frozen=True)
class Draft:
    """Tokens proposed to follow a row's committed tokens, and what vouches for them."""

    tokens: tuple[int, ...]
    source: str
    evidence: int = 0  # the match's length, at most `LONG` (longer: likelier to be accepted)


class DraftSource(Protocol):
    """One place drafts come from, for one row (or shared, if it keeps its own per-row state)."""

    name: str

    def extend(self, tokens: Sequence[int]) -> None:
        """`tokens` were committed to the row (its prompt, then each accepted run)."""
        ...

    def propose(self, limit: int) -> Draft | None:
        """At most `limit` tokens to follow the row's committed tokens (None: no guess)."""
        ...


class PromptLookup:
    """Prompt lookup over one row's own tokens (prompt and output), indexed incrementally."""

    name = "prompt_lookup"

    def __init__(self, n_max: int = 4, n_min: int = 1, tokens: Iterable[int] = ()) -> None:
        if not 1 <= n_min <= n_max:
            raise ValueError(f"need 1 <= n_min <= n_max, got n_min={n_min}, n_max={n_max}")
        self.n_max, self.n_min = n_max, n_min
        self.tokens: list[int] = []
        # n -> {hash of an n-gram: the position after its latest occurrence}
        self._after: dict[int, dict[int, int]] = {n: {} for n in range(n_min, n_max + 1)}
        self.extend(list(tokens))

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        first = len(self.tokens)
        self.tokens.extend(int(t) for t in tokens)
        if len(tokens) >= _BULK:
            self._index_bulk(first)
        else:
            for position in range(first, len(self.tokens)):
                self._index_one(position)

    def propose(self, limit: int) -> Draft | None:
        """The continuation of the longest earlier match of the last n tokens (n_max..n_min);
        one that runs into the end continues the repetition it is part of (a loop, a list).
        Its evidence is how far back the match goes (the n-gram and up to `LONG` - n before
        it), so that a copy under way outweighs another source's shorter match."""
        tokens, end = self.tokens, len(self.tokens)
        if limit <= 0 or end < self.n_min + 1:
            return None
        for n, key in reversed(self._suffix_hashes(end)):
            after = self._after[n].get(key)
            if after is None or tokens[after - n : after] != tokens[end - n : end]:
                continue  # unseen, or a hash collision
            draft = tokens[after : after + limit]
            period = end - after  # a match ending at the end: the text repeats with this period
            while len(draft) < limit:
                draft.append(draft[len(draft) - period])
            span = n + matched(tokens, after - n, tokens, end - n, LONG - n)
            return Draft(tuple(draft), self.name, span)
        return None

    # ------------------------------------------------------------------------------------
    def _suffix_hashes(self, end: int) -> list[tuple[int, int]]:
        return suffix_hashes(self.tokens, end, self.n_min, self.n_max)

    def _index_one(self, position: int) -> None:
        """Token `position` arrived: it is the continuation of the n-grams ending before it."""
        for n, key in self._suffix_hashes(position):
            self._after[n][key] = position

    def _index_bulk(self, first: int) -> None:
        """Index the continuations at positions first..end-1 with vectorised rolling hashes."""
        end = len(self.tokens)
        base = max(0, first - self.n_max)
        arr = np.asarray(self.tokens[base:end], dtype=np.uint64)
        for n, h in ngram_hashes(arr, self.n_min, self.n_max):
            starts = np.arange(len(h)) + base  # absolute window starts
            after = starts + n
            keep = (after >= first) & (after < end)
            # later occurrences come later in the zip, so they win: the latest match
            self._after[n].update(zip(h[keep].tolist(), after[keep].tolist(), strict=True))


def matched(a: Sequence[int], a_end: int, b: Sequence[int], b_end: int, reach: int) -> int:
    """How many tokens before a[a_end] and b[b_end] agree, going back, at most `reach`."""
    reach = max(0, min(reach, a_end, b_end))
    for i in range(1, reach + 1):
        if a[a_end - i] != b[b_end - i]:
            return i - 1
    return reach


def suffix_hashes(tokens: Sequence[int], end: int, n_min: int, n_max: int) -> list[tuple[int, int]]:
    """(n, hash of tokens[end-n:end]) for n_min..n_max, shortest first (those that fit)."""
    out, h, power = [], 0, 1
    for n in range(1, min(n_max, end) + 1):
        h = (h + tokens[end - n] * power) & _MASK  # extend the window to the left
        power = (power * _BASE) & _MASK
        if n >= n_min:
            out.append((n, h))
    return out


def ngram_hashes(arr: np.ndarray, n_min: int, n_max: int) -> list[tuple[int, np.ndarray]]:
    """(n, h) for n_min..n_max where h[s] is the hash of arr[s:s+n] (as `suffix_hashes`'),
    for every window start s that fits; `arr` is uint64."""
    out, h = [], np.zeros(len(arr), dtype=np.uint64)
    with np.errstate(over="ignore"):
        for n in range(1, min(n_max, len(arr)) + 1):
            h = h[: len(arr) - n + 1] * np.uint64(_BASE) + arr[n - 1 :]
            if n >= n_min:
                out.append((n, h))
    return out


class Drafter:
    """A row's draft sources; a proposal is the one with the most evidence (first on ties)."""

    def __init__(self, sources: Sequence[DraftSource]) -> None:
        self.sources = list(sources)
        self.seen = 0  # tokens every source was given

    def __len__(self) -> int:
        return self.seen

    def extend(self, tokens: Sequence[int]) -> None:
        self.seen += len(tokens)
        for source in self.sources:
            source.extend(tokens)

    def would_propose(self) -> bool:
        """Whether some source has a draft now."""
        return self.peek() is not None

    def peek(self) -> tuple[str, int] | None:
        """The source and evidence the proposal would have now: a source that costs a forward
        (`ready`) says so without running it, the others propose one token."""
        best: tuple[str, int] | None = None
        for source in self.sources:
            ready = getattr(source, "ready", None)
            if ready is not None:
                found = (source.name, getattr(source, "evidence", 0)) if ready() else None
            else:
                draft = source.propose(1)
                found = (draft.source, draft.evidence) if draft and draft.tokens else None
            if found is not None and (best is None or found[1] > best[1]):
                best = found
        return best

    def propose(self, limit: int, worth: Callable[[str, int], float] | None = None) -> Draft | None:
        """A source whose every proposal carries the same `evidence` (a model's heads, which
        cost a forward) is not asked once an earlier one has proposed as much. `worth`: what
        drafts of a source with a match of that length were kept before, which decides
        between equal evidence (else the first source wins)."""
        best: Draft | None = None
        for source in self.sources:
            fixed = getattr(source, "evidence", None)
            if best is not None and fixed is not None and best.evidence >= fixed:
                continue
            draft = source.propose(limit)
            if not draft or not draft.tokens:
                continue
            if (
                best is None
                or draft.evidence > best.evidence
                or (
                    draft.evidence == best.evidence
                    and worth is not None
                    and worth(draft.source, draft.evidence) > worth(best.source, best.evidence)
                )
            ):
                best = draft
        return best
