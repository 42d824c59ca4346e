"""The reasoning pieces in process: the output parser's split, the reasoning gate's budget, the
template-variable mapping and the settings that carry server defaults.

The gate and the mapping run on a real tokenizer (the tiny Qwen3.5 model of
tests/support/thinking_models.py) and real llguidance grammars; nothing is stubbed.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlx_kvserve.chat import ChatRequest, Message, Thinking, Tool, ToolChoice
from mlx_kvserve.chat.events import ContentDelta, ReasoningDelta, ToolCallFinished
from mlx_kvserve.chat.formats.hermes import FORMAT as HERMES
from mlx_kvserve.chat.invalid_request import InvalidRequest
from mlx_kvserve.chat.output import OutputParser
from mlx_kvserve.chat.reasoning.reasoning_gate import ReasoningGate
from mlx_kvserve.chat.reasoning.thinking import ThinkMarkers, template_kwargs
from mlx_kvserve.config.precedence import ConfigError, resolve_settings
from tests.support.thinking_models import build_thinking_model

MARKERS = ThinkMarkers("<think>", "</think>", (1,), (2,), (3, 2, 4))
CALL = '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'


def run(parser: OutputParser, text: str, step: int) -> list:
    events = []
    for i in range(0, len(text), step):
        events += parser.feed(text[i : i + step])
    return events + parser.finish()


@pytest.mark.parametrize("step", [1, 2, 3, 7, 1000])
def test_reasoning_is_split_from_content_at_any_chunking(step: int) -> None:
    text = f"Let me try {CALL} first.\n</think>\n\nThe answer. {CALL}"
    parser = OutputParser(HERMES, [Tool("f")], markers=MARKERS, reasoning=True)
    events = run(parser, text, step)
    reasoning = "".join(e.text for e in events if isinstance(e, ReasoningDelta))
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    assert reasoning == parser.reasoning == f"Let me try {CALL} first."  # not a call
    assert content.strip() == "The answer." and "</think>" not in content
    assert [e.call.name for e in events if isinstance(e, ToolCallFinished)] == ["f"]


@pytest.mark.parametrize("step", [1, 4, 1000])
def test_model_written_think_opens_the_reasoning(step: int) -> None:
    parser = OutputParser(None, markers=MARKERS)
    run(parser, "<think>\nhmm, </thin k\n</think>\n\nHello", step)
    assert (parser.reasoning, parser.content) == ("hmm, </thin k", "Hello")


def test_without_markers_everything_is_content() -> None:
    parser = OutputParser(None)
    run(parser, "<think>x</think>y", 1)
    assert (parser.reasoning, parser.content) == ("", "<think>x</think>y")


def test_reasoning_cut_short_keeps_what_was_written() -> None:
    parser = OutputParser(None, markers=MARKERS, reasoning=True)
    run(parser, "still thinking </thi", 3)
    assert (parser.reasoning, parser.content) == ("still thinking </thi", "")


def test_the_gate_forces_the_end_when_the_budget_is_spent() -> None:
    gate = ReasoningGate(MARKERS, reasoning=True, budget=3)
    for token in (10, 11):
        assert gate.allowed(50) is None
        gate.advance(token)
        assert gate.forced(10) == []
    gate.advance(12)  # the third reasoning token spends the budget
    assert gate.forced(2) == [3, 2]  # limited by the room left
    assert not gate.reasoning
    mask = gate.allowed(50)  # the rest is forced through the mask
    assert mask is not None and mask.sum() == 1 and mask[4]
    gate.advance(4)
    assert gate.allowed(50) is None and gate.forced(10) == []


def test_the_gate_follows_the_model_in_and_out_without_a_budget() -> None:
    gate = ReasoningGate(MARKERS, reasoning=False, budget=None)
    for token, inside in [(7, False), (1, True), (8, True), (2, False), (9, False)]:
        gate.advance(token)
        assert gate.reasoning is inside


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory):
    from mlx_lm import load

    _, tok = load(str(build_thinking_model(tmp_path_factory.mktemp("m") / "q", "qwen3.5")))
    return tok


def test_the_gate_keeps_a_grammar_out_of_the_reasoning(tokenizer) -> None:
    """tool_choice "required" on a model whose prompt opened <think>: the reasoning is free, the
    budget ends it, then the grammar forces the call."""
    from mlx_kvserve.chat.formats.hermes import FORMAT as HERMES
    from mlx_kvserve.chat.grammar import GrammarCompiler
    from mlx_kvserve.chat.render import render_chat

    req = ChatRequest(
        [Message("user", "hi")],
        tools=[Tool("f", None, {"type": "object", "properties": {}, "required": []})],
        tool_choice=ToolChoice("required"),
    )
    prompt = render_chat(tokenizer, req)
    assert prompt.reasoning and prompt.markers is not None
    compiler = GrammarCompiler(tokenizer)
    inner = compiler.constraint_for(req, HERMES)
    assert inner is not None
    gate = ReasoningGate(prompt.markers, reasoning=True, budget=2, inner=inner)
    free = tokenizer.encode(" well", add_special_tokens=False)[0]
    assert gate.allowed(50000) is None  # while reasoning nothing is masked
    gate.advance(free)
    gate.advance(free)
    closing = gate.forced(100)
    assert tokenizer.decode(closing) == "\n</think>\n\n"
    vocab = len(tokenizer.get_vocab())  # once: the tokenizer builds the whole dict per call
    mask = gate.allowed(vocab)
    assert mask is not None and not mask[free]  # the call's grammar now rules
    out = []
    for _ in range(200):
        forced = gate.forced(100)
        out += forced
        if gate.finished:
            break
        if not forced:
            token = int(gate.allowed(vocab).nonzero()[0][0])
            gate.advance(token)
            out.append(token)
    assert tokenizer.decode(out).startswith("<tool_call>")


def test_template_variables_follow_the_template(tokenizer) -> None:
    from mlx_kvserve.chat.reasoning.thinking import template_variables

    variables = template_variables(tokenizer)
    assert "enable_thinking" in variables and "reasoning_effort" not in variables
    off = Thinking(effort="none")
    assert template_kwargs(variables, off, {}, {}) == {"enable_thinking": False}
    assert template_kwargs(variables, Thinking(effort="low"), {}, {"enable_thinking": False}) == {
        "enable_thinking": True
    }
    gpt_oss = frozenset({"reasoning_effort"})
    assert template_kwargs(gpt_oss, Thinking(effort="xhigh"), {}, {}) == {
        "reasoning_effort": "high"
    }
    assert template_kwargs(gpt_oss, Thinking(effort="high"), {"reasoning_effort": "low"}, {}) == {
        "reasoning_effort": "low"
    }


def test_reserved_template_kwargs_are_refused(tokenizer) -> None:
    from mlx_kvserve.chat.render import render_chat

    req = ChatRequest([Message("user", "hi")], template_kwargs={"add_generation_prompt": False})
    with pytest.raises(InvalidRequest) as err:
        render_chat(tokenizer, req)
    assert err.value.param == "chat_template_kwargs.add_generation_prompt"


def test_chat_template_kwargs_setting_from_every_source(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "config.toml"
    config.write_text(
        "chat_template_kwargs = '{\"enable_thinking\": false}'\nthinking_budget = 9\n"
    )
    settings = resolve_settings({}, config).settings
    assert settings.template_defaults() == {"enable_thinking": False}
    assert settings.thinking_budget == 9
    monkeypatch.setenv("MLX_KVSERVE_CHAT_TEMPLATE_KWARGS", '{"preserve_thinking": true}')
    assert resolve_settings({}, config).settings.template_defaults() == {"preserve_thinking": True}
    flags = {"chat_template_kwargs": "{}"}
    assert resolve_settings(flags, config).settings.template_defaults() == {}
    for bad in ("[1]", "{", '"x"', '{"tokenize": true}'):
        with pytest.raises(ConfigError, match="chat_template_kwargs"):
            resolve_settings({"chat_template_kwargs": bad}, config)
    with pytest.raises(ConfigError, match="thinking_budget"):
        resolve_settings({"thinking_budget": -1}, config)


fragments = st.lists(
    st.sampled_from(
        ["<think>", "</think>", "</th", "<thi", "a", "b c", " ", "\n", "\n\n", CALL, "<tool_call>"]
    ),
    max_size=12,
)


@settings(max_examples=300, deadline=None, database=None)
@given(
    parts=fragments,
    cuts=st.lists(st.integers(min_value=1, max_value=9), max_size=40),
    opened=st.booleans(),
)
def test_any_chunking_gives_the_same_split(parts: list[str], cuts: list[int], opened: bool) -> None:
    """Streamed deltas concatenate to what one whole feed gives, however the text is cut."""
    text = "".join(parts)
    whole = OutputParser(HERMES, [Tool("f")], markers=MARKERS, reasoning=opened)
    whole.feed(text)
    whole.finish()
    parser = OutputParser(HERMES, [Tool("f")], markers=MARKERS, reasoning=opened)
    events, at = [], 0
    for n in [*cuts, len(text)]:
        events += parser.feed(text[at : at + n])
        at += n
    events += parser.feed(text[at:]) + parser.finish()
    reasoning = "".join(e.text for e in events if isinstance(e, ReasoningDelta))
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    assert reasoning == parser.reasoning == whole.reasoning
    assert content == parser.content
    assert content.strip() == whole.content.strip()  # whitespace before a call may be held
    assert [c.name for c in parser.calls] == [c.name for c in whole.calls]
    assert "</think>" not in reasoning
