"""Block-format tool calls (MiniMax-M2, Kimi K2) without a server: the server's rendering against
the templates' own, the grammar's limits, and the stream under any split of a block's text.
The server-side tests are tests/server/test_tools_blocks.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support.block_tools import FAMILIES, assert_renders_as_the_template, build_family_model
from tests.support.tool_parsing import (
    acceptor,
    assert_admits_only_declared_tools,
    assert_any_split_streams_the_same_calls,
    parsed_events,
    template_text,
    weather_calls,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def model_dir(family: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    dest = tmp_path_factory.mktemp("block_tools") / family
    return build_family_model(dest, family)


# -- without a server: rendering, the grammar, the stream ------------------------------------
def test_rendering_equals_the_templates_own(tokenizer):
    """Tools, calls (two in one turn) and their results render as the template itself renders
    them when handed the arguments as objects."""
    assert_renders_as_the_template(tokenizer)


def test_the_grammar_admits_only_declared_tools(tokenizer, family):
    """In `auto` the text is free until the block opens; from there only a declared function's
    name and its declared parameters can follow (an invented tool is impossible)."""
    from mlx_kvserve.chat.formats import tool_format_for

    _, parser, _, *texts = FAMILIES[family]
    assert_admits_only_declared_tools(tokenizer, parser, tuple(texts), parallel=False)
    call, close = texts[:2]
    fmt = tool_format_for(tokenizer)
    accepts = acceptor(tokenizer)
    # several calls share one block when parallel calls are allowed, and only then
    between = "</invoke>\n" if fmt.name == "minimax_m2" else "<|tool_call_end|>"
    twice = call + between + call[len(call.split("<invoke")[0]) :]
    if fmt.name == "kimi_k2":
        twice = call + between + call[len(call.split("<|tool_call_begin|>")[0]) :]
    assert accepts("required", twice + close, parallel=True)
    assert not accepts("required", twice, parallel=False)


def _block(tokenizer, calls: list[tuple[str, dict]]) -> str:
    """The block the template renders for these calls (after the opening marker)."""
    from mlx_kvserve.chat.formats import tool_format_for

    fmt = tool_format_for(tokenizer)
    text = template_text(tokenizer, calls, lambda i, n: f"functions.{n}:{i}")
    start = text.rindex(fmt.start)  # the system turn shows an example block first
    return text[start : text.index(fmt.end, start) + len(fmt.end)]


def _events(tokenizer, chunks: list[str]) -> list[tuple]:
    return parsed_events(tokenizer, chunks, ids=True)


@settings(max_examples=150, deadline=None, database=None)
@given(
    calls=weather_calls(detailed=False),
    cuts=st.lists(st.integers(0, 400), max_size=12),
    data=st.data(),
)
def test_any_split_of_a_block_streams_the_same_calls(tokenizer, calls, cuts, data):
    """Whatever chunks a valid block arrives in, the same calls are announced and finished, and
    each call's streamed fragments concatenate to its final arguments, which are the ones the
    template rendered."""
    calls = [(n, a) for n, a in calls if "</" not in json.dumps(a)]
    if not calls:
        return
    text = "Sure." + _block(tokenizer, calls)
    assert_any_split_streams_the_same_calls(tokenizer, text, calls, cuts, ids=True)


def test_a_block_cut_short_names_only_declared_tools(tokenizer):
    """Generation may stop anywhere in a block (max_tokens): whatever the parser makes of the
    rest, a call keeps the declared name it was announced with."""
    weather = {"city": "Paris", "unit": "celsius", "days": 2}
    text = "Sure." + _block(tokenizer, [("get_weather", weather), ("ping", {"host": "localhost"})])
    names = set()
    for cut in range(len(text)):
        for event in _events(tokenizer, [text[:cut]]):
            if event[0] in ("ToolCallStarted", "ToolCallFinished"):
                names.add(event[3])
    assert names == {"get_weather", "ping"}


def test_calls_the_model_numbered_alike_get_ids_of_their_own(tokenizer, family):
    """Kimi K2 writes its calls' ids (`functions.NAME:IDX`); a random model may number two
    calls of a section alike. A turn's calls must still be told apart: the later one takes the
    next free index, and an id the model gave once stays its own."""
    if family != "kimi-k2":
        pytest.skip("the server names this family's calls")
    ping = {"host": "localhost"}
    block = _block(tokenizer, [("ping", ping), ("ping", ping), ("get_weather", {})])
    block = block.replace("functions.ping:1", "functions.ping:0")
    block = block.replace("functions.get_weather:2", "functions.get_weather:0")
    started = [e for e in _events(tokenizer, [block]) if e[0] == "ToolCallStarted"]
    ids = [e[2] for e in started]
    assert ids == ["functions.ping:0", "functions.ping:1", "functions.get_weather:0"]
