"""`mlx-kvserve serve` as a job of several ranks: `mlx.launch --backend ring` on loopback.

Each rank holds a shard of a tiny random-weight model (llama split by heads, qwen3_next by
layers) or of the default SmolLM2 (9 heads over 3 ranks); rank 0 serves HTTP and every rank
steps the same batch (engine/lockstep.py). The answers must be the ones a single process gives:
greedy and seeded, batched, grammar-constrained, after a client left mid-stream. A stop of rank
0 stops every rank cleanly; a rank killed mid-request ends the job instead of hanging it; a job
that cannot serve says so on every rank before any port opens.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import anthropic
import httpx
import pytest
from openai import OpenAI

from mlx_kvserve.cache import PromptCache
from mlx_kvserve.service.manage import health
from tests.conftest import ServerProcess
from tests.support.launch import BIND_FAILED, free_ports, launch_prefix, rank_pids
from tests.support.tiny_models import make_model_dir

pytestmark = pytest.mark.slow

TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city", "days"],
        },
    },
}


class Job(ServerProcess):
    """A server run by `mlx.launch` on `ranks` ranks; the process is the launcher."""

    def __init__(self, workdir: Path, ranks: int, *args: str) -> None:
        super().__init__(workdir, *args, prefix=launch_prefix(ranks))

    def ranks(self) -> dict[int, int]:
        try:
            return rank_pids(self.proc.pid)
        except OSError:  # the launcher has just exited
            return {}

    def exit_codes(self) -> dict[int, int]:
        """Per rank, what mlx.launch reports (it exits 0 itself whatever its ranks did)."""
        found = re.findall(r"Node with rank (\d+) exited with code (-?\d+)", self.log())
        return {int(rank): int(code) for rank, code in found}

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        """A stop as a service manager's reaches rank 0: it drains and stops the others."""
        ranks = self.ranks() if self.proc.poll() is None else {}
        if 0 in ranks:
            with_signal(ranks[0], sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout)
        code = super().stop(signal.SIGKILL, timeout)  # the launcher, if it is still there
        for pid in ranks.values():  # a killed launcher leaves its ranks running
            with_signal(pid, signal.SIGKILL)
        return code


def with_signal(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


def start_job(workdir: Path, ranks: int, *args: str, ready: bool = True) -> Job:
    """A job, started again on other ports if the ring lost a race for one."""
    for _ in range(3):
        job = Job(workdir, ranks, *args)
        if not ready:
            return job
        try:
            return job.wait_ready(timeout=300)
        except RuntimeError:
            job.stop()
            if BIND_FAILED not in job.log():
                raise
    raise RuntimeError("the ring backend could not bind its ports three times")


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    work = tmp_path_factory.mktemp("cluster-models")
    return {
        "llama": make_model_dir(work / "llama", "llama"),
        "qwen3_next": make_model_dir(work / "qwen3_next", "qwen3_next"),
    }


@pytest.fixture(scope="module")
def alone(models, tmp_path_factory):
    server = ServerProcess(tmp_path_factory.mktemp("alone"), "--model", str(models["llama"]))
    yield server.wait_ready()
    server.stop()


@pytest.fixture(scope="module")
def job(models, tmp_path_factory):
    work = tmp_path_factory.mktemp("job")
    server = start_job(work, 2, "--model", str(models["llama"]), "--shard", "tensor")
    yield server
    server.stop()


def client(server: ServerProcess) -> OpenAI:
    return OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0, timeout=120)


def chat(server: ServerProcess, i: int, **extra) -> dict:
    options = {"max_tokens": 6 + 3 * i, "temperature": 0, **extra}
    reply = client(server).chat.completions.create(
        model="llama",
        messages=[{"role": "user", "content": f"Tell me about the number {i}, please."}],
        **options,
    )
    return reply.model_dump()["choices"][0]


def conversation(server: ServerProcess, turns: int) -> list[tuple[str, int]]:
    """A conversation of `turns` greedy turns: (each answer, its cached prompt tokens)."""
    messages = [{"role": "system", "content": "You answer briefly and kindly. " * 12}]
    seen = []
    for turn in range(turns):
        messages.append({"role": "user", "content": f"Question {turn}: what about {turn}?"})
        reply = client(server).chat.completions.create(
            model="llama", messages=messages, max_tokens=10, temperature=0
        )
        text = reply.choices[0].message.content
        messages.append({"role": "assistant", "content": text})
        details = reply.usage.prompt_tokens_details
        seen.append((text, details.cached_tokens if details else 0))
    return seen


def answers(server: ServerProcess, count: int) -> list[dict]:
    with concurrent.futures.ThreadPoolExecutor(count) as pool:
        return list(pool.map(lambda i: chat(server, i), range(count)))


def test_health_names_every_rank_and_the_split(job):
    body = httpx.get(job.base_url + "/health").json()
    assert body["status"] == "ok"
    assert body["cluster"]["ranks"] == 2 and body["cluster"]["shard"] == "tensor"
    assert len(body["cluster"]["hosts"]) == 2


def test_requests_batched_across_ranks_answer_as_one_process(job, alone):
    together = answers(job, 4)
    assert together == answers(alone, 4)
    assert all(c["message"]["content"] for c in together)
    assert re.search(r"batch=[2-4]", job.log()), "the job never decoded two requests together"
    text = client(job).completions.create(model="llama", prompt="Once", max_tokens=9, temperature=0)
    same = client(alone).completions.create(
        model="llama", prompt="Once", max_tokens=9, temperature=0
    )
    assert text.choices[0].text == same.choices[0].text


def test_seeded_sampling_and_grammars_answer_as_one_process(job, alone):
    def sampled(server: ServerProcess) -> list:
        seeded = chat(server, 3, temperature=0.9, seed=11)["message"]["content"]
        called = chat(server, 4, tools=[TOOL], tool_choice="required", max_tokens=60)
        schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
        shaped = chat(
            server,
            5,
            max_tokens=30,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "n", "schema": schema, "strict": True},
            },
        )
        calls = [call["function"] for call in called["message"]["tool_calls"]]
        return [seeded, calls, shaped["message"]["content"]]

    ours = sampled(job)
    assert ours == sampled(alone)
    call = ours[1][0]  # a random-weight model's arguments run to max_tokens, in the grammar
    assert call["name"] == "get_weather" and call["arguments"].startswith('{"city": "')
    unseeded = chat(job, 6, temperature=1.0)  # rank 0 seeds it for every rank
    assert unseeded["finish_reason"] == "length"


def test_the_anthropic_and_responses_protocols_and_metrics_across_ranks(job, alone):
    def both(server: ServerProcess) -> list[str]:
        claude = anthropic.Anthropic(base_url=server.base_url, api_key="none", max_retries=0)
        message = claude.messages.create(
            model="llama",
            max_tokens=12,
            messages=[{"role": "user", "content": "Name a colour."}],
            extra_body={"temperature": 0},
        )
        response = client(server).responses.create(
            model="llama", input="Name a fruit.", max_output_tokens=12, temperature=0
        )
        return [message.content[0].text, response.output_text]

    assert both(job) == both(alone)
    metrics = httpx.get(job.base_url + "/metrics").text
    assert re.search(r"mlx_kvserve_requests_total\{[^}]*\} [1-9]", metrics), metrics[:2000]


def test_a_client_that_leaves_mid_stream_leaves_the_ranks_in_step(job, alone):
    body = {
        "model": "llama",
        "messages": [{"role": "user", "content": "Count for me."}],
        "max_tokens": 2000,
        "temperature": 0,
        "stream": True,
    }
    with httpx.stream("POST", job.base_url + "/v1/chat/completions", json=body) as stream:
        for n, _line in enumerate(stream.iter_lines()):
            if n > 6:
                break
    job.wait_for_log("finish=cancelled")
    assert answers(job, 2) == answers(alone, 2)
    assert httpx.get(job.base_url + "/health").json()["running"] == 0


def test_every_rank_keeps_its_slice_and_a_restarted_job_restores_from_disk(models, alone, tmp_path):
    cache = str(tmp_path / "cache")
    args = ("--model", str(models["llama"]), "--cache-dir", cache)
    job = start_job(tmp_path, 2, *args)
    first = conversation(job, 2)
    assert job.stop() == 0 and job.exit_codes() == {}
    slices = sorted(p.name.split("-", 2)[2] for p in Path(cache).iterdir())
    assert slices == ["tensor-2r0", "tensor-2r1"]  # one cache per rank, named by the layout
    assert all(list((Path(cache) / p).glob("*.kvc")) for p in os.listdir(cache))

    job = start_job(tmp_path, 2, *args)
    try:
        again = conversation(job, 3)
        expected = [text for text, _ in conversation(alone, 3)]
        assert [text for text, _ in again] == expected
        assert [text for text, _ in first] == expected[:2]
        assert again[0][1] > 0 and again[1][1] > again[0][1], again  # from disk, every rank
        assert "cache=disk" in job.log()
    finally:
        job.stop()


def test_rank_0s_disk_budget_decides_what_every_rank_evicts(models, tmp_path):
    cache = tmp_path / "cache"
    args = ("--model", str(models["llama"]), "--cache-dir", str(cache), "--cache-budget", "256KiB")
    job = start_job(tmp_path, 2, *args)
    try:
        for topic in range(8):  # different conversations, more than the budget holds
            reply = client(job).chat.completions.create(
                model="llama",
                messages=[
                    {"role": "system", "content": f"Topic {topic}. " + "Be brief. " * 40},
                    {"role": "user", "content": "Go on."},
                ],
                max_tokens=8,
                temperature=0,
            )
            assert reply.choices[0].message.content
        evictions = httpx.get(job.base_url + "/v1/cache").json()["evictions"]
        assert evictions > 0
    finally:
        job.stop()
    kept = {}
    for directory in cache.iterdir():
        stored = PromptCache(cache, directory.name, disk_budget=None, ram_budget=0, read_only=True)
        kept[directory.name[-3:]] = sorted((e.n_tokens, e.reason) for e in stored.entries())
        stored.close()
    assert kept["2r0"] and kept["2r0"] == kept["2r1"], kept


def test_a_damaged_slice_on_one_rank_is_a_miss_on_every_rank(models, alone, tmp_path):
    cache = tmp_path / "cache"
    args = ("--model", str(models["llama"]), "--cache-dir", str(cache))
    job = start_job(tmp_path, 2, *args)
    conversation(job, 2)
    job.stop()
    (rank_1,) = [p for p in cache.iterdir() if p.name.endswith("-2r1")]
    for path in rank_1.glob("*.kvc"):  # every checkpoint of rank 1's slice
        data = bytearray(path.read_bytes())
        data[-150:-100] = bytes(b ^ 0x5A for b in data[-150:-100])
        path.write_bytes(bytes(data))

    job = start_job(tmp_path, 2, *args)
    try:
        again = conversation(job, 2)
        assert [text for text, _ in again] == [text for text, _ in conversation(alone, 2)]
        assert again[0][1] == 0  # a miss on rank 0 too, though its own slice is sound
        log = job.log()
        assert "payload checksum mismatch" in log
        assert "another rank of the job could not restore its slice" in log
    finally:
        job.stop()


def test_a_pipeline_job_answers_as_one_process(models, tmp_path):
    model = str(models["qwen3_next"])
    job = start_job(tmp_path, 2, "--model", model, "--shard", "pipeline", "--no-cache")
    alone = ServerProcess(tmp_path, "--model", model, "--no-cache").wait_ready()
    try:
        assert httpx.get(job.base_url + "/health").json()["cluster"]["shard"] == "pipeline"
        assert answers(job, 3) == answers(alone, 3)
    finally:
        alone.stop()
        job.stop()


def test_three_ranks_serve_the_default_model_as_one_process(nocache_server, tmp_path):
    job = start_job(tmp_path, 3, "--shard", "tensor")
    try:
        question = [{"role": "user", "content": "What is the capital of France?"}]
        name = httpx.get(job.base_url + "/health").json()["model"]
        replies = [
            client(server).chat.completions.create(
                model=name, messages=question, max_tokens=12, temperature=0
            )
            for server in (job, nocache_server)
        ]
        assert replies[0].choices[0].message.content == replies[1].choices[0].message.content
    finally:
        job.stop()


def test_a_stop_of_rank_0_stops_every_rank_cleanly(models, tmp_path):
    job = start_job(tmp_path, 2, "--model", str(models["llama"]))
    assert chat(job, 1)["message"]["content"]
    assert job.stop() == 0
    log = job.log()
    assert job.exit_codes() == {}, log  # every rank exited 0
    assert "rank 1/2: stopped with rank 0" in log and "stopped cleanly" in log


def test_a_rank_killed_mid_request_ends_the_job_and_the_client_hears(models, tmp_path):
    args = ("--model", str(models["llama"]), "--cache-dir", str(tmp_path / "cache"))
    job = start_job(tmp_path, 2, *args, "--peer-timeout", "5")
    before = conversation(job, 1)
    body = {"model": "llama", "prompt": "Go", "max_tokens": 4000, "temperature": 0, "stream": True}
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


def test_a_job_that_cannot_serve_says_why_on_every_rank_before_http(models, tmp_path):
    llama = str(models["llama"])
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


def hostfile_job(tmp_path: Path, *args: str) -> ServerProcess:
    """`serve --hostfile` over two ranks on this machine (hosts named 127.0.0.1 run locally)."""
    hosts = tmp_path / "hosts.json"
    hosts.write_text(json.dumps([{"ssh": "127.0.0.1", "ips": ["127.0.0.1"]}] * 2))
    for _ in range(3):
        port = str(free_ports(2))
        server = ServerProcess(tmp_path, "--hostfile", str(hosts), "--ring-port", port, *args)
        try:
            return server.wait_ready(timeout=300)
        except RuntimeError:
            server.stop()
            if BIND_FAILED not in server.log():
                raise
    raise RuntimeError("the ring backend could not bind its ports three times")


def ranks_of(server: ServerProcess) -> dict[int, int]:
    """The ranks under `serve --hostfile`'s launcher (its one child)."""
    pid = server.proc.pid
    (launcher,) = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return rank_pids(int(launcher))


def test_serve_with_a_hostfile_stands_for_the_whole_job(models, alone, tmp_path):
    server = hostfile_job(tmp_path, "--model", str(models["llama"]))
    assert httpx.get(server.base_url + "/health").json()["cluster"]["ranks"] == 2
    line = health("127.0.0.1", server.port)  # what `service status` prints
    assert line.startswith("ok (") and "2 ranks, tensor parallel: rank 0 " in line
    assert answers(server, 2) == answers(alone, 2)
    ranks = ranks_of(server)
    assert sorted(ranks) == [0, 1]
    assert server.stop() == 0  # SIGTERM to this process: rank 0 drains, every rank stops
    assert "rank 1/2: stopped with rank 0" in server.log()
    assert not [pid for pid in ranks.values() if Path(f"/proc/{pid}").exists()]


def test_serve_with_a_hostfile_exits_75_when_a_rank_is_lost(models, tmp_path):
    server = hostfile_job(tmp_path, "--model", str(models["llama"]), "--peer-timeout", "5")
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
