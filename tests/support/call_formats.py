"""The tool-call families tests/server/test_tools_formats.py runs: sample call texts, history and
hostile tool strategies (a module of data, so the test file stays readable; the tools they call
are tests/support/tool_schemas.py's)."""

from __future__ import annotations

import json

from hypothesis import strategies as st

from tests.support.fuzz_values import hostile_property, hostile_tool
from tests.support.thinking_models import (
    DEEPSEEK_TOOL_TOKENS,
    FUNCTION_GEMMA_TOOL_TOKENS,
    GEMMA4_TOOL_TOKENS,
    LFM_TOOL_TOKENS,
    LLAMA3_TOOL_TOKENS,
    MISTRAL_TOOL_TOKENS,
)
from tests.support.tool_schemas import ASK

Q = '<|"|>'
DS_BLOCK, DS_BLOCK_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CALL, DS_SEP, DS_END = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"

# family, its tokenizer's tool markers, the parser mlx-lm picks, and call texts: a whole call
# (markers included), an invented tool's opening, an undeclared parameter, a required one left
# out, and a call's block text (after the opening marker) with values that hold the format's
# separators
FAMILIES = {
    "lfm2.5": (
        LFM_TOOL_TOKENS,
        "pythonic",
        "<|tool_call_start|>[get_time(timezone='UTC')]<|tool_call_end|>",
        "<|tool_call_start|>[get_tme(",
        "<|tool_call_start|>[get_time(tz=",
        "<|tool_call_start|>[get_time()",
        "[get_weather(city='Pa, (ris)]', unit='celsius', days=3, detailed=False, hours=[1, 2]),"
        " get_time(timezone='UTC'), ping(host='localhost')]",
    ),
    "gemma4": (
        GEMMA4_TOOL_TOKENS,
        "gemma4",
        f"<|tool_call>call:get_time{{timezone:{Q}UTC{Q}}}<tool_call|>",
        "<|tool_call>call:get_tme{",
        "<|tool_call>call:get_time{tz:",
        "<|tool_call>call:get_time{}",
        f"call:get_weather{{city:{Q}Pa, {{ris}}]{Q},days:3,detailed:false,hours:[1,2],"
        f"unit:{Q}celsius{Q}}}",
    ),
    "mistral-v13": (
        MISTRAL_TOOL_TOKENS,
        "mistral",
        '[TOOL_CALLS]get_time[ARGS]{"timezone": "UTC"}',
        "[TOOL_CALLS]get_tme",
        '[TOOL_CALLS]get_time[ARGS]{"tz"',
        "[TOOL_CALLS]get_time[ARGS]{}",
        'get_weather[ARGS]{"city": "Pa}[ris\\"", "unit": "celsius", "days": 3, "hours": [1, 2]}'
        '[TOOL_CALLS]get_time[ARGS]{"timezone": "UTC"}',
    ),
    "deepseek-v3.1": (
        DEEPSEEK_TOOL_TOKENS,
        "deepseek_v31",
        f'{DS_BLOCK}{DS_CALL}get_time{DS_SEP}{{"timezone": "UTC"}}{DS_END}{DS_BLOCK_END}',
        f"{DS_BLOCK}{DS_CALL}get_tme",
        f'{DS_BLOCK}{DS_CALL}get_time{DS_SEP}{{"tz"',
        f"{DS_BLOCK}{DS_CALL}get_time{DS_SEP}{{}}",
        f'{DS_CALL}get_weather{DS_SEP}{{"city": "Pa}}[{DS_END[:4]}", "unit": "celsius", "days": 3}}'
        f'{DS_END}{DS_CALL}get_time{DS_SEP}{{"timezone": "UTC"}}{DS_END}',
    ),
    "mistral-v11": (
        MISTRAL_TOOL_TOKENS,
        "mistral",
        '[TOOL_CALLS]get_time[CALL_ID]abcdefghi[ARGS]{"timezone": "UTC"}',
        "[TOOL_CALLS]get_tme",
        '[TOOL_CALLS]get_time[CALL_ID]abcdefghi[ARGS]{"tz"',
        "[TOOL_CALLS]get_time[CALL_ID]abcdefghi[ARGS]{}",
        'get_weather[CALL_ID]a1b2c3d4e[ARGS]{"city": "Pa}[ris\\"", "unit": "celsius", "days": 3,'
        ' "hours": [1, 2]}[TOOL_CALLS]get_time[CALL_ID]Z9Z9Z9Z9Z[ARGS]{"timezone": "UTC"}',
    ),
    "mistral-v7": (
        MISTRAL_TOOL_TOKENS,
        "mistral",
        '[TOOL_CALLS][{"name": "get_time", "arguments": {"timezone": "UTC"}, "id": "abcdefghi"}]',
        '[TOOL_CALLS][{"name": "get_tme',
        '[TOOL_CALLS][{"name": "get_time", "arguments": {"tz"',
        '[TOOL_CALLS][{"name": "get_time", "arguments": {}',
        '[{"name": "get_weather", "arguments": {"city": "Pa}[ris\\"", "unit": "celsius",'
        ' "days": 3}, "id": "a1b2c3d4e"}, {"name": "get_time", "arguments": {"timezone": "UTC"},'
        ' "id": "Z9Z9Z9Z9Z"}]',
    ),
    "function-gemma": (
        FUNCTION_GEMMA_TOOL_TOKENS,
        "function_gemma",
        "<start_function_call>call:get_time{timezone:<escape>UTC<escape>}<end_function_call>",
        "<start_function_call>call:get_tme{",
        "<start_function_call>call:get_time{tz:",
        "<start_function_call>call:get_time{}",
        "call:get_weather{city:<escape>Pa, (ris:<escape>,days:3,detailed:false,"
        "unit:<escape>celsius<escape>}",
    ),
    "llama3": (
        LLAMA3_TOOL_TOKENS,
        "llama3_json",
        '{"name": "get_time", "parameters": {"timezone": "UTC"}}',
        '{"name": "get_tme',
        '{"name": "get_time", "parameters": {"tz"',
        '{"name": "get_time", "parameters": {}',
        'get_weather", "parameters": {"city": "Pa}[ris\\"", "unit": "celsius", "days": 3, '
        '"hours": [1, 2]}}',
    ),
}
# families whose template renders one call per assistant turn (and raises on more)
ONE_CALL = {"llama3"}
# families whose templates refuse call ids that are not 9 characters long
NINE_CHAR_IDS = {"mistral-v11", "mistral-v7"}
# families whose call can only open the answer (no text before it)
AT_START = {"llama3"}


# no reasoning section: the answer is the call, so each turn re-renders as it was sampled
KWARGS = {"deepseek-v3.1": {"thinking": False}}


HISTORY = [
    {"role": "system", "content": "You are terse."},
    *ASK,
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "c1",
                "type": "function",
                "function": {
                    "name": "get_weather",
                    "arguments": json.dumps(
                        {"city": "Paris", "unit": "celsius", "days": 2, "hours": [9, 12]}
                    ),
                },
            },
            {
                "id": "c2",
                "type": "function",
                "function": {"name": "get_time", "arguments": '{"timezone": "CET"}'},
            },
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": "sunny, 21 C"},
    {"role": "tool", "tool_call_id": "c2", "content": "12:00"},
]


def history_for(family: str) -> list[dict]:
    """HISTORY as the family's template can render it: its first call alone where a turn
    holds one call."""
    history = HISTORY
    if family in NINE_CHAR_IDS:
        ids = {"c1": "callid001", "c2": "callid002"}
        history = [
            {**m, "tool_calls": [{**c, "id": ids[c["id"]]} for c in m["tool_calls"]]}
            if "tool_calls" in m
            else {**m, "tool_call_id": ids[m["tool_call_id"]]}
            if "tool_call_id" in m
            else m
            for m in history
        ]
    if family in ONE_CALL:
        first = {**history[2], "tool_calls": history[2]["tool_calls"][:1]}
        history = [*history[:2], first, history[3]]
    return history


# tools as hostile clients write them: names neither syntax can hold, schemas of every shape,
# property names with spaces, quotes and markup, typed and untyped, nested properties
kw_leaf = st.fixed_dictionaries({"type": st.sampled_from(["integer", "string", "boolean"])})
kw_key = st.one_of(
    st.just("k"), st.sampled_from(["class", "None", "a-b"]), st.text("ab _<>'=:{\n", max_size=6)
)
kw_property = hostile_property(
    kw_leaf,
    st.fixed_dictionaries(
        {"type": st.just("object"), "properties": st.dictionaries(kw_key, kw_leaf, max_size=2)}
    ),
    minItems=st.integers(-1, 3),
    maxItems=st.integers(-1, 3),
)
kw_tool = hostile_tool(kw_key, kw_property, ["a b", "x.y", "def", "1st", "call:x", "<tool_call|>"])
