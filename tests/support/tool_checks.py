"""What every tool-format server test checks, once (tests/server/test_tools*.py, test_harmony.py):
that a forced call is a declared tool with valid arguments, that a stream reassembles to the whole
reply, that bad tools are 400s naming the field and fuzzed ones never a 5xx, and a tool loop's
turns. A family's test file keeps its tests and says only what is its own."""

from __future__ import annotations

import json
from dataclasses import dataclass

import httpx
import jsonschema
from hypothesis import HealthCheck, settings

from tests.support.fuzzing import check
from tests.support.servers import ServerProcess
from tests.support.tool_schemas import ASK, NAMED, SCHEMAS, TOOLS

CHAT = "/v1/chat/completions"
# hypothesis against a module's server: the server outlives the examples, and each is a request
SERVED_FUZZ = settings(
    max_examples=60,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
# tool choices and tools every format refuses, with the field the 400 names
BAD_TOOLS = [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    (
        {
            "tools": [
                {
                    "type": "function",
                    "function": {
                        "name": "f",
                        "parameters": {
                            "type": "object",
                            "properties": {"n": {"type": "integer", "minimum": "x"}},
                        },
                    },
                }
            ]
        },
        "tools[0].function.parameters",
    ),
]


def model_id(client) -> str:
    return client.models.list().data[0].id


def valid(call, schemas: dict[str, dict] = SCHEMAS) -> dict:
    """The call's arguments: it names a declared function, and they are valid against its schema."""
    assert call.type == "function" and call.function.name in schemas
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, schemas[call.function.name])
    return args


def assert_format_named_once(served: ServerProcess, parser: str) -> None:
    notice = f"tool calls: {parser} format, constrained and streamed"
    assert served.log().count(notice) == 1


def forced_choice(
    client,
    *,
    named: bool,
    seed: int,
    max_tokens: int,
    messages: list[dict] = ASK,
    tools: list[dict] = TOOLS,
    parallel: bool | None = False,
    model: str | None = None,
):
    """A reply forced at temperature 1 to call get_weather (`named`) or any tool: it ends in calls
    and none of their syntax leaks into content. `parallel` None leaves the request's default."""
    reply = client.chat.completions.create(
        model=model or model_id(client),
        messages=messages,
        tools=tools,
        tool_choice=NAMED if named else "required",
        **({} if parallel is None else {"parallel_tool_calls": parallel}),
        temperature=1.0,
        seed=seed,
        max_tokens=max_tokens,
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert not choice.message.content
    return choice


def forced_replies(
    client,
    named: bool,
    *,
    max_tokens: int,
    schemas: dict[str, dict] = SCHEMAS,
    tools: list[dict] = TOOLS,
    parallel: bool | None = False,
    model: str | None = None,
) -> list:
    """20 seeds of `forced_choice`: every call is a declared tool with valid arguments (get_weather
    when named), one a reply unless parallel calls are allowed. The choices, for more checks."""
    choices = []
    for seed in range(20):
        choice = forced_choice(
            client,
            named=named,
            seed=seed,
            max_tokens=max_tokens,
            tools=tools,
            parallel=parallel,
            model=model,
        )
        calls = choice.message.tool_calls
        assert len(calls) == 1 if parallel is False else len(calls) >= 1
        for call in calls:
            valid(call, schemas)
            if named:
                assert call.function.name == "get_weather"
        choices.append(choice)
    return choices


@dataclass
class Streamed:
    """A streamed reply's calls as `streamed_calls` reassembles them."""

    calls: list[tuple[str | None, str | None, str]]  # id, name, arguments, in the order opened
    fragments: int  # argument deltas
    finish: str | None


def streamed_calls(client, **kwargs) -> Streamed:
    """The calls of a streamed reply, asserting that nothing leaks into content and that each call
    opens with its id and name, before any of its arguments, in index order."""
    calls: dict[int, dict] = {}
    fragments, finish = 0, None
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        choice = chunk.choices[0]
        finish = choice.finish_reason or finish
        assert not choice.delta.content
        for delta in choice.delta.tool_calls or []:
            entry = calls.setdefault(delta.index, {"id": None, "name": None, "arguments": ""})
            if delta.id or (delta.function and delta.function.name):
                assert entry == {"id": None, "name": None, "arguments": ""}, entry  # they first
                entry["id"], entry["name"] = delta.id, delta.function.name
            if delta.function and delta.function.arguments:
                entry["arguments"] += delta.function.arguments
                fragments += 1
    assert list(calls) == sorted(calls)
    return Streamed(
        [(c["id"], c["name"], c["arguments"]) for c in calls.values()], fragments, finish
    )


def named_arguments(calls) -> list[tuple[str, str]]:
    """(name, arguments) of a whole reply's calls, to compare with a stream's."""
    return [(c.function.name, c.function.arguments) for c in calls]


def assert_bad_tools_400(
    served: ServerProcess, body: dict, param: str, tools: list[dict] = TOOLS
) -> None:
    payload = {
        "model": "m",
        "messages": ASK,
        "tools": tools,
        "tool_choice": "required",
        "max_tokens": 8,
        **body,
    }
    reply = httpx.post(served.base_url + CHAT, json=payload, timeout=60)
    assert reply.status_code == 400, reply.text
    assert param in reply.json()["error"]["param"]


def post_fuzzed(served: ServerProcess, body: dict) -> httpx.Response:
    """POST a hostile chat body (lone surrogates go as `\\ud800` escapes): never a 5xx, and an
    error in OpenAI's shape."""
    r = httpx.post(
        served.base_url + CHAT,
        content=json.dumps(body, ensure_ascii=True).encode(),
        headers={"content-type": "application/json"},
        timeout=60,
    )
    assert check(r.status_code, r.content, False, CHAT) is None, (body, r.text[:300])
    return r


def loop_turn(
    client,
    messages: list[dict],
    turn: int,
    *,
    max_tokens: int,
    forced: bool = False,
    tools: list[dict] = TOOLS,
):
    """A tool loop's turn at temperature 1, with logprobs (the tokens sampled): one call, `ping`'s
    when `forced` (its every token the grammar's), else any tool's."""
    return client.chat.completions.create(
        model=model_id(client),
        messages=messages,
        tools=tools,
        tool_choice={"type": "function", "function": {"name": "ping"}} if forced else "required",
        parallel_tool_calls=False,
        temperature=1.0,
        seed=turn,
        max_tokens=max_tokens,
        logprobs=True,
    )


def answer_call(messages: list[dict], choice, schemas: dict[str, dict] = SCHEMAS):
    """Appends the reply and a result for its (first, valid) call to the history; the call."""
    call = choice.message.tool_calls[0]
    valid(call, schemas)
    messages.append(choice.message.model_dump(exclude_none=True))
    messages.append({"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"})
    return call


def next_usage(client, messages: list[dict], tools: list[dict] = TOOLS):
    """The usage of a one-token turn on the history: how much of it the cache had."""
    return client.chat.completions.create(
        model=model_id(client), messages=messages, tools=tools, max_tokens=1
    ).usage


def tokens_alike(tokenizer, rest: list[int], sampled: list[bytes]) -> int:
    """How many tokens of `rest` (a re-rendered turn) are, from its start, the tokens sampled."""
    same = 0
    while same < min(len(rest), len(sampled)) and (
        tokenizer.decode([rest[same]]).encode() == sampled[same]
    ):
        same += 1
    return same
