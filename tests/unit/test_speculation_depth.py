"""The depth controller (engine/speculation/depth.py) on synthetic acceptance streams: prose
drafts nothing, re-emitted code drafts long, a row that changes is followed, and the cost of a
wider pass is measured rather than assumed."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from mlx_kvserve.engine.speculation.depth import (
    PROBE_DEPTH,
    READ_FIRST,
    RETIME,
    DepthController,
    SourcePriors,
    VerifyCost,
    plan_width,
)

# This machine's default model, one decode pass = 1 (docs/speculation.md): cheap extra positions.
MEASURED = {1: 1.0, 2: 1.02, 3: 1.04, 5: 1.11, 9: 1.41}


def measured_cost(batch: int = 1, table: dict[int, float] = MEASURED) -> VerifyCost:
    cost = VerifyCost()
    for width, relative in table.items():
        cost.observe(batch, width, relative * 0.01)
    return cost


def run(
    ctrl: DepthController, rate: float, rounds: int, cost: Callable[[int], float], seed: int = 0
) -> list[int]:
    """Rounds of a row whose every draft position is kept with probability `rate` (given the
    ones before it were): the depth chosen each round."""
    rng = random.Random(seed)
    depths = []
    for _ in range(rounds):
        k = ctrl.depth(cost)
        kept = 0
        while kept < k and rng.random() < rate:
            kept += 1
        ctrl.record(k, kept)
        depths.append(k)
    return depths


def test_prose_drafts_nothing_but_rare_probes() -> None:
    cost = measured_cost()
    ctrl = DepthController()
    depths = run(ctrl, 0.05, 2000, lambda w: cost.cost(1, w))
    assert depths[-1] == 0
    assert sum(1 for k in depths[200:] if k) <= 8  # probes only, backing off to 512 rounds
    assert ctrl.drafted <= 60


def test_re_emitted_code_drafts_long() -> None:
    cost = measured_cost()
    ctrl = DepthController(max_depth=8)
    depths = run(ctrl, 0.95, 300, lambda w: cost.cost(1, w))
    assert min(depths[50:]) >= 6
    assert ctrl.accepted / ctrl.drafted > 0.8


def test_middling_acceptance_drafts_a_few() -> None:
    cost = measured_cost()
    ctrl = DepthController(max_depth=8)
    depths = run(ctrl, 0.6, 400, lambda w: cost.cost(1, w))
    assert 1 <= sorted(depths[100:])[150] <= 5


def test_a_row_that_turns_from_prose_to_code_is_followed() -> None:
    cost = measured_cost()
    ctrl = DepthController(max_depth=8)
    run(ctrl, 0.02, 150, lambda w: cost.cost(1, w))
    assert ctrl.depth(lambda w: cost.cost(1, w)) == 0
    depths = run(ctrl, 0.95, 400, lambda w: cost.cost(1, w), seed=1)
    first_long = next(i for i, k in enumerate(depths) if k >= 6)
    assert first_long < 200  # within the longest backoff reached, plus a few rounds to learn
    assert min(depths[first_long + 20 :]) >= 6
    # ... and back: drafting stops within the rounds the acceptance estimate remembers
    depths = run(ctrl, 0.02, 300, lambda w: cost.cost(1, w), seed=2)
    assert max(depths[100:]) <= PROBE_DEPTH and sum(1 for k in depths[100:] if k) <= 6


def test_nothing_pays_when_a_wider_pass_costs_its_width() -> None:
    """Compute-bound (a full batch, a long context): E(k) < k + 1 for any acceptance below 1."""
    table = {w: float(w) for w in range(1, 10)}
    cost = measured_cost(8, table)
    ctrl = DepthController()
    depths = run(ctrl, 0.9, 500, lambda w: cost.cost(8, w))
    assert sum(1 for k in depths[100:] if k) <= 4


def test_verify_cost_is_relative_to_a_plain_pass_and_interpolated() -> None:
    cost = VerifyCost(prior_slope=0.1)
    assert cost.cost(4, 1) == 1.0
    assert abs(cost.cost(4, 3) - (1 + 0.1 * 2 * 2)) < 1e-9  # the prior, scaled by sqrt(batch)
    cost.observe(4, 1, 0.020)
    cost.observe(4, 5, 0.030)
    assert abs(cost.cost(4, 5) - 1.5) < 1e-9
    assert abs(cost.cost(4, 3) - 1.25) < 1e-9  # between measured widths
    assert abs(cost.cost(4, 7) - (1.5 + 0.1 * 2 * 2)) < 1e-9  # past them: the prior slope
    cost.observe(4, 5, 0.040)  # smoothed, not replaced
    assert 1.5 < cost.cost(4, 5) < 2.0


@pytest.mark.timed_cost
def test_each_batch_sizes_plain_pass_is_timed_and_timed_again() -> None:
    """A batch size whose plain pass was never timed asks for a plain step (else rows that
    draft at every step would be priced on the prior for ever), and again after RETIME verify
    passes; each batch size on its own; a read-first step is no plain pass."""
    cost = VerifyCost()
    assert cost.untimed(1) and cost.untimed(4)
    cost.observe(4, READ_FIRST, 0.02)
    assert cost.untimed(4)
    cost.observe(4, 1, 0.01)
    assert not cost.untimed(4) and cost.untimed(1)
    for _ in range(RETIME - 1):
        cost.observe(4, 5, 0.02)
    assert not cost.untimed(4)
    cost.observe(4, 5, 0.02)
    assert cost.untimed(4)
    cost.observe(4, 1, 0.01)
    assert not cost.untimed(4)
    cost.retime = None  # the seam the other unit tests pin the prior with
    assert not cost.untimed(8)


def test_the_batch_width_serves_the_rows_that_pay() -> None:
    coder, writer = DepthController(), DepthController()
    run(coder, 0.95, 100, lambda w: 1.0)
    run(writer, 0.05, 100, lambda w: 1.0)
    cheap = measured_cost(4)
    curves_one_coder = [coder.expected(8)] + [[1.0]] * 3
    assert plan_width(curves_one_coder, lambda w: cheap.cost(4, w)) >= 7
    # prose rows' drafts barely count, and a batch whose wider passes cost their width: none
    dear = measured_cost(4, {w: 0.4 + 0.6 * w for w in range(1, 10)})
    curves = [writer.expected(8)] * 4
    assert plan_width(curves, lambda w: dear.cost(4, w)) == 1
    assert plan_width([[1.0]] * 4, lambda w: cheap.cost(4, w)) == 1


def test_source_priors_keep_decayed_counts_per_source_and_match_length() -> None:
    priors = SourcePriors(max_depth=4, decay=0.8)
    assert priors.rates(("prompt_lookup", 2)) is None  # nothing seen: the row's own chain
    for _ in range(20):
        priors.record(("prompt_lookup", 4), 4, 4)  # a file being copied: every draft kept
        priors.record(("prompt_lookup", 2), 2, 0)  # a story's 2-token matches: none
    assert min(priors.rates(("prompt_lookup", 4))) > 0.85  # 5 rounds' weight vs 2
    assert priors.rates(("prompt_lookup", 2))[0] < 0.15
    assert priors.rates(("prompt_cache", 4)) is None  # another source: its own counts
    # a rejection at position 1 leaves positions past it untried: their rates follow it
    priors.record(("prompt_cache", 3), 4, 0)
    tried, kept, _ = priors._counts[("prompt_cache", 3)]
    assert tried == [1, 0, 0, 0] and kept == [0, 0, 0, 0]
    # decayed: 4 new rounds outweigh the 20 old ones (decay 0.8 per round of a source)
    for _ in range(4):
        priors.record(("prompt_lookup", 2), 2, 2)
    assert priors.rates(("prompt_lookup", 2))[0] > 0.5
    # read-first steps that ended in a draft, per source
    assert priors.hit_rate(("draft_model", 3)) == 0.5
    for _ in range(10):
        priors.read(("prompt_lookup", 2), False)
    assert priors.hit_rate(("prompt_lookup", 2)) < 0.2  # 4.6 rounds of weight vs 2


def test_a_new_row_starts_from_what_its_source_kept_before() -> None:
    cost = measured_cost()
    priors = SourcePriors()
    for _ in range(60):
        priors.record(("prompt_lookup", 2), 2, 0)
        priors.record(("prompt_lookup", 4), 8, 8)
    story, copy, flat = DepthController(), DepthController(), DepthController()
    assert flat.depth(lambda w: cost.cost(1, w)) > 0  # the flat 0.5 prior drafts at once
    assert story.depth(lambda w: cost.cost(1, w), prior=priors.rates(("prompt_lookup", 2))) == 0
    assert copy.depth(lambda w: cost.cost(1, w), prior=priors.rates(("prompt_lookup", 4))) >= 6
    # the row's own rounds still count: a copy whose drafts turn out wrong stops drafting
    run(copy, 0.0, 30, lambda w: cost.cost(1, w))
    assert copy.best(lambda w: cost.cost(1, w), 8) == 0


def test_read_first_steps_that_draft_nothing_are_paid_for() -> None:
    cost = measured_cost()
    cost.observe(1, READ_FIRST, 0.0115)  # reading first costs 15% of a plain step here
    assert abs(cost.read_first(1) - 1.15) < 1e-9
    assert abs(VerifyCost(prior_slope=0.06).read_first(4) - 1.12) < 1e-9  # before it is timed
    assert abs(cost.cost(1, 2) - 1.02) < 1e-9  # the read-first time is no width of a pass
    ctrl = DepthController()

    def depth() -> int:
        miss = cost.read_first(1)
        return ctrl.depth(lambda w: cost.cost(1, w), hit=ctrl.hit_rate(0.5), miss=miss)

    assert depth() > 0  # acceptance 0.5, reads assumed to draft half the time: it pays
    # every read finds no draft after all: the row pays c_0 for one token each time, and stops
    depths = []
    for _ in range(300):
        k = depth()
        if k:
            ctrl.read(False)
        depths.append(k)
    assert depths[-1] == 0 and sum(1 for k in depths[50:] if k) <= 8  # probes only
    # the same acceptance with reads that always draft keeps drafting
    lucky = DepthController()
    for _ in range(30):
        lucky.read(True)
    assert lucky.depth(lambda w: cost.cost(1, w), hit=lucky.hit_rate(0.5), miss=1.15) > 0


def test_a_rows_own_first_drafts_outweigh_the_engines_between_sources() -> None:
    """A commit message the prompt cache holds whole: the row's own rounds find its copies
    kept and its own tokens' 4-token matches rejected, whatever other rows' copies did."""
    ctrl = DepthController()
    lookup, cache = ("prompt_lookup", 4), ("prompt_cache", 4)
    assert ctrl.worth(lookup, 0.9) == 0.9  # nothing of its own yet: the engine's
    for _ in range(5):
        ctrl.record(4, 0, lookup)
        ctrl.record(8, 8, cache)
    assert ctrl.worth(lookup, 0.9) < 0.5 < ctrl.worth(cache, 0.5)
    ctrl.record(3, 1)  # a round without a source: no source's worth changes
    assert ctrl.firsts[cache][0] == ctrl.firsts[lookup][0]
