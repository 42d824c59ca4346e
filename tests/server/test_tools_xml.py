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

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.support.fuzz_values import hostile_property, hostile_tool
from tests.support.seeded import PLAIN
from tests.support.servers import ServerProcess, serve_model
from tests.support.thinking_models import GLM_TOOL_TOKENS, TOOL_TOKENS, build_thinking_model
from tests.support.tool_checks import (
    BAD_TOOLS,
    SERVED_FUZZ,
    answer_call,
    assert_bad_tools_400,
    assert_format_named_once,
    forced_replies,
    loop_turn,
    model_id,
    named_arguments,
    next_usage,
    post_fuzzed,
    streamed_calls,
    tokens_alike,
)
from tests.support.tool_parsing import assert_admits_only_declared_tools, server_prompt
from tests.support.tool_schemas import ASK, NAMED, PING, TIME, WEATHER, function_tools, opened

pytestmark = pytest.mark.slow

# time and ping as clients often declare them, open to other properties
SCHEMAS = {"get_weather": WEATHER, "get_time": opened(TIME), "ping": opened(PING)}
TOOLS = function_tools(SCHEMAS)


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
def served(model_dir: Path) -> Iterator[ServerProcess]:
    yield from serve_model(model_dir, "--chat-template-kwargs", json.dumps(KWARGS))


def test_the_format_is_named_once_at_start_up(served, family):
    assert_format_named_once(served, FAMILIES[family][1])


@pytest.mark.parametrize("named", [True, False], ids=["named", "required"])
def test_forced_xml_calls_always_validate(client, named):
    """20 seeds per mode at temperature 1: every call is a declared tool with valid arguments,
    and nothing of the XML leaks into content."""
    forced_replies(client, named, max_tokens=120, schemas=SCHEMAS, tools=TOOLS)


def test_streamed_xml_call_reassembles_to_the_non_streamed_one(client):
    kwargs = dict(
        model=model_id(client),
        messages=ASK,
        tools=TOOLS,
        tool_choice=NAMED,
        temperature=1.0,
        seed=3,
        extra_body=PLAIN,  # compared token for token: tests/support/seeded.py
        max_tokens=120,
    )
    whole = client.chat.completions.create(**kwargs).choices[0].message.tool_calls
    streamed = streamed_calls(client, **kwargs)
    assert streamed.fragments >= 7  # `{"key": ` and the value per parameter, as each is written
    assert [c[1:] for c in streamed.calls] == named_arguments(whole)


def _prompt(tokenizer, messages: list[dict]) -> list[int]:
    return server_prompt(tokenizer, messages, "required", KWARGS, TOOLS)


def test_xml_tool_loop_hits_the_cache(client, tokenizer):
    """The call re-renders byte for byte as the model sampled it, and the next turn reads the
    previous prompt and the call from the cache, as far as the sampled tokens are the ones the
    tokenizer makes of that text: all of them for a call the grammar wrote alone (`ping`), up to
    the first odd split (`w`+`e`+`ather`) a random-weight model samples in a free one."""
    messages = list(ASK)
    spliced = 0  # how many more tokens the server's prompt has: kept calls are their own tokens
    for turn in range(4):
        forced = turn % 2 == 0
        reply = loop_turn(client, messages, turn, max_tokens=120, forced=forced, tools=TOOLS)
        choice = reply.choices[0]
        prompt = _prompt(tokenizer, messages)
        assert len(prompt) + spliced == reply.usage.prompt_tokens
        sampled = [bytes(t.bytes) for t in choice.logprobs.content]
        answer_call(messages, choice, SCHEMAS)
        following = _prompt(tokenizer, messages)
        assert following[: len(prompt)] == prompt
        rest = following[len(prompt) :]
        text = tokenizer.decode(rest).encode()
        assert text.startswith(b"".join(sampled)), (text, sampled)  # byte for byte
        same = tokens_alike(tokenizer, rest, sampled)
        if forced:
            assert same == len(sampled), (sampled, [tokenizer.decode([t]) for t in rest])
        # the server renders the call as the tokens sampled (chat.reasoning.sampled_turns), in
        # place of the tokenizer's tokens of the same text
        whole = b"".join(sampled)
        canonical = next(
            k for k in range(len(rest) + 1) if tokenizer.decode(rest[:k]).encode() == whole
        )
        spliced += len(sampled) - canonical
        usage = next_usage(client, messages, TOOLS)
        assert usage.prompt_tokens == len(following) + spliced
        # a grammar-forced tail that ended the generation was never fed: the cache stops at it
        cached = usage.prompt_tokens_details.cached_tokens
        assert cached >= len(prompt) + spliced - (len(sampled) - canonical) + min(
            same, len(sampled) - 1
        ), (turn, same)


@pytest.mark.parametrize(("body", "param"), BAD_TOOLS)
def test_bad_tools_are_400s_naming_the_field(served, body, param):
    assert_bad_tools_400(served, body, param, TOOLS)


# tools as hostile clients write them: names the XML cannot hold, schemas of every shape,
# property names with spaces and markup, typed and untyped properties
xml_leaf = st.fixed_dictionaries({"type": st.sampled_from(["integer", "string"])})
xml_key = st.one_of(st.just("k"), st.text(alphabet="ab _<>/=\n", min_size=1, max_size=6))
xml_property = hostile_property(xml_leaf)
xml_tool = hostile_tool(xml_key, xml_property, ["a b", "x>y", "</parameter>"])


@SERVED_FUZZ
@given(
    tools=st.lists(xml_tool, min_size=1, max_size=2), choice=st.sampled_from(["auto", "required"])
)
def test_fuzzed_tools_never_break_the_xml_grammar(served, tools, choice):
    post_fuzzed(served, {"messages": ASK, "tools": tools, "tool_choice": choice, "max_tokens": 4})


def test_the_grammar_admits_only_declared_tools(tokenizer, family):
    """In `auto` the text is free until `<tool_call>`; from there only a declared function's name
    and its declared parameters can follow (an invented tool is impossible)."""
    _, parser, *texts = FAMILIES[family]
    assert_admits_only_declared_tools(tokenizer, parser, tuple(texts), lead="Let me check.\n")
