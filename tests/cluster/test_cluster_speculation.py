"""A job speculates, and every rank drafts, verifies and keeps alike (engine/speculation/job.py).

Two ranks split the tiny llama by heads under `--speculation auto`. Rank 1 is made to time its
verify passes a thousand times dearer than they were (engine/faults.py's
`verify_cost_otherwise`): left to its own clock it would stop drafting while rank 0 drafts,
and the ranks would fall out of step (their passes' widths differ: a hang in the next
collective, or a divergence). Every rank weighs drafts with rank 0's timings instead, so the
job answers as a single process without speculation and keeps drafts; the turn's digest
carries each row's drafted and kept counts, so a rank that drafted or kept otherwise would end
the job naming the request (tests/unit/test_lockstep_units.py), and the job steps on.
"""

from __future__ import annotations

import re

import httpx
import pytest

from tests.support.cluster_jobs import client, start_job
from tests.support.launch import on_rank
from tests.support.servers import ServerProcess

pytestmark = pytest.mark.slow

# A random-weight model does not copy a file, but its greedy text soon repeats itself, which
# is what prompt lookup drafts from: the same as an agent re-emitting what it has seen.
PROMPT = "one two three four five six seven eight nine ten " * 4


def completion(server: ServerProcess) -> str:
    reply = client(server).completions.create(
        model="llama", prompt=PROMPT, max_tokens=120, temperature=0
    )
    return reply.choices[0].text


def counts(log: str) -> list[tuple[int, int]]:
    """(drafted, accepted) of every request log line that drafted, in the log's order."""
    return [(int(d), int(a)) for d, a in re.findall(r"drafted=(\d+) accepted=(\d+)", log)]


def test_every_rank_of_a_job_accepts_the_same_drafts(job_models, tmp_path):
    model = str(job_models["llama"])
    slower = on_rank(1, MLX_KVSERVE_FAULTS="verify_cost_otherwise:1000000000")
    job = start_job(
        tmp_path, 2, "--model", model, "--shard", "tensor", "--speculation", "auto", wrap=slower
    )
    alone = ServerProcess(tmp_path, "--model", model, "--speculation", "off").wait_ready()
    try:
        answer = completion(job)
        assert answer == completion(alone)
        (drafted, accepted), *_ = counts(job.wait_for_log("drafted="))  # rank 0's line
        assert drafted > 0 and accepted > 0, job.log()
        # the turn's digest carries each row's drafted and kept counts: a rank that drafted
        # otherwise would have ended the job ("no longer steps with rank 0"); it steps on
        assert completion(job) == answer
        assert httpx.get(job.base_url + "/health").json()["status"] == "ok"
        assert "no longer steps" not in job.log(), job.log()
    finally:
        alone.stop()
        job.stop()
