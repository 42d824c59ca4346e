"""A draft model as a speculation source (engine/speculation/draft_model.py): batched drafts,
each row's draft KV kept in step with what the target kept, and the target's own tokens."""

from __future__ import annotations

from dataclasses import replace

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache

from mlx_kvserve.engine.batch import DecodeBatch
from mlx_kvserve.engine.speculation.draft_model import DraftModel
from mlx_kvserve.engine.speculation.drafts import Drafter, PromptLookup
from tests.unit.test_batching import PROMPTS, Driver, check_caches
from tests.unit.test_cache_models import tiny_llama
from tests.unit.test_engine_units import request, tiny_model, tokens_of
from tests.unit.test_speculation_step import LOOPY, MISLED, FlatPriors, PriorCost


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture
def alone(monkeypatch):
    """The draft model as the only source: the tiny model's answers loop, so prompt lookup
    would otherwise draft most of them."""
    monkeypatch.setattr(PromptLookup, "propose", lambda self, limit: None)


def other_model(seed: int = 1, vocab: int = 97):
    """Another random model of the same token ids (`vocab` > 97: padded embedding rows)."""
    mx.random.seed(seed)
    m = tiny_llama(False, vocab=vocab)
    mx.eval(m.parameters())
    return m


class Counted:
    """A model that records every pass: its batch size, and the rows in the draft batch then
    (0 while a joining row is prefilled on its own)."""

    def __init__(self, model) -> None:
        self.model, self.calls, self.drafts = model, [], None

    def __call__(self, inputs, cache=None):
        members = 0 if isinstance(cache[0], KVCache) else len(self.drafts.members)
        self.calls.append((inputs.shape[0], members))
        return self.model(inputs, cache=cache)

    def __getattr__(self, name):
        return getattr(self.model, name)


def run(model, draft, prompts, lengths, temperature=0.0, seeds=None, speculation="auto"):
    driver = Driver(model)
    drafts = None if draft is None else DraftModel(draft, prefill_step=64, prior=CHEAP)
    if isinstance(draft, Counted):
        draft.drafts = drafts
    driver.batch = DecodeBatch(model, driver._end, speculation=speculation, draft_model=drafts)
    if driver.batch.speculator is not None:
        driver.batch.speculator.cost = PriorCost()
        driver.batch.speculator.priors = FlatPriors()
    reqs = []
    for i, (p, n) in enumerate(zip(prompts, lengths, strict=True)):
        req = request(p, max_tokens=n)
        seed = None if seeds is None else seeds[i]
        req.params = replace(req.params, temperature=temperature, seed=seed)
        reqs.append(req)
    for req in reqs:  # each joins a step after the one before
        driver.join(req)
        driver.step()
    driver.drain()
    return driver, reqs


def by_source(driver, source: str) -> tuple[int, int]:
    counts = [s.timings.by_source.get(source, [0, 0, 0]) for s in driver.ended]
    return sum(c[0] for c in counts), sum(c[1] for c in counts)


# A draft pass's cost over a target pass, as if the draft model were far smaller than its
# target (these tests' drafts are as large): the mechanics, not whether drafting pays.
CHEAP = 0.02
PROMPT_SET = [PROMPTS[1], PROMPTS[3], MISLED, PROMPTS[2]]
LENGTHS = [40, 31, 24, 37]


@pytest.mark.parametrize("rows", [1, 4], ids=["solo", "merged"])
def test_the_target_as_its_own_draft_keeps_nearly_every_draft_and_answers_the_same(
    model, rows, alone
):
    """The same weights draft what the target then samples: nearly every draft is kept, so the
    drafts are really used, and the draft KV rolled back and caught up as the target's was."""
    prompts, lengths = PROMPT_SET[:rows], LENGTHS[:rows]
    _, plain = run(model, None, prompts, lengths, speculation="off")
    draft = Counted(model)
    driver, spec = run(model, draft, prompts, lengths)
    for a, b in zip(plain, spec, strict=True):
        assert tokens_of(b.text) == tokens_of(a.text), b.request_id
    drafted, kept = by_source(driver, "draft_model")
    assert drafted > 20 and kept >= 0.9 * drafted, (drafted, kept)
    assert driver.batch.steps < sum(lengths) / 2
    check_caches(driver.ended)
    # batched: every pass but a joining row's prefill runs every row of the draft batch
    assert all(b == members for b, members in draft.calls if members), draft.calls
    assert max(b for b, _ in draft.calls) >= min(rows, 3)


@pytest.mark.parametrize("rows", [1, 4], ids=["solo", "merged"])
@pytest.mark.parametrize(("seed", "vocab"), [(3, 97), (1, 128)], ids=["same", "padded"])
def test_another_random_draft_model_is_rarely_right_and_changes_nothing(
    model, rows, seed, vocab, alone
):
    """A model of other weights (with padded embedding rows past the tokenizer's ids, too):
    most drafts are rejected, and the answers are the target's."""
    prompts, lengths = PROMPT_SET[:rows], LENGTHS[:rows]
    _, plain = run(model, None, prompts, lengths, speculation="off")
    driver, spec = run(model, other_model(seed, vocab), prompts, lengths)
    for a, b in zip(plain, spec, strict=True):
        assert tokens_of(b.text) == tokens_of(a.text), b.request_id
    drafted, kept = by_source(driver, "draft_model")
    assert drafted > 10 and kept < 0.6 * drafted, (drafted, kept)
    check_caches(driver.ended)


@pytest.mark.parametrize("draft", ["self", "other"])
def test_seeded_sampled_rows_reproduce_with_a_draft_model(model, draft):
    prompts, lengths, seeds = [MISLED, LOOPY, PROMPTS[3]], [30, 24, 20], [7, 8, 9]
    _, plain = run(model, None, prompts, lengths, 0.7, seeds, speculation="off")
    source = model if draft == "self" else other_model()
    driver, spec = run(model, source, prompts, lengths, 0.7, seeds)
    for a, b in zip(plain, spec, strict=True):
        assert tokens_of(b.text) == tokens_of(a.text), b.request_id
    assert by_source(driver, "draft_model")[0] > 0
    check_caches(driver.ended)


def test_the_draft_kv_holds_each_members_tokens(model, alone):
    """After every step each member's row of the draft KV holds exactly its `held` tokens,
    and those are the start of its committed tokens plus at most its newest draft."""
    drafts = DraftModel(model, prefill_step=8, prior=CHEAP)
    driver = Driver(model)
    driver.batch = DecodeBatch(model, driver._end, speculation="auto", draft_model=drafts)
    driver.batch.speculator.cost = PriorCost()
    driver.batch.speculator.priors = FlatPriors()
    for p, n in zip(PROMPT_SET, LENGTHS, strict=True):
        driver.join(request(p, max_tokens=n))
        driver.step()
    seen = 0
    while driver.batch:
        driver.step()
        for i, m in enumerate(drafts.members):
            assert drafts.cache is not None
            assert int(drafts.cache[0].offset[i].item()) == len(m.held)
            assert m.held[: m.settled] == m.tokens[: m.settled]
            seen += 1
    assert seen > 0 and not drafts.members  # rows that left are forgotten


def test_a_draft_model_with_windows_is_refused():
    with pytest.raises(ValueError, match="plain attention"):
        DraftModel(tiny_llama(True))


def test_a_failed_draft_pass_starts_the_draft_batch_afresh(model, alone):
    """A pass that raises leaves the draft KV unknown: the draft model drops every row, which
    rejoin (prefilled again) on their next draft, and answers stay the target's."""
    _, plain = run(model, None, PROMPT_SET[:2], LENGTHS[:2], speculation="off")

    class Flaky(Counted):
        def __call__(self, inputs, cache=None):
            if len(self.calls) == 11:
                self.calls.append((0, 0))
                raise RuntimeError("a failed draft pass")
            return super().__call__(inputs, cache=cache)

    draft = Flaky(model)
    drafts = DraftModel(draft, prefill_step=8, prior=CHEAP)
    draft.drafts = drafts
    driver = Driver(model)
    driver.batch = DecodeBatch(model, driver._end, speculation="auto", draft_model=drafts)
    driver.batch.speculator.cost = PriorCost()
    driver.batch.speculator.priors = FlatPriors()
    reqs = [request(p, max_tokens=n) for p, n in zip(PROMPT_SET[:2], LENGTHS[:2], strict=True)]
    with pytest.raises(RuntimeError, match="a failed draft pass"):
        for req in reqs:
            driver.join(req)
            driver.step()
        driver.drain()
    assert drafts.members == [] and drafts.cache is None
    for seq in driver.batch.fail_all():  # as the engine does after a failed step
        driver.ended.append(seq)
    again = [request(p, max_tokens=n) for p, n in zip(PROMPT_SET[:2], LENGTHS[:2], strict=True)]
    for req in again:
        driver.join(req)
    driver.drain()
    for a, b in zip(plain, again, strict=True):
        assert tokens_of(b.text) == tokens_of(a.text)
    assert by_source(driver, "draft_model")[1] > 0


@pytest.mark.parametrize("rows", [1, 3], ids=["solo", "merged"])
def test_a_row_cancelled_mid_verify_leaves_and_the_others_answer_the_same(model, rows, alone):
    """A client that leaves while a verify pass's kept drafts are emitted: its row ends
    "cancelled" within one pass, the draft batch forgets it, the others answer as without
    speculation, and every row's caches hold exactly its tokens."""
    prompts, lengths = PROMPT_SET[:rows], [40, 34, 24][:rows]
    _, plain = run(model, None, prompts, lengths, speculation="off")
    drafts = DraftModel(model, prefill_step=8, prior=CHEAP)
    driver = Driver(model)
    driver.batch = DecodeBatch(model, driver._end, speculation="auto", draft_model=drafts)
    driver.batch.speculator.cost = PriorCost()
    driver.batch.speculator.priors = FlatPriors()
    reqs = [request(p, max_tokens=n) for p, n in zip(prompts, lengths, strict=True)]
    leaving = reqs[0]
    emit = type(leaving).emit

    def leave_midway(self, event) -> None:
        emit(self, event)
        if len(tokens_of(self.text)) >= 12 and driver.batch.speculator.accepted:
            self.cancel()

    leaving.emit = leave_midway.__get__(leaving)  # type: ignore[method-assign]
    for req in reqs:
        driver.join(req)
        driver.step()
    driver.drain()
    (gone,) = [s for s in driver.ended if s.req is leaving]
    assert gone.timings.finish_reason == "cancelled"
    assert 12 <= gone.timings.completion_tokens <= 12 + driver.batch.speculator.max_depth + 1
    assert tokens_of(leaving.text) == tokens_of(plain[0].text)[: len(tokens_of(leaving.text))]
    for a, b in zip(plain[1:], reqs[1:], strict=True):
        assert tokens_of(b.text) == tokens_of(a.text)
    assert by_source(driver, "draft_model")[1] > 0
    assert not drafts.members
    check_caches(driver.ended)


def test_a_long_prompt_joins_the_draft_batch_a_chunk_per_step(model, alone):
    """A joining row's prompt is prefilled one chunk per step, so the rows already drafting
    keep drafting meanwhile; it drafts once it has joined."""
    draft = Counted(model)
    drafts = DraftModel(draft, prefill_step=4, prior=CHEAP)
    draft.drafts = drafts
    driver = Driver(model)
    driver.batch = DecodeBatch(model, driver._end, speculation="auto", draft_model=drafts)
    driver.batch.speculator.cost = PriorCost()
    driver.batch.speculator.priors = FlatPriors()
    driver.join(request(PROMPTS[1], max_tokens=300))
    for _ in range(6):
        driver.step()
    driver.join(request(MISLED, max_tokens=30))  # 31 tokens: 8 chunks of 4
    chunks, joined = [], None
    for step in range(30):
        before = len(draft.calls)
        driver.step()
        new = draft.calls[before:]
        chunks.append(sum(1 for _, members in new if members == 0))
        assert any(members for _, members in new) or not drafts.members  # others still draft
        if joined is None and len(drafts.members) == 2 and not drafts.joining:
            joined = step
    assert max(chunks) == 1 and joined is not None and joined >= 7
    driver.drain()
    drafted = [s.timings.by_source.get("draft_model", [0])[0] for s in driver.ended]
    assert all(drafted)


def test_a_draft_model_as_costly_as_its_target_drafts_only_probes(model, alone):
    """Each draft costs a pass of the draft model: one as large as its target never pays, so
    the controller drafts nothing but its probes, however often the drafts are right."""
    driver = Driver(model)
    drafts = DraftModel(model, prefill_step=64, prior=1.0)
    driver.batch = DecodeBatch(model, driver._end, speculation="auto", draft_model=drafts)
    driver.batch.speculator.cost = PriorCost()
    driver.batch.speculator.priors = FlatPriors()
    driver.join(request(PROMPTS[1], max_tokens=60))
    driver.drain()
    drafted, kept = by_source(driver, "draft_model")
    assert drafted <= 8 and kept == drafted  # probes of depth 2, all kept, never enough


def test_a_long_lookup_match_is_drafted_without_the_draft_model(model):
    """A row whose own tokens have a 4-token match takes that copy (free) and the draft model
    runs no pass for it."""
    draft = Counted(model)
    driver, spec = run(model, draft, [LOOPY], [30])
    drafted = by_source(driver, "prompt_lookup")[0]
    assert drafted > 20 and by_source(driver, "draft_model")[0] <= 4
    assert len(draft.calls) <= 12  # the first steps', before the match; none after


def test_a_draft_model_whose_drafts_are_rejected_yields_to_any_lookup_match(model):
    """While its first drafts are kept half the time or more, the model's guess beats a
    2-token match of the row's own tokens; once they are mostly rejected, every match goes
    first (and only rows without one ask the model)."""
    drafts = DraftModel(model, prior=CHEAP)
    row = drafts.row()
    drafter = Drafter([PromptLookup(), row])
    drafter.extend([5, 6, 7, 8, 9, 5, 6])  # "5 6" occurred before: a 2-token match
    assert drafter.propose(4).evidence == 2
    assert drafts.wanted(drafter)
    for _ in range(6):
        drafts.record(4, 0)
    assert not drafts.wanted(drafter)
    for _ in range(30):
        drafts.record(4, 3)
    assert drafts.wanted(drafter)
    drafter.extend([1, 2])  # no match of "6 1 2" or "1 2"
    assert drafter.propose(4) is None and drafts.wanted(drafter)
