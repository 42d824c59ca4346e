"""The Anthropic Messages API through the official anthropic SDK, on the same engine and cache."""

from __future__ import annotations

import json
import threading
import time

import anthropic
import httpx
import jsonschema
import pytest

from tests.support.concurrently import concurrently

MODEL = "claude-opus-4-7"  # any name is served by the loaded model
SERVED = "SmolLM2-135M-Instruct"
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 24},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS = [{"name": "get_weather", "description": "Weather for a city", "input_schema": WEATHER}]
PROMPTS = [
    "What's the weather in Paris?",
    "Is it raining in Tokyo?",
    "Forecast for Lagos.",
    "How cold is Oslo?",
    "Weather in New York, please.",
    "Do I need an umbrella in London?",
    "Is it sunny in Lima?",
    "Temperature in Cairo in fahrenheit?",
    "How hot is Delhi?",
    "Weather for Sydney.",
]


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0)


def total_input(usage) -> int:
    return usage.input_tokens + usage.cache_read_input_tokens + usage.cache_creation_input_tokens


def test_messages_create(client):
    reply = client.messages.create(
        model=MODEL,
        max_tokens=12,
        system="You are terse.",
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        extra_body={"temperature": 0},
    )
    assert reply.id.startswith("msg_") and reply.type == "message" and reply.role == "assistant"
    assert reply.model == SERVED
    assert [b.type for b in reply.content] == ["text"] and reply.content[0].text
    assert reply.stop_reason in {"end_turn", "max_tokens"}
    assert reply.usage.output_tokens <= 12 and reply.usage.cache_creation_input_tokens == 0
    assert reply.usage.input_tokens >= 1


def test_stop_sequence_and_max_tokens(client):
    reply = client.messages.create(
        model=MODEL,
        max_tokens=3,
        messages=[{"role": "user", "content": "Count: 1, 2, 3, 4, 5, 6"}],
        extra_body={"temperature": 0, "ignore_eos": True},  # all 3 tokens, however it goes
    )
    assert reply.stop_reason == "max_tokens" and reply.usage.output_tokens == 3
    text = (
        client.messages.create(
            model=MODEL,
            max_tokens=40,
            messages=[{"role": "user", "content": "Say hello"}],
            extra_body={"temperature": 0, "ignore_eos": True},  # words to stop at
        )
        .content[0]
        .text
    )
    word = text.split()[1] if len(text.split()) > 1 else text[1:3]
    stopped = client.messages.create(
        model=MODEL,
        max_tokens=40,
        messages=[{"role": "user", "content": "Say hello"}],
        extra_body={"temperature": 0, "ignore_eos": True},
        stop_sequences=[word],
    )
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == word
    assert word not in stopped.content[0].text


def test_structured_output_config(client):
    schema = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 20},
            "country": {"type": "string", "maxLength": 20},
        },
        "required": ["city", "country"],
        "additionalProperties": False,
    }
    reply = client.messages.create(
        model=MODEL,
        max_tokens=60,
        messages=[{"role": "user", "content": "Where is the Eiffel Tower?"}],
        output_config={"format": {"type": "json_schema", "schema": schema}},
    )
    jsonschema.validate(json.loads(reply.content[0].text), schema)


def test_stream_event_sequence(server, client):
    body = {
        "model": MODEL,
        "max_tokens": 8,
        "stream": True,
        "messages": [{"role": "user", "content": "Hello"}],
    }
    with httpx.stream(
        "POST",
        server.base_url + "/v1/messages",
        json=body,
        timeout=60,
        headers={"anthropic-version": "2023-06-01", "x-api-key": "unused"},
    ) as resp:
        assert resp.status_code == 200
        names = [ln[len("event: ") :] for ln in resp.iter_lines() if ln.startswith("event: ")]
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"}
    with client.messages.stream(
        model=MODEL,
        max_tokens=8,
        messages=[{"role": "user", "content": "Hello"}],
        extra_body={"temperature": 0},
    ) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    whole = client.messages.create(
        model=MODEL,
        max_tokens=8,
        messages=[{"role": "user", "content": "Hello"}],
        extra_body={"temperature": 0},
    )
    assert streamed == final.content[0].text == whole.content[0].text
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert total_input(final.usage) == total_input(whole.usage)


def test_forced_tool_input_validates(client):
    """20 forced calls, "any" and named in turn, sent 8 at a time (one batch, as agents' are)."""

    def ask(pair: tuple[int, str]):
        i, prompt = pair
        choice = {"type": "tool", "name": "get_weather"} if i % 2 else {"type": "any"}
        return client.messages.create(
            model=MODEL,
            max_tokens=60,
            messages=[{"role": "user", "content": prompt}],
            tools=TOOLS,
            tool_choice={**choice, "disable_parallel_tool_use": True},
        )

    for reply in concurrently(ask, enumerate(PROMPTS * 2)):
        assert reply.stop_reason == "tool_use"
        uses = [b for b in reply.content if b.type == "tool_use"]
        assert len(uses) == 1 and uses[0].id.startswith("toolu_")
        assert uses[0].name == "get_weather"
        jsonschema.validate(uses[0].input, WEATHER)


def test_streamed_tool_use_matches(client):
    kwargs = dict(
        model=MODEL,
        max_tokens=60,
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=TOOLS,
        tool_choice={"type": "tool", "name": "get_weather"},
        extra_body={"temperature": 0},
    )
    with client.messages.stream(**kwargs) as stream:
        partial = "".join(
            e.delta.partial_json
            for e in stream
            if e.type == "content_block_delta" and e.delta.type == "input_json_delta"
        )
        final = stream.get_final_message()
    whole = client.messages.create(**kwargs)
    assert final.stop_reason == "tool_use"
    assert json.loads(partial) == final.content[0].input == whole.content[0].input


def test_tool_loop_reads_the_previous_turn_from_cache(client):
    messages = [{"role": "user", "content": "What's the weather in Paris?"}]
    system = "You are a weather assistant. Use the tools."
    previous_total = None
    for turn in range(6):
        reply = client.messages.create(
            model=MODEL,
            max_tokens=60,
            system=system,
            messages=messages,
            tools=TOOLS,
            tool_choice={"type": "tool", "name": "get_weather"},
            extra_body={"temperature": 0},
        )
        usage = reply.usage
        if previous_total is not None:
            assert usage.cache_read_input_tokens >= 0.9 * previous_total, (turn, usage)
        previous_total = total_input(usage)
        use = next(b for b in reply.content if b.type == "tool_use")
        messages.append({"role": "assistant", "content": [b.model_dump() for b in reply.content]})
        messages.append(
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": use.id, "content": "21 C, clear"},
                    {"type": "text", "text": f"And in city number {turn + 2}?"},
                ],
            }
        )


def test_count_tokens_equals_reported_total(client):
    kwargs = dict(
        model=MODEL,
        system=[{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
        messages=[{"role": "user", "content": "Weather in Rome?"}],
        tools=TOOLS,
    )
    counted = client.messages.count_tokens(**kwargs).input_tokens
    reply = client.messages.create(**kwargs, max_tokens=2)
    assert counted == total_input(reply.usage)


HEADER = "x-anthropic-billing-header: cc_version=2.1.37; cc_entrypoint=cli; "


def test_billing_header_does_not_defeat_the_cache(client):
    system = "You are Claude Code, a coding agent. " + "Follow the repository's conventions. " * 40
    question = [{"role": "user", "content": "List the files."}]
    first = client.messages.create(
        model=MODEL,
        max_tokens=2,
        messages=question,
        system=f"{HEADER}cch=a1b2c;\n{system}",
    )
    second = client.messages.create(
        model=MODEL,
        max_tokens=2,
        messages=question,
        system=f"{HEADER}cch=9f3e7;\n{system}",
    )
    assert total_input(first.usage) == total_input(second.usage)
    assert second.usage.cache_read_input_tokens >= 0.95 * total_input(second.usage)


def test_billing_header_kept_when_asked(start_server):
    srv = start_server("--keep-billing-header")
    c = anthropic.Anthropic(base_url=srv.base_url, api_key="unused", max_retries=0)
    with_header = c.messages.count_tokens(
        model=MODEL,
        system="x-anthropic-billing-header: cch=a1b2c;\nHi",
        messages=[{"role": "user", "content": "x"}],
    ).input_tokens
    without = c.messages.count_tokens(
        model=MODEL, system="Hi", messages=[{"role": "user", "content": "x"}]
    ).input_tokens
    assert with_header > without


def post(server, body, **headers):
    return httpx.post(server.base_url + "/v1/messages", json=body, headers=headers, timeout=60)


def assert_anthropic_error(resp, status: int, kind: str) -> str:
    assert resp.status_code == status, resp.text
    data = resp.json()
    assert data["type"] == "error" and data["error"]["type"] == kind, data
    return data["error"]["message"]


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"model": MODEL, "messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
        (
            {
                "model": MODEL,
                "max_tokens": 5,
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {
                                "type": "image",
                                "source": {
                                    "type": "base64",
                                    "media_type": "image/png",
                                    "data": "AA",
                                },
                            }
                        ],
                    }
                ],
            },
            "image",
        ),
        (
            {
                "model": MODEL,
                "max_tokens": 5,
                "messages": [{"role": "user", "content": "x"}],
                "tools": TOOLS,
                "tool_choice": {"type": "tool", "name": "nope"},
            },
            "nope",
        ),
        (
            {
                "model": MODEL,
                "max_tokens": 5,
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "tool_result", "tool_use_id": "toolu_x", "content": "1"}
                        ],
                    }
                ],
            },
            "toolu_x",
        ),
        (
            {
                "model": MODEL,
                "max_tokens": 5,
                "temperature": 1.5,  # unseeded: refused, Anthropic's temperatures end at 1
                "messages": [{"role": "user", "content": "x"}],
            },
            "temperature",
        ),
    ],
    ids=["no-max-tokens", "image", "unknown-tool", "orphan-result", "temperature"],
)
def test_invalid_requests_in_anthropic_shape(server, body, needle):
    assert needle in assert_anthropic_error(post(server, body), 400, "invalid_request_error")


def test_unknown_path_and_sdk_error_types(server, client):
    missing = httpx.post(server.base_url + "/v1/messages/nope", json={}, timeout=10)
    assert_anthropic_error(missing, 404, "not_found_error")
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(
            model=MODEL, max_tokens=0, messages=[{"role": "user", "content": "x"}]
        )


def test_auth_by_x_api_key_or_bearer_and_size_limit(start_server):
    srv = start_server("--api-key", "sekrit", "--max-body-bytes", "4096")
    body = {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
    assert_anthropic_error(post(srv, body), 401, "authentication_error")
    assert_anthropic_error(post(srv, body, **{"x-api-key": "wrong"}), 401, "authentication_error")
    ok = post(
        srv,
        body,
        **{
            "x-api-key": "sekrit",
            "anthropic-version": "2023-06-01",
            "anthropic-beta": "prompt-caching-2024-07-31",
        },
    )
    assert ok.status_code == 200
    assert post(srv, body, Authorization="Bearer sekrit").status_code == 200
    sdk = anthropic.Anthropic(base_url=srv.base_url, api_key="sekrit", max_retries=0)
    assert sdk.messages.count_tokens(model=MODEL, messages=body["messages"]).input_tokens > 0
    big = {**body, "messages": [{"role": "user", "content": "x" * 5000}]}
    assert_anthropic_error(post(srv, big, **{"x-api-key": "sekrit"}), 413, "request_too_large")


def test_full_queue_is_529_overloaded(start_server):
    srv = start_server("--max-queue", "1", "--max-concurrency", "1")  # the others must queue
    long_body = {"prompt": "1, 2, 3, 4, 5,", "max_tokens": 4000, "ignore_eos": True, "stream": True}
    holding = threading.Event()
    release = threading.Event()

    def hold(event: threading.Event) -> None:
        with httpx.stream(
            "POST", srv.base_url + "/v1/completions", json=long_body, timeout=120
        ) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    event.set()
                if release.is_set():
                    return

    holder = threading.Thread(target=hold, args=(holding,))
    holder.start()
    assert holding.wait(60)
    queued = threading.Thread(target=hold, args=(threading.Event(),))
    queued.start()
    try:
        for _ in range(600):  # until the second stream waits in the queue
            if httpx.get(srv.base_url + "/health", timeout=10).json().get("queued", 0) >= 1:
                break
            time.sleep(0.05)
        body = {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
        assert_anthropic_error(post(srv, body), 529, "overloaded_error")
    finally:
        release.set()
        holder.join(60)
        queued.join(60)


def test_replayed_thinking_blocks_are_accepted(client):
    """Claude Code resends the model's thinking with Anthropic's signatures (never trusted: the
    visible text becomes the turn's reasoning); the default model's template renders no past
    reasoning, so the prompt is the same as without the blocks."""
    plain = [
        {"role": "user", "content": "Weather in Rome?"},
        {"role": "assistant", "content": [{"type": "text", "text": "Sunny."}]},
        {"role": "user", "content": "And tomorrow?"},
    ]
    thinking = json.loads(json.dumps(plain))
    thinking[1]["content"] = [
        {"type": "thinking", "thinking": "The user wants weather.", "signature": "sig"},
        {"type": "redacted_thinking", "data": "opaque"},
        *plain[1]["content"],
    ]
    count = client.messages.count_tokens
    assert count(model=MODEL, messages=thinking).input_tokens == (
        count(model=MODEL, messages=plain).input_tokens
    )
    reply = client.messages.create(model=MODEL, max_tokens=4, messages=thinking)
    assert reply.stop_reason in {"end_turn", "max_tokens"}


def test_failure_after_the_stream_started_is_an_error_event(start_server):
    """A stream cut short by the server (here: shutdown past its grace) ends with
    `event: error` in Anthropic's shape, not with a torn connection or a fake message_stop."""
    srv = start_server("--shutdown-grace", "1")
    body = {
        "model": MODEL,
        "max_tokens": 4000,
        "stream": True,
        "messages": [{"role": "user", "content": "Count from 1 to 1000, one number per line."}],
        # a forced call whose input must be long: the answer cannot end by itself within the
        # shutdown's grace (a free answer sometimes did, and ended with a true message_stop)
        "tools": [
            {
                "name": "write",
                "input_schema": {
                    "type": "object",
                    "properties": {"text": {"type": "string", "minLength": 3000}},
                    "required": ["text"],
                },
            }
        ],
        "tool_choice": {"type": "tool", "name": "write"},
    }
    events: list[tuple[str, str]] = []
    started = threading.Event()

    def read() -> None:
        name = ""
        with httpx.stream("POST", srv.base_url + "/v1/messages", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("event: "):
                    name = line[len("event: ") :]
                elif line.startswith("data: "):
                    events.append((name, line[len("data: ") :]))
                    if name == "content_block_delta":
                        started.set()

    reader = threading.Thread(target=read)
    reader.start()
    assert started.wait(120)
    srv.stop()
    reader.join(60)
    names = [name for name, _ in events]
    assert names[-1] == "error" and "message_stop" not in names, names[-5:]
    error = json.loads(events[-1][1])
    assert error["type"] == "error" and error["error"]["type"] in {"overloaded_error", "api_error"}
    assert error["error"]["message"]
