"""Tool-call formats whose block holds several calls (MiniMax-M2, Kimi K2), constrained and
streamed.

Each family's tiny random-weight model carries its real chat template (tests/fixtures/templates)
and its tokenizer's markers as tokens; mlx-lm picks the parser from the template:

* MiniMax-M2, `minimax_m2`: `<minimax:tool_call>\\n<invoke name="NAME">\\n<parameter
  name="KEY">VALUE</parameter>\\n...</invoke>\\n...</minimax:tool_call>`;
* Kimi K2 (Thinking), `kimi_k2`: `<|tool_calls_section_begin|><|tool_call_begin|>functions.
  NAME:IDX<|tool_call_argument_begin|>{JSON}<|tool_call_end|>...<|tool_calls_section_end|>`.

Whatever such a model samples at temperature 1, a forced call must parse (by mlx-lm's own parser)
to arguments valid against the function's schema. MiniMax-M2's generation prompt opens its
reasoning, so its server spends a small thinking budget before each answer.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import ServerProcess, client_for
from tests.support.fuzz_values import name, schema
from tests.support.fuzzing import check
from tests.support.thinking_models import (
    KIMI_TOOL_TOKENS,
    MINIMAX_TOOL_TOKENS,
    build_thinking_model,
)

pytestmark = pytest.mark.slow

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 24},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "detailed": {"type": "boolean"},
        "hours": {
            "type": "array",
            "items": {"type": "integer", "minimum": 0, "maximum": 23},
            "maxItems": 3,
        },
    },
    "required": ["city", "unit", "days"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"timezone": {"type": "string", "maxLength": 20}},
    "required": ["timezone"],
    "additionalProperties": False,  # a JSON-body call (Kimi's) is bounded only so
}
PING = {  # a call with nothing left to choose but its index: (almost) every token is forced
    "type": "object",
    "properties": {"host": {"type": "string", "enum": ["localhost"]}},
    "required": ["host"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
    {"type": "function", "function": {"name": "ping", "parameters": PING}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME, "ping": PING}
NAMED = {"type": "function", "function": {"name": "get_weather"}}
ASK = [{"role": "user", "content": "What's the weather in Paris?"}]

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


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def model_dir(family: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    dest = tmp_path_factory.mktemp("block_tools") / family
    return build_thinking_model(dest, family, tool_tokens=FAMILIES[family][0])


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path):
    from mlx_lm import load

    return load(str(model_dir))[1]


@pytest.fixture(scope="module")
def served(model_dir: Path, family: str) -> Iterator[ServerProcess]:
    proc = ServerProcess(model_dir.parent, "--model", str(model_dir), *FAMILIES[family][2])
    yield proc.wait_ready()
    proc.stop()


@pytest.fixture(scope="module")
def client(served: ServerProcess):
    return client_for(served)


def _model(client) -> str:
    return client.models.list().data[0].id


def _valid(call) -> dict:
    assert call.type == "function" and call.function.name in SCHEMAS
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, SCHEMAS[call.function.name])
    return args


# -- without a server: rendering, the grammar, the stream ------------------------------------
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


def _render(tokenizer, messages: list[dict], choice: str = "auto") -> list[int]:
    """The prompt the server renders for these messages (its own request parsing and render)."""
    from mlx_kvserve.api.openai_chat import to_chat_request
    from mlx_kvserve.api.schemas import ChatCompletionRequest
    from mlx_kvserve.chat.render import render_chat

    body = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": messages, "tools": TOOLS, "tool_choice": choice}
    )
    return render_chat(tokenizer, to_chat_request(body), {}).tokens


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
    ours = tokenizer.decode(_render(tokenizer, HISTORY))
    assert ours == expected
    assert "get_weather" in ours and "14:05" in ours


def test_the_grammar_admits_only_declared_tools(tokenizer, family):
    """In `auto` the text is free until the block opens; from there only a declared function's
    name and its declared parameters can follow (an invented tool is impossible)."""
    import llguidance

    from mlx_kvserve.chat import ChatRequest, Message, Tool, ToolChoice
    from mlx_kvserve.chat.grammar import GrammarCompiler
    from mlx_kvserve.chat.tool_format import tool_format_for

    _, parser, _, call, close, invented, undeclared, missing, (value, unread) = FAMILIES[family]
    fmt = tool_format_for(tokenizer)
    assert fmt.name == parser and fmt.constrained
    tools = [Tool(t["function"]["name"], None, t["function"]["parameters"]) for t in TOOLS]
    compiler = GrammarCompiler(tokenizer, len(tokenizer.get_vocab()))

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
    from mlx_kvserve.chat.tool_format import tool_format_for

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
    from mlx_kvserve.chat.output import OutputParser
    from mlx_kvserve.chat.tool_format import tool_format_for

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


# -- with a server -----------------------------------------------------------------------------
def test_the_format_is_named_once_at_start_up(served, family):
    notice = f"tool calls: {FAMILIES[family][1]} format, constrained and streamed"
    assert served.log().count(notice) == 1


@pytest.mark.parametrize("named", [True, False], ids=["named", "required"])
def test_forced_calls_always_validate(client, named):
    """20 seeds per mode at temperature 1: every call is a declared tool with valid arguments,
    and nothing of the block leaks into content."""
    names = set()
    for seed in range(20):
        reply = client.chat.completions.create(
            model=_model(client),
            messages=ASK,
            tools=TOOLS,
            tool_choice=NAMED if named else "required",
            parallel_tool_calls=False,
            temperature=1.0,
            seed=seed,
            max_tokens=160,
        )
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        assert not choice.message.content
        assert len(choice.message.tool_calls) == 1
        call = choice.message.tool_calls[0]
        _valid(call)
        names.add(call.function.name)
    assert names == ({"get_weather"} if named else names)


def test_parallel_calls_share_a_block_and_all_validate(client):
    """With parallel calls allowed, every call of the block validates and has its own id."""
    counts = set()
    for seed in range(8):
        reply = client.chat.completions.create(
            model=_model(client),
            messages=ASK,
            tools=TOOLS,
            tool_choice="required",
            temperature=1.0,
            seed=seed,
            max_tokens=300,
        )
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        for call in choice.message.tool_calls:
            _valid(call)
        assert len({c.id for c in choice.message.tool_calls}) == len(choice.message.tool_calls)
        counts.add(len(choice.message.tool_calls))
    # (that the grammar allows several calls per block is test_the_grammar_admits_...; whether a
    # random-weight model writes a second one depends on its weights)
    assert counts


def _streamed(client, **kwargs) -> list[tuple[str, str, str]]:
    calls: dict[int, dict] = {}
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        choice = chunk.choices[0]
        assert not choice.delta.content
        for delta in choice.delta.tool_calls or []:
            entry = calls.setdefault(delta.index, {"id": None, "name": None, "arguments": ""})
            if delta.id:
                assert entry["name"] is None and entry["arguments"] == ""  # id and name first
                entry["id"], entry["name"] = delta.id, delta.function.name
            if delta.function and delta.function.arguments:
                entry["arguments"] += delta.function.arguments
    return [(c["id"], c["name"], c["arguments"]) for _, c in sorted(calls.items())]


@pytest.mark.parametrize("choice", ["required", "named"])
def test_streamed_calls_reassemble_to_the_non_streamed_ones(client, family, choice):
    kwargs = dict(
        model=_model(client),
        messages=ASK,
        tools=TOOLS,
        tool_choice=NAMED if choice == "named" else "required",
        temperature=1.0,
        seed=3,
        max_tokens=300,
    )
    whole = client.chat.completions.create(**kwargs).choices[0].message.tool_calls
    streamed = _streamed(client, **kwargs)
    if family == "kimi-k2":  # the model writes its calls' ids: the same with the same seed
        assert streamed == [(c.id, c.function.name, c.function.arguments) for c in whole]
    else:
        assert [s[1:] for s in streamed] == [(c.function.name, c.function.arguments) for c in whole]


def test_a_tool_loop_re_renders_what_the_model_sampled(client, tokenizer, family):
    """Each call re-renders byte for byte as the model sampled it, and the next turn reads the
    previous prompt from the cache, and the call too as far as the template renders the turn
    as it was sampled: Kimi's template puts an empty `<think></think>` before a past call,
    which a forced call does not write, and MiniMax's re-renders the reasoning stripped, as the
    server returns it (a random-weight model's reasoning often starts with a space)."""
    from mlx_kvserve.chat.tool_format import tool_format_for

    messages = list(ASK)
    whole = 0
    for turn in range(3):
        forced = turn % 2 == 0
        reply = client.chat.completions.create(
            model=_model(client),
            messages=messages,
            tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "ping"}}
            if forced
            else "required",
            parallel_tool_calls=False,
            temperature=1.0,
            seed=turn,
            max_tokens=200,
            logprobs=True,
        )
        choice = reply.choices[0]
        prompt = _render(tokenizer, messages)
        assert len(prompt) == reply.usage.prompt_tokens
        sampled = b"".join(bytes(t.bytes) for t in choice.logprobs.content)
        call = choice.message.tool_calls[0]
        _valid(call)
        messages.append(choice.message.model_dump(exclude_none=True))
        messages.append({"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"})
        following = _render(tokenizer, messages)
        assert following[: len(prompt)] == prompt
        text = tokenizer.decode(following[len(prompt) :]).encode()
        opening = tool_format_for(tokenizer).start.encode()
        block = sampled[sampled.index(opening) :]
        assert block in text, (text, sampled)  # the call, byte for byte
        nxt = client.chat.completions.create(
            model=_model(client), messages=messages, tools=TOOLS, max_tokens=1
        )
        assert nxt.usage.prompt_tokens == len(following)
        cached = nxt.usage.prompt_tokens_details.cached_tokens
        assert cached >= len(prompt), turn
        # as far as the next prompt's tokens are the ones sampled, the cache has them (the
        # last sampled token ended the generation, so it was never fed)
        rest, tokens = following[len(prompt) :], [bytes(t.bytes) for t in choice.logprobs.content]
        same = 0
        while (
            same < min(len(rest), len(tokens))
            and tokenizer.decode([rest[same]]).encode() == (tokens[same])
        ):
            same += 1
        assert cached >= len(prompt) + min(same, len(tokens) - 1), (turn, same, cached)
        whole += text.startswith(sampled)
    if family == "kimi-k2":
        assert whole == 0  # the template's `<think></think>`: if this changes, say so


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {
                            "name": "f",
                            "parameters": {
                                "type": "object",
                                "properties": {"n": {"type": "integer", "minimum": "x"}},
                            },
                        },
                    }
                ]
            },
            "tools[0].function.parameters",
        ),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools"),
    ],
)
def test_bad_tools_are_400s_naming_the_field(served, body, param):
    payload = {
        "model": "m",
        "messages": ASK,
        "tools": TOOLS,
        "tool_choice": "required",
        "max_tokens": 8,
        **body,
    }
    reply = httpx.post(f"{served.base_url}/v1/chat/completions", json=payload, timeout=60)
    assert reply.status_code == 400, reply.text
    assert param in reply.json()["error"]["param"]


# tools as hostile clients write them: names the formats cannot hold, schemas of every shape,
# property names with spaces, quotes and markup, typed and untyped properties
leaf = st.fixed_dictionaries({"type": st.sampled_from(["integer", "string"])})
key = st.one_of(st.just("k"), st.text(alphabet='ab _<>/="|\n', min_size=1, max_size=6))
hostile_property = st.one_of(
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
            "items": leaf,
            "anyOf": st.lists(leaf, max_size=2),
        },
    ),
)
hostile_name = st.one_of(
    st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,8}", fullmatch=True),
    st.sampled_from(['a"b', "x>y", "a|b", "f:1", "</invoke>", "<|tool_call_end|>"]),
    name,
)
hostile_parameters = st.fixed_dictionaries(
    {"type": st.just("object"), "properties": st.dictionaries(key, hostile_property, max_size=3)},
    optional={"required": st.lists(key, max_size=3)},
)
hostile_tool = st.fixed_dictionaries(
    {
        "type": st.just("function"),
        "function": st.fixed_dictionaries(
            {"name": hostile_name},
            optional={"parameters": st.one_of(schema, hostile_parameters)},
        ),
    }
)


@settings(
    max_examples=60,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    tools=st.lists(hostile_tool, min_size=1, max_size=2),
    choice=st.sampled_from(["auto", "required"]),
    parallel=st.booleans(),
)
def test_fuzzed_tools_never_break_the_grammar(served, tools, choice, parallel):
    body = {
        "messages": ASK,
        "tools": tools,
        "tool_choice": choice,
        "parallel_tool_calls": parallel,
        "max_tokens": 4,
    }
    try:
        content = json.dumps(body).encode()
    except (UnicodeEncodeError, ValueError):
        content = json.dumps(body, ensure_ascii=True).encode()
    r = httpx.post(
        f"{served.base_url}/v1/chat/completions",
        content=content,
        headers={"content-type": "application/json"},
        timeout=60,
    )
    assert check(r.status_code, r.content, False, "/v1/chat/completions") is None, (
        body,
        r.text[:300],
    )
