"""The prompt cache's continuations as a draft source: what earlier requests went on with.

Agents re-emit what other requests saw or wrote (a file written again with a change, the paths
and JSON arguments of a replayed tool loop, tool output), which the row's own prompt may not
hold. In the spirit of SuffixDecoding (Oliaro et al., 2024, arXiv:2411.04975), `Continuations`
keeps the recent token streams of finished requests (their prompts and outputs) and a row asks
it what followed an earlier occurrence of its last n tokens (n from `n_max` down to `n_min`,
the longest first), as prompt lookup asks the row's own tokens (drafts.py).

Which occurrence: SuffixDecoding scores a candidate by how much of the context it matches
(and how often it was followed so). Here the last `CHOICES` occurrences of the n-gram are
compared with the row's context going back (at most `REACH` tokens past the n-gram), and the one
that matches furthest back wins (the latest on ties): a replayed turn's tool name is the one its
earlier answer to this very prompt gave, not the latest call's. That length, up to `LONG`, is
the draft's evidence, which the `Drafter` and the shared priors (depth.py) weigh.

The structure is prompt lookup's, over many documents, with zlib's hash chains: for each n a
dict from the hash of every n-gram to the absolute position after its latest occurrence, and an
array that gives, for each position, the one after the previous occurrence of the same hash. A
query costs O(n_max + CHOICES x REACH + k) and adding a document O(its length) (numpy's
rolling hashes and a sort). Documents are joined with a separator no match crosses, and a
continuation stops at its document's end. Bounded by `max_tokens`: the oldest documents go
first (with their part of the chains); dict entries are checked away on use (a position
before the kept tokens is no hit, and ends a chain) and rebuilt away when they outnumber the
live ones. Memory: the tokens (a Python list, some 36 bytes each), the dicts (some 100 bytes
per token and n, twice that just before a rebuild) and the chains (8 bytes per token and n):
at the default bound of 2^18 tokens and n = 3, 4, some 70 MB per namespace, 120 MB at the
peak (measured with every n-gram distinct).

One index per model (the engine's) and per prompt-cache namespace (engine/namespaces.py): a
request drafts only from its own key's tokens, as it only reuses its own key's KV.
"""

from __future__ import annotations

from array import array
from collections import deque
from collections.abc import Sequence

import numpy as np

from mlx_kvserve.engine.speculation.drafts import (
    LONG,
    REACH,
    Draft,
    matched,
    ngram_hashes,
    suffix_hashes,
)
from mlx_kvserve.images.spans import IMAGE_KEY_BASE

SOURCE = "prompt_cache"
_SEPARATOR = 1 << 40  # no token id: ends a document's continuations, matches no row's n-gram
DEFAULT_MAX_TOKENS = 1 << 18
CHOICES = 8  # the occurrences of an n-gram a query compares (the latest ones)


class TokenIndex:
    """Recent documents' tokens, and for each n-gram the positions after its occurrences."""

    def __init__(
        self,
        max_tokens: int = DEFAULT_MAX_TOKENS,
        n_max: int = 4,
        n_min: int = 2,
        choices: int = CHOICES,
        reach: int = REACH,
    ):
        if not 1 <= n_min <= n_max:
            raise ValueError(f"need 1 <= n_min <= n_max, got n_min={n_min}, n_max={n_max}")
        self.max_tokens, self.n_max, self.n_min = max(1, max_tokens), n_max, n_min
        self.choices, self.reach = max(1, choices), max(0, reach)
        self.base = 0  # the absolute position of tokens[0]
        self.tokens: list[int] = []  # documents, each followed by the separator
        self._docs: deque[tuple[int, int]] = deque()  # (absolute start, length) per document
        # n -> {hash of an n-gram: the position after its latest occurrence}
        self._after: dict[int, dict[int, int]] = {n: {} for n in range(n_min, n_max + 1)}
        # n -> for each kept position p (from base): the position after the previous
        # occurrence of the hash of the n-gram before p, or -1 (a hash chain)
        self._before: dict[int, array] = {n: array("q") for n in self._after}

    def __len__(self) -> int:
        """Tokens kept (separators included)."""
        return len(self.tokens)

    def add(self, tokens: Sequence[int]) -> None:
        """A finished request's tokens (or a stored entry's): at most the last `max_tokens`.
        An image's key ids are no tokens a model could be fed: the text between images goes
        in as documents of its own, so no n-gram matches across an image and no draft holds
        one."""
        doc = [int(t) for t in tokens[-self.max_tokens :]]
        images = np.flatnonzero(np.asarray(doc, dtype=np.int64) >= IMAGE_KEY_BASE).tolist()
        if images:
            for lo, hi in zip([-1, *images], [*images, len(doc)], strict=True):
                self._add(doc[lo + 1 : hi])
            return
        self._add(doc)

    def _add(self, doc: list[int]) -> None:
        if len(doc) <= self.n_min:
            return
        start = self.base + len(self.tokens)
        self.tokens.extend(doc)
        self.tokens.append(_SEPARATOR)
        self._docs.append((start, len(doc)))
        self._index(start, doc)
        while len(self.tokens) > self.max_tokens + len(self._docs) and len(self._docs) > 1:
            self._drop_oldest()
        entries = sum(len(d) for d in self._after.values())
        if entries > 2 * len(self._after) * len(self.tokens) + 1024:
            self._rebuild()  # dropped documents' entries outnumber the live ones

    def propose(self, suffix: Sequence[int], limit: int) -> Draft | None:
        """What followed the occurrence of the longest of `suffix`'s last n tokens (n_max..n_min)
        that occurred, among its `choices` latest, whose tokens before it match `suffix`
        furthest back (at most `reach` past the n-gram; the latest on ties): at most `limit`
        tokens, up to its document's end. The evidence: n plus that match, at most `LONG`."""
        if limit <= 0 or len(suffix) < self.n_min:
            return None
        tail = list(suffix[-(self.n_max + self.reach) :])
        end, tokens = len(tail), self.tokens
        for n, key in reversed(suffix_hashes(tail, end, self.n_min, self.n_max)):
            best, longest = -1, -1
            after, chain = self._after[n].get(key, -1), self._before[n]
            for _ in range(self.choices):
                if after - n < self.base:
                    break  # unseen, or in a dropped document (and so is the rest of the chain)
                at = after - self.base
                if tokens[at - n : at] == tail[-n:]:  # else a hash collision
                    more = matched(tokens, at - n, tail, end - n, self.reach)
                    if more > longest:
                        best, longest = at, more
                after = chain[at]
            if best < 0:
                continue
            draft = []
            for token in tokens[best : best + limit]:
                if token == _SEPARATOR:
                    break
                draft.append(token)
            if draft:
                return Draft(tuple(draft), SOURCE, min(n + longest, max(LONG, n)))
        return None

    # ------------------------------------------------------------------------------------
    def _index(self, start: int, doc: list[int]) -> None:
        """Every n-gram of `doc` that something in it follows: the dicts point at the latest
        occurrences, and each occurrence's chain link at the one before (in `doc` or before)."""
        hashes = dict(ngram_hashes(np.asarray(doc, dtype=np.uint64), self.n_min, self.n_max))
        for n in self._after:
            after = np.arange(n, len(doc))  # relative to the document: those followed in it
            keys = hashes[n][: len(after)] if n in hashes else after.astype(np.uint64)
            absolute = after + start
            links = np.full(len(doc) + 1, -1, dtype=np.int64)  # the document and its separator
            if len(keys):
                order = np.argsort(keys, kind="stable")  # equal hashes: in order of position
                same = keys[order[1:]] == keys[order[:-1]]
                links[after[order[1:][same]]] = absolute[order[:-1][same]]
                head = self._after[n]
                firsts = order[np.concatenate(([True], ~same))]  # each hash's first occurrence
                for i, key in zip(firsts.tolist(), keys[firsts].tolist(), strict=True):
                    links[after[i]] = head.get(key, -1)
                head.update(zip(keys.tolist(), absolute.tolist(), strict=True))
            self._before[n].frombytes(links.tobytes())

    def _drop_oldest(self) -> None:
        start, length = self._docs.popleft()
        assert start == self.base
        del self.tokens[: length + 1]
        for chain in self._before.values():
            del chain[: length + 1]
        self.base += length + 1

    def _rebuild(self) -> None:
        self._after = {n: {} for n in self._after}
        self._before = {n: array("q") for n in self._after}
        for start, length in self._docs:
            at = start - self.base
            self._index(start, self.tokens[at : at + length])


class Continuations:
    """A model's `TokenIndex` per prompt-cache namespace (None: the shared cache)."""

    def __init__(self, max_tokens: int = DEFAULT_MAX_TOKENS, n_max: int = 4, n_min: int = 2):
        self.max_tokens, self.n_max, self.n_min = max_tokens, n_max, n_min
        self._indexes: dict[str | None, TokenIndex] = {}

    def index(self, namespace: str | None) -> TokenIndex:
        found = self._indexes.get(namespace)
        if found is None:
            found = self._indexes[namespace] = TokenIndex(self.max_tokens, self.n_max, self.n_min)
        return found

    def remember(self, namespace: str | None, tokens: Sequence[int], cached: int = 0) -> None:
        """A finished request's tokens (prompt and output). Its prompt's first `cached` tokens
        came from the prompt cache, so from earlier requests, whose tokens are here already:
        only the rest (and the n_max - 1 before it, so the n-grams at the seam count) is added.
        """
        self.index(namespace).add(tokens[max(0, cached - self.n_max + 1) :])


class CacheLookup:
    """A row's view of its namespace's `TokenIndex`: a `DraftSource` that keeps only the row's
    last n_max + reach tokens (the index holds no tokens of the running request)."""

    name = SOURCE

    def __init__(self, index: TokenIndex) -> None:
        self.index = index
        self.seen = 0
        self._tail: deque[int] = deque(maxlen=index.n_max + index.reach)

    def __len__(self) -> int:
        return self.seen

    def extend(self, tokens: Sequence[int]) -> None:
        self.seen += len(tokens)
        self._tail.extend(int(t) for t in tokens[-(self.index.n_max + self.index.reach) :])

    def propose(self, limit: int) -> Draft | None:
        return self.index.propose(list(self._tail), limit)
