"""Shared parts of the block-format tool-call tests (MiniMax-M2, Kimi K2): tools, the families'
tiny models and sample call texts, and the server's own render of a conversation."""

from __future__ import annotations

import json
from pathlib import Path

from tests.support.thinking_models import (
    KIMI_TOOL_TOKENS,
    MINIMAX_TOOL_TOKENS,
    build_thinking_model,
)

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 24},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "detailed": {"type": "boolean"},
        "hours": {
            "type": "array",
            "items": {"type": "integer", "minimum": 0, "maximum": 23},
            "maxItems": 3,
        },
    },
    "required": ["city", "unit", "days"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"timezone": {"type": "string", "maxLength": 20}},
    "required": ["timezone"],
    "additionalProperties": False,  # a JSON-body call (Kimi's) is bounded only so
}
PING = {  # a call with nothing left to choose but its index: (almost) every token is forced
    "type": "object",
    "properties": {"host": {"type": "string", "enum": ["localhost"]}},
    "required": ["host"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
    {"type": "function", "function": {"name": "ping", "parameters": PING}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME, "ping": PING}
NAMED = {"type": "function", "function": {"name": "get_weather"}}
ASK = [{"role": "user", "content": "What's the weather in Paris?"}]

_MM_OPEN = "\n<minimax:tool_call>\n"
_KIMI_OPEN = "<|tool_calls_section_begin|><|tool_call_begin|>"
_KIMI_ARGS = "<|tool_call_argument_begin|>"
# family: its tokenizer's markers, the parser mlx-lm picks, the server's extra flags, and sample
# call texts (a call, what closes the block, what opens a call to an invented tool, an undeclared
# parameter, a required parameter left out, a value the parser would not read back)
FAMILIES = {
    "minimax-m2": (
        MINIMAX_TOOL_TOKENS,
        "minimax_m2",
        ("--thinking-budget", "2"),
        _MM_OPEN + '<invoke name="get_time">\n<parameter name="timezone">UTC</parameter>\n',
        "</invoke>\n</minimax:tool_call>",
        _MM_OPEN + '<invoke name="get_tme">',
        _MM_OPEN + '<invoke name="get_time">\n<parameter name="tz">',
        _MM_OPEN + '<invoke name="get_time">\n</invoke>',
        (">UTC<", ">null<"),
    ),
    "kimi-k2": (
        KIMI_TOOL_TOKENS,
        "kimi_k2",
        (),
        _KIMI_OPEN + "functions.get_time:0" + _KIMI_ARGS + '{"timezone": "UTC"}',
        "<|tool_call_end|><|tool_calls_section_end|>",
        _KIMI_OPEN + "functions.get_tme:",
        _KIMI_OPEN + "functions.get_time:0" + _KIMI_ARGS + '{"tz"',
        _KIMI_OPEN + "functions.get_time:0" + _KIMI_ARGS + "{}",
        ('"UTC"', "5"),
    ),
}


HISTORY = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Weather and time in Paris?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "functions.get_weather:0",
                "type": "function",
                "function": {
                    "name": "get_weather",
                    "arguments": json.dumps({"city": "Paris", "unit": "celsius", "days": 2}),
                },
            },
            {
                "id": "functions.get_time:1",
                "type": "function",
                "function": {"name": "get_time", "arguments": '{"timezone": "CET"}'},
            },
        ],
    },
    {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "sunny, 21 C"},
    {"role": "tool", "tool_call_id": "functions.get_time:1", "content": "14:05"},
    {"role": "assistant", "content": "Sunny, 21 C; it is 14:05."},
    {"role": "user", "content": "And tomorrow?"},
]


def build_family_model(dest: Path, family: str) -> Path:
    return build_thinking_model(dest, family, tool_tokens=FAMILIES[family][0])


def render_prompt(tokenizer, messages: list[dict], choice: str = "auto") -> list[int]:
    """The prompt the server renders for these messages (its own request parsing and render)."""
    from mlx_kvserve.api.openai_chat import to_chat_request
    from mlx_kvserve.api.schemas import ChatCompletionRequest
    from mlx_kvserve.chat.render import render_chat

    body = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": messages, "tools": TOOLS, "tool_choice": choice}
    )
    return render_chat(tokenizer, to_chat_request(body), {}).tokens
