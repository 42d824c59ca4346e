"""A tool format in this process, as the tool-format tests (tests/server/test_tools*.py,
tests/unit/test_tools_blocks_units.py) check it: the prompt the server renders, what its grammar
admits, and what its output parser makes of a text however it is cut. One copy, so that every
format is held to the same checks."""

from __future__ import annotations

import json
from collections.abc import Callable

from hypothesis import strategies as st

from tests.support.tool_schemas import ASK, TOOLS


def server_render(tokenizer, body: dict, defaults: dict | None = None) -> list[int]:
    """The prompt the server renders for a chat body (its own request parsing and render)."""
    from mlx_kvserve.api.openai_chat import to_chat_request
    from mlx_kvserve.api.schemas import ChatCompletionRequest
    from mlx_kvserve.chat.render import render_chat

    request = ChatCompletionRequest.model_validate({"model": "m", **body})
    return render_chat(tokenizer, to_chat_request(request), defaults).tokens


def server_prompt(
    tokenizer,
    messages: list[dict],
    choice: object = "auto",
    defaults: dict | None = None,
    tools: list[dict] = TOOLS,
) -> list[int]:
    """`server_render` of these messages offering the tools."""
    body = {"messages": messages, "tools": tools, "tool_choice": choice}
    return server_render(tokenizer, body, defaults)


def acceptor(
    tokenizer, tools: list[dict] = TOOLS, *, complete: bool = False
) -> Callable[..., bool]:
    """`accepts(mode, text, parallel=True)`: whether the grammar the server builds for the tools
    and that tool choice takes the tokenizer's tokens of `text` (and, `complete`, ends there)."""
    import llguidance

    from mlx_kvserve.chat import ChatRequest, Message, Tool, ToolChoice
    from mlx_kvserve.chat.formats import tool_format_for
    from mlx_kvserve.chat.grammar import GrammarCompiler

    fmt = tool_format_for(tokenizer)
    declared = [Tool(t["function"]["name"], None, t["function"].get("parameters")) for t in tools]
    compiler = GrammarCompiler(tokenizer)

    def accepts(mode: str, text: str, parallel: bool = True) -> bool:
        choice = ToolChoice(mode, parallel=parallel)
        req = ChatRequest([Message("user", "hi")], tools=declared, tool_choice=choice)
        grammar = compiler.grammar_for(req, fmt)
        matcher = llguidance.LLMatcher(compiler._llg_tokenizer(), grammar, log_level=0)
        ids = tokenizer.encode(text, add_special_tokens=False)
        taken = all(matcher.consume_token(t) for t in ids) and not matcher.is_error()
        return taken and (not complete or matcher.is_accepting())

    return accepts


def assert_admits_only_declared_tools(
    tokenizer,
    parser: str,
    texts: tuple,
    *,
    lead: str = "Let me check.",
    parallel: bool = True,
    at_start: bool = False,
    unread_closed: bool = False,
) -> None:
    """The format is `parser`'s and constrained. In `auto` text is free until a call opens (or,
    `at_start`, a call can only open the answer); from there only a declared function's name and
    its declared parameters follow. `texts`: a call, what closes it, an invented tool's opening,
    an undeclared parameter, a required one left out, and (value, what the parser would not read
    back) or None; `unread_closed` closes the call holding the unread value."""
    from mlx_kvserve.chat.formats import tool_format_for

    call, close, invented, undeclared, missing, unread = texts
    fmt = tool_format_for(tokenizer)
    assert fmt.name == parser and fmt.constrained
    accepts = acceptor(tokenizer)
    if at_start:  # a call is the whole answer: text first means no call follows
        assert accepts("auto", call + close, parallel)
        assert accepts("auto", lead + call + close, parallel)
        assert not accepts("auto", invented, parallel)
        assert not accepts("auto", " " + call + close, parallel)
    else:
        assert accepts("auto", lead + call + close, parallel)
        assert not accepts("auto", lead + invented, parallel)
    assert accepts("required", call + close, parallel)
    assert not accepts("required", invented, parallel)
    assert not accepts("required", undeclared, parallel)
    assert not accepts("required", missing, parallel)
    if unread is not None:
        value, other = unread
        wrong = call.replace(value, other) + (close if unread_closed else "")
        assert not accepts("required", wrong, parallel)


def template_text(tokenizer, calls: list[tuple[str, dict]], call_id: Callable[..., str]) -> str:
    """What the template renders for the question and an assistant turn making these calls
    (`call_id(index, name)` their ids)."""
    message = {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": call_id(i, n), "type": "function", "function": {"name": n, "arguments": a}}
            for i, (n, a) in enumerate(calls)
        ],
    }
    return tokenizer.apply_chat_template([ASK[0], message], tools=TOOLS, tokenize=False)


def parsed_events(tokenizer, chunks: list[str], *, ids: bool = False) -> list[tuple]:
    """The output parser's events for a text arriving in these chunks: texts joined, a call's
    start (kind, index[, id], name) and finish (... name, arguments, its fragments joined). With
    `ids`, the server's own random ids read as `call_`; the model's stay as written."""
    from mlx_kvserve.chat import Tool
    from mlx_kvserve.chat.formats import tool_format_for
    from mlx_kvserve.chat.output import OutputParser

    tools = [Tool(t["function"]["name"], None, t["function"]["parameters"]) for t in TOOLS]
    parser = OutputParser(tool_format_for(tokenizer), tools)
    events = [e for c in chunks for e in parser.feed(c)] + parser.finish()
    out: list[tuple] = []
    args: dict[int, str] = {}

    def head(kind: str, index: int, call_id: str) -> tuple:
        if not ids:
            return (kind, index)
        return (kind, index, "call_" if call_id.startswith("call_") else call_id)

    for e in events:
        kind = type(e).__name__
        if kind == "ToolCallDelta":
            args[e.index] = args.get(e.index, "") + e.arguments
        elif kind == "ToolCallStarted":
            out.append((*head(kind, e.index, e.id), e.name))
        elif kind == "ToolCallFinished":
            call = e.call
            fragments = args.get(e.index, "")
            out.append((*head(kind, e.index, call.id), call.name, call.arguments, fragments))
        elif out and out[-1][0] == kind:  # text arrives in chunks of any size
            out[-1] = (kind, out[-1][1] + e.text)
        else:
            out.append((kind, e.text))
    return out


def weather_calls(*, detailed: bool) -> st.SearchStrategy:
    """Lists of valid calls (name, arguments) of get_weather (`detailed`: its flag too) and ping."""
    text = st.text(alphabet=st.characters(blacklist_categories=["Cs"]), max_size=12)
    optional = {"hours": st.lists(st.integers(0, 23), max_size=3)}
    if detailed:
        optional["detailed"] = st.booleans()
    weather = st.fixed_dictionaries(
        {
            "city": text.filter(lambda s: s == s.strip() and s and s.lower() != "null"),
            "unit": st.sampled_from(["celsius", "fahrenheit"]),
            "days": st.integers(1, 7),
        },
        optional=optional,
    )
    return st.lists(
        st.one_of(
            st.tuples(st.just("get_weather"), weather),
            st.tuples(st.just("ping"), st.just({"host": "localhost"})),
        ),
        min_size=1,
        max_size=3,
    )


def assert_any_split_streams_the_same_calls(
    tokenizer, text: str, calls: list[tuple[str, dict]], cuts: list[int], *, ids: bool = False
) -> None:
    """Whatever chunks `text` arrives in (cut at `cuts`), the same calls are announced and
    finished, they are `calls`, and each call's fragments concatenate to its final arguments."""
    points = sorted({c % (len(text) + 1) for c in cuts})
    chunks = [text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=True)]
    whole = parsed_events(tokenizer, [text], ids=ids)
    assert parsed_events(tokenizer, [c for c in chunks if c], ids=ids) == whole
    finished = [e[-3:] for e in whole if e[0] == "ToolCallFinished"]
    assert [(name, json.loads(arguments)) for name, arguments, _ in finished] == calls
    assert all(arguments == fragments for _, arguments, fragments in finished)
