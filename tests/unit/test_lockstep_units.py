"""engine/lockstep.py in this process: what a turn's digest carries of each row's draws, the
line a rank that drew otherwise ends the job with, and a forward pass's deadline derived from
the peer timeout and the pass's size (kept by distributed/collective.py's real watchdog)."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import mlx.core as mx
import pytest

from mlx_kvserve.distributed.collective import Collective
from mlx_kvserve.engine.lockstep import (
    PASS_SECONDS_PER_TOKEN,
    Draws,
    Lockstep,
    difference,
    pass_timeout,
)


def row(request_id: str, *sampled: int) -> SimpleNamespace:
    return SimpleNamespace(request_id=request_id, sampled=list(sampled))


def test_draws_differ_for_another_token_with_the_same_count():
    here, there = Draws(), Draws()
    a, b = row("a", 5, 6), row("b", 9)
    assert here.of([a, b]) == there.of([row("a", 5, 6), row("b", 9)])
    a.sampled.append(7)  # one more token each: rank 0 drew 7, this rank 8
    mine, theirs = here.of([a, b]), there.of([row("a", 5, 6, 8), row("b", 9)])
    assert mine["a"][0] == theirs["a"][0] == 3 and mine["a"] != theirs["a"]
    assert mine["b"] == theirs["b"]


def test_draws_hash_only_new_tokens_and_match_a_fresh_count():
    running = Draws()
    req = row("a")
    for token in range(1, 50):
        req.sampled.append(token)
        running.of([req])
    assert running.of([req]) == Draws().of([row("a", *range(1, 50))])
    req.sampled[:] = [1, 2]  # drawn again from an earlier point
    assert running.of([req]) == Draws().of([row("a", 1, 2)])
    assert running.of([]) == {}  # a row that left is forgotten


def test_a_rank_that_drew_otherwise_is_told_which_request():
    mine = [1, 0, 0, {"chatcmpl-x": [3, 0x1234], "chatcmpl-y": [1, 7]}]
    leader = [1, 0, 0, {"chatcmpl-x": [3, 0xABCD], "chatcmpl-y": [1, 7]}]
    why = difference(mine, leader)
    assert why.startswith("request chatcmpl-x drew other tokens here than on rank 0")
    assert "00001234" in why and "0000abcd" in why
    assert difference([2, 0, 0, {}], [1, 0, 0, {}]).startswith("its batch differs from rank 0's")
    assert difference([2], [3]) == "its batch differs from rank 0's ([2] against [3])"


def test_a_rank_that_drafted_otherwise_is_told_which_request():
    """The digest's drafted and kept counts per row (engine/speculation/job.py): greedy rows
    draw the same tokens whatever they drafted, so the counts are checked on their own."""
    drawn = {"chatcmpl-x": [9, 0x1234]}
    mine = [1, 0, 0, {"chatcmpl-x": [6, 4]}, drawn]
    leader = [1, 0, 0, {"chatcmpl-x": [8, 4]}, drawn]
    why = difference(mine, leader)
    assert why == (
        "request chatcmpl-x drafted and kept other tokens here than on rank 0 "
        "(6 drafted, 4 kept, against 8 and 4)"
    )
    assert difference(mine, [1, 0, 0, {"chatcmpl-x": [6, 4]}, drawn]).startswith("its batch")


def test_a_pass_may_take_the_peer_timeout_and_a_generous_allowance_per_token():
    assert pass_timeout(30, 512) == 30 + 512 * PASS_SECONDS_PER_TOKEN == 158
    assert pass_timeout(30, 1) == pass_timeout(30, 0) == 30.25  # a lone decode step
    assert pass_timeout(5, 8) == 7
    assert pass_timeout(30, 2048) > pass_timeout(30, 512) > pass_timeout(10, 512)


class Wire:
    def encode(self, req):
        return {}

    def decode(self, wire):
        return None


@pytest.mark.parametrize("tokens", [1, 8])
def test_a_pass_that_outlives_its_derived_deadline_ends_the_job(tokens):
    ended: list[str] = []
    done = threading.Event()

    def end(message: str) -> None:
        ended.append(message)
        done.set()

    collective = Collective(mx.distributed.init(), timeout=0.5, on_lost=end)
    with Lockstep(collective, Wire()).working("a decode step", tokens):
        assert done.wait(60)  # a pass stuck past its deadline
    limit = pass_timeout(0.5, tokens)
    assert ended == [
        f"rank 0: no answer from a peer within {limit:g} s during a decode step; "
        "ending the job so every rank restarts"
    ]


def test_a_pass_within_its_deadline_goes_on():
    ended: list[str] = []
    collective = Collective(mx.distributed.init(), timeout=0.5, on_lost=ended.append)
    with Lockstep(collective, Wire()).working("a prefill chunk", 20):  # 5.5 s
        time.sleep(1.0)  # twice the peer timeout, within the pass's own
    time.sleep(1.0)  # the watchdog has looked again since
    assert ended == []
