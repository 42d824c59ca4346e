"""Reasoning apart from the answer, thinking controls and past reasoning, on the OpenAI chat API.

Real servers on tiny random-weight models (tests/support/thinking_models.py) whose tokenizers
carry `<think>`/`</think>` and whose chat templates are the families' own (tests/fixtures):
Qwen3.5 and DeepSeek-R1 distills open `<think>` in the generation prompt, so everything the
model samples before `</think>` is reasoning; Qwen3 reasons only when the model writes `<think>`.
The model never closes its reasoning by chance, so a thinking budget is what ends it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from hypothesis import HealthCheck, given, settings

from tests.support.fuzzing import check, json_body
from tests.support.seeded import PLAIN
from tests.support.servers import ServerProcess, client_for
from tests.support.thinking_models import build_thinking_model

pytestmark = pytest.mark.slow

HI = [{"role": "user", "content": "Say hi."}]
# seeded: the same tokens however the request runs; the tests compare requests token for
# token, so they decode plainly (tests/support/seeded.py)
SAMPLING = {"temperature": 1.0, "seed": 7, **PLAIN}


def _serve(
    tmp: Path, family: str, *flags: str, architecture: str = "llama"
) -> Iterator[ServerProcess]:
    model = build_thinking_model(tmp / family, family, architecture=architecture)
    proc = ServerProcess(tmp, "--model", str(model), *flags).wait_ready()
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def qwen35(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    yield from _serve(tmp_path_factory.mktemp("qwen35"), "qwen3.5")


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    yield from _serve(tmp_path_factory.mktemp("qwen3"), "qwen3")


@pytest.fixture(scope="module")
def r1(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """R1 with server defaults: a thinking budget of 6 and a template variable."""
    yield from _serve(
        tmp_path_factory.mktemp("r1"),
        "deepseek-r1",
        "--thinking-budget",
        "6",
        "--chat-template-kwargs",
        '{"enable_thinking": false}',  # the R1 template reads no such variable: ignored
    )


def chat(server: ServerProcess, **body) -> dict:
    body = {"messages": HI, "max_tokens": 24, **SAMPLING, **body}
    r = httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def streamed(server: ServerProcess, **body) -> tuple[str, str, str | None]:
    """(reasoning, content, finish_reason) of a streamed answer, from the raw SSE deltas."""
    body = {"messages": HI, "max_tokens": 24, **SAMPLING, **body, "stream": True}
    reasoning, alias, content, finish = "", "", "", None
    with httpx.stream(
        "POST", server.base_url + "/v1/chat/completions", json=body, timeout=120
    ) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"][0]
            delta = choice["delta"]
            reasoning += delta.get("reasoning_content") or ""
            alias += delta.get("reasoning") or ""
            content += delta.get("content") or ""
            finish = choice["finish_reason"] or finish
    assert alias == reasoning  # both names carry the same deltas
    return reasoning, content, finish


def message(answer: dict) -> dict:
    return answer["choices"][0]["message"]


# -- reasoning apart ---------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["qwen35", "r1"])
def test_reasoning_is_apart_from_the_answer(family: str, request: pytest.FixtureRequest) -> None:
    server = request.getfixturevalue(family)
    answer = chat(server)
    msg = message(answer)
    assert msg["reasoning_content"], msg
    assert msg["reasoning"] == msg["reasoning_content"]
    assert "</think>" not in (msg["content"] or "") and "<think>" not in msg["reasoning_content"]
    reasoning, content, finish = streamed(server)
    assert reasoning == msg["reasoning_content"]
    assert content == msg["content"]
    assert finish == answer["choices"][0]["finish_reason"]


def test_openai_sdk_reads_the_reasoning(qwen35: ServerProcess) -> None:
    client = client_for(qwen35)
    done = client.chat.completions.create(
        model="m", messages=HI, max_tokens=8, temperature=1.0, seed=7
    )
    assert done.choices[0].message.model_extra["reasoning_content"]
    assert done.choices[0].message.content == ""  # still thinking when max_tokens ran out


def test_enable_thinking_false_changes_the_prompt_and_drops_the_reasoning(
    qwen35: ServerProcess,
) -> None:
    thinking = chat(qwen35)
    off = chat(qwen35, chat_template_kwargs={"enable_thinking": False})
    assert off["usage"]["prompt_tokens"] > thinking["usage"]["prompt_tokens"]  # <think></think>
    assert "reasoning_content" not in message(off)
    assert message(off)["content"]
    # reasoning_effort "none" is mapped onto the same template variable
    none = chat(qwen35, reasoning_effort="none")
    assert none["usage"]["prompt_tokens"] == off["usage"]["prompt_tokens"]
    assert message(none) == message(off)
    # explicit chat_template_kwargs win over the mapped effort
    both = chat(qwen35, reasoning_effort="high", chat_template_kwargs={"enable_thinking": False})
    assert both["usage"]["prompt_tokens"] == off["usage"]["prompt_tokens"]
    high = chat(qwen35, reasoning_effort="high")
    assert high["usage"]["prompt_tokens"] == thinking["usage"]["prompt_tokens"]


def test_qwen3_enable_thinking_false_closes_an_empty_block(qwen3: ServerProcess) -> None:
    default = chat(qwen3)
    off = chat(qwen3, chat_template_kwargs={"enable_thinking": False})
    assert off["usage"]["prompt_tokens"] > default["usage"]["prompt_tokens"]
    assert "reasoning_content" not in message(off)


# -- the budget --------------------------------------------------------------------------------
@pytest.mark.parametrize("budget", [3, 10])
def test_budget_ends_the_reasoning_and_the_answer_follows(
    qwen35: ServerProcess, budget: int
) -> None:
    unlimited = chat(qwen35, max_tokens=budget)  # the first `budget` tokens, all reasoning
    assert message(unlimited)["content"] == ""
    limited = chat(qwen35, max_tokens=budget + 16, thinking_token_budget=budget)
    msg = message(limited)
    # the same tokens up to the budget, then the forced end of thinking: exactly `budget`
    assert msg["reasoning_content"] == message(unlimited)["reasoning_content"]
    assert msg["content"] and "</think>" not in msg["content"]
    reasoning, content, _ = streamed(qwen35, max_tokens=budget + 16, thinking_token_budget=budget)
    assert (reasoning, content) == (msg["reasoning_content"], msg["content"])
    # with logprobs the end is forced through the mask instead (sampled, so the answer's draws
    # differ): the same reasoning, then an answer
    with_logprobs = message(
        chat(qwen35, max_tokens=budget + 16, thinking_token_budget=budget, logprobs=True)
    )
    assert with_logprobs["reasoning_content"] == msg["reasoning_content"]
    assert with_logprobs["content"] and "</think>" not in with_logprobs["content"]


def test_server_default_budget_and_a_request_budget_over_it(r1: ServerProcess) -> None:
    default = message(chat(r1))
    assert default["reasoning_content"] == message(chat(r1, max_tokens=6))["reasoning_content"]
    assert default["content"]
    longer = message(chat(r1, thinking_token_budget=12))
    first_12 = message(chat(r1, max_tokens=12, thinking_token_budget=100))
    assert longer["reasoning_content"] == first_12["reasoning_content"]
    assert len(longer["reasoning_content"]) > len(default["reasoning_content"])


# -- history -----------------------------------------------------------------------------------
def tool_loop(**assistant) -> list[dict]:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    return [
        {"role": "user", "content": "Use the tool."},
        {"role": "assistant", "content": "", "tool_calls": [call], **assistant},
        {"role": "tool", "tool_call_id": "c1", "content": "42"},
    ]


def test_past_reasoning_reaches_the_template(qwen3: ServerProcess) -> None:
    """Qwen3 renders the reasoning of assistant turns after the last user message."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    base = chat(qwen3, messages=tool_loop(), tools=tools, max_tokens=1)
    thought = "I should call f to find out."
    given = chat(qwen3, messages=tool_loop(reasoning_content=thought), tools=tools, max_tokens=1)
    alias = chat(qwen3, messages=tool_loop(reasoning=thought), tools=tools, max_tokens=1)
    assert given["usage"]["prompt_tokens"] > base["usage"]["prompt_tokens"]
    assert alias["usage"]["prompt_tokens"] == given["usage"]["prompt_tokens"]


def test_next_turn_hits_the_cache_where_the_template_strips_the_reasoning(
    r1: ServerProcess,
) -> None:
    """R1 drops past reasoning: the next prompt departs from the last one where `<think>` was
    opened, and the cache serves everything before it."""
    first = chat(r1, messages=[{"role": "user", "content": "A question about caches."}])
    msg = message(first)
    entries = httpx.get(r1.base_url + "/v1/cache", timeout=60).json()["entries_list"]
    opened = first["usage"]["prompt_tokens"] - 2  # before `<think>\n`
    assert {"prompt": opened} in [{e["reason"]: e["n_tokens"]} for e in entries], entries
    history = [
        {"role": "user", "content": "A question about caches."},
        {"role": "assistant", "content": msg["content"], "reasoning_content": msg["reasoning"]},
        {"role": "user", "content": "And another."},
    ]
    second = chat(r1, messages=history)
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= first["usage"]["prompt_tokens"] - 2  # all but `<think>\n`


# -- bad input ---------------------------------------------------------------------------------
BAD = [
    ({"chat_template_kwargs": [1]}, "chat_template_kwargs"),
    ({"chat_template_kwargs": "enable_thinking=false"}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs.tokenize"),
    ({"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs."),
    ({"reasoning_effort": "extreme"}, "reasoning_effort"),
    ({"reasoning_effort": 3}, "reasoning_effort"),
    ({"thinking_token_budget": 0}, "thinking_token_budget"),
    ({"thinking_token_budget": -5}, "thinking_token_budget"),
    ({"thinking_token_budget": 2.5}, "thinking_token_budget"),
    ({"thinking_token_budget": "8"}, "thinking_token_budget"),
    ({"thinking_token_budget": True}, "thinking_token_budget"),
    ({"messages": [{"role": "user", "content": "x", "reasoning_content": "y"}]}, "messages[0]"),
    ({"messages": [{"role": "assistant", "content": "x", "reasoning": 5}]}, "messages.0"),
    ({"messages": [{"role": "assistant", "content": "", "reasoning_content": {}}]}, "messages.0"),
]


@pytest.mark.parametrize(("fields", "param"), BAD)
def test_bad_reasoning_input_is_a_400_naming_the_field(
    qwen35: ServerProcess, fields: dict, param: str
) -> None:
    body = {"messages": HI, "max_tokens": 2, **fields}
    r = httpx.post(qwen35.base_url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"].startswith(param), error
    field = param.split(".")[-1].split("[")[0] or param.split(".")[0]
    assert field in error["message"] or field in error["param"]


def test_a_template_that_raises_is_a_400_with_its_message(qwen35: ServerProcess) -> None:
    """Qwen3.5's template raises on a conversation without a user turn; its message is the 400's.
    (A late system message, which it also refuses, is folded into the user turn instead.)"""
    body = {
        "messages": [{"role": "system", "content": "s"}, {"role": "assistant", "content": "a"}],
        "max_tokens": 2,
    }
    r = httpx.post(qwen35.base_url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert "No user query found in messages." in r.json()["error"]["message"]
    late = {"messages": [*HI, {"role": "system", "content": "late"}], "max_tokens": 2}
    r = httpx.post(qwen35.base_url + "/v1/chat/completions", json=late, timeout=60)
    assert r.status_code == 200, r.text


@settings(
    max_examples=40,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(body=json_body("/v1/chat/completions"))
def test_fuzzed_chat_bodies_never_break_a_thinking_model(
    qwen35: ServerProcess, body: bytes
) -> None:
    with httpx.Client(base_url=qwen35.base_url, timeout=60) as client:
        r = client.post(
            "/v1/chat/completions", content=body, headers={"content-type": "application/json"}
        )
        streamed_ = r.headers.get("content-type", "").startswith("text/event-stream")
        assert check(r.status_code, r.content, streamed_, "/v1/chat/completions") is None, (
            body,
            r.text[:300],
        )


def test_a_forced_call_follows_the_reasoning(r1: ServerProcess) -> None:
    """R1 distills have no tool format mlx-lm knows: the Hermes fallback, constrained. The
    grammar waits for the reasoning to end (the server's budget of 6), then forces the call."""
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_time",
                "parameters": {
                    "type": "object",
                    "properties": {"zone": {"type": "string", "maxLength": 8}},
                    "required": ["zone"],
                    "additionalProperties": False,
                },
            },
        }
    ]
    body = {"tools": tools, "tool_choice": "required", "max_tokens": 80}
    answer = chat(r1, **body)
    msg = message(answer)
    free = chat(r1, tools=tools, tool_choice="none", max_tokens=6)  # the same prompt, no grammar
    assert msg["reasoning_content"] == message(free)["reasoning_content"]
    (call,) = msg["tool_calls"]
    assert call["function"]["name"] == "get_time"
    assert set(json.loads(call["function"]["arguments"])) == {"zone"}
    assert answer["choices"][0]["finish_reason"] == "tool_calls"
    reasoning, _, finish = streamed(r1, **body)
    assert (reasoning, finish) == (msg["reasoning_content"], "tool_calls")


def _rotating(tmp: Path, family: str) -> Iterator[ServerProcess]:
    """A family's template on a model with sliding-window layers, whose caches cannot be
    trimmed."""
    yield from _serve(tmp, family, architecture="gemma3_text")


@pytest.fixture(scope="module")
def qwen3_rotating(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    yield from _rotating(tmp_path_factory.mktemp("qwen3_rotating"), "qwen3")


@pytest.fixture(scope="module")
def r1_rotating(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    yield from _rotating(tmp_path_factory.mktemp("r1_rotating"), "deepseek-r1")


def cache_entries(server: ServerProcess) -> list[tuple[str, int]]:
    entries = httpx.get(server.base_url + "/v1/cache", timeout=60).json()["entries_list"]
    return [(e["reason"], e["n_tokens"]) for e in entries]


@pytest.mark.parametrize(("family", "departs"), [("qwen3_rotating", 1), ("r1_rotating", 2)])
def test_the_next_turn_resumes_where_it_departs_on_untrimmable_caches(
    family: str, departs: int, request: pytest.FixtureRequest
) -> None:
    """Both templates drop the reasoning of earlier turns, so the next prompt departs from the
    last one at its end (Qwen3: checkpointed one token before it, where a retry of the same
    request departs too) or at the `<think>` its generation prompt opened (R1). A
    sliding-window cache cannot be cut back there from the generation's checkpoint, so that point
    is a checkpoint of its own, which the generation's does not replace."""
    server = request.getfixturevalue(family)
    turn = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why?"}]
    first = chat(server, messages=turn, max_tokens=4)
    at = first["usage"]["prompt_tokens"] - departs
    assert ("prompt", at) in cache_entries(server)
    answered = {"role": "assistant", "content": "Because.", "reasoning_content": "Hmm, why."}
    second = chat(server, messages=[*turn, answered, {"role": "user", "content": "Sure?"}])
    # At least that point; a window not yet full may also be cut back from a longer state.
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert at <= cached <= first["usage"]["prompt_tokens"] - departs + 1


def test_trimmable_caches_keep_no_prompt_end_checkpoint(qwen3: ServerProcess) -> None:
    """They are cut back from the generation's checkpoint instead."""
    turn = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why?"}]
    chat(qwen3, messages=turn, max_tokens=4)
    assert cache_entries(qwen3) and not [e for e in cache_entries(qwen3) if e[0] == "prompt"]
