"""The pure admission arithmetic (engine/ledger.py), with numbers only: no model, no MLX."""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st

from mlx_kvserve.engine.ledger import (
    RESERVE_TOKENS,
    STATE,
    TOKENS,
    WINDOW,
    KVCost,
    Ledger,
    default_budget,
)


@dataclass(frozen=True)
class Layer:
    kind: str
    bytes_per_token: int
    fixed_bytes: int = 0
    window: int | None = None


LLAMA = KVCost.of([Layer(TOKENS, 100)] * 4)
GEMMA = KVCost.of([Layer(WINDOW, 100, 100 * 64, 64)] * 5 + [Layer(TOKENS, 100)])
HYBRID = KVCost.of([Layer(STATE, 0, 5000)] * 3 + [Layer(TOKENS, 100)])


def test_bytes_grow_per_token_windows_stop_states_stay():
    assert LLAMA.bytes_for(10) == 4000 and LLAMA.bytes_for(1000) == 400_000
    # the window layers stop at 64 positions; the global layer keeps growing
    assert GEMMA.bytes_for(10) == 6 * 100 * 10
    assert GEMMA.bytes_for(1000) == 5 * 100 * 64 + 100 * 1000
    assert HYBRID.bytes_for(0) == 15000 and HYBRID.bytes_for(10) == 16000


def test_tokens_within_is_the_longest_that_fits():
    for cost in (LLAMA, GEMMA, HYBRID):
        for budget in (0, 15000, 16000, 10**6, 12_345_678):
            n = cost.tokens_within(budget)
            if n:
                assert cost.bytes_for(n) <= budget < cost.bytes_for(n + 1)
            else:
                assert cost.bytes_for(1) > budget
    only_windows = KVCost.of([Layer(WINDOW, 10, 640, 64)])
    assert only_windows.tokens_within(640) > 10**9  # a full window never grows


def test_a_request_is_charged_its_prompt_and_a_reserve_not_its_max_tokens():
    ledger = Ledger(LLAMA, budget=400 * (20_000 + 2 * RESERVE_TOKENS))
    # Claude Code's max_tokens (32000) beside a 20k prompt: prompt + 256 reserved
    assert ledger.shortfall(20_000, 32_000) == 0
    hold = ledger.admit("cc", 20_000, 32_000)
    assert hold.reserved == 20_000 + RESERVE_TOKENS
    assert ledger.total() == 400 * hold.reserved
    # a short max_tokens reserves only what it may generate
    assert ledger.admit("short", 10, 3).reserved == 13


def test_growth_is_reserved_a_step_at_a_time_and_refused_beyond_the_budget():
    ledger = Ledger(LLAMA, budget=400 * 1000, reserve=100)
    ledger.admit("a", 500, 10_000)
    assert ledger.holds["a"].reserved == 600
    assert ledger.grow("a", 600) and ledger.holds["a"].reserved == 600
    assert ledger.grow("a", 601) and ledger.holds["a"].reserved == 700
    assert ledger.grow("a", 1000)
    assert not ledger.grow("a", 1001)  # the budget holds 1000 tokens
    assert ledger.holds["a"].reserved == 1000 and ledger.total() <= ledger.budget
    assert ledger.grow("a", 650, limit=650)


def test_rows_of_a_batch_pay_the_longest_row_left_padding():
    batched = Ledger(LLAMA, budget=10**9, reserve=1)
    alone = Ledger(LLAMA, budget=10**9, reserve=1, batched=False)
    for ledger in (batched, alone):
        ledger.admit("long", 1000, 1)
        ledger.admit("short", 10, 1)
    assert alone.held() == LLAMA.bytes_for(1001) + LLAMA.bytes_for(11)
    assert alone.padding() == 0
    assert batched.held() == 2 * LLAMA.bytes_for(1001)
    assert batched.padding() == LLAMA.bytes_for(1001) - LLAMA.bytes_for(11)
    batched.finish("long")  # one row left: no padding
    assert batched.padding() == 0 and batched.held() == LLAMA.bytes_for(11)
    # admission counts the padding a newcomer will bring when it joins
    tight = Ledger(LLAMA, budget=LLAMA.bytes_for(1001) + LLAMA.bytes_for(11), reserve=1)
    tight.admit("long", 1000, 1)
    assert tight.shortfall(10, 1) == LLAMA.bytes_for(1001) - LLAMA.bytes_for(11)
    assert Ledger(LLAMA, tight.budget, 1, batched=False).shortfall(10, 1) == 0


def test_a_prompt_that_cannot_fit_alone_is_refused_and_extras_count():
    ledger = Ledger(LLAMA, budget=400 * 1000)
    assert ledger.fits_alone(999) and not ledger.fits_alone(1000)
    ledger.set_extra("pending_writes", 400 * 500)  # cannot be dropped now
    assert not ledger.fits_alone(600) and ledger.most_tokens() == 500
    ledger.set_extra("ram_tier", 400 * 400)  # can be dropped: a prompt still fits alone
    assert ledger.fits_alone(400)
    report = ledger.report()
    assert report["pending_writes_bytes"] == 200_000 and report["ram_tier_bytes"] == 160_000
    assert report["total_bytes"] == ledger.total()


def test_plan_step_pauses_the_youngest_first():
    ledger = Ledger(LLAMA, budget=400 * 3000, reserve=100)
    for rid in ("old", "mid", "young"):
        ledger.admit(rid, 800, 10_000)  # 900 each reserved: 2700 of 3000
    needs = {rid: 901 for rid in ("old", "mid", "young")}  # each wants 100 more: 3000 needed
    paused, full = ledger.plan_step(needs, needs)
    assert paused == [] and full == []
    needs = {rid: 1001 for rid in ("old", "mid", "young")}  # 3300 > 3000: one must go
    paused, full = ledger.plan_step(needs, needs)
    assert paused == ["young"] and full == []
    assert set(ledger.holds) == {"old", "mid"}


def test_plan_step_ends_only_a_request_that_is_alone_and_full():
    ledger = Ledger(LLAMA, budget=400 * 1000, reserve=100)
    ledger.admit("only", 900, 10_000)
    paused, full = ledger.plan_step({"only": 1001}, ["only"])
    assert paused == [] and full == ["only"]


def test_a_request_that_must_grow_pauses_itself_when_it_is_the_youngest():
    ledger = Ledger(LLAMA, budget=400 * 2000, reserve=100)
    ledger.admit("prefilling", 1000, 10)  # older, not pausable (it is prefilling)
    ledger.admit("decoding", 800, 10_000)
    paused, _ = ledger.plan_step({"decoding": 901}, ["decoding"])
    assert paused == ["decoding"]


def test_default_budget_is_half_of_what_the_weights_leave():
    assert default_budget(16 << 30, 4 << 30) == 6 << 30
    assert default_budget(4 << 30, 8 << 30) == 256 << 20  # never below the floor


ops = st.lists(
    st.one_of(
        st.tuples(st.just("admit"), st.integers(1, 3000), st.integers(1, 40_000)),
        st.tuples(st.just("grow"), st.integers(0, 9), st.integers(1, 600)),
        st.tuples(st.just("finish"), st.integers(0, 9), st.just(0)),
        st.tuples(st.just("extra"), st.integers(0, 2), st.integers(0, 400_000)),
        st.tuples(st.just("step"), st.integers(1, 300), st.just(0)),
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(
    ops=ops,
    budget=st.integers(1, 2_000_000),
    reserve=st.integers(1, 512),
    cost=st.sampled_from([LLAMA, GEMMA, HYBRID]),
    batched=st.booleans(),
)
def test_any_sequence_keeps_the_accounted_bytes_within_the_budget(
    ops, budget, reserve, cost, batched
):
    """Whatever happens, what the ledger accounts never exceeds the budget, nothing is ever
    negative, and a pause always takes the youngest of those that can be paused."""
    ledger = Ledger(cost, budget, reserve, batched)
    extras = ("resident_sessions", "ram_tier", "pending_writes")
    n = 0
    for op, a, b in ops:
        rids = sorted(ledger.holds, key=lambda r: ledger.holds[r].order)
        if op == "admit":
            if ledger.shortfall(a, b) == 0:
                ledger.admit(f"r{n}", a, b)
                n += 1
        elif op == "grow" and rids:
            rid = rids[a % len(rids)]
            ledger.grow(rid, ledger.holds[rid].tokens + b)
        elif op == "finish" and rids:
            ledger.finish(rids[a % len(rids)])
        elif op == "extra":
            # copies only appear in what is left (the engine drops them before pausing anyone)
            room = ledger.budget - ledger.total() + ledger.extras.get(extras[a], 0)
            ledger.set_extra(extras[a], min(b, max(0, room)))
        elif op == "step" and rids:
            needs = {r: ledger.holds[r].tokens + a for r in rids}
            pausable = rids[::2]
            youngest_first = sorted(pausable, key=lambda r: -ledger.holds[r].order)
            before = set(ledger.holds)
            paused, full = ledger.plan_step(needs, pausable)
            for rid in paused:
                assert rid in before and rid not in ledger.holds
            others = [r for r in paused if r in pausable]
            assert others == youngest_first[: len(others)]  # always the youngest first
            assert len(full) <= 1 and (not full or len(ledger.holds) == 1)
        assert 0 <= ledger.total() <= ledger.budget
        assert ledger.padding() >= 0 and ledger.held() >= 0
        for hold in ledger.holds.values():
            assert 0 <= hold.tokens <= hold.reserved
