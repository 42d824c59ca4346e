"""`mlx-kvserve serve` as a job of several ranks: `mlx.launch --backend ring` on loopback.

Each rank holds a shard of a tiny random-weight model (llama split by heads, qwen3_next by
layers) or of the default SmolLM2 (9 heads over 3 ranks); rank 0 serves HTTP and every rank
steps the same batch (engine/lockstep.py). The answers must be the ones a single process gives:
greedy and seeded, batched, grammar-constrained, over every protocol, after a client left.
The cache across ranks is tests/cluster/test_cluster_cache.py; starting and stopping jobs,
tests/cluster/test_cluster_lifecycle.py.
"""

from __future__ import annotations

import re

import anthropic
import httpx
import pytest

from tests.support.cluster_jobs import (
    answers,
    chat,
    client,
    start_job,
)
from tests.support.servers import ServerProcess

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def job(job_models, tmp_path_factory):
    work = tmp_path_factory.mktemp("job")
    server = start_job(work, 2, "--model", str(job_models["llama"]), "--shard", "tensor")
    yield server
    server.stop()


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


def test_health_names_every_rank_and_the_split(job):
    body = httpx.get(job.base_url + "/health").json()
    assert body["status"] == "ok"
    assert body["cluster"]["ranks"] == 2 and body["cluster"]["shard"] == "tensor"
    assert len(body["cluster"]["hosts"]) == 2
    # unloading the model would stop every rank: refused, and the job goes on serving
    answer = httpx.post(job.base_url + "/v1/models/llama/unload", json={}).json()
    assert answer["unloaded"] is False and answer["state"] == "loaded"
    assert chat(job, 1)["message"]["content"]


def test_several_choices_are_refused_with_a_400_naming_n(job):
    """Forking a prefill into rows is not done across ranks: `n` above 1 is a clear 400."""
    for path, body in [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
        ("/v1/completions", {"prompt": "Once"}),
    ]:
        reply = httpx.post(job.base_url + path, json={**body, "n": 2, "max_tokens": 2})
        assert reply.status_code == 400, reply.text
        error = reply.json()["error"]
        assert error["param"] == "n" and "cluster" in error["message"]
    assert chat(job, 1, n=1)["message"]["content"]


def test_requests_batched_across_ranks_answer_as_one_process(job, llama_alone):
    together = answers(job, 4)
    assert together == answers(llama_alone, 4)
    assert all(c["message"]["content"] for c in together)
    assert re.search(r"batch=[2-4]", job.log()), "the job never decoded two requests together"
    text = client(job).completions.create(model="llama", prompt="Once", max_tokens=9, temperature=0)
    same = client(llama_alone).completions.create(
        model="llama", prompt="Once", max_tokens=9, temperature=0
    )
    assert text.choices[0].text == same.choices[0].text


def test_seeded_sampling_and_grammars_answer_as_one_process(job, llama_alone):
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
    assert ours == sampled(llama_alone)
    call = ours[1][0]  # a random-weight model's arguments run to max_tokens, in the grammar
    assert call["name"] == "get_weather" and call["arguments"].startswith('{"city": "')
    # rank 0 seeds it for every rank (jobs run without --seed); ignore_eos: all 6 tokens
    unseeded = chat(job, 6, temperature=1.0, extra_body={"ignore_eos": True})  # unseeded: tested
    assert unseeded["finish_reason"] == "length"


def test_the_anthropic_and_responses_protocols_and_metrics_across_ranks(job, llama_alone):
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

    assert both(job) == both(llama_alone)
    metrics = httpx.get(job.base_url + "/metrics").text
    assert re.search(r"mlx_kvserve_requests_total\{[^}]*\} [1-9]", metrics), metrics[:2000]


def test_a_client_that_leaves_mid_stream_leaves_the_ranks_in_step(job, llama_alone):
    body = {
        "model": "llama",
        "messages": [{"role": "user", "content": "Count for me."}],
        "max_tokens": 2000,
        "ignore_eos": True,  # still running when the client leaves
        "temperature": 0,
        "stream": True,
    }
    with httpx.stream("POST", job.base_url + "/v1/chat/completions", json=body) as stream:
        for n, _line in enumerate(stream.iter_lines()):
            if n > 6:
                break
    job.wait_for_log("finish=cancelled")
    assert answers(job, 2) == answers(llama_alone, 2)
    assert httpx.get(job.base_url + "/health").json()["running"] == 0


def test_a_pipeline_job_answers_as_one_process(job_models, tmp_path):
    model = str(job_models["qwen3_next"])
    job = start_job(tmp_path, 2, "--model", model, "--shard", "pipeline", "--no-cache")
    single = ServerProcess(tmp_path, "--model", model, "--no-cache").wait_ready()
    try:
        assert httpx.get(job.base_url + "/health").json()["cluster"]["shard"] == "pipeline"
        assert answers(job, 3) == answers(single, 3)
    finally:
        single.stop()
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
