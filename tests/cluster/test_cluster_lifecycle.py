"""Starting and stopping jobs of several ranks: a stop of rank 0 stops every rank cleanly, a
rank killed mid-request ends the job instead of hanging it (and a restart serves from the
cache), a job that cannot serve says why on every rank before any port opens, and `serve
--hostfile` stands for the whole job as one process."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from mlx_kvserve.service.manage import health
from tests.support.cluster_jobs import (
    answers,
    chat,
    conversation,
    hostfile_job,
    ranks_of,
    start_job,
    with_signal,
)

pytestmark = pytest.mark.slow


def test_a_stop_of_rank_0_stops_every_rank_cleanly(job_models, tmp_path):
    job = start_job(tmp_path, 2, "--model", str(job_models["llama"]))
    assert chat(job, 1)["message"]["content"]
    assert job.stop() == 0
    log = job.log()
    assert job.exit_codes() == {}, log  # every rank exited 0
    assert "rank 1/2: stopped with rank 0" in log and "stopped cleanly" in log


def test_a_rank_killed_mid_request_ends_the_job_and_the_client_hears(job_models, tmp_path):
    args = ("--model", str(job_models["llama"]), "--cache-dir", str(tmp_path / "cache"))
    job = start_job(tmp_path, 2, *args, "--peer-timeout", "5")
    before = conversation(job, 1)
    body = {"model": "llama", "prompt": "Go", "max_tokens": 4000, "temperature": 0}
    body |= {"ignore_eos": True, "stream": True}  # still running when the rank dies
    events = []
    started = time.monotonic()
    url = job.base_url + "/v1/completions"
    with (  # the stream breaks off: no [DONE]
        pytest.raises(httpx.HTTPError),
        httpx.stream("POST", url, json=body, timeout=60) as reply,
    ):
        for line in reply.iter_lines():
            events.append(line)
            if len(events) == 6:
                with_signal(job.ranks()[1], signal.SIGKILL)
            assert line != "data: [DONE]"
    job.proc.wait(60)
    assert time.monotonic() - started < 60
    codes = job.exit_codes()
    assert codes[1] == -9 and codes[0] == 75, job.log()
    assert "ending the job so every rank restarts" in job.log() or "a peer left" in job.log()
    job.stop()
    job = start_job(tmp_path, 2, *args)  # what a service manager does next
    try:
        after = conversation(job, 1)
        assert after[0][0] == before[0][0] and after[0][1] > 0  # served from every rank's disk
    finally:
        job.stop()


def test_a_job_that_cannot_serve_says_why_on_every_rank_before_http(job_models, tmp_path):
    llama = str(job_models["llama"])
    two = start_job(tmp_path, 2, "--model", llama, "--model", f"other={llama}", ready=False)
    two.proc.wait(120)
    log = two.log()
    refusals = [x for x in log.splitlines() if "serves one model" in x]
    assert {x.split(": cannot serve")[0].split()[-1] for x in refusals} == {"0/2", "1/2"}, log
    assert set(two.exit_codes().values()) == {2}
    assert "Uvicorn running" not in log
    two.stop()

    three = start_job(tmp_path, 3, "--model", llama, ready=False)
    three.proc.wait(120)
    log = three.log()
    refused = set(re.findall(r"rank (\d)/3: .*do not divide its 4 attention", log))
    assert refused == {"0", "1", "2"}, log
    assert 2 in three.exit_codes().values() and "Uvicorn running" not in log
    three.stop()


def test_serve_with_a_hostfile_stands_for_the_whole_job(job_models, llama_alone, tmp_path):
    server = hostfile_job(tmp_path, "--model", str(job_models["llama"]))
    assert httpx.get(server.base_url + "/health").json()["cluster"]["ranks"] == 2
    line = health("127.0.0.1", server.port)  # what `service status` prints
    assert line.startswith("ok (") and "2 ranks, tensor parallel: rank 0 " in line
    assert answers(server, 2) == answers(llama_alone, 2)
    ranks = ranks_of(server)
    assert sorted(ranks) == [0, 1]
    assert server.stop() == 0  # SIGTERM to this process: rank 0 drains, every rank stops
    assert "rank 1/2: stopped with rank 0" in server.log()
    assert not [pid for pid in ranks.values() if Path(f"/proc/{pid}").exists()]


def test_serve_with_a_hostfile_exits_75_when_a_rank_is_lost(job_models, tmp_path):
    server = hostfile_job(tmp_path, "--model", str(job_models["llama"]), "--peer-timeout", "5")
    with_signal(ranks_of(server)[1], signal.SIGKILL)
    assert server.proc.wait(60) == 75  # the service manager restarts the job
    server.stop()


def test_a_hostfile_that_does_not_parse_is_refused_before_anything_starts(tmp_path):
    bad = tmp_path / "hosts.json"
    bad.write_text('[{"ssh": "a", "ips": ["not an address"]}, {"ssh": "b"}]')
    proc = subprocess.run(
        [sys.executable, "-m", "mlx_kvserve", "serve", "--hostfile", str(bad), "--port", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert str(bad) in proc.stderr and "not an address" in proc.stderr
