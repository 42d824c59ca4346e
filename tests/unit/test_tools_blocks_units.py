"""Block-format tool calls (MiniMax-M2, Kimi K2) without a server: the server's rendering against
the templates' own, the grammar's limits, and the stream under any split of a block's text.
The server-side tests are tests/server/test_tools_blocks.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support.block_tools import (
    ASK,
    FAMILIES,
    HISTORY,
    TOOLS,
    build_family_model,
    render_prompt,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def model_dir(family: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    dest = tmp_path_factory.mktemp("block_tools") / family
    return build_family_model(dest, family)


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path):
    from mlx_lm import load

    return load(str(model_dir))[1]


# -- without a server: rendering, the grammar, the stream ------------------------------------
def test_rendering_equals_the_templates_own(tokenizer):
    """Tools, calls (two in one turn) and their results render as the template itself renders
    them when handed the arguments as objects."""
    own = json.loads(json.dumps(HISTORY))
    for message in own:
        for call in message.get("tool_calls", []):
            call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    expected = tokenizer.apply_chat_template(
        own, tools=TOOLS, add_generation_prompt=True, tokenize=False
    )
    ours = tokenizer.decode(render_prompt(tokenizer, HISTORY))
    assert ours == expected
    assert "get_weather" in ours and "14:05" in ours


def test_the_grammar_admits_only_declared_tools(tokenizer, family):
    """In `auto` the text is free until the block opens; from there only a declared function's
    name and its declared parameters can follow (an invented tool is impossible)."""
    import llguidance

    from mlx_kvserve.chat import ChatRequest, Message, Tool, ToolChoice
    from mlx_kvserve.chat.formats import tool_format_for
    from mlx_kvserve.chat.grammar import GrammarCompiler

    _, parser, _, call, close, invented, undeclared, missing, (value, unread) = FAMILIES[family]
    fmt = tool_format_for(tokenizer)
    assert fmt.name == parser and fmt.constrained
    tools = [Tool(t["function"]["name"], None, t["function"]["parameters"]) for t in TOOLS]
    compiler = GrammarCompiler(tokenizer)

    def accepts(mode: str, text: str, parallel: bool = False) -> bool:
        choice = ToolChoice(mode, parallel=parallel)
        req = ChatRequest([Message("user", "hi")], tools=tools, tool_choice=choice)
        grammar = compiler.grammar_for(req, fmt)
        matcher = llguidance.LLMatcher(compiler._llg_tokenizer(), grammar, log_level=0)
        ids = tokenizer.encode(text, add_special_tokens=False)
        return all(matcher.consume_token(t) for t in ids) and not matcher.is_error()

    assert accepts("auto", "Let me check." + call + close)
    assert accepts("required", call + close)
    assert not accepts("auto", "Let me check." + invented)
    assert not accepts("required", invented)
    assert not accepts("required", undeclared)
    assert not accepts("required", missing)
    assert not accepts("required", call.replace(value, unread))
    # several calls share one block when parallel calls are allowed, and only then
    between = "</invoke>\n" if fmt.name == "minimax_m2" else "<|tool_call_end|>"
    twice = call + between + call[len(call.split("<invoke")[0]) :]
    if fmt.name == "kimi_k2":
        twice = call + between + call[len(call.split("<|tool_call_begin|>")[0]) :]
    assert accepts("required", twice + close, parallel=True)
    assert not accepts("required", twice)


def _block(tokenizer, calls: list[tuple[str, dict]]) -> str:
    """The block the template renders for these calls (after the opening marker)."""
    from mlx_kvserve.chat.formats import tool_format_for

    fmt = tool_format_for(tokenizer)
    message = {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": f"functions.{n}:{i}",
                "type": "function",
                "function": {"name": n, "arguments": a},
            }
            for i, (n, a) in enumerate(calls)
        ],
    }
    text = tokenizer.apply_chat_template([ASK[0], message], tools=TOOLS, tokenize=False)
    start = text.rindex(fmt.start)  # the system turn shows an example block first
    return text[start : text.index(fmt.end, start) + len(fmt.end)]


def _events(tokenizer, chunks: list[str]) -> list[tuple]:
    from mlx_kvserve.chat import Tool
    from mlx_kvserve.chat.formats import tool_format_for
    from mlx_kvserve.chat.output import OutputParser

    tools = [Tool(t["function"]["name"], None, t["function"]["parameters"]) for t in TOOLS]
    parser = OutputParser(tool_format_for(tokenizer), tools)
    events = [e for c in chunks for e in parser.feed(c)] + parser.finish()
    out: list[tuple] = []
    args: dict[int, str] = {}

    def same(call_id: str) -> str:  # the server's own ids are random; the model's are not
        return "call_" if call_id.startswith("call_") else call_id

    for e in events:
        kind = type(e).__name__
        if kind == "ToolCallDelta":
            args[e.index] = args.get(e.index, "") + e.arguments
        elif kind == "ToolCallStarted":
            out.append((kind, e.index, same(e.id), e.name))
        elif kind == "ToolCallFinished":
            call = e.call
            out.append(
                (kind, e.index, same(call.id), call.name, call.arguments, args.get(e.index, ""))
            )
        elif out and out[-1][0] == kind:  # text arrives in chunks of any size
            out[-1] = (kind, out[-1][1] + e.text)
        else:
            out.append((kind, e.text))
    return out


_text = st.text(alphabet=st.characters(blacklist_categories=["Cs"]), max_size=12)
_weather = st.fixed_dictionaries(
    {
        "city": _text.filter(lambda s: s == s.strip() and s and s.lower() != "null"),
        "unit": st.sampled_from(["celsius", "fahrenheit"]),
        "days": st.integers(1, 7),
    },
    optional={"hours": st.lists(st.integers(0, 23), max_size=3)},
)
_calls = st.lists(
    st.one_of(
        st.tuples(st.just("get_weather"), _weather),
        st.tuples(st.just("ping"), st.just({"host": "localhost"})),
    ),
    min_size=1,
    max_size=3,
)


@settings(max_examples=150, deadline=None, database=None)
@given(calls=_calls, cuts=st.lists(st.integers(0, 400), max_size=12), data=st.data())
def test_any_split_of_a_block_streams_the_same_calls(tokenizer, calls, cuts, data):
    """Whatever chunks a valid block arrives in, the same calls are announced and finished, and
    each call's streamed fragments concatenate to its final arguments, which are the ones the
    template rendered."""
    calls = [(n, a) for n, a in calls if "</" not in json.dumps(a)]
    if not calls:
        return
    text = "Sure." + _block(tokenizer, calls)
    points = sorted({c % (len(text) + 1) for c in cuts})
    chunks = [text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=True)]
    whole = _events(tokenizer, [text])
    assert _events(tokenizer, [c for c in chunks if c]) == whole
    finished = [e for e in whole if e[0] == "ToolCallFinished"]
    assert [(e[3], json.loads(e[4])) for e in finished] == calls
    assert all(e[4] == e[5] for e in finished)  # the fragments make the arguments


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
