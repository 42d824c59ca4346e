"""Speculation through the real server: the same greedy answers with `--speculation auto` as
with `off`, on the default model, over the three protocols, streamed and not, for free text and
for the tool-format grammars (a forced call, a lazy one, JSON output). Whether the auto server
drafts depends on the verify cost it measures on this shared machine (a loaded one can make
drafting not pay), so that is counted in-process, on the cost prior
(tests/unit/test_speculation_metrics.py), not here.

Two `serve` processes side by side, asked the same requests with the official SDKs. A verify
pass runs other kernels than a one-token pass, so a near tie could flip a greedy token
(docs/speculation.md); the requests here have none.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import anthropic
import pytest

from tests.support.servers import ServerProcess, client_for

CODE = '''def area(width, height):
    """The area of a rectangle."""
    return width * height


def perimeter(width, height):
    """The perimeter of a rectangle."""
    return 2 * (width + height)
'''
COPY = f"Here is a file:\n\n{CODE}\nThe same file again, unchanged:\n\n"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris and in Lyon? Use the tool."}]
SCHEMA = {
    "type": "object",
    "properties": {"files": {"type": "array", "items": {"type": "string"}}},
    "required": ["files"],
}


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, ServerProcess]]:
    root: Path = tmp_path_factory.mktemp("speculation")
    procs = {mode: ServerProcess(root, "--speculation", mode) for mode in ("off", "auto")}
    try:
        yield {mode: proc.wait_ready() for mode, proc in procs.items()}
    finally:
        for proc in procs.values():
            proc.stop()


def text_completion(server: ServerProcess, stream: bool) -> str:
    client = client_for(server)
    body = {"model": "default", "prompt": COPY, "max_tokens": 80, "temperature": 0}
    if not stream:
        return client.completions.create(**body).choices[0].text
    return "".join(c.choices[0].text for c in client.completions.create(**body, stream=True))


def chat(server: ServerProcess, stream: bool, **extra) -> str:
    client = client_for(server)
    body = {"model": "default", "max_tokens": 80, "temperature": 0, **extra}
    if not stream:
        message = client.chat.completions.create(**body).choices[0].message
        calls = [(c.function.name, c.function.arguments) for c in message.tool_calls or []]
        return json.dumps([message.content, calls])
    text, calls = "", {}
    for chunk in client.chat.completions.create(**body, stream=True):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        text += delta.content or ""
        for call in delta.tool_calls or []:
            name, args = calls.get(call.index, ("", ""))
            function = call.function
            calls[call.index] = (
                name + ((function.name or "") if function else ""),
                args + ((function.arguments or "") if function else ""),
            )
    return json.dumps([text or None, [list(c) for c in calls.values()]])


def messages(server: ServerProcess, stream: bool) -> str:
    client = anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0)
    tool = {
        "name": "get_weather",
        "description": "The weather in a city.",
        "input_schema": WEATHER["function"]["parameters"],
    }
    body = {
        "model": "default",
        "max_tokens": 80,
        "extra_body": {"temperature": 0},  # this SDK's signature lacks it
        "messages": ASK,
        "tools": [tool],
        "tool_choice": {"type": "any"},
    }
    if stream:
        with client.messages.stream(**body) as events:
            message = events.get_final_message()
    else:
        message = client.messages.create(**body)
    return json.dumps([b.model_dump(exclude={"id"}) for b in message.content])


def responses(server: ServerProcess) -> str:
    client = client_for(server)
    reply = client.responses.create(
        model="default", input=COPY, max_output_tokens=60, temperature=0
    )
    return reply.output_text


CASES = {
    "text": lambda s, stream: text_completion(s, stream),
    "chat": lambda s, stream: chat(s, stream, messages=[{"role": "user", "content": COPY}]),
    "tool_required": lambda s, stream: chat(
        s, stream, messages=ASK, tools=[WEATHER], tool_choice="required"
    ),
    "tool_auto": lambda s, stream: chat(s, stream, messages=ASK, tools=[WEATHER]),
    "json_schema": lambda s, stream: chat(
        s,
        stream,
        messages=[{"role": "user", "content": COPY + "List the file's functions as JSON."}],
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "functions", "schema": SCHEMA},
        },
    ),
    "anthropic_tools": lambda s, stream: messages(s, stream),
    "responses": lambda s, stream: responses(s),
}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("case", list(CASES))
def test_the_same_greedy_answer_with_and_without_speculation(servers, case, stream) -> None:
    if case == "responses" and stream:
        pytest.skip("one Responses case: the text path is the chat one")
    off, auto = (CASES[case](servers[mode], stream) for mode in ("off", "auto"))
    assert auto == off
