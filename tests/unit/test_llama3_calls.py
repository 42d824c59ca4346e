"""Llama 3.x's tool calls (chat.formats.llama3_json) without a model: which templates get the
format, and how the output parser reads an answer that is a call, or text, however the text
arrives. The served format (grammar, streaming, history, cache) runs in
tests/server/test_tools_formats.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlx_kvserve.chat import Tool
from mlx_kvserve.chat.formats import tool_format_for
from mlx_kvserve.chat.formats.llama3_json import FORMAT as LLAMA3
from mlx_kvserve.chat.output import OutputParser

TEMPLATES = Path(__file__).parents[1] / "fixtures" / "templates"
TOOLS = [
    Tool("get_time", None, {"type": "object", "properties": {"timezone": {"type": "string"}}}),
    Tool("get weather", None, {"type": "object", "properties": {"city": {"type": "string"}}}),
]


def _read(chunks: list[str]) -> tuple[str, list[tuple[str, str]], dict[int, str]]:
    """(content, finished calls as (name, arguments), streamed arguments per call index)."""
    parser = OutputParser(LLAMA3, TOOLS)
    events = [e for c in chunks for e in parser.feed(c)] + parser.finish()
    streamed: dict[int, str] = {}
    for e in events:
        if type(e).__name__ == "ToolCallDelta":
            streamed[e.index] = streamed.get(e.index, "") + e.arguments
    calls = [(c.name, c.arguments) for c in parser.calls]
    return parser.content, calls, streamed


def _cut(text: str, cuts: list[int]) -> list[str]:
    points = sorted({c % (len(text) + 1) for c in cuts})
    return [text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=True)]


ANSWERS = [
    # (answer text, content, calls)
    (
        '{"name": "get_time", "parameters": {"timezone": "Europe/Paris"}}',
        "",
        [("get_time", '{"timezone": "Europe/Paris"}')],
    ),
    (
        '{"name": "get weather", "parameters": {"city": "Pa}ris \\"x\\""}}',
        "",
        [("get weather", '{"city": "Pa}ris \\"x\\""}')],
    ),
    # text first: whatever follows is text, even a call's JSON
    (
        'Sure: {"name": "get_time", "parameters": {}}',
        'Sure: {"name": "get_time", "parameters": {}}',
        [],
    ),
    ('{"timezone": "UTC"}', '{"timezone": "UTC"}', []),  # JSON that is not a call
    ("{", "{", []),  # a marker's beginning that never became one
    ("Hello", "Hello", []),
]


@settings(max_examples=150, deadline=None, database=None)
@given(case=st.sampled_from(ANSWERS), cuts=st.lists(st.integers(0, 200), max_size=10))
def test_an_answer_is_a_call_or_text_however_it_arrives(case, cuts):
    text, content, calls = case
    got_content, got_calls, streamed = _read(_cut(text, cuts))
    assert got_content == content
    assert got_calls == calls
    for index, (_, arguments) in enumerate(calls):
        assert streamed[index] == arguments  # the fragments are the call's arguments
        json.loads(arguments)


@pytest.mark.parametrize("template", ["llama-3.1.jinja", "llama-3.2.jinja"])
def test_llama3_templates_get_the_format_and_others_do_not(template, tmp_path):
    from mlx_lm.tokenizer_utils import load

    from tests.support.thinking_models import LLAMA3_TOOL_TOKENS, build_thinking_model

    dest = build_thinking_model(tmp_path / "m", "llama3", tool_tokens=LLAMA3_TOOL_TOKENS)
    config_path = dest / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config["chat_template"] = (TEMPLATES / template).read_text(encoding="utf-8")
    config_path.write_text(json.dumps(config), encoding="utf-8")
    fmt = tool_format_for(load(dest))
    assert fmt.name == "llama3_json" and fmt.constrained and fmt.at_start
    config["chat_template"] = (TEMPLATES / "qwen3.jinja").read_text(encoding="utf-8")
    config_path.write_text(json.dumps(config), encoding="utf-8")
    assert tool_format_for(load(dest)).name != "llama3_json"
