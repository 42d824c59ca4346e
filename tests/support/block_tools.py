"""Shared parts of the block-format tool-call tests (MiniMax-M2, Kimi K2; the tagged formats'
tests use the history, the render check and the hostile tools too): the families' tiny models
and sample call texts, a history with two calls in one turn, and hostile tools."""

from __future__ import annotations

import json
from pathlib import Path

from hypothesis import strategies as st

from tests.support.fuzz_values import hostile_tool, schema
from tests.support.thinking_models import (
    KIMI_TOOL_TOKENS,
    MINIMAX_TOOL_TOKENS,
    build_thinking_model,
)
from tests.support.tool_parsing import server_prompt
from tests.support.tool_schemas import TOOLS

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


def assert_renders_as_the_template(tokenizer) -> None:
    """Tools, calls (two in one turn) and their results render as the template itself renders
    them when handed the arguments as objects."""
    own = json.loads(json.dumps(HISTORY))
    for message in own:
        for call in message.get("tool_calls", []):
            call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    expected = tokenizer.apply_chat_template(
        own, tools=TOOLS, add_generation_prompt=True, tokenize=False
    )
    ours = tokenizer.decode(server_prompt(tokenizer, HISTORY))
    assert ours == expected
    assert "get_weather" in ours and "14:05" in ours


# tools as hostile clients write them: names the formats cannot hold, schemas of every shape,
# property names with spaces, quotes and markup, typed and untyped properties
_leaf = st.fixed_dictionaries({"type": st.sampled_from(["integer", "string"])})
_key = st.one_of(st.just("k"), st.text(alphabet='ab _<>/="|\n', min_size=1, max_size=6))
_property = st.one_of(
    schema,
    st.fixed_dictionaries(
        {
            "type": st.one_of(
                st.sampled_from(["string", "integer", "number", "boolean", "null", "array"]),
                st.lists(st.sampled_from(["string", "integer", "null"]), max_size=2),
            )
        },
        optional={
            "enum": st.lists(st.one_of(st.text(max_size=8), st.integers()), max_size=3),
            "maxLength": st.integers(-2, 5),
            "items": _leaf,
            "anyOf": st.lists(_leaf, max_size=2),
        },
    ),
)
hostile_block_tool = hostile_tool(
    _key, _property, ['a"b', "x>y", "a|b", "f:1", "</invoke>", "<|tool_call_end|>"]
)
