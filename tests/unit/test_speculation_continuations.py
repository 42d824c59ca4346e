"""The prompt cache's continuations as a draft source (engine/speculation/continuations.py):
what finished requests' tokens went on with, the same as a scan of the documents kept, one
namespace never drafting from another's tokens, bounded, and cheap per query."""

from __future__ import annotations

import random

import pytest

from mlx_kvserve.engine.speculation import drafts
from mlx_kvserve.engine.speculation.continuations import (
    SOURCE,
    CacheLookup,
    Continuations,
    TokenIndex,
)
from mlx_kvserve.engine.speculation.drafts import Draft, Drafter, PromptLookup


def kept(docs: list[list[int]], max_tokens: int, n_min: int) -> list[list[int]]:
    """The documents an index bounded by `max_tokens` keeps, by the rule stated."""
    out: list[list[int]] = []
    for doc in docs:
        doc = doc[-max_tokens:]
        if len(doc) <= n_min:
            continue
        out.append(doc)
        while sum(map(len, out)) > max_tokens and len(out) > 1:
            out.pop(0)
    return out


def reference(docs, suffix, n_max: int, n_min: int, limit: int) -> tuple[int, ...] | None:
    """The specification, by scanning: for n from n_max down, the latest occurrence (newest
    document first, then the latest place in it) of the suffix's last n tokens that something
    follows, and what followed it, up to its document's end."""
    for n in range(min(n_max, len(suffix)), n_min - 1, -1):
        want = list(suffix[-n:])
        for doc in reversed(docs):
            for start in range(len(doc) - n - 1, -1, -1):
                if doc[start : start + n] == want:
                    return tuple(doc[start + n : start + n + limit])
    return None


@pytest.mark.parametrize("max_tokens", [10_000, 300, 40], ids=["all", "some", "few"])
def test_matches_the_scanning_reference_on_random_streams(max_tokens: int) -> None:
    rng = random.Random(11)
    index = TokenIndex(max_tokens=max_tokens, n_max=4, n_min=2)
    docs: list[list[int]] = []
    for _ in range(60):
        doc = [rng.randrange(9) for _ in range(rng.randrange(1, 80))]  # many matches
        docs.append(doc)
        index.add(doc)
        live = kept(docs, max_tokens, 2)
        for _ in range(10):
            source = rng.choice(docs)  # old and dropped documents' n-grams too
            at = rng.randrange(len(source) + 1)
            suffix = (source[:at] + [rng.randrange(9)])[-rng.randrange(1, 6) :]
            limit = rng.randrange(0, 9)
            want = reference(live, suffix, 4, 2, limit)
            got = index.propose(suffix, limit)
            if not want or not limit:
                assert got is None, (suffix, limit)
            else:
                assert got is not None and got.tokens == want, (suffix, limit)
                assert got.source == SOURCE


def test_a_continuation_stops_at_its_documents_end() -> None:
    index = TokenIndex(n_max=3, n_min=2)
    index.add([1, 2, 3, 4, 5])
    index.add([7, 8, 9])
    assert index.propose([1, 2, 3], 8) == Draft((4, 5), SOURCE, 3)
    assert index.propose([9, 3, 4], 8) == Draft((5,), SOURCE, 2)
    assert index.propose([8, 9], 8) is None  # the end of a document: nothing followed
    assert index.propose([5, 7], 8) is None  # no match across documents


def test_hash_collisions_are_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(drafts, "_BASE", 0)  # every n-gram ending in the same token collides
    index = TokenIndex(n_max=3, n_min=2)
    index.add([1, 2, 3, 4, 5, 7, 2, 6])
    assert index.propose([7, 2], 1) == Draft((6,), SOURCE, 2)
    assert index.propose([1, 2], 2) is None  # "7 2" took its slot: no draft, not a wrong one


def test_one_namespace_never_drafts_from_anothers_tokens() -> None:
    continuations = Continuations()
    secret = [101, 102, 103, 104, 105, 106, 107, 108]
    continuations.remember("alice", secret)
    for namespace in ("bob", None):
        row = CacheLookup(continuations.index(namespace))
        row.extend(secret[:4])
        assert row.propose(4) is None
    row = CacheLookup(continuations.index("alice"))
    row.extend(secret[:4])
    assert row.propose(4) == Draft((105, 106, 107, 108), SOURCE, 4)


def test_the_index_is_bounded_and_forgets_the_oldest_first() -> None:
    rng = random.Random(2)
    index = TokenIndex(max_tokens=1000, n_max=4, n_min=2)
    first = [rng.randrange(50_000) for _ in range(200)]
    index.add(first)
    assert index.propose(first[:4], 3) == Draft(tuple(first[4:7]), SOURCE, 4)
    for _ in range(200):
        index.add([rng.randrange(50_000) for _ in range(rng.randrange(50, 300))])
        assert len(index) <= 1000 + len(index._docs)  # the tokens, and one separator each
        entries = sum(len(d) for d in index._after.values())
        assert entries <= 2 * 3 * len(index) + 1024  # dropped documents' entries go too
    assert index.propose(first[:4], 3) is None
    huge = list(range(5000))
    index.add(huge)  # a document beyond the bound keeps its last max_tokens
    assert len(index) == 1001
    assert index.propose([4000, 4001], 2) == Draft((4002, 4003), SOURCE, 2)
    assert index.propose([1, 2], 2) is None


def test_a_requests_cached_prefix_is_not_added_again() -> None:
    continuations = Continuations(n_max=4)
    turn = list(range(100, 140))
    continuations.remember(None, turn)
    index = continuations.index(None)
    size = len(index)
    continuations.remember(None, turn + [7, 8, 9], cached=len(turn))
    assert len(index) - size == 3 + 3 + 1  # the new tokens, the 3 before them, a separator
    row = CacheLookup(index)
    row.extend(turn[-2:])
    assert row.propose(3) == Draft((7, 8, 9), SOURCE, 2)


def test_a_query_does_not_scan_the_index(monkeypatch: pytest.MonkeyPatch) -> None:
    """A proposal touches O(n_max + k) tokens, however many the index holds."""
    rng = random.Random(4)
    index = TokenIndex(n_max=4, n_min=2)
    for _ in range(20):
        index.add([rng.randrange(30_000) for _ in range(5_000)])
    touched = []
    real = drafts.suffix_hashes

    def counting(tokens, end, n_min, n_max):
        touched.append(len(tokens))
        return real(tokens, end, n_min, n_max)

    monkeypatch.setattr("mlx_kvserve.engine.speculation.continuations.suffix_hashes", counting)
    doc = index.tokens[-5001:-1]
    assert index.propose(doc[100:104], 8) == Draft(tuple(doc[104:112]), SOURCE, 4)
    assert touched == [4]  # the hashes saw the suffix only


def test_the_drafter_prefers_more_evidence_and_the_rows_own_tokens_on_ties() -> None:
    index = TokenIndex(n_max=4, n_min=2)
    index.add([1, 2, 3, 4, 50, 51, 52])
    drafter = Drafter([PromptLookup(), CacheLookup(index)])
    drafter.extend([9, 3, 4, 60, 61, 2, 3, 4])  # own: "3 4" -> 60 61; cache: "2 3 4" -> 50..
    assert drafter.propose(2) == Draft((50, 51), SOURCE, 3)
    drafter.extend([60, 2, 3, 4])  # own now has "2 3 4" too (-> 60 2): a tie, the row wins
    assert drafter.propose(2) == Draft((60, 2), "prompt_lookup", 3)
    assert len(drafter) == 12
