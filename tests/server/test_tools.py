"""Tool calling, faithful tool history and constrained decoding on the OpenAI chat API.

Real server, real default model (SmolLM2-135M, whose template has no tool support: it gets the
Hermes fallback format), the official openai SDK. Every forced call must parse and validate
against the function's JSON Schema, however small the model.
"""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

from tests.support import tool_schemas
from tests.support.concurrently import concurrently
from tests.support.tool_checks import forced_choice, named_arguments, streamed_calls
from tests.support.tool_schemas import TIME

MODEL = "SmolLM2-135M-Instruct"

# SmolLM2's weather tool: the shared one without its optional parameters
WEATHER = {
    **tool_schemas.WEATHER,
    "properties": {k: tool_schemas.WEATHER["properties"][k] for k in ("city", "unit", "days")},
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather forecast for a city",
            "parameters": WEATHER,
        },
    },
    {
        "type": "function",
        "function": {"name": "get_time", "description": "Current time", "parameters": TIME},
    },
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
PROMPTS = [
    "What's the weather in Paris?",
    "Will it rain in Tokyo this week?",
    "Forecast for Lagos, please.",
    "Is it cold in Oslo?",
    "What time is it in New York?",
    "Should I take an umbrella in London tomorrow?",
    "Weather for Lima for three days.",
    "Tell me the temperature in Cairo in fahrenheit.",
    "How hot is it in Delhi?",
    "Time in Sydney?",
]


def assert_valid_call(call) -> dict:
    assert call.type == "function" and call.id.startswith("call_")
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, SCHEMAS[call.function.name])
    return args


@pytest.mark.parametrize("named", [True, False], ids=["named", "required"])
def test_forced_calls_always_validate(openai_client, named):
    """20 prompt and seed pairs per mode at temperature 1: every forced call is valid (sent
    8 at a time, so the call grammars are also checked side by side in one batch)."""

    def ask(pair: tuple[int, str]):
        seed, prompt = pair
        return forced_choice(
            openai_client,
            named=named,
            seed=seed,
            max_tokens=80,
            messages=[{"role": "user", "content": prompt}],
            tools=TOOLS,
            model=MODEL,
        )

    for choice0 in concurrently(ask, enumerate(PROMPTS * 2)):
        assert choice0.message.content is None  # no tool markup left in content
        assert len(choice0.message.tool_calls) == 1
        call = choice0.message.tool_calls[0]
        if named:
            assert call.function.name == "get_weather"
        assert_valid_call(call)


def test_unimplemented_schema_keywords_are_ignored_in_tools(openai_client):
    """Claude Code's tools use `propertyNames`, which the grammar library does not implement: the
    keyword is ignored (as non-strict OpenAI tools ignore what they do not enforce), the rest of
    the schema still constrains the call."""
    schema = {
        "type": "object",
        "properties": {"tags": {"type": "object", "propertyNames": {"pattern": "^[a-z]+$"}}},
        "required": ["tags"],
        "additionalProperties": False,
    }
    tool = {"type": "function", "function": {"name": "tag", "parameters": schema}}
    reply = openai_client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Tag this."}],
        tools=[tool],
        tool_choice="required",
        temperature=0,
        max_tokens=60,
    )
    call = reply.choices[0].message.tool_calls[0]
    assert list(json.loads(call.function.arguments)) == ["tags"]


def test_streamed_call_reassembles_to_the_non_streamed_one(openai_client):
    kwargs = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "What's the weather in Paris?"}],
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
        max_tokens=120,
    )
    whole = openai_client.chat.completions.create(**kwargs).choices[0]
    streamed = streamed_calls(openai_client, **kwargs)  # nothing of the call leaks into content
    assert streamed.finish == "tool_calls"
    assert streamed.fragments > 2  # arguments arrive in fragments as they are generated
    assert [c[1:] for c in streamed.calls] == named_arguments(whole.message.tool_calls)


def test_tool_loop_reuses_the_previous_turn(openai_client):
    """8 turns of user / call / result: each turn reads >= 90% of the last prompt from cache."""
    messages = [
        {"role": "system", "content": "You are a weather assistant. Use the tools."},
        {"role": "user", "content": "What's the weather in Paris?"},
    ]
    cities = ["Rome", "Oslo", "Lima", "Kyiv", "Doha", "Baku", "Suva"]
    previous_prompt = None
    for turn in range(8):
        reply = openai_client.chat.completions.create(
            model=MODEL,
            messages=messages,
            tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
            temperature=0,
            max_tokens=80,
        )
        usage = reply.usage
        if previous_prompt is not None:
            assert usage.prompt_tokens_details.cached_tokens >= 0.9 * previous_prompt, (
                turn,
                usage,
            )
        previous_prompt = usage.prompt_tokens
        call = reply.choices[0].message.tool_calls[0]
        assert_valid_call(call)
        messages.append(reply.choices[0].message.model_dump(exclude_none=True))
        messages.append(
            {
                "role": "tool",
                "tool_call_id": call.id,
                "content": '{"temperature": 21, "sky": "clear"}',
            }
        )
        if turn < 7:
            messages.append({"role": "user", "content": f"And in {cities[turn]}?"})


def test_json_schema_output_validates_every_time(openai_client):
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 16},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "pets": {"type": "array", "items": {"enum": ["cat", "dog", "fish"]}, "maxItems": 3},
        },
        "required": ["name", "age", "pets"],
        "additionalProperties": False,
    }

    def ask(seed: int) -> str:
        reply = openai_client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Describe a person as JSON."}],
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "person", "schema": schema, "strict": True},
            },
            temperature=1.0,
            seed=seed,
            max_tokens=80,
        )
        return reply.choices[0].message.content

    contents = concurrently(ask, range(50))  # 8 at a time: the grammars side by side in a batch
    for content in contents:
        jsonschema.validate(json.loads(content), schema)
    assert len(contents) == 50


def test_json_object_output_parses(openai_client):
    reply = openai_client.chat.completions.create(
        model=MODEL,
        messages=[
            {
                "role": "user",
                "content": "Give a JSON object with the keys name and city for a fictional person.",
            }
        ],
        response_format={"type": "json_object"},
        temperature=0,
        max_tokens=100,
    )
    assert reply.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(reply.choices[0].message.content), dict)


def test_auto_history_and_tool_none(openai_client):
    """A full history with a call and its result is accepted; tool_choice none returns text."""
    history = [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {
                        "name": "get_weather",
                        "arguments": '{"city": "Paris", "unit": "celsius", "days": 1}',
                    },
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "21 C"},
    ]
    reply = openai_client.chat.completions.create(
        model=MODEL, messages=history, tools=TOOLS, tool_choice="none", max_tokens=20
    )
    assert reply.choices[0].message.tool_calls is None
    assert reply.choices[0].finish_reason in {"stop", "length"}
    auto = openai_client.chat.completions.create(
        model=MODEL, messages=history, tools=TOOLS, temperature=0, max_tokens=60
    )
    for call in auto.choices[0].message.tool_calls or []:
        assert_valid_call(call)  # in auto, a call the model opens is constrained too


def test_logprobs_chat_and_completions(server, openai_client):
    reply = openai_client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        logprobs=True,
        top_logprobs=3,
        max_tokens=5,
        temperature=0,
    )
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens or len(content) == 5
    for item in content:
        assert item.logprob <= 0 and len(item.top_logprobs) == 3
        assert item.top_logprobs[0].logprob >= item.top_logprobs[-1].logprob
        assert bytes(item.bytes).decode(errors="replace") == item.token
        assert item.logprob == pytest.approx(item.top_logprobs[0].logprob)  # greedy
    assert "".join(i.token for i in content).startswith(reply.choices[0].message.content[:3])
    chunks = list(
        openai_client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Hi"}],
            logprobs=True,
            top_logprobs=2,
            max_tokens=5,
            temperature=0,
            stream=True,
        )
    )
    streamed = [
        i
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for i in c.choices[0].logprobs.content
    ]
    assert [i.token for i in streamed] == [i.token for i in content]
    text = openai_client.completions.create(
        model=MODEL, prompt="The capital of France is", logprobs=2, max_tokens=4, temperature=0
    )
    lp = text.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert "".join(lp.tokens) == text.choices[0].text
    assert lp.text_offset[0] == 0 and all(len(t) == 2 for t in lp.top_logprobs)
    raw = httpx.post(
        server.base_url + "/v1/completions",
        json={"prompt": "Hi", "max_tokens": 3, "logprobs": 1, "stream": True},
        timeout=60,
    )
    assert raw.status_code == 200 and '"token_logprobs"' in raw.text


def post(server, body):
    return httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=60)


def assert_400(resp, param_part: str):
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert param_part in (error["param"] or "") + error["message"], error
    return error


CALL = {"id": "call_9", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (  # a tool result that answers no earlier call
            {
                "messages": [
                    {"role": "user", "content": "x"},
                    {"role": "tool", "tool_call_id": "nope", "content": "1"},
                ]
            },
            "messages[1]",
        ),
        (  # history arguments that are not JSON
            {
                "messages": [
                    {"role": "user", "content": "x"},
                    {
                        "role": "assistant",
                        "tool_calls": [{**CALL, "function": {"name": "f", "arguments": "{oops"}}],
                    },
                ]
            },
            "messages[1].tool_calls[0]",
        ),
        (  # tool_choice names a function that is not offered
            {
                "messages": [{"role": "user", "content": "x"}],
                "tools": TOOLS,
                "tool_choice": {"type": "function", "function": {"name": "launch_rocket"}},
            },
            "tool_choice",
        ),
        (  # a schema the library cannot compile (look-around)
            {
                "messages": [{"role": "user", "content": "x"}],
                "tool_choice": "required",
                "tools": [
                    {
                        "type": "function",
                        "function": {
                            "name": "f",
                            "parameters": {
                                "type": "object",
                                "properties": {"a": {"type": "string", "pattern": "(?=x)y"}},
                            },
                        },
                    }
                ],
            },
            "tools[0].function.parameters",
        ),
        (
            {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "yaml"}},
            "response_format",
        ),
        (
            {
                "messages": [{"role": "user", "content": "x"}],
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {
                        "name": "x",
                        "schema": {"type": "string", "pattern": "(?<=a)b"},
                    },
                },
            },
            "response_format.json_schema.schema",
        ),
        (
            {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21},
            "top_logprobs",
        ),
        (
            {"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"},
            "tool_choice",
        ),
        (
            {
                "messages": [{"role": "user", "content": "x"}],
                "tools": [{"type": "function", "function": {"name": "a\U00040000"}}],
                "tool_choice": "required",
            },
            "tools[0].function.name",
        ),
    ],
    ids=[
        "orphan-tool",
        "bad-arguments",
        "unknown-function",
        "uncompilable",
        "format-type",
        "uncompilable-format",
        "top-logprobs",
        "required-without-tools",
        "unwritable-name",
    ],
)
def test_tool_errors_are_400s_that_say_which(server, body, param):
    assert_400(post(server, {"model": MODEL, **body}), param)
