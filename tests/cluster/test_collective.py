"""distributed.collective across real ranks: `mlx.launch` with the ring backend on loopback."""

from __future__ import annotations

import json
import re
import sys

import pytest

from mlx_kvserve.distributed.collective import MAX_MESSAGE
from tests.support.launch import run_job


def launch(mode: str, ranks: int = 2, timeout: float = 5.0) -> tuple[list[dict], str]:
    """Run the job; a job that hangs fails the test through the subprocess timeout."""
    command = [sys.executable, "-m", "tests.support.collective_job", mode]
    proc = run_job(command, ranks, env={"COLLECTIVE_TIMEOUT": str(timeout)}, timeout=120)
    return json_objects(proc.stdout), proc.stderr


def json_objects(text: str) -> list[dict]:
    """The JSON objects the ranks printed, also where two came on one line (mlx.launch forwards
    each rank's output as it comes)."""
    found, decoder = [], json.JSONDecoder()
    for line in text.splitlines():
        at = 0
        while line.startswith("{", at):
            doc, at = decoder.raw_decode(line, at)
            found.append(doc)
    return found


@pytest.mark.parametrize("ranks", [2, 3])
def test_every_rank_sees_rank_zeros_messages_and_votes(ranks):
    lines, err = launch("ok", ranks)
    seen = {x["rank"]: x for x in lines if "small" in x}
    assert sorted(seen) == list(range(ranks)), err
    for x in seen.values():
        assert x["size"] == ranks
        assert x["small"] == {"tick": 1} and x["big"] is True and x["none"] is None
        assert x["vote_all"] is True and x["vote_one"] is False
        assert x["same"] is True and x["differ"] is False
        assert x["gathered"] is True
    assert sorted(x["rank"] for x in lines if x.get("done")) == list(range(ranks))


def test_a_stuck_peer_ends_the_job_with_one_clear_line():
    lines, err = launch("hang", timeout=3.0)  # the peer sleeps two minutes: no wait for it
    assert not any(x.get("done") for x in lines)
    assert "no answer from a peer within 3 s during the last barrier" in err


def test_a_dead_peer_ends_the_job():
    lines, err = launch("die")
    assert len([x for x in lines if "small" in x]) == 2, err
    assert not any(x.get("done") for x in lines)


@pytest.mark.parametrize(
    ("mode", "says"),
    [
        ("hostile-share", f"a message of {(1 << 40) + 10} bytes announced (at most {MAX_MESSAGE})"),
        ("hostile-gather", "gather sizes [-1073741812, 0] out of bounds"),
    ],
)
def test_a_peer_that_sends_a_length_no_rank_would_ends_the_job(mode, says):
    lines, err = launch(mode)
    assert not any(x.get("done") for x in lines), err
    assert f"rank 0: a peer sent {says}" in err, err
    assert re.search(r"Node with rank 0 exited with code 75", err), err


def test_lockstep_replays_rank_0s_turns_and_a_rank_out_of_step_ends_the_job():
    proc = run_job([sys.executable, "-m", "tests.support.lockstep_job"], 2, timeout=120)
    seen = json_objects(proc.stdout)
    turns = {(s["rank"], s["turn"]): s for s in seen}
    for rank in (0, 1):
        assert turns[rank, 1] == {
            "rank": rank,
            "turn": 1,
            "item": "a",
            "first": 5,
            "second": [["a", 2]],
        }
        assert turns[rank, 2]["cancelled"] is True and turns[rank, 2]["item"] is None
    assert (1, 3) not in turns, proc.stdout
    assert "rank 1 no longer steps with rank 0: its batch differs from rank 0's" in proc.stderr
    assert re.search(r"Node with rank 1 exited with code 75", proc.stderr), proc.stderr
