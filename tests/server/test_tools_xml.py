"""Tag-per-parameter tool calls (Qwen3-Coder XML, GLM), constrained and streamed.

Each family's tiny random-weight model carries its real chat template (tests/fixtures/templates)
and its tokenizer's tool tags as tokens; mlx-lm picks the parser from the template:

* Qwen3.5, `qwen3_coder`:
  `<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n...</function>\\n</tool_call>`;
* GLM-4.6, `glm47`:
  `<tool_call>NAME\\n<arg_key>KEY</arg_key>\\n<arg_value>VALUE</arg_value>\\n...</tool_call>`.

Whatever such a model samples at temperature 1, a forced call must parse (by mlx-lm's own parser)
to arguments valid against the function's schema.
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

from tests.support.fuzz_values import name, schema
from tests.support.fuzzing import check
from tests.support.servers import ServerProcess, client_for
from tests.support.thinking_models import GLM_TOOL_TOKENS, TOOL_TOKENS, build_thinking_model

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
}
PING = {  # a call with nothing left to choose: every token of it is forced
    "type": "object",
    "properties": {"host": {"type": "string", "enum": ["localhost"]}},
    "required": ["host"],
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
    {"type": "function", "function": {"name": "ping", "parameters": PING}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME, "ping": PING}
NAMED = {"type": "function", "function": {"name": "get_weather"}}
ASK = [{"role": "user", "content": "What's the weather in Paris?"}]


# no reasoning section: the answer is the call, so each turn re-renders as it was sampled
KWARGS = {"enable_thinking": False}


# family, its tokenizer's tool tags, the parser mlx-lm picks, and sample call texts:
# (a call up to its closing marker, what closes it, what opens a call to an invented tool,
# an undeclared parameter, a required parameter left out, a value the parser would not read back)
FAMILIES = {
    "qwen3.5": (
        TOOL_TOKENS,
        "qwen3_coder",
        "<tool_call>\n<function=get_time>\n<parameter=timezone>\nUTC\n</parameter>\n",
        "</function>\n</tool_call>",
        "<tool_call>\n<function=get_tme>\n",
        "<tool_call>\n<function=get_time>\n<parameter=tz>\n",
        "<tool_call>\n<function=get_time>\n</function>",
        ("UTC", "null"),
    ),
    "glm-4.6": (
        GLM_TOOL_TOKENS,
        "glm47",
        "\n<tool_call>get_time\n<arg_key>timezone</arg_key>\n<arg_value>UTC</arg_value>\n",
        "</tool_call>",
        "\n<tool_call>get_tme\n",
        "\n<tool_call>get_time\n<arg_key>tz</arg_key>",
        "\n<tool_call>get_time\n</tool_call>",
        ("UTC", " UTC"),
    ),
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def model_dir(family: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    dest = tmp_path_factory.mktemp("xml_tools") / family
    return build_thinking_model(dest, family, tool_tokens=FAMILIES[family][0])


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path):
    from mlx_lm import load

    return load(str(model_dir))[1]


@pytest.fixture(scope="module")
def served(model_dir: Path) -> Iterator[ServerProcess]:
    kwargs = json.dumps(KWARGS)
    proc = ServerProcess(
        model_dir.parent, "--model", str(model_dir), "--chat-template-kwargs", kwargs
    )
    yield proc.wait_ready()
    proc.stop()


@pytest.fixture(scope="module")
def client(served: ServerProcess):
    return client_for(served)


def test_the_format_is_named_once_at_start_up(served, family):
    notice = f"tool calls: {FAMILIES[family][1]} format, constrained and streamed"
    assert served.log().count(notice) == 1


def _model(client) -> str:
    return client.models.list().data[0].id


def _valid(call) -> dict:
    assert call.type == "function" and call.function.name in SCHEMAS
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, SCHEMAS[call.function.name])
    return args


@pytest.mark.parametrize("named", [True, False], ids=["named", "required"])
def test_forced_xml_calls_always_validate(client, named):
    """20 seeds per mode at temperature 1: every call is a declared tool with valid arguments,
    and nothing of the XML leaks into content."""
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
            max_tokens=120,
        )
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        assert not choice.message.content
        assert len(choice.message.tool_calls) == 1
        call = choice.message.tool_calls[0]
        _valid(call)
        names.add(call.function.name)
    assert names == ({"get_weather"} if named else names)


def test_streamed_xml_call_reassembles_to_the_non_streamed_one(client):
    kwargs = dict(
        model=_model(client),
        messages=ASK,
        tools=TOOLS,
        tool_choice=NAMED,
        temperature=1.0,
        seed=3,
        max_tokens=120,
    )
    whole = client.chat.completions.create(**kwargs).choices[0].message.tool_calls
    calls: dict[int, dict] = {}
    fragments = 0
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        choice = chunk.choices[0]
        assert not choice.delta.content
        for delta in choice.delta.tool_calls or []:
            entry = calls.setdefault(delta.index, {"name": None, "arguments": ""})
            if delta.id:
                assert entry["name"] is None and entry["arguments"] == ""  # id and name first
                entry["name"] = delta.function.name
            if delta.function and delta.function.arguments:
                entry["arguments"] += delta.function.arguments
                fragments += 1
    assert fragments >= 7  # `{"key": ` and the value per parameter, as each is written
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (c.function.name, c.function.arguments) for c in whole
    ]


def _prompt(tokenizer, messages: list[dict]) -> list[int]:
    """The prompt the server renders for these messages (its own request parsing and render)."""
    from mlx_kvserve.api.openai_chat import to_chat_request
    from mlx_kvserve.api.schemas import ChatCompletionRequest
    from mlx_kvserve.chat.render import render_chat

    body = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": messages, "tools": TOOLS, "tool_choice": "required"}
    )
    return render_chat(tokenizer, to_chat_request(body), KWARGS).tokens


def test_xml_tool_loop_hits_the_cache(client, tokenizer):
    """The call re-renders byte for byte as the model sampled it, and the next turn reads the
    previous prompt and the call from the cache, as far as the sampled tokens are the ones the
    tokenizer makes of that text: all of them for a call the grammar wrote alone (`ping`), up to
    the first odd split (`w`+`e`+`ather`) a random-weight model samples in a free one."""
    messages = list(ASK)
    spliced = 0  # how many more tokens the server's prompt has: kept calls are their own tokens
    for turn in range(4):
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
            max_tokens=120,
            logprobs=True,
        )
        choice = reply.choices[0]
        prompt = _prompt(tokenizer, messages)
        assert len(prompt) + spliced == reply.usage.prompt_tokens
        sampled = [bytes(t.bytes) for t in choice.logprobs.content]
        call = choice.message.tool_calls[0]
        _valid(call)
        messages.append(choice.message.model_dump(exclude_none=True))
        messages.append({"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"})
        following = _prompt(tokenizer, messages)
        assert following[: len(prompt)] == prompt
        rest = following[len(prompt) :]
        text = tokenizer.decode(rest).encode()
        assert text.startswith(b"".join(sampled)), (text, sampled)  # byte for byte
        same = 0
        while (
            same < min(len(rest), len(sampled))
            and tokenizer.decode([rest[same]]).encode() == sampled[same]
        ):
            same += 1
        if forced:
            assert same == len(sampled), (sampled, [tokenizer.decode([t]) for t in rest])
        # the server renders the call as the tokens sampled (chat.reasoning.sampled_turns), in
        # place of the tokenizer's tokens of the same text
        whole = b"".join(sampled)
        canonical = next(
            k for k in range(len(rest) + 1) if tokenizer.decode(rest[:k]).encode() == whole
        )
        spliced += len(sampled) - canonical
        nxt = client.chat.completions.create(
            model=_model(client), messages=messages, tools=TOOLS, max_tokens=1
        )
        assert nxt.usage.prompt_tokens == len(following) + spliced
        # a grammar-forced tail that ended the generation was never fed: the cache stops at it
        cached = nxt.usage.prompt_tokens_details.cached_tokens
        assert cached >= len(prompt) + spliced - (len(sampled) - canonical) + min(
            same, len(sampled) - 1
        ), (turn, same)


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


# tools as hostile clients write them: names the XML cannot hold, schemas of every shape,
# property names with spaces and markup, typed and untyped properties
xml_leaf = st.fixed_dictionaries({"type": st.sampled_from(["integer", "string"])})
xml_key = st.one_of(st.just("k"), st.text(alphabet="ab _<>/=\n", min_size=1, max_size=6))
xml_property = st.one_of(
    schema,
    st.fixed_dictionaries(
        {"type": st.sampled_from(["string", "integer", "number", "boolean", "null", "array"])},
        optional={
            "enum": st.lists(st.text(max_size=8), max_size=3),
            "maxLength": st.integers(-2, 5),
            "items": xml_leaf,
        },
    ),
)
xml_name = st.one_of(
    st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,8}", fullmatch=True),
    st.sampled_from(["a b", "x>y", "</parameter>"]),
    name,
)
xml_parameters = st.fixed_dictionaries(
    {
        "type": st.just("object"),
        "properties": st.dictionaries(xml_key, xml_property, max_size=3),
    },
    optional={"required": st.lists(xml_key, max_size=3)},
)
xml_tool = st.fixed_dictionaries(
    {
        "type": st.just("function"),
        "function": st.fixed_dictionaries(
            {"name": xml_name}, optional={"parameters": st.one_of(schema, xml_parameters)}
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
    tools=st.lists(xml_tool, min_size=1, max_size=2), choice=st.sampled_from(["auto", "required"])
)
def test_fuzzed_tools_never_break_the_xml_grammar(served, tools, choice):
    body = {"messages": ASK, "tools": tools, "tool_choice": choice, "max_tokens": 4}
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


def test_the_grammar_admits_only_declared_tools(tokenizer, family):
    """In `auto` the text is free until `<tool_call>`; from there only a declared function's name
    and its declared parameters can follow (an invented tool is impossible)."""
    import llguidance

    from mlx_kvserve.chat import ChatRequest, Message, Tool, ToolChoice
    from mlx_kvserve.chat.formats import tool_format_for
    from mlx_kvserve.chat.grammar import GrammarCompiler

    _, parser, call, close, invented, undeclared, missing, (value, unread) = FAMILIES[family]
    fmt = tool_format_for(tokenizer)
    assert fmt.name == parser and fmt.constrained
    tools = [Tool(t["function"]["name"], None, t["function"]["parameters"]) for t in TOOLS]
    compiler = GrammarCompiler(tokenizer)

    def accepts(mode: str, text: str) -> bool:
        req = ChatRequest([Message("user", "hi")], tools=tools, tool_choice=ToolChoice(mode))
        grammar = compiler.grammar_for(req, fmt)
        matcher = llguidance.LLMatcher(compiler._llg_tokenizer(), grammar, log_level=0)
        ids = tokenizer.encode(text, add_special_tokens=False)
        return all(matcher.consume_token(t) for t in ids)

    assert accepts("auto", "Let me check.\n" + call + close)
    assert accepts("required", call + close)
    assert not accepts("auto", "Let me check.\n" + invented)
    assert not accepts("required", invented)
    assert not accepts("required", undeclared)
    assert not accepts("required", missing)
    assert not accepts("required", call.replace(value, unread))
