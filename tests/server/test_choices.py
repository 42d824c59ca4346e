"""Several choices (`n`) on /v1/chat/completions and /v1/completions, against the real server.

The official openai SDK reads them, streamed and not, with logprobs and forced tool calls; the
prompt is prefilled once (the metrics count it once); seeded choice i is the answer of a
one-choice request seeded seed + i; a client that leaves mid-stream leaves no row behind; `n`
out of range or not an integer is a 400 naming `n` (fuzzed with hypothesis).
"""

from __future__ import annotations

import json
import re
import uuid
from collections import defaultdict

import httpx
import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.server.test_disconnect import COUNTING, engine_lines, open_request, poll
from tests.server.test_metrics import scrape, value
from tests.server.test_tools import SCHEMAS, TOOLS
from tests.support.seeded import PLAIN

MODEL = "SmolLM2-135M-Instruct"
# every choice runs to max_tokens (exact counts), decoded plainly: seeded answers compared
# across requests must not hang on how wide speculation's passes were (tests/support/seeded.py)
RUN_ON = {"ignore_eos": True, **PLAIN}


def fresh(question: str = "Name a colour.") -> list[dict]:
    """A conversation the server has never seen (nothing of it cached but the template's head;
    not worded as other files' fresh conversations, which count what they find cached)."""
    return [
        {"role": "system", "content": f"{uuid.uuid4().hex} names this conversation."},
        {"role": "user", "content": question},
    ]


def running(server) -> int:
    return httpx.get(server.base_url + "/health", timeout=30).json()["running"]


def test_greedy_choices_are_equal_and_the_prompt_counts_once(server, openai_client):
    before = scrape(server.base_url)
    reply = openai_client.chat.completions.create(
        model=MODEL, messages=fresh(), temperature=0, max_tokens=12, n=3, extra_body=RUN_ON
    )
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert len({c.message.content for c in reply.choices}) == 1  # temperature 0: all equal
    assert {c.finish_reason for c in reply.choices} == {"length"}
    usage = reply.usage
    assert usage.completion_tokens == 3 * 12  # every choice's tokens
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    after = scrape(server.base_url)
    counted = value(after, "mlx_kvserve_prompt_tokens_total") - value(
        before, "mlx_kvserve_prompt_tokens_total"
    )
    assert counted == usage.prompt_tokens  # prefilled and counted once, not three times
    assert (
        value(after, "mlx_kvserve_generated_tokens_total")
        - value(before, "mlx_kvserve_generated_tokens_total")
        == 3 * 12
    )


def test_seeded_choices_reproduce_and_choice_i_uses_seed_plus_i(openai_client):
    messages = fresh("Write a word.")

    def ask(n: int, seed: int) -> list[str]:
        reply = openai_client.chat.completions.create(
            model=MODEL,
            messages=messages,
            temperature=1.0,
            seed=seed,
            max_tokens=8,
            n=n,
            extra_body=PLAIN,
        )
        return [c.message.content for c in reply.choices]

    three = ask(3, seed=40)
    assert ask(3, seed=40) == three  # a seeded n-request reproduces
    assert len(set(three)) > 1  # its choices are not copies of one another
    assert ask(1, seed=42) == three[2:]  # choice 2 is the answer seeded 40 + 2


def test_streamed_choices_carry_their_index_and_equal_the_body(openai_client):
    messages = fresh("Count to five.")
    asked = {"model": MODEL, "messages": messages, "temperature": 1.0, "seed": 5, "n": 4}
    body = openai_client.chat.completions.create(**asked, max_tokens=10, extra_body=RUN_ON)
    stream = openai_client.chat.completions.create(
        **asked,
        max_tokens=10,
        extra_body=RUN_ON,
        stream=True,
        stream_options={"include_usage": True},
    )
    texts: dict[int, str] = defaultdict(str)
    finishes: dict[int, str] = {}
    usage = None
    for chunk in stream:
        if chunk.usage is not None:
            assert not chunk.choices
            usage = chunk.usage
        for choice in chunk.choices:
            assert choice.index not in finishes  # nothing after a choice's finish
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    assert finishes == dict.fromkeys(range(4), "length")
    assert [texts[i] for i in range(4)] == [c.message.content for c in body.choices]
    assert usage is not None and usage.completion_tokens == 4 * 10
    assert usage.prompt_tokens == body.usage.prompt_tokens


def test_each_choice_has_its_logprobs(openai_client):
    reply = openai_client.chat.completions.create(
        model=MODEL,
        messages=fresh(),
        temperature=1.0,
        seed=9,
        max_tokens=6,
        n=2,
        logprobs=True,
        top_logprobs=2,
        extra_body=RUN_ON,
    )
    for choice in reply.choices:
        content = choice.logprobs.content
        assert len(content) == 6
        assert "".join(t.token for t in content) == choice.message.content
        assert all(len(t.top_logprobs) == 2 for t in content)


@pytest.mark.parametrize("stream", [False, True], ids=["body", "streamed"])
def test_each_choice_parses_its_own_tool_calls(openai_client, stream):
    asked = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "What's the weather in Paris?"}],
        "tools": TOOLS,
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "temperature": 1.0,
        "seed": 11,
        "max_tokens": 80,
        "n": 3,
    }
    if not stream:
        reply = openai_client.chat.completions.create(**asked)
        calls = {c.index: c.message.tool_calls for c in reply.choices}
        finishes = {c.index: c.finish_reason for c in reply.choices}
    else:
        args: dict[int, str] = defaultdict(str)
        names: dict[int, str] = {}
        finishes = {}
        for chunk in openai_client.chat.completions.create(**asked, stream=True):
            for choice in chunk.choices:
                for call in choice.delta.tool_calls or []:
                    assert call.index == 0  # one call per choice
                    names[choice.index] = call.function.name or names[choice.index]
                    args[choice.index] += call.function.arguments or ""
                if choice.finish_reason:
                    finishes[choice.index] = choice.finish_reason
        calls = {i: [(names[i], args[i])] for i in names}
    assert finishes == dict.fromkeys(range(3), "tool_calls")
    seen = set()
    for i in range(3):
        (call,) = calls[i]
        name, arguments = (call.function.name, call.function.arguments) if not stream else call
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])
        seen.add(arguments)
    assert len(seen) > 1  # each choice sampled its own call


def test_text_completions_with_several_choices(openai_client):
    asked = {
        "model": MODEL,
        "prompt": "Once upon a time",
        "temperature": 1.0,
        "seed": 3,
        "max_tokens": 7,
        "n": 3,
        "logprobs": 2,
        "extra_body": RUN_ON,
    }
    body = openai_client.completions.create(**asked)
    assert [c.index for c in body.choices] == [0, 1, 2]
    for choice in body.choices:
        assert choice.finish_reason == "length"
        assert "".join(choice.logprobs.tokens) == choice.text
        assert choice.logprobs.text_offset[0] == 0
    assert body.usage.completion_tokens == 3 * 7
    texts: dict[int, str] = defaultdict(str)
    tokens: dict[int, list[str]] = defaultdict(list)
    finishes = {}
    usage = None
    stream = openai_client.completions.create(
        **asked, stream=True, stream_options={"include_usage": True}
    )
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            if choice.logprobs is not None:
                tokens[choice.index] += choice.logprobs.tokens
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    assert [texts[i] for i in range(3)] == [c.text for c in body.choices]
    assert [tokens[i] for i in range(3)] == [c.logprobs.tokens for c in body.choices]
    assert finishes == dict.fromkeys(range(3), "length")
    assert usage is not None and usage.completion_tokens == 3 * 7


def test_a_client_that_leaves_mid_stream_leaves_no_rows(server):
    before = len(engine_lines(server))
    sock = open_request(server, {**COUNTING, "max_tokens": 2000, "n": 4, "stream": True})
    try:
        received = b""
        while received.count(b'"index": 3') < 2:  # every choice decodes
            received += sock.recv(65536)
        assert poll(lambda: running(server) == 4)
    finally:
        sock.close()
    assert poll(lambda: running(server) == 0)
    server.wait_for_log("text id=", after=before + 3)
    gone = engine_lines(server)[before:]
    assert [line["finish"] for line in gone] == ["cancelled"] * 4, gone


def test_choices_paused_by_a_full_kv_budget_resume_and_store_nothing(server, start_server):
    """Under a KV budget with room for about one answer, choices pause (checkpoint-free when
    a fork pauses), resume and still give the greedy answer; only choice 0's pauses store."""
    from tests.server.test_memory_admission import KV_BYTES_PER_TOKEN

    body = {"messages": [{"role": "user", "content": "What is a cat?"}], "temperature": 0}
    alone = httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=600).json()
    usage = alone["usage"]
    assert usage["completion_tokens"] >= 20  # long enough to grow past the budget
    budget = (usage["prompt_tokens"] + usage["completion_tokens"] + 24) * KV_BYTES_PER_TOKEN
    srv = start_server("--kv-budget", str(budget), "--kv-reserve", "8")
    reply = httpx.post(srv.base_url + "/v1/chat/completions", json={**body, "n": 3}, timeout=600)
    assert reply.status_code == 200, reply.text
    want = alone["choices"][0]["message"]["content"]
    assert [c["message"]["content"] for c in reply.json()["choices"]] == [want] * 3
    paused = re.findall(r"request (\S+) paused at", srv.log())
    forks = [rid for rid in paused if re.search(r"-[12]$", rid)]
    assert forks, srv.log()[-3000:]  # the youngest rows, the forks, paused
    entries = httpx.get(srv.base_url + "/v1/cache", timeout=30).json()["entries_list"]
    stored = [e for e in entries if e["reason"] == "pause"]
    assert len(stored) <= len(paused) - len(forks)  # a fork's pause stored nothing
    assert httpx.get(srv.base_url + "/health", timeout=30).json()["paused"] == 0


BAD_N = [0, -1, 9, 100, 1.5, "2", True, None, [2]]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
@pytest.mark.parametrize("n", BAD_N, ids=repr)
def test_bad_n_is_a_400_naming_n(server, path, n):
    body = {"messages": fresh()} if "chat" in path else {"prompt": "Hi"}
    reply = httpx.post(server.base_url + path, json={**body, "n": n, "max_tokens": 1}, timeout=60)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == "n"


@pytest.mark.parametrize(
    "extra",
    [{"echo": True, "logprobs": 1}, {"prompt": ["Hi", "Ho"]}, {"max_tokens": 0, "echo": True}],
    ids=["echo", "prompts", "scoring"],
)
def test_n_with_echo_several_prompts_or_scoring_is_a_400_naming_n(server, extra):
    body = {"prompt": "Hi", "max_tokens": 1, "n": 2, **extra}
    reply = httpx.post(server.base_url + "/v1/completions", json=body, timeout=60)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == "n"


@settings(
    max_examples=25,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    n=st.one_of(
        st.integers(min_value=-3, max_value=12),
        st.floats(allow_nan=False, allow_infinity=False),  # what a JSON encoder can send
        st.text(max_size=3),
        st.booleans(),
        st.none(),
    ),
    stream=st.booleans(),
    chat=st.booleans(),
)
def test_fuzzed_n_is_n_choices_or_a_400(server, n, stream, chat):
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body = {"messages": fresh()} if chat else {"prompt": "Hi"}
    body = {**body, "n": n, "max_tokens": 2, "stream": stream, "temperature": 0}
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        reply = client.post(path, json=body)
        good = type(n) is int and 1 <= n <= 8
        if not good:
            assert reply.status_code == 400, (n, reply.text)
            assert reply.json()["error"]["param"] == "n"
            return
        assert reply.status_code == 200, (n, reply.text)
        if not stream:
            assert [c["index"] for c in reply.json()["choices"]] == list(range(n))
            return
        lines = [ln[6:] for ln in reply.text.splitlines() if ln.startswith("data: ")]
        assert lines[-1] == "[DONE]"
        chunks = [json.loads(line) for line in lines[:-1]]
        ended = [c["index"] for ch in chunks for c in ch["choices"] if c["finish_reason"]]
        assert sorted(ended) == list(range(n))
