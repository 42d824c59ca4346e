"""The prompt cache's continuations as a draft source (engine/speculation/continuations.py):
what finished requests' tokens went on with, the same as a scan of the documents kept, one
namespace never drafting from another's tokens, bounded, and cheap per query."""

from __future__ import annotations

import random

import pytest

from mlx_kvserve.engine.speculation import continuations, drafts
from mlx_kvserve.engine.speculation.continuations import (
    CHOICES,
    SOURCE,
    CacheLookup,
    Continuations,
    TokenIndex,
)
from mlx_kvserve.engine.speculation.drafts import LONG, REACH, Draft, Drafter, PromptLookup


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


def reference(
    docs, suffix, n_max: int, n_min: int, limit: int, choices: int = CHOICES, reach: int = REACH
) -> Draft | None:
    """The specification, by scanning: for n from n_max down, the `choices` latest occurrences
    (newest document first, then the latest place in it) of the suffix's last n tokens that
    something follows; of those, the one whose tokens before it match the suffix's furthest
    back (at most `reach` more, not past its document's start; the latest on ties), what
    followed it up to its document's end, and n plus that match (at most LONG) as evidence."""
    for n in range(min(n_max, len(suffix)), n_min - 1, -1):
        want = list(suffix[-n:])
        found = [
            (doc, start)
            for doc in reversed(docs)
            for start in range(len(doc) - n - 1, -1, -1)
            if doc[start : start + n] == want
        ]
        best = None
        for doc, start in found[:choices]:
            back = 0
            while (
                back < min(reach, start, len(suffix) - n)
                and doc[start - 1 - back] == suffix[-n - 1 - back]
            ):
                back += 1
            if best is None or back > best[2]:
                best = (doc, start, back)
        if best is not None:
            doc, start, back = best
            return Draft(tuple(doc[start + n : start + n + limit]), SOURCE, min(n + back, LONG))
    return None


@pytest.mark.parametrize(
    ("max_tokens", "choices", "reach"),
    [(10_000, CHOICES, REACH), (300, 2, 3), (40, CHOICES, REACH)],
    ids=["all", "some", "few"],
)
def test_matches_the_scanning_reference_on_random_streams(
    max_tokens: int, choices: int, reach: int
) -> None:
    rng = random.Random(11)
    index = TokenIndex(max_tokens=max_tokens, n_max=4, n_min=2, choices=choices, reach=reach)
    docs: list[list[int]] = []
    longer = 0
    for _ in range(60):
        doc = [rng.randrange(9) for _ in range(rng.randrange(1, 80))]  # many matches
        if docs and rng.random() < 0.5:  # a replay of an earlier document's part, changed
            old = rng.choice(docs)
            at = rng.randrange(len(old))
            doc = old[at : at + rng.randrange(1, 40)] + doc[:10]
        docs.append(doc)
        index.add(doc)
        live = kept(docs, max_tokens, 2)
        for _ in range(10):
            source = rng.choice(docs)  # old and dropped documents' n-grams too
            at = rng.randrange(len(source) + 1)
            suffix = (source[:at] + [rng.randrange(9)])[-rng.randrange(1, 30) :]
            limit = rng.randrange(0, 9)
            want = reference(live, suffix, 4, 2, limit, choices, reach)
            got = index.propose(suffix, limit)
            if not want or not limit:
                assert got is None, (suffix, limit)
            else:
                assert got == want, (suffix, limit)
                longer += want.evidence > 4
    assert longer >= 3  # matches that went back past the n-gram were compared too


def test_a_continuation_stops_at_its_documents_end() -> None:
    index = TokenIndex(n_max=3, n_min=2)
    index.add([1, 2, 3, 4, 5])
    index.add([7, 8, 9])
    assert index.propose([1, 2, 3], 8) == Draft((4, 5), SOURCE, 3)
    assert index.propose([9, 3, 4], 8) == Draft((5,), SOURCE, 2)
    assert index.propose([8, 9], 8) is None  # the end of a document: nothing followed
    assert index.propose([5, 7], 8) is None  # no match across documents


def test_the_occurrence_matching_furthest_back_wins_ties_to_the_latest() -> None:
    """A replayed turn: the latest call's name follows the same few tokens, but the earlier
    answer to this very prompt matches the row's context further back, and is drafted."""
    prompt, start = [31, 32, 33, 34, 35], [80, 81, 82, 83]  # a user turn; "<tool_call>{name:"
    index = TokenIndex(n_max=4, n_min=3)
    index.add(prompt + start + [90, 91])  # the first pass: read_file
    index.add([40, 41, 42] + start + [95, 96])  # a later turn's call: edit_file
    row = CacheLookup(index)
    row.extend(prompt + start)
    assert row.propose(2) == Draft((90, 91), SOURCE, LONG)  # 9 tokens match: LONG counts
    row = CacheLookup(index)
    row.extend([7, 8] + start)
    assert row.propose(2) == Draft((95, 96), SOURCE, 4)  # no more matched: the latest
    index.add([99, 35] + start + [97])
    row = CacheLookup(index)
    row.extend(prompt + start)
    assert row.propose(2) == Draft((90, 91), SOURCE, LONG)
    row = CacheLookup(index)
    row.extend([1, 35] + start)  # 5 tokens match in the first pass's and in the newest
    assert row.propose(2) == Draft((97,), SOURCE, 5)  # ties: the latest


def test_the_choice_is_bounded_in_occurrences_and_reach() -> None:
    start = [80, 81, 82, 83]
    index = TokenIndex(n_max=4, n_min=3, choices=3, reach=2)
    index.add([1, 2, 3] + start + [90])  # the best match, 3 back
    index.add([9, 2, 3] + start + [91])  # 2 back: as good within the reach
    assert index.propose([1, 2, 3, *start], 1) == Draft((91,), SOURCE, 6)
    index.add([7] + start + [92])
    index.add([8] + start + [93])
    assert index.propose([1, 2, 3, *start], 1) == Draft((91,), SOURCE, 6)
    index.add([6] + start + [94])  # "9 2 3" is now 4th latest: past the 3 compared
    assert index.propose([1, 2, 3, *start], 1) == Draft((94,), SOURCE, 4)


def test_hash_collisions_are_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(drafts, "_BASE", 0)  # every n-gram ending in the same token collides
    index = TokenIndex(n_max=3, n_min=2)
    index.add([1, 2, 3, 4, 5, 7, 2, 6])
    assert index.propose([7, 2], 1) == Draft((6,), SOURCE, 2)
    # "7 2" took the slot: the chain goes on to the earlier "1 2" (never a wrong draft)
    assert index.propose([1, 2], 2) == Draft((3, 4), SOURCE, 2)
    index = TokenIndex(n_max=3, n_min=2, choices=2)
    index.add([1, 2, 3, 4, 5, 6, 2, 7, 2, 8])
    assert index.propose([1, 2], 2) is None  # past the 2 latest: none, not a colliding one


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
        assert all(len(chain) == len(index) for chain in index._before.values())
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
    """A proposal touches O(n_max + CHOICES x REACH + k) tokens, however many the index holds:
    it hashes the row's tail and extends at most CHOICES occurrences at most REACH back."""
    rng = random.Random(4)
    index = TokenIndex(n_max=4, n_min=2)
    for _ in range(20):
        index.add([rng.randrange(30_000) for _ in range(5_000)])
    touched = []
    real = drafts.suffix_hashes

    def counting(tokens, end, n_min, n_max):
        touched.append(len(tokens))
        return real(tokens, end, n_min, n_max)

    def extending(a, a_end, b, b_end, reach):
        touched.append(reach)
        return real_matched(a, a_end, b, b_end, reach)

    real_matched = continuations.matched
    monkeypatch.setattr("mlx_kvserve.engine.speculation.continuations.suffix_hashes", counting)
    monkeypatch.setattr(continuations, "matched", extending)
    doc = index.tokens[-5001:-1]
    assert index.propose(doc[100:104], 8) == Draft(tuple(doc[104:112]), SOURCE, 4)
    assert touched == [4, REACH]  # the hashes saw the suffix only; one occurrence extended
    touched.clear()
    for _ in range(3 * CHOICES):  # many occurrences of one 4-gram: CHOICES compared
        index.add([5, 6, 7, 8, rng.randrange(30_000)])
    assert index.propose(list(range(200)) + [5, 6, 7, 8], 1).evidence == 4
    assert touched == [4 + REACH] + [REACH] * CHOICES  # the row's tail: n_max + REACH tokens


def test_the_drafter_prefers_more_evidence_and_the_rows_own_tokens_on_ties() -> None:
    index = TokenIndex(n_max=4, n_min=2)
    index.add([1, 2, 3, 4, 50, 51, 52])
    drafter = Drafter([PromptLookup(), CacheLookup(index)])
    drafter.extend([9, 3, 4, 60, 61, 2, 3, 4])  # own: "3 4" -> 60 61; cache: "2 3 4" -> 50..
    assert drafter.propose(2) == Draft((50, 51), SOURCE, 3)
    drafter.extend([60, 2, 3, 4])  # own now has "2 3 4" too (-> 60 2): a tie, the row wins
    assert drafter.propose(2) == Draft((60, 2), "prompt_lookup", 3)
    assert len(drafter) == 12
