"""A job whose ranks stop stepping together ends instead of answering wrong or hanging: one rank
is made to draw another token, to stall inside a forward pass, or to fail to rebuild a request
(engine/faults.py's seams, given to rank 1 only through tests/support/on_rank.py). The client
gets an error or a closed connection, never an answer; the job's log says why in one line."""

from __future__ import annotations

import re
import time

import openai
import pytest

from mlx_kvserve.engine.lockstep import pass_timeout
from tests.support.cluster_jobs import client, start_job
from tests.support.launch import on_rank

pytestmark = pytest.mark.slow

# Long enough that a loaded CI machine's pauses do not end an idle job, short enough that a
# stalled pass is found within the test's patience.
PEER_TIMEOUT = 20.0


def faulty_job(job_models, tmp_path, faults: str, *extra: str):
    args = ("--model", str(job_models["llama"]), "--peer-timeout", f"{PEER_TIMEOUT:g}", *extra)
    return start_job(tmp_path, 2, *args, wrap=on_rank(1, MLX_KVSERVE_FAULTS=faults))


def ask(job) -> None:
    """A greedy request long enough to be under way when the fault strikes: no answer comes."""
    with pytest.raises(openai.APIError):  # a clean error or the connection's end
        client(job).chat.completions.create(
            model="llama",
            messages=[{"role": "user", "content": "Count from one to a hundred, please."}],
            max_tokens=60,
            temperature=0,
        )


@pytest.mark.parametrize("speculation", ["off", "auto"])
def test_a_rank_that_drew_another_token_ends_the_job_naming_the_request(
    job_models, tmp_path, speculation
):
    """Speculating, the rank drafts otherwise from the step that reads the token: its next
    pass's shape differs from rank 0's, which is checked first (engine/speculation/job.py)."""
    # rank 1's fourth draw
    job = faulty_job(job_models, tmp_path, "draw_otherwise@4", "--speculation", speculation)
    try:
        ask(job)
        job.proc.wait(120)
        log = job.log()
        lines = [x for x in log.splitlines() if "no longer steps with rank 0" in x]
        assert len(lines) == 1, log
        assert re.search(
            r"rank 1 no longer steps with rank 0: request [0-9a-f]+ drew other tokens here "
            r"than on rank 0 \(\d+ tokens, hash [0-9a-f]{8}, against \d+ tokens",
            lines[0],
        ), lines[0]
        assert job.exit_codes()[1] == 75, log
    finally:
        job.stop()


def test_a_rank_stuck_inside_a_pass_ends_the_job_within_the_passs_deadline(job_models, tmp_path):
    job = faulty_job(job_models, tmp_path, "decode_stall@3")  # rank 1 sleeps an hour
    try:
        started = time.monotonic()
        ask(job)
        job.proc.wait(150)  # generous: under the old fixed 300 s this took five minutes
        assert time.monotonic() - started < 150
        log = job.log()
        limit = pass_timeout(PEER_TIMEOUT, 1)  # a decode step of one row
        assert re.search(
            rf"rank [01]: no answer from a peer within {limit:g} s during a decode step", log
        ), log
        assert 75 in job.exit_codes().values(), log
    finally:
        job.stop()


def test_a_rank_whose_engine_failed_exits_non_zero_with_the_cause(job_models, tmp_path):
    job = faulty_job(job_models, tmp_path, "request_decode")  # rank 0's request, not rebuilt
    try:
        ask(job)
        job.proc.wait(120)
        log = job.log()
        assert (
            "rank 1/2: the engine stopped on its own: InjectedFault: injected fault at "
            "request_decode" in log
        ), log
        assert job.exit_codes()[1] == 70, log
        assert "rank 1/2: stopped with rank 0" not in log
    finally:
        job.stop()
