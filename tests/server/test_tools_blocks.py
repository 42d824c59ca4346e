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

from tests.support.block_tools import (
    ASK,
    FAMILIES,
    NAMED,
    SCHEMAS,
    TOOLS,
    build_family_model,
    render_prompt,
)
from tests.support.fuzz_values import name, schema
from tests.support.fuzzing import check
from tests.support.servers import ServerProcess, client_for

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
    from mlx_kvserve.chat.formats import tool_format_for

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
        prompt = render_prompt(tokenizer, messages)
        if turn == 0:  # later prompts hold replayed calls as sampled (chat.reasoning.sampled_turns)
            assert len(prompt) == reply.usage.prompt_tokens
        sampled = b"".join(bytes(t.bytes) for t in choice.logprobs.content)
        call = choice.message.tool_calls[0]
        _valid(call)
        messages.append(choice.message.model_dump(exclude_none=True))
        messages.append({"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"})
        following = render_prompt(tokenizer, messages)
        assert following[: len(prompt)] == prompt
        text = tokenizer.decode(following[len(prompt) :]).encode()
        opening = tool_format_for(tokenizer).start.encode()
        block = sampled[sampled.index(opening) :]
        assert block in text, (text, sampled)  # the call, byte for byte
        nxt = client.chat.completions.create(
            model=_model(client), messages=messages, tools=TOOLS, max_tokens=1
        )
        cached = nxt.usage.prompt_tokens_details.cached_tokens
        assert cached >= reply.usage.prompt_tokens, turn
        # as far as the next prompt's tokens are the ones sampled, the cache has them (the
        # last sampled token ended the generation, so it was never fed)
        rest, tokens = following[len(prompt) :], [bytes(t.bytes) for t in choice.logprobs.content]
        same = 0
        while (
            same < min(len(rest), len(tokens))
            and tokenizer.decode([rest[same]]).encode() == (tokens[same])
        ):
            same += 1
        assert cached >= reply.usage.prompt_tokens + min(same, len(tokens) - 1), (
            turn,
            same,
            cached,
        )
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
