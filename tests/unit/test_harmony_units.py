"""The harmony output parser on its own (harmony.channel_reader): channels, calls, hostile text."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from mlx_kvserve.chat.events import (
    ContentDelta,
    ReasoningDelta,
    ToolCallDelta,
    ToolCallFinished,
    ToolCallStarted,
)
from mlx_kvserve.chat.formats.harmony.channel_reader import HarmonyParser
from mlx_kvserve.chat.request import Tool

CONTROL = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|call|>")
CONTROL += ("<|return|>", "<|endoftext|>")


def run(text: str, cuts: list[int] | None = None, **kwargs) -> tuple[HarmonyParser, list]:
    parser = HarmonyParser([Tool("f"), Tool("patch", kind="custom")], **kwargs)
    events: list = []
    at = 0
    for cut in sorted(set(cuts or [])) + [len(text)]:
        events += parser.feed(text[at:cut])
        at = max(at, cut)
    events += parser.finish()
    return parser, events


def test_channels_become_reasoning_content_and_calls() -> None:
    text = (
        "<|channel|>analysis<|message|>Think.<|end|><|start|>assistant"
        '<|channel|>commentary to=functions.f <|constrain|>json<|message|>{"a": 1}<|call|>'
    )
    parser, events = run(text)
    assert parser.reasoning == "Think." and parser.content == ""
    assert [(c.name, c.arguments) for c in parser.calls] == [("f", '{"a": 1}')]
    assert isinstance(events[1], ToolCallStarted)
    final, _ = run("<|channel|>final<|message|>It is sunny.<|return|>")
    assert final.content == "It is sunny." and not final.calls
    template, _ = run(' to=functions.f<|channel|>commentary json<|message|>{"b": "x"}')
    assert [(c.name, c.arguments) for c in template.calls] == [("f", '{"b": "x"}')]


def test_text_without_a_header_is_the_answer() -> None:
    parser, _ = run("Tomorrow it rains.")
    assert parser.content == "Tomorrow it rains."


def test_a_custom_tool_gets_its_raw_input_whole() -> None:
    parser, events = run(
        ' to=functions.patch<|channel|>commentary json<|message|>{"input": "x\\ny"}'
    )
    assert [(c.name, c.arguments, c.kind) for c in parser.calls] == [("patch", "x\ny", "custom")]
    assert [e.arguments for e in events if isinstance(e, ToolCallDelta)] == ["x\ny"]


def test_calls_are_dropped_when_tools_are_off() -> None:
    parser, _ = run(
        ' to=functions.f<|channel|>commentary json<|message|>{"a": 1}', parse_calls=False
    )
    assert parser.calls == [] and parser.content == ""


pieces = st.sampled_from(
    [
        *CONTROL,
        "analysis",
        "final",
        "commentary",
        " json",
        "assistant",
        " to=functions.f",
        "to=functions.patch",
        "<|",
        "|>",
        "{",
        '"a": 1',
        "}",
        " ",
        "\n",
        "hello",
        "to",
    ]
)


@settings(max_examples=500, deadline=None)
@given(parts=st.lists(pieces, max_size=24), cuts=st.lists(st.integers(0, 200), max_size=8))
def test_fuzzed_harmony_text(parts: list[str], cuts: list[int]) -> None:
    """Whatever the model writes, however it is cut into chunks: no control token reaches the
    content, the reasoning or a call, the deltas add up to the whole, and the chunked result
    equals the result of the text fed at once."""
    text = "".join(parts)
    parser, events = run(text, cuts)
    whole, _ = run(text)
    for value in (parser.content, parser.reasoning, *(c.arguments for c in parser.calls)):
        assert not any(token in value for token in CONTROL), (text, value)
    assert "".join(e.text for e in events if isinstance(e, ContentDelta)) == parser.content
    assert "".join(e.text for e in events if isinstance(e, ReasoningDelta)) == parser.reasoning
    for index, call in enumerate(parser.calls):
        deltas = [e.arguments for e in events if isinstance(e, ToolCallDelta) and e.index == index]
        assert "".join(deltas) == call.arguments
    assert [e.call for e in events if isinstance(e, ToolCallFinished)] == parser.calls
    assert (parser.content, parser.reasoning) == (whole.content, whole.reasoning)
    assert [(c.name, c.arguments) for c in parser.calls] == [
        (c.name, c.arguments) for c in whole.calls
    ]
