"""The OpenAI Responses API (stateless) through the official openai SDK."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

MODEL = "gpt-4.1"
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 24}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "name": "get_weather", "description": "Weather", "parameters": WEATHER}
]


def test_create_text(openai_client):
    reply = openai_client.responses.create(
        model=MODEL,
        input="What is the capital of France?",
        instructions="Be brief.",
        max_output_tokens=16,
        temperature=0,
    )
    assert reply.id.startswith("resp_") and reply.object == "response"
    assert reply.status in {"completed", "incomplete"}
    assert reply.output[0].type == "message" and reply.output_text
    usage = reply.usage
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert 0 <= usage.input_tokens_details.cached_tokens < usage.input_tokens


def test_stream_text_matches(openai_client):
    kwargs = dict(model=MODEL, input="Say hello.", max_output_tokens=200, temperature=0)
    whole = openai_client.responses.create(**kwargs)
    kinds = []
    with openai_client.responses.stream(**kwargs) as stream:
        for event in stream:
            kinds.append(event.type)
        final = stream.get_final_response()
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert "response.output_text.delta" in kinds and kinds[-1] == "response.completed"
    assert final.output_text == whole.output_text


def test_forced_function_call_and_round_trip(openai_client):
    call = openai_client.responses.create(
        model=MODEL,
        input="Weather in Paris?",
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
        max_output_tokens=60,
    )
    calls = [item for item in call.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER)
    with openai_client.responses.stream(
        model=MODEL,
        input="Weather in Paris?",
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
        max_output_tokens=60,
    ) as stream:
        deltas = "".join(
            e.delta for e in stream if e.type == "response.function_call_arguments.delta"
        )
        final = stream.get_final_response()
    assert deltas == calls[0].arguments == final.output[0].arguments
    answer = openai_client.responses.create(
        model=MODEL,
        input=[
            {"role": "user", "content": "Weather in Paris?"},
            {
                "type": "function_call",
                "call_id": calls[0].call_id,
                "name": "get_weather",
                "arguments": calls[0].arguments,
            },
            {"type": "function_call_output", "call_id": calls[0].call_id, "output": "21 C, sunny"},
        ],
        tools=TOOLS,
        temperature=0,
        max_output_tokens=30,
    )
    assert answer.usage.input_tokens_details.cached_tokens > 0.8 * call.usage.input_tokens


def test_json_schema_text_format(openai_client):
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    reply = openai_client.responses.create(
        model=MODEL,
        input="Describe a person.",
        max_output_tokens=60,
        text={
            "format": {"type": "json_schema", "name": "person", "schema": schema, "strict": True}
        },
    )
    jsonschema.validate(json.loads(reply.output_text), schema)


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"previous_response_id": "resp_123"}, "previous_response_id"),
        ({"store": True}, "store"),
        ({"tools": [{"type": "hologram"}]}, "tools"),
        ({"tool_choice": {"type": "function", "name": "nope"}, "tools": TOOLS}, "tool_choice"),
        (
            {"input": [{"type": "function_call_output", "call_id": "call_x", "output": "1"}]},
            "input",
        ),
    ],
    ids=["previous-response", "store", "unknown-tool-type", "unknown-function", "orphan-output"],
)
def test_stateless_and_invalid_requests(server, extra, param):
    body = {"model": MODEL, "input": "hi", **extra}
    resp = httpx.post(server.base_url + "/v1/responses", json=body, timeout=60)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert (
        error["type"] == "invalid_request_error"
        and param in (error["param"] or "") + error["message"]
    )


def test_agents_sdk_default_responses_model(server):
    agents = pytest.importorskip("agents")
    from openai import AsyncOpenAI

    agents.set_tracing_disabled(True)
    client = AsyncOpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
    seen: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """Current weather for a city."""
        seen.append(city)
        return f"Sunny, 21 C in {city}."

    agent = agents.Agent(
        name="weather",
        instructions="Answer weather questions with the get_weather tool.",
        tools=[get_weather],
        model=agents.OpenAIResponsesModel(model=MODEL, openai_client=client),
        model_settings=agents.ModelSettings(tool_choice="required", temperature=0, max_tokens=400),
    )
    import asyncio

    result = asyncio.run(agents.Runner.run(agent, "Weather in Paris?", max_turns=4))
    assert seen and isinstance(result.final_output, str)
    kinds = [item.type for item in result.new_items]
    assert "tool_call_item" in kinds and "tool_call_output_item" in kinds
