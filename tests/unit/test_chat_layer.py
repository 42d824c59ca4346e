"""The protocol-neutral chat layer on rendered text: tool formats, history, streaming parser.

No server and no model weights: the default model's tokenizer files are enough for templating.
"""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path
from types import SimpleNamespace

import pytest
from mlx_lm.tool_parsers import glm47, json_tools, mistral, qwen3_coder

from mlx_kvserve import paths
from mlx_kvserve.chat import ChatRequest, InvalidRequest, Message, Tool, ToolCall, ToolChoice
from mlx_kvserve.chat.events import ContentDelta, ToolCallDelta, ToolCallStarted
from mlx_kvserve.chat.formats import tool_format_for, tool_format_notice
from mlx_kvserve.chat.formats.hermes import FORMAT as HERMES
from mlx_kvserve.chat.output import OutputParser
from mlx_kvserve.chat.render import render_chat

TOOL = Tool(
    "get_weather", "Weather", {"type": "object", "properties": {"city": {"type": "string"}}}
)


@pytest.fixture(scope="module")
def tokenizer():
    from mlx_lm.tokenizer_utils import load

    from mlx_kvserve.models.resolve import local_model_dir, resolve_model

    _, ref = resolve_model(None, paths.data_dir(), progress=False)
    return load(Path(local_model_dir(ref)))


def test_parser_selection_follows_mlx_lm():
    """A tokenizer that mlx-lm gave a parser keeps it; one without gets the Hermes fallback."""
    plain = SimpleNamespace(tool_parser=None, has_tool_calling=False)
    assert tool_format_for(plain) is HERMES
    qwen = SimpleNamespace(
        tool_parser=qwen3_coder.parse_tool_call,
        has_tool_calling=True,
        tool_call_start=qwen3_coder.tool_call_start,
        tool_call_end=qwen3_coder.tool_call_end,
    )
    fmt = tool_format_for(qwen)
    assert fmt.native and not fmt.json_body and fmt.name == "qwen3_coder"
    hermes_native = SimpleNamespace(
        tool_parser=json_tools.parse_tool_call,
        has_tool_calling=True,
        tool_call_start="<tool_call>",
        tool_call_end="</tool_call>",
    )
    assert tool_format_for(hermes_native).json_body


def test_default_model_gets_hermes_tools_in_its_system_turn(tokenizer):
    assert tool_format_for(tokenizer) is HERMES
    req = ChatRequest(
        [Message("system", "Be brief."), Message("user", "Weather in Paris?")], tools=[TOOL]
    )
    text = tokenizer.decode(render_chat(tokenizer, req).tokens)
    system = text.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\nBe brief.\n\n# Tools")
    assert json.dumps(TOOL.as_openai()) in system and "<tool_call>" in system


def test_history_renders_as_the_model_generated_it(tokenizer):
    """A call re-renders as `<tool_call>\\n{json}\\n</tool_call>` (the grammar's form) and
    results as user <tool_response> turns; the same conversation renders to the same tokens."""
    call = ToolCall("call_1", "get_weather", '{ "city" :"Paris"}')
    messages = [
        Message("user", "Weather in Paris and Rome?"),
        Message("assistant", "", [call, ToolCall("call_2", "get_weather", '{"city": "Rome"}')]),
        Message("tool", "21 C", tool_call_id="call_1"),
        Message("tool", "25 C", tool_call_id="call_2"),
    ]
    first = render_chat(tokenizer, ChatRequest(messages, tools=[TOOL]))
    again = render_chat(tokenizer, ChatRequest(list(messages), tools=[TOOL]))
    assert first.tokens == again.tokens
    text = tokenizer.decode(first.tokens)
    assert (
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": '
        '"Paris"}}\n</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": '
        '{"city": "Rome"}}\n</tool_call><|im_end|>'
    ) in text
    assert (
        "<|im_start|>user\n<tool_response>\n21 C\n</tool_response>\n"
        "<tool_response>\n25 C\n</tool_response><|im_end|>"
    ) in text
    assert sorted(first.boundaries.values()) == ["anchor", "message"]  # tools: a system turn


def test_history_errors_name_the_message(tokenizer):
    orphan = [Message("user", "x"), Message("tool", "1", tool_call_id="call_x")]
    with pytest.raises(InvalidRequest) as err:
        render_chat(tokenizer, ChatRequest(orphan))
    assert err.value.param == "messages[1].tool_call_id"
    bad = [Message("user", "x"), Message("assistant", "", [ToolCall("c", "f", "[1, 2]")])]
    with pytest.raises(InvalidRequest) as err:
        render_chat(tokenizer, ChatRequest(bad))
    assert err.value.param == "messages[1].tool_calls[0].function.arguments"


def test_tool_choice_none_still_lists_tools_for_a_stable_prefix(tokenizer):
    messages = [Message("user", "hi")]
    auto = render_chat(tokenizer, ChatRequest(messages, tools=[TOOL]))
    none = render_chat(tokenizer, ChatRequest(messages, [TOOL], ToolChoice("none")))
    assert auto.tokens == none.tokens


TEXT = (
    'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa\\"ris}", '
    '"n": [1, {"a": 2}], "note": "</tool_call>x"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "x", "arguments": {}}\n</tool_call>'
)


@pytest.mark.parametrize("seed", range(40))
def test_streaming_parser_any_split(seed):
    """However the text is split, the argument fragments reassemble to the final arguments,
    each call is announced (id and name) before its arguments, and no markup is content."""
    rng = random.Random(seed)
    parser = OutputParser(HERMES)
    events, i = [], 0
    while i < len(TEXT):
        n = rng.randint(1, 9)
        events += parser.feed(TEXT[i : i + n])
        i += n
    events += parser.finish()
    streamed: dict[int, str] = {}
    for event in events:
        if isinstance(event, ToolCallStarted):
            assert event.index not in streamed
            streamed[event.index] = ""
        elif isinstance(event, ToolCallDelta):
            streamed[event.index] += event.arguments
    assert [c.name for c in parser.calls] == ["get_weather", "x"]
    assert [c.arguments for c in parser.calls] == [streamed[0], streamed[1]]
    assert json.loads(parser.calls[0].arguments)["city"] == 'Pa"ris}'
    assert json.loads(parser.calls[0].arguments)["note"] == "</tool_call>x"  # not the call's end
    assert "".join(e.text for e in events if isinstance(e, ContentDelta)) == "Let me check."


def test_parser_keeps_text_that_only_looks_like_a_call():
    parser = OutputParser(HERMES)
    events = parser.feed("a <tool") + parser.feed("s> b") + parser.finish()
    assert "".join(e.text for e in events if isinstance(e, ContentDelta)) == "a <tools> b"
    assert parser.calls == []


def _native(module) -> object:
    return tool_format_for(
        SimpleNamespace(
            tool_parser=module.parse_tool_call,
            has_tool_calling=True,
            tool_call_start=module.tool_call_start,
            tool_call_end=module.tool_call_end,
        )
    )


def test_parser_for_other_formats_sends_each_call_whole():
    # Mistral's format when its template's layout cannot be told (no template to probe):
    # parsed only, each call sent whole
    fmt = _native(mistral)
    assert not fmt.constrained
    tokenizer = SimpleNamespace(
        tool_parser=mistral.parse_tool_call,
        has_tool_calling=True,
        tool_call_start=mistral.tool_call_start,
        tool_call_end=mistral.tool_call_end,
    )
    assert "mistral format, parsed only" in tool_format_notice(tokenizer)
    parser = OutputParser(fmt, [TOOL])
    text = '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}'
    events = [e for ch in text for e in parser.feed(ch)] + parser.finish()
    assert [type(e).__name__ for e in events] == [
        "ToolCallStarted",
        "ToolCallDelta",
        "ToolCallFinished",
    ]
    assert json.loads(parser.calls[0].arguments) == {"city": "Paris"}


def test_glm47_calls_stream_parameter_by_parameter():
    fmt = _native(glm47)
    assert fmt.constrained and fmt.name == "glm47"
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    }
    parser = OutputParser(fmt, [Tool("get_weather", None, schema)])
    text = (
        "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>null</arg_value>\n"
        "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>"
    )
    events = [e for ch in text for e in parser.feed(ch)] + parser.finish()
    deltas = [e.arguments for e in events if isinstance(e, ToolCallDelta)]
    assert len(deltas) == 5
    assert "".join(deltas) == parser.calls[0].arguments == '{"city": "null", "days": 3}'


def test_qwen3_coder_calls_stream_parameter_by_parameter():
    """Fed a byte at a time, an XML call is announced by name, then each parameter passes as it
    closes, converted by its schema type; the fragments are exactly the final arguments."""
    fmt = _native(qwen3_coder)
    assert fmt.constrained and fmt.name == "qwen3_coder"
    schema = {
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "days": {"type": "integer"},
            "opts": {"type": "object"},
            "note": {"type": "string"},
        },
    }
    parser = OutputParser(fmt, [Tool("get_weather", None, schema)])
    text = (
        'Checking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nSão\n"Paulo"\n'
        "</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=opts>\n"
        '{"a": [1, 2]}\n</parameter>\n<parameter=note>\nnull\n</parameter>\n</function>\n'
        "</tool_call>"
    )
    events = [e for ch in text for e in parser.feed(ch)] + parser.finish()
    kinds = [type(e).__name__ for e in events]
    assert kinds[0] == "ContentDelta" and kinds[-1] == "ToolCallFinished"
    assert kinds.count("ToolCallStarted") == 1
    deltas = [e.arguments for e in events if isinstance(e, ToolCallDelta)]
    assert len(deltas) == 9  # `{"key": ` and the value per parameter, then `}`
    arguments = parser.calls[0].arguments
    assert "".join(deltas) == arguments
    assert json.loads(arguments) == {
        "city": 'São\n"Paulo"',
        "days": 3,
        "opts": {"a": [1, 2]},
        "note": None,
    }
    assert arguments == json.dumps(json.loads(arguments), ensure_ascii=False)


def test_glm_layout_is_read_from_the_template():
    """GLM-4.6's template puts a newline after the name and after each value; GLM-4.7's call
    markup (`{{- '<tool_call>' + tc.name -}}` ... `<arg_key>{{ k }}</arg_key><arg_value>...`)
    none. The grammar follows whichever the model's template renders."""
    from jinja2 import Environment

    from mlx_kvserve.chat.formats.glm47 import glm_layout
    from mlx_kvserve.chat.formats.glm47 import syntax as GLM47

    fixture = Path(__file__).parents[1] / "fixtures" / "templates" / "glm-4.6.jinja"
    env = Environment(trim_blocks=True, lstrip_blocks=True)
    glm46 = env.from_string(fixture.read_text(encoding="utf-8"))
    assert glm_layout(lambda m: glm46.render(messages=m)) == GLM47
    glm47_markup = env.from_string(
        "{% for m in messages %}{% if m.tool_calls %}{% for tc in m.tool_calls %}"
        "{%- if tc.function %}{%- set tc = tc.function %}{%- endif %}"
        "{{- '<tool_call>' + tc.name -}}\n"
        "{% set _args = tc.arguments %}{% for k, v in _args.items() %}<arg_key>{{ k }}</arg_key>"
        "<arg_value>{{ v }}</arg_value>{% endfor %}</tool_call>{% endfor %}{% endif %}{% endfor %}"
    )
    compact = glm_layout(lambda m: glm47_markup.render(messages=m))
    assert (compact.head_end, compact.key_close, compact.value_after, compact.lead) == (
        "",
        "</arg_key><arg_value>",
        "",
        "",
    )
    assert glm_layout(lambda m: "no calls here") == GLM47

    # streamed a byte at a time, a compact call's name is announced whole, not as it grows
    fmt = dataclasses.replace(_native(glm47), syntax=compact)
    schema = {"type": "object", "properties": {"city": {"type": "string"}}}
    parser = OutputParser(fmt, [Tool("get_weather", None, schema)])
    text = "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Oslo</arg_value></tool_call>"
    events = [e for ch in text for e in parser.feed(ch)] + parser.finish()
    assert [e.name for e in events if isinstance(e, ToolCallStarted)] == ["get_weather"]
    deltas = [e.arguments for e in events if isinstance(e, ToolCallDelta)]
    assert "".join(deltas) == parser.calls[0].arguments == '{"city": "Oslo"}'
