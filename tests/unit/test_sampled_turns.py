"""Kept turns (chat.reasoning.sampled_turns) spliced into a re-rendered history, in process, on the
real Qwen3 and Qwen3.5 templates: only an unchanged replay of a turn, in the conversation it
came from, renders the kept tokens; the store stays bounded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mlx_kvserve.chat.reasoning.sampled_turns import SampledTurns
from mlx_kvserve.chat.render import render_chat
from mlx_kvserve.chat.request import ChatRequest, Message, Tool, ToolCall, ToolChoice
from tests.support.thinking_models import TOOL_TOKENS, build_thinking_model

TOOL = Tool(
    "get_weather",
    parameters={
        "type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    },
)
MODEL = "m"
ARGS = {"city": "Paris", "days": 3}


@pytest.fixture(scope="module", params=["qwen3", "qwen3.5"])
def tokenizer(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    from mlx_lm import load

    dest = tmp_path_factory.mktemp("kept") / request.param
    return load(str(build_thinking_model(Path(dest), request.param, tool_tokens=TOOL_TOKENS)))[1]


def _request(messages: list[Message]) -> ChatRequest:
    return ChatRequest(list(messages), tools=[TOOL], tool_choice=ToolChoice("required"))


QUESTION = [Message("system", "Be brief."), Message("user", "Weather in Paris?")]


def _answer(tokenizer, kept: SampledTurns, question: list[Message], reasoning: str = "") -> tuple:
    """Render the question, and keep an answer to it as the server would: sampled tokens that
    the tokenizer would not make of the answer's text (one token per character)."""
    prompt = render_chat(tokenizer, _request(question), sampled=kept, model=MODEL)
    call = ToolCall("call_1", "get_weather", json.dumps(ARGS))
    text = f'<tool_call>\n{{"name": "get_weather", "arguments": {json.dumps(ARGS)}}}\n</tool_call>'
    if reasoning:
        text = f"{reasoning}\n</think>\n\n{text}"
    sampled = [tokenizer.encode(ch, add_special_tokens=False)[0] for ch in text if ch.isalpha()]
    kept.remember(MODEL, prompt.text, sampled, "", reasoning, [call])
    return prompt, sampled, call


def _next(tokenizer, kept, question, call, *, arguments=None, model=MODEL, reasoning=None):
    replay = ToolCall(call.id, call.name, arguments or call.arguments)
    history = [
        *question,
        Message("assistant", "", [replay], reasoning=reasoning),
        Message("tool", '{"sky": "clear"}', tool_call_id=call.id),
    ]
    return render_chat(tokenizer, _request(history), sampled=kept, model=model).tokens


def _holds(tokens: list[int], part: list[int]) -> bool:
    return any(tokens[i : i + len(part)] == part for i in range(len(tokens) - len(part) + 1))


def test_an_unchanged_replay_renders_the_sampled_tokens(tokenizer):
    kept = SampledTurns()
    prompt, sampled, call = _answer(tokenizer, kept, QUESTION)
    tokens = _next(tokenizer, kept, QUESTION, call)
    assert tokens[: len(prompt.tokens)] == prompt.tokens
    assert tokens[len(prompt.tokens) : len(prompt.tokens) + len(sampled)] == sampled
    # the same arguments re-serialised by the client (key order, spacing) are the same call
    spaced = json.dumps({"days": 3, "city": "Paris"}, indent=2)
    assert _next(tokenizer, kept, QUESTION, call, arguments=spaced) == tokens
    plain = render_chat(tokenizer, _request(_history(call)), model=MODEL).tokens
    assert plain != tokens and not _holds(plain, sampled)


def _history(call: ToolCall) -> list[Message]:
    return [
        *QUESTION,
        Message("assistant", "", [call]),
        Message("tool", '{"sky": "clear"}', tool_call_id=call.id),
    ]


def test_anything_changed_renders_the_template_text(tokenizer):
    kept = SampledTurns()
    _, sampled, call = _answer(tokenizer, kept, QUESTION)
    other = json.dumps({**ARGS, "days": 4})
    assert not _holds(_next(tokenizer, kept, QUESTION, call, arguments=other), sampled)
    assert not _holds(_next(tokenizer, kept, QUESTION, call, model="other"), sampled)
    edited = [Message("system", "Be very brief."), QUESTION[1]]  # another conversation
    assert not _holds(_next(tokenizer, kept, edited, call), sampled)
    forged = ToolCall("call_2", call.name, call.arguments)  # an id the server never made
    assert not _holds(_next(tokenizer, kept, QUESTION, forged), sampled)


def test_reasoning_a_template_drops_is_not_brought_back(tokenizer):
    """A later user message makes Qwen's templates drop the turn's reasoning: the kept tokens
    (which hold it) are not spliced in then; a client that rewrote the reasoning gets none."""
    kept = SampledTurns()
    _, sampled, call = _answer(tokenizer, kept, QUESTION, reasoning="Think about Paris")
    assert _holds(_next(tokenizer, kept, QUESTION, call, reasoning="Think about Paris"), sampled)
    assert not _holds(_next(tokenizer, kept, QUESTION, call, reasoning="Other text"), sampled)
    later = [*_history(call), Message("user", "Thanks. And Rome?")]
    later[2] = Message("assistant", "", [call], reasoning="Think about Paris")
    tokens = render_chat(tokenizer, _request(later), sampled=kept, model=MODEL).tokens
    assert not _holds(tokens, sampled)


def test_the_store_is_bounded() -> None:
    kept = SampledTurns(max_turns=3, max_tokens=10)
    for n in range(5):
        kept.remember(MODEL, (1, b"h"), [1, 2, 3], "", "", [ToolCall(f"c{n}", "f", "{}")])
    assert len(kept) == 3
    assert kept.match(Message("assistant", "", [ToolCall("c0", "f", "{}")]), MODEL) is None
    assert kept.match(Message("assistant", "", [ToolCall("c4", "f", "{}")]), MODEL) is not None
    kept.remember(MODEL, (1, b"h"), list(range(8)), "", "", [ToolCall("big", "f", "{}")])
    assert len(kept) == 1  # 8 + 3 tokens would pass the budget of 10
    kept.remember(MODEL, (1, b"h"), [1], "", "", [ToolCall("bad", "f", "{not json")])
    assert kept.match(Message("assistant", "", [ToolCall("bad", "f", "{not json")]), MODEL) is None


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    arguments=st.one_of(st.text(max_size=30), st.dictionaries(st.text(max_size=5), st.integers())),
    call_id=st.sampled_from(["call_1", "call_x", ""]),
    content=st.text(max_size=20),
)
def test_hostile_replays_never_break_rendering(tokenizer, arguments, call_id, content):
    """Whatever a client replays under a kept call id, rendering answers or refuses with a 400
    (InvalidRequest), and splices nothing unless the replay is the kept turn."""
    from mlx_kvserve.chat.invalid_request import InvalidRequest

    kept = SampledTurns()
    _, sampled, call = _answer(tokenizer, kept, QUESTION)
    text = arguments if isinstance(arguments, str) else json.dumps(arguments)
    replay = ToolCall(call_id, call.name, text)
    history = [
        *QUESTION,
        Message("assistant", content, [replay]),
        Message("tool", "ok", tool_call_id=call_id),
    ]
    try:
        tokens = render_chat(tokenizer, _request(history), sampled=kept, model=MODEL).tokens
    except InvalidRequest:
        return
    unchanged = call_id == call.id and not content.strip() and _parsed(text) == ARGS
    assert _holds(tokens, sampled) == unchanged


def _parsed(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None
