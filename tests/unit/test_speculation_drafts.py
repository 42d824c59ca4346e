"""Prompt lookup (engine/speculation/drafts.py): the longest match's continuation, kept
incrementally, the same whether tokens arrive in bulk or one by one, and cheap per step."""

from __future__ import annotations

import random

import pytest

from mlx_kvserve.engine.speculation import drafts
from mlx_kvserve.engine.speculation.drafts import LONG, Draft, Drafter, PromptLookup


def reference(tokens: list[int], n_max: int, n_min: int, limit: int) -> Draft | None:
    """The specification, by scanning: for n from n_max down, the latest earlier occurrence of
    the last n tokens, and what followed it (read on into the draft itself past the end); its
    evidence, how far back it matches the row's last tokens (at most `LONG`)."""
    end = len(tokens)
    for n in range(min(n_max, end - 1), n_min - 1, -1):
        suffix = tokens[end - n :]
        for start in range(end - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                full = list(tokens)
                for i in range(limit):
                    full.append(full[start + n + i])
                span = n
                while (
                    span < LONG
                    and start + n - span > 0
                    and (tokens[start + n - span - 1] == tokens[end - span - 1])
                ):
                    span += 1
                return Draft(tuple(full[end:]), "prompt_lookup", span)
    return None


def test_proposes_what_followed_the_longest_match() -> None:
    # "5 6 7" occurred once followed by 8 9; "6 7" occurred later followed by 1 2.
    lookup = PromptLookup(n_max=3, n_min=2, tokens=[5, 6, 7, 8, 9, 0, 6, 7, 1, 2, 3, 5, 6, 7])
    assert lookup.propose(4) == Draft((8, 9, 0, 6), "prompt_lookup", 3)
    lookup.extend([8, 9])  # now "7 8 9"... the latest "8 9" was followed by 0
    # ... and "5 6 7 8 9" went before both: the evidence is how far back the match goes
    assert lookup.propose(2) == Draft((0, 6), "prompt_lookup", 5)


def test_shorter_match_when_the_longest_is_unseen() -> None:
    lookup = PromptLookup(n_max=4, n_min=2, tokens=[1, 2, 3, 4, 9, 3, 4])
    assert lookup.propose(3) == Draft((9, 3, 4), "prompt_lookup", 2)


def test_a_row_drafts_after_a_one_token_match_by_default() -> None:
    """After a copy parts from its source (here 9 where the prompt had 3), the next match is
    one token long: the row's prompt lookup goes down to it, evidence 1."""
    lookup = PromptLookup(tokens=[1, 2, 3, 4, 5, 6, 1, 2, 9, 4])
    assert lookup.propose(2) == Draft((5, 6), "prompt_lookup", 1)


def test_no_draft_without_a_match_or_room() -> None:
    lookup = PromptLookup(n_max=4, n_min=2, tokens=[1, 2, 3, 4, 5])
    assert lookup.propose(4) is None
    lookup.extend([1, 2])
    assert lookup.propose(0) is None
    assert lookup.propose(3) == Draft((3, 4, 5), "prompt_lookup", 2)


def test_the_latest_occurrence_wins() -> None:
    lookup = PromptLookup(n_max=2, n_min=2, tokens=[1, 2, 7, 1, 2, 8, 1, 2])
    assert lookup.propose(1) == Draft((8,), "prompt_lookup", 2)


def test_a_continuation_that_runs_into_the_end_repeats() -> None:
    lookup = PromptLookup(n_max=3, n_min=2, tokens=[1, 4, 5, 6, 4, 5, 6])
    assert lookup.propose(8) == Draft((4, 5, 6, 4, 5, 6, 4, 5), "prompt_lookup", 3)
    lookup = PromptLookup(n_max=3, n_min=2, tokens=[9, 9, 9])
    assert lookup.propose(4) == Draft((9, 9, 9, 9), "prompt_lookup", 2)


@pytest.mark.parametrize("bulk_first", [True, False])
def test_matches_the_scanning_reference_on_random_streams(bulk_first: bool) -> None:
    rng = random.Random(7)
    tokens = [rng.randrange(12) for _ in range(100)]  # a small alphabet: many matches
    while len(tokens) < 600:  # and copies of earlier runs: matches longer than n_max
        at = rng.randrange(len(tokens) - 20)
        tokens += tokens[at : at + rng.randrange(3, 20)] + [rng.randrange(12)]
    tokens = tokens[:600]
    lookup = PromptLookup(n_max=5, n_min=2)
    if bulk_first:
        lookup.extend(tokens[:200])  # the prompt, indexed in bulk with numpy
        fed = 200
    else:
        fed = 0
    checked = longer = 0
    while fed < len(tokens):
        step = rng.choice([1, 1, 1, 3, 70])  # accepted runs, and one bulk append now and then
        lookup.extend(tokens[fed : fed + step])
        fed = min(fed + step, len(tokens))
        want = reference(tokens[:fed], 5, 2, 6)
        assert lookup.propose(6) == want, fed
        checked += want is not None
        longer += want is not None and want.evidence > 5
    assert checked > 15 and longer > 5, (checked, longer)


def test_hash_collisions_are_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    # with a degenerate hash every n-gram collides: only the token check keeps drafts right
    monkeypatch.setattr(drafts, "_BASE", 0)
    lookup = PromptLookup(n_max=3, n_min=2, tokens=[1, 2, 3, 9, 9, 4, 5, 3])
    assert lookup.propose(2) is None  # "5 3" and "4 5 3" never occurred before
    lookup.extend([4, 5])
    assert lookup.propose(2) == Draft((3, 4), "prompt_lookup", 2)


def test_drafting_does_not_scan_the_context(monkeypatch: pytest.MonkeyPatch) -> None:
    """A proposal and a new token touch O(n_max + k) tokens, whatever the context's length."""
    rng = random.Random(3)
    prompt = [rng.randrange(30_000) for _ in range(30_000)]
    lookup = PromptLookup(n_max=4, n_min=2, tokens=prompt)
    lookup.extend(prompt[1000:1003])  # the row's output starts re-emitting part of the prompt

    class Counting(list):
        reads = 0

        def __getitem__(self, index):  # type: ignore[no-untyped-def]
            got = super().__getitem__(index)
            Counting.reads += len(got) if isinstance(index, slice) else 1
            return got

    lookup.tokens = Counting(lookup.tokens)
    assert lookup.propose(8) == Draft(tuple(prompt[1003:1011]), "prompt_lookup", 3)
    lookup.extend([prompt[1003]])
    assert Counting.reads <= 4 * (4 + 8)


def test_drafter_takes_the_source_with_most_evidence() -> None:
    class Fixed:
        def __init__(self, name: str, draft: Draft | None) -> None:
            self.name, self.draft, self.seen = name, draft, []

        def extend(self, tokens):  # type: ignore[no-untyped-def]
            self.seen += list(tokens)

        def propose(self, limit: int) -> Draft | None:
            return self.draft

    weak, none = Fixed("heads", Draft((1, 2), "heads", 0)), Fixed("cache", None)
    lookup = PromptLookup(n_max=3, n_min=2, tokens=[7, 8, 9, 7, 8])
    drafter = Drafter([weak, none, lookup])
    assert drafter.propose(2) == Draft((9, 7), "prompt_lookup", 2)
    drafter.extend([1])
    assert weak.seen == [1] and none.seen == [1]
    assert drafter.propose(2) == Draft((1, 2), "heads", 0)  # lookup has nothing now


def test_equal_evidence_goes_to_the_source_whose_drafts_were_kept_before() -> None:
    """Two sources with a 4-token match: the row's own first, unless the engine's counts say
    the other's drafts of that match length were kept more often (SourcePriors.worth)."""
    from mlx_kvserve.engine.speculation.continuations import CacheLookup, TokenIndex
    from mlx_kvserve.engine.speculation.depth import SourcePriors

    index = TokenIndex(n_min=3)
    index.add([1, 2, 3, 4, 50, 51, 52])
    drafter = Drafter([PromptLookup(), CacheLookup(index)])
    drafter.extend([1, 2, 3, 4, 60, 61, 1, 2, 3, 4])
    assert drafter.propose(3).source == "prompt_lookup"  # ties: the row's own tokens
    priors = SourcePriors()
    assert drafter.propose(3, priors.worth).source == "prompt_lookup"  # nothing learnt yet
    for _ in range(10):
        priors.record(("prompt_lookup", 4), 3, 0)
        priors.record(("prompt_cache", 4), 3, 3)
    chosen = drafter.propose(3, priors.worth)
    assert (chosen.source, chosen.tokens) == ("prompt_cache", (50, 51, 52))
    priors.record(("prompt_cache", 3), 3, 0)  # another match length's counts: no say here
    assert drafter.propose(3, priors.worth).source == "prompt_cache"
