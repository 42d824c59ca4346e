"""The crash tests' and the soak's workload: greedy chat conversations sent to a real server,
with the answers of a `--no-cache` server as the reference (tests/support/kill_loop.py).

A `Target` says which model the requests name (and the server arguments that load it) and
whether every request carries `tools` (two function tools, `tool_choice` "auto"). Answers are
compared as an `Answer`: the content, the reasoning and each tool call's name and arguments
(parsed JSON, so key order and spacing do not count), the same whether the answer came in one
body or was assembled from a stream's content, reasoning and tool-call deltas.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from dataclasses import dataclass

import httpx

from tests.support.concurrently import concurrently

MODEL = "SmolLM2-135M-Instruct"
MAX_TOKENS = 8
TIMEOUT = 300.0  # a guard against a hung server, never a speed assertion

SYSTEM = {
    "role": "system",
    "content": "You are a terse assistant for a gardening shop. Answer in one short sentence.",
}
# A few conversations sharing one system prompt; each grows turn by turn.
CONVERSATIONS = [
    ["Which pots do you sell?", "Are they big?", "What colours?", "Thanks."],
    ["Do you have tomato seeds?", "When should I plant them?", "How deep?", "Thanks."],
    ["When do you open?", "And on Sundays?", "Is there parking?", "Bye."],
]

# Bounded arguments (an enum, a small integer, a short string), so a call a random model
# starts ends within a few tokens instead of running to the token limit inside one string.
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Lyon", "Oslo", "Lima"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"type": "string", "maxLength": 8}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Forecast", "parameters": WEATHER},
    },
    {
        "type": "function",
        "function": {"name": "get_time", "description": "Time", "parameters": TIME},
    },
]
RESULTS = {"get_weather": '{"sky": "clear", "high": 21}', "get_time": '{"time": "09:30"}'}
# With tools, conversation 1 opens with a finished call, so every prompt of it renders a call
# and its result even when the model itself never calls.
PRIOR_CALL = [
    {"role": "user", "content": "Will it be sunny in Lyon for three days?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "call_prior",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Lyon", "days": 3}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_prior", "content": RESULTS["get_weather"]},
]


@dataclass(frozen=True)
class Target:
    """What the requests go to: the model they name, the server arguments that load it, and
    whether each carries the tools."""

    name: str = "default"
    model: str = MODEL
    server_args: tuple[str, ...] = ()
    tools: bool = False
    max_tokens: int = MAX_TOKENS

    def body(self, messages: list[dict], *, stream: bool = False) -> dict:
        body = {
            "model": self.model,
            "messages": messages,
            "temperature": 0,
            "max_tokens": self.max_tokens,
        }
        if stream:
            body["stream"] = True
        if self.tools:
            body.update(tools=TOOLS, tool_choice="auto")
        return body


DEFAULT = Target()


@dataclass(frozen=True)
class Answer:
    """An answer as compared: content, reasoning, and (name, canonical arguments) per call."""

    content: str
    reasoning: str = ""
    calls: tuple[tuple[str, str], ...] = ()

    @classmethod
    def of_message(cls, message: dict) -> Answer:
        calls = tuple(
            (c["function"]["name"], canonical_arguments(c["function"]["arguments"]))
            for c in message.get("tool_calls") or []
        )
        return cls(message.get("content") or "", message.get("reasoning_content") or "", calls)


def canonical_arguments(text: str) -> str:
    """A call's arguments as sorted, compact JSON; text that does not parse stays as it is."""
    try:
        return json.dumps(json.loads(text), sort_keys=True, ensure_ascii=False)
    except ValueError:
        return text


# ====================================================================== client helpers ======
class RequestFailed(Exception):
    """A request the server should have answered did not get a normal answer."""


def chat(
    base_url: str,
    messages: list[dict],
    *,
    max_tokens: int | None = None,
    target: Target = DEFAULT,
) -> dict:
    """One greedy, non-streamed chat completion; returns the response body (raises if not 200).
    `max_tokens` defaults to the target's."""
    body = target.body(messages)
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    resp = httpx.post(base_url + "/v1/chat/completions", json=body, timeout=TIMEOUT)
    if resp.status_code != 200:
        raise RequestFailed(f"HTTP {resp.status_code}: {resp.text[:300]}")
    return resp.json()


def answer(base_url: str, messages: list[dict]) -> str:
    """The default model's greedy content."""
    return chat(base_url, messages)["choices"][0]["message"]["content"]


def ask(base_url: str, messages: list[dict], target: Target = DEFAULT) -> Answer:
    """A greedy, non-streamed answer of `target`, as compared."""
    return Answer.of_message(chat(base_url, messages, target=target)["choices"][0]["message"])


def stream_chat(
    base_url: str,
    messages: list[dict],
    *,
    target: Target = DEFAULT,
    on_chunk: Callable[[int], bool] | None = None,
) -> Answer | None:
    """A streamed greedy answer assembled from its deltas, or None if `on_chunk(n)` said stop
    (n counts the chunks that carried content, reasoning or a piece of a call)."""
    content: list[str] = []
    reasoning: list[str] = []
    calls: dict[int, list[str]] = {}  # index -> [name, arguments so far]
    n = 0
    body = target.body(messages, stream=True)
    with httpx.stream(
        "POST", base_url + "/v1/chat/completions", json=body, timeout=TIMEOUT
    ) as resp:
        if resp.status_code != 200:
            raise RequestFailed(f"HTTP {resp.status_code}: {resp.read()[:300]!r}")
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RequestFailed(f"stream error: {event['error']}")
            for choice in event.get("choices", []):
                delta = choice.get("delta", {})
                got = False
                for text, parts in (
                    (delta.get("content"), content),
                    (delta.get("reasoning_content"), reasoning),
                ):
                    if text:
                        parts.append(text)
                        got = True
                for call in delta.get("tool_calls") or []:
                    name_args = calls.setdefault(call["index"], ["", ""])
                    function = call.get("function", {})
                    name_args[0] += function.get("name") or ""
                    name_args[1] += function.get("arguments") or ""
                    got = True
                if got:
                    n += 1
                    if on_chunk is not None and on_chunk(n):
                        return None
    return Answer(
        "".join(content),
        "".join(reasoning),
        tuple((name, canonical_arguments(args)) for _, (name, args) in sorted(calls.items())),
    )


# ====================================================================== the workload =========
@dataclass(frozen=True)
class Turn:
    conversation: int
    index: int
    messages: tuple  # of chat messages (dicts), the history up to this turn's question
    expected: Answer  # the --no-cache server's greedy answer

    @property
    def reference(self) -> str:
        """The no-cache answer's content."""
        return self.expected.content

    def as_messages(self) -> list[dict]:
        return copy.deepcopy(list(self.messages))


def replies(expected: Answer, conversation: int, turn: int) -> list[dict]:
    """The history a client appends after an answer: the assistant message, then one tool
    result per call (the ids are the client's own, so the history does not depend on the
    server's random ones). A call cut off by the token limit is left out: its arguments are
    not JSON, which no client could send back."""
    message: dict = {"role": "assistant", "content": expected.content}
    calls = [(name, args) for name, args in expected.calls if _is_json(args)]
    if not calls:
        return [message]
    ids = [f"call_{conversation}_{turn}_{k}" for k in range(len(calls))]
    message["tool_calls"] = [
        {"id": i, "type": "function", "function": {"name": name, "arguments": args}}
        for i, (name, args) in zip(ids, calls, strict=True)
    ]
    results = [
        {"role": "tool", "tool_call_id": i, "content": RESULTS.get(name, "{}")}
        for i, (name, _) in zip(ids, calls, strict=True)
    ]
    return [message, *results]


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def build_workload(
    reference_url: str,
    target: Target = DEFAULT,
    *,
    conversations: int | None = None,
    turns: int | None = None,
) -> list[list[Turn]]:
    """Every turn of every conversation (or the first `turns` of the first `conversations`),
    with the no-cache answers also used as history.

    The conversations are independent, so they are asked side by side (the reference server
    batches them); each one's turns stay in order, as each turn's history holds the answers
    before it."""
    chosen = range(len(CONVERSATIONS[:conversations]))
    return concurrently(lambda ci: _conversation(reference_url, target, ci, turns), chosen)


def _conversation(reference_url: str, target: Target, ci: int, n: int | None) -> list[Turn]:
    history = [dict(SYSTEM)]
    if target.tools and ci == 1:
        history += copy.deepcopy(PRIOR_CALL)
    turns = []
    for ti, question in enumerate(CONVERSATIONS[ci][:n]):
        history.append({"role": "user", "content": question})
        expected = ask(reference_url, history, target)
        turns.append(Turn(ci, ti, tuple(copy.deepcopy(history)), expected))
        history += replies(expected, ci, ti)
    return turns
