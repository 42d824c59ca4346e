"""How a prefill is cut into forward passes (pure planning, no model)."""

from __future__ import annotations

from mlx_kvserve.engine.chunks import TAIL_FOLD, Checkpoints, plan_chunks


def marks(boundaries=None, interval=0):
    return Checkpoints(dict(boundaries or {}), interval, store=lambda *a, **k: None)


def covered(chunks, last_from, start, end):
    """Chunks and the last pass tile [start, end) without gaps or overlaps."""
    pos = start
    for lo, hi in chunks:
        assert lo == pos and hi > lo
        pos = hi
    assert pos == last_from and last_from < end


def test_short_next_turn_runs_as_one_pass_with_its_boundary_folded():
    cp = marks({2055: "message"})
    chunks, last_from = plan_chunks(2049, 2063, 512, cp, foldable=True)
    assert chunks == [] and last_from == 2049


def test_boundary_is_a_cut_when_the_state_cannot_be_cut_to_a_prefix():
    cp = marks({2055: "message"})
    chunks, last_from = plan_chunks(2049, 2063, 512, cp, foldable=False)
    assert chunks == [(2049, 2055)] and last_from == 2055
    covered(chunks, last_from, 2049, 2063)


def test_long_prefill_keeps_step_alignment_and_folds_only_a_small_tail():
    cp = marks({100: "anchor", 1990: "message"}, interval=1024)
    chunks, last_from = plan_chunks(0, 2000, 512, cp, foldable=True)
    covered(chunks, last_from, 0, 2000)
    ends = [hi for _, hi in chunks]
    assert {100, 512, 1024, 1536}.issubset(ends)  # anchor, step multiples, interval
    # [1536, 2000) is too long to fold whole: the boundary stays a cut, and only the
    # 10 tokens after it join the final token's pass.
    assert ends[-1] == 1990 and last_from == 1990 and TAIL_FOLD < 2000 - 1536


def test_tail_of_at_most_tail_fold_tokens_is_folded():
    cp = marks({1990: "message"})
    chunks, last_from = plan_chunks(0, 1536 + TAIL_FOLD, 512, cp, foldable=True)
    assert last_from == 1536 and chunks[-1] == (1024, 1536)
    chunks, last_from = plan_chunks(0, 1536 + TAIL_FOLD + 1, 512, cp, foldable=True)
    assert last_from == 1536 + TAIL_FOLD  # the final token alone, as without folding


def test_single_token_prompt():
    chunks, last_from = plan_chunks(0, 1, 512, marks(), foldable=True)
    assert chunks == [] and last_from == 0
