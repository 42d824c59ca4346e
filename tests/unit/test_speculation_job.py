"""engine/speculation/job.py: the ranks of a job weigh drafts with rank 0's timings alone, so
their depth controllers choose alike however their own clocks ran."""

from __future__ import annotations

from collections.abc import Callable

from mlx_kvserve.engine import faults
from mlx_kvserve.engine.speculation.depth import DepthController, VerifyCost
from mlx_kvserve.engine.speculation.job import AgreedCost
from mlx_kvserve.json_value import JSON


def relay(leader: AgreedCost) -> tuple[Callable, Callable]:
    """A turn's `decide` on rank 0 and on another rank: the other gets rank 0's value."""
    sent: list[JSON] = []

    def on_leader(decide: Callable[[], JSON]) -> JSON:
        sent.append(decide())
        return sent[-1]

    def on_other(decide: Callable[[], JSON]) -> JSON:
        decide()  # never called by a real turn on another rank; harmless here
        return sent.pop(0)

    return on_leader, on_other


def test_every_rank_observes_rank_0s_timings_and_chooses_the_same_depth():
    leader, other = AgreedCost(), AgreedCost()
    on_leader, on_other = relay(leader)
    for _ in range(5):  # rank 0: a 9-wide pass as cheap as a plain one; the other: 10x dearer
        leader.observe(1, 1, 0.010)
        leader.observe(1, 9, 0.011)
        other.observe(1, 1, 0.010)
        other.observe(1, 9, 0.110)
        assert leader.cost(1, 9) == other.cost(1, 9)  # nothing observed before the agreement
        leader.agree(on_leader)
        other.agree(on_other)
    assert leader.plain(1) == other.plain(1) == 0.010
    assert leader.cost(1, 9) == other.cost(1, 9) < 1.2
    alone = VerifyCost()  # what the other rank would weigh with by itself
    for _ in range(5):
        alone.observe(1, 1, 0.010)
        alone.observe(1, 9, 0.110)
    copying = DepthController()
    for _ in range(20):
        copying.record(8, 8)
    assert copying.best(lambda w: leader.cost(1, w), 8) == 8
    assert copying.best(lambda w: other.cost(1, w), 8) == 8
    assert copying.best(lambda w: alone.cost(1, w), 8) == 0  # the ranks would have differed


def test_a_rank_timed_otherwise_by_the_fault_point(monkeypatch):
    monkeypatch.setenv(faults.ENV, "verify_cost_otherwise:1")
    faults.reset()
    try:
        cost = AgreedCost()
        cost.observe(1, 1, 1.0)  # a plain pass: as timed
        cost.observe(1, 4, 1.0)
        cost.observe(1, 4, 1.0)  # the rule's one reach is spent
        seen: list[JSON] = []
        cost.agree(lambda decide: seen.append(decide()) or seen[-1])
        assert seen == [[[1, 1, 1.0], [1, 4, 1000.0], [1, 4, 1.0]]]
    finally:
        monkeypatch.delenv(faults.ENV)
        faults.reset()
