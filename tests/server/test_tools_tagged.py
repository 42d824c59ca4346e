"""Tag-per-parameter tool-call formats beyond Qwen's, GLM's and MiniMax's, constrained and
streamed:

* LongCat, `longcat`: `<longcat_tool_call>NAME\\n<longcat_arg_key>KEY</longcat_arg_key>\\n
  <longcat_arg_value>VALUE</longcat_arg_value>\\n...</longcat_tool_call>`. No public LongCat
  template was at hand: its model carries a minimal template (tests/fixtures/templates/
  longcat-minimal.jinja) that makes mlx-lm pick the parser, so rendering is checked against that
  template only. Its parser cannot read a call without arguments: the grammar never writes one.
* MiniCPM5, `minicpm5`: `<function name="NAME"><param name="KEY">VALUE</param>...</function>`,
  one call per element, a value holding `<`, `&` or a newline as `<![CDATA[...]]>`. Its own
  template was not at hand either: tests/fixtures/templates/minicpm5-minimal.jinja renders
  calls as its public snippets show.
* Poolside Laguna, `laguna`: GLM-4.7's layout, `<tool_call>NAME<arg_key>KEY</arg_key><arg_value>
  VALUE</arg_value>...</tool_call>`, which mlx-lm reads with GLM's parser (its `laguna` module
  is `glm47`'s, chosen by `tool_parser_type: laguna` in a converted checkpoint's tokenizer
  config), so the server names the format `glm47` and follows the layout the template renders
  (chat.formats.xml_calls.glm_layout). No Laguna template was at hand: a minimal one
  (laguna-minimal.jinja) renders that layout.
* Kimi K3, `kimi_k3` (picked by the tokenizer's XTML tags): `<|open|>tools<|sep|><|open|>call
  tool="NAME" index="1"<|sep|><|open|>json type="object"<|sep|>{JSON}<|close|>json<|sep|>
  <|close|>call<|sep|>...<|close|>tools<|sep|>`, the calls of a turn in one section. No Kimi K3
  template was at hand: a minimal one (kimi-k3-minimal.jinja) renders calls that way.

Each family's tiny random-weight model has the format's tags as tokens. Whatever it samples at
temperature 1, a forced call parses (by mlx-lm's own parser, in the server) to arguments valid
against the function's schema.
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

from tests.support.block_tools import assert_renders_as_the_template, hostile_block_tool
from tests.support.seeded import PLAIN
from tests.support.servers import ServerProcess, serve_model
from tests.support.thinking_models import (
    GLM_TOOL_TOKENS,
    KIMI_K3_TOOL_TOKENS,
    LONGCAT_TOOL_TOKENS,
    build_thinking_model,
)
from tests.support.tool_checks import (
    SERVED_FUZZ,
    answer_call,
    assert_format_named_once,
    forced_replies,
    loop_turn,
    model_id,
    named_arguments,
    post_fuzzed,
    streamed_calls,
)
from tests.support.tool_parsing import (
    acceptor,
    assert_admits_only_declared_tools,
    assert_any_split_streams_the_same_calls,
    server_prompt,
    template_text,
    weather_calls,
)
from tests.support.tool_schemas import ASK, NAMED, TOOLS

pytestmark = pytest.mark.slow

_LC = "<longcat_tool_call>"
# family: its tokenizer's tags, the parser mlx-lm picks, the server's extra flags, and sample call
# texts (a call, what closes it, what opens a call to an invented tool, an undeclared parameter,
# a required parameter left out, a value the parser would not read back)
FAMILIES = {
    "longcat": (
        LONGCAT_TOOL_TOKENS,
        "longcat",
        (),
        _LC + "get_time\n<longcat_arg_key>timezone</longcat_arg_key>\n"
        "<longcat_arg_value>UTC</longcat_arg_value>\n",
        "</longcat_tool_call>",
        _LC + "get_tme\n",
        _LC + "get_time\n<longcat_arg_key>tz</longcat_arg_key>",
        _LC + "get_time\n</longcat_tool_call>",
        (">UTC<", "> UTC<"),
    ),
    "minicpm5": (
        (),
        "minicpm5",
        (),
        '<function name="get_time"><param name="timezone">UTC</param>',
        "</function>",
        '<function name="get_tme"',
        '<function name="get_time"><param name="tz">',
        '<function name="get_time"></function>',
        (">UTC<", ">null<"),
    ),
    "laguna": (
        GLM_TOOL_TOKENS,
        "glm47",
        (),
        "<tool_call>get_time<arg_key>timezone</arg_key><arg_value>UTC</arg_value>",
        "</tool_call>",
        "<tool_call>get_tme<",
        "<tool_call>get_time<arg_key>tz</arg_key>",
        "<tool_call>get_time</tool_call>",
        (">UTC<", "> UTC<"),
    ),
}
_K3 = '<|open|>tools<|sep|><|open|>call tool="{}" index="1"<|sep|>'
_K3_JSON = '<|open|>json type="object"<|sep|>'
FAMILIES["kimi-k3"] = (
    KIMI_K3_TOOL_TOKENS,
    "kimi_k3",
    (),
    _K3.format("get_time") + _K3_JSON + '{"timezone": "UTC"}',
    "<|close|>json<|sep|><|close|>call<|sep|><|close|>tools<|sep|>",
    _K3.format("get_tme"),
    _K3.format("get_time") + _K3_JSON + '{"tz"',
    _K3.format("get_time") + _K3_JSON + "{}",
    ('"UTC"', "5"),
)
_MUSE = '<atem:function_calls>\n<atem:invoke name="{}">\n'
FAMILIES["muse-spark"] = (
    ("<|start|>", "<|message|>", "<|eot|>"),
    "muse_spark",
    (),
    _MUSE.format("get_time") + '<atem:parameter name="timezone">UTC</atem:parameter>\n',
    "</atem:invoke>\n</atem:function_calls>",
    _MUSE.format("get_tme"),
    _MUSE.format("get_time") + '<atem:parameter name="tz">',
    _MUSE.format("get_time") + "</atem:invoke>",
    (">UTC<", ">5<"),
)
# the parser a converted checkpoint names in its tokenizer config (else mlx-lm infers one)
PARSER_TYPE = {"laguna": "laguna"}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def model_dir(family: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    dest = tmp_path_factory.mktemp("tagged_tools") / family
    dest = build_thinking_model(dest, family, tool_tokens=FAMILIES[family][0])
    if family in PARSER_TYPE:
        path = dest / "tokenizer_config.json"
        config = json.loads(path.read_text(encoding="utf-8"))
        path.write_text(json.dumps({**config, "tool_parser_type": PARSER_TYPE[family]}))
    return dest


@pytest.fixture(scope="module")
def served(model_dir: Path, family: str) -> Iterator[ServerProcess]:
    yield from serve_model(model_dir, *FAMILIES[family][2])


# -- with a server -----------------------------------------------------------------------------
def test_the_format_is_named_once_at_start_up(served, family):
    assert_format_named_once(served, FAMILIES[family][1])


@pytest.mark.parametrize("named", [True, False], ids=["named", "required"])
def test_forced_calls_always_validate(client, named):
    """20 seeds per mode at temperature 1: every call is a declared tool with valid arguments,
    and nothing of the block leaks into content."""
    # room for four calls in the wordiest format (Muse Spark's XML)
    forced_replies(client, named, max_tokens=400, parallel=None)


@pytest.mark.parametrize("choice", ["required", "named"])
def test_streamed_calls_reassemble_to_the_non_streamed_ones(client, choice):
    for seed in range(3):
        kwargs = dict(
            model=model_id(client),
            messages=ASK,
            tools=TOOLS,
            tool_choice=NAMED if choice == "named" else "required",
            temperature=1.0,
            seed=seed,
            max_tokens=300,
            extra_body=PLAIN,  # compared token for token: tests/support/seeded.py
        )
        whole = client.chat.completions.create(**kwargs).choices[0].message.tool_calls
        streamed = streamed_calls(client, **kwargs).calls
        assert [c[1:] for c in streamed] == named_arguments(whole)


def test_a_tool_loop_re_renders_what_the_model_sampled(client, tokenizer):
    """A forced call re-renders through the template byte for byte as the model sampled it
    (the grammar writes the template's layout), and the next prompt extends the previous."""
    from mlx_kvserve.chat.formats import tool_format_for

    messages = list(ASK)
    opening = tool_format_for(tokenizer).start.encode()
    for turn in range(3):
        reply = loop_turn(client, messages, turn, max_tokens=200)
        choice = reply.choices[0]
        prompt = server_prompt(tokenizer, messages)
        if turn == 0:  # later prompts hold replayed calls as sampled (chat.reasoning.sampled_turns)
            assert len(prompt) == reply.usage.prompt_tokens
        sampled = b"".join(bytes(t.bytes) for t in choice.logprobs.content)
        answer_call(messages, choice)
        following = server_prompt(tokenizer, messages)
        assert following[: len(prompt)] == prompt
        text = tokenizer.decode(following[len(prompt) :]).encode()
        block = sampled[sampled.index(opening) :]
        assert block in text, (text, sampled)


def test_a_tool_without_arguments_is_a_400_or_never_called_bare(served, family):
    """A tool that allows no parameter cannot be called in LongCat's format (its parser reads
    the name up to the first argument); one with only optional parameters is called with one."""
    if family != "longcat":
        pytest.skip("only LongCat's parser cannot read a call without arguments")
    base = {"model": "m", "messages": ASK, "tool_choice": "required", "max_tokens": 60}
    bare = [{"type": "function", "function": {"name": "now"}}]
    closed = {"type": "object", "properties": {}, "additionalProperties": False}
    closed_tool = [{"type": "function", "function": {"name": "now", "parameters": closed}}]
    optional = {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "boolean"}},
        "additionalProperties": False,
    }
    opt_tool = [{"type": "function", "function": {"name": "opt", "parameters": optional}}]
    url = f"{served.base_url}/v1/chat/completions"
    assert httpx.post(url, json={**base, "tools": closed_tool}, timeout=60).status_code == 400
    reply = httpx.post(url, json={**base, "tools": bare}, timeout=60)  # free parameters
    assert reply.status_code == 200, reply.text
    for seed in range(5):
        reply = httpx.post(url, json={**base, "tools": opt_tool, "seed": seed}, timeout=60)
        assert reply.status_code == 200, reply.text
        for call in reply.json()["choices"][0]["message"]["tool_calls"]:
            args = json.loads(call["function"]["arguments"])
            assert args and set(args) <= {"a", "b"}
            jsonschema.validate(args, optional)


@settings(SERVED_FUZZ, max_examples=40)
@given(
    tools=st.lists(hostile_block_tool, min_size=1, max_size=2),
    choice=st.sampled_from(["auto", "required"]),
)
def test_fuzzed_tools_never_break_the_grammar(served, tools, choice):
    post_fuzzed(served, {"messages": ASK, "tools": tools, "tool_choice": choice, "max_tokens": 4})


# -- without a server: rendering, the grammar, the stream ------------------------------------
def test_rendering_equals_the_templates_own(tokenizer):
    assert_renders_as_the_template(tokenizer)


def _accepts(tokenizer, tools: list[dict], mode: str, text: str, parallel: bool = True) -> bool:
    return acceptor(tokenizer, tools)(mode, text, parallel)


def test_the_grammar_admits_only_declared_tools(tokenizer, family):
    _, parser, _, *texts = FAMILIES[family]
    assert_admits_only_declared_tools(tokenizer, parser, tuple(texts), unread_closed=True)


def test_laguna_is_read_by_its_own_parser_module_in_its_templates_layout(
    model_dir, tokenizer, family
):
    """The checkpoint's `tool_parser_type` picks mlx-lm's `laguna` module (GLM's parser), and
    the grammar follows the template's GLM-4.7 layout (no newlines)."""
    if family != "laguna":
        pytest.skip("Laguna's parser type")
    from mlx_lm.tool_parsers import laguna

    from mlx_kvserve.chat.formats import tool_format_for

    config = json.loads((model_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert config["tool_parser_type"] == "laguna"
    assert tokenizer.tool_parser is laguna.parse_tool_call
    assert tokenizer.tool_call_start == laguna.tool_call_start
    syntax = tool_format_for(tokenizer).syntax
    assert (syntax.head_end, syntax.value_after, syntax.lead) == ("", "", "")


def test_kimi_k3_calls_are_numbered_in_order_in_one_section(tokenizer, family):
    """Several calls share the section when parallel calls are allowed, numbered 1, 2, ... as
    the template numbers them; one call only otherwise."""
    if family != "kimi-k3":
        pytest.skip("Kimi K3's section")
    head = '<|open|>call tool="get_time" index="{}"<|sep|><|open|>json type="object"<|sep|>'
    call = head + '{{"timezone": "UTC"}}<|close|>json<|sep|><|close|>call<|sep|>'
    section = "<|open|>tools<|sep|>{}<|close|>tools<|sep|>"
    two = section.format(call.format(1) + call.format(2))
    assert _accepts(tokenizer, TOOLS, "required", two)
    assert not _accepts(tokenizer, TOOLS, "required", two, parallel=False)
    assert _accepts(tokenizer, TOOLS, "required", section.format(call.format(1)), parallel=False)
    assert not _accepts(tokenizer, TOOLS, "required", section.format(call.format(2)))
    assert not _accepts(tokenizer, TOOLS, "required", section.format(call.format(1) * 2))


def test_muse_strings_are_never_read_back_as_other_json(tokenizer, family):
    """Muse's parser reads a value as JSON when it can: a string is raw text that is not JSON,
    or a JSON string."""
    if family != "muse-spark":
        pytest.skip("Muse's JSON-first values")
    note = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}
    tools = [{"type": "function", "function": {"name": "note", "parameters": note}}]
    call = _MUSE.format("note") + '<atem:parameter name="text">{}</atem:parameter>\n'
    end = "</atem:invoke>\n</atem:function_calls>"
    for value in ("UTC", "Europe/Paris", '"5"', '"[x]"', '"a\\"b"', "5 6", "tru", ""):
        assert _accepts(tokenizer, tools, "required", call.format(value) + end), value
    for value in ("5", "-1.5e3", "true", "null", "NaN", "[x]", "{}", '"open', " UTC"):
        assert not _accepts(tokenizer, tools, "required", call.format(value) + end), value
    # with length bounds a string is raw text only (a JSON string's length is not its value's)
    bounded = _MUSE.format("get_time") + '<atem:parameter name="timezone">"UTC"</atem:parameter>\n'
    assert not _accepts(tokenizer, TOOLS, "required", bounded + end)


def test_minicpm5_strings_are_plain_or_cdata_as_the_template_writes_them(tokenizer, family):
    """A string holding `<`, `&` or a newline is CDATA (read verbatim); other text is plain and
    cannot start or end with whitespace (the parser strips it)."""
    if family != "minicpm5":
        pytest.skip("MiniCPM5's CDATA values")
    call = '<function name="get_time"><param name="timezone">{}</param></function>'
    for value in ("UTC", "<![CDATA[a<b & c\n]]>", "<![CDATA[ x\n]]>", "a b"):
        assert _accepts(tokenizer, TOOLS, "required", call.format(value)), value
    for value in ("a<b", "a&b", "a\nb", " UTC", "null", "<![CDATA[a]]>", "<![CDATA[a<]]>x"):
        assert not _accepts(tokenizer, TOOLS, "required", call.format(value)), value


def test_an_astral_character_in_a_name_is_one_character_in_the_grammar(tokenizer, family):
    """Lark reads `\\ud8c0\\udc00` as two lone surrogates, not the character they encode: a
    name is written into the grammar literally."""
    from mlx_kvserve.chat import ChatRequest, Message, Tool, ToolChoice
    from mlx_kvserve.chat.formats import tool_format_for
    from mlx_kvserve.chat.grammar import GrammarCompiler

    name = "f\U0001d49c"  # MATHEMATICAL SCRIPT CAPITAL A: assigned, beyond the BMP
    params = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    req = ChatRequest(
        [Message("user", "hi")],
        tools=[Tool(name, None, params)],
        tool_choice=ToolChoice("required"),
    )
    compiler = GrammarCompiler(tokenizer)
    grammar = compiler.grammar_for(req, tool_format_for(tokenizer))
    assert name in grammar and "\\ud8" not in grammar.lower()


def test_the_grammar_never_writes_a_call_without_arguments(tokenizer, family):
    """mlx-lm's longcat parser fails on a call without an argument: with only optional
    parameters one must be written, and any of them may be the first."""
    if family != "longcat":
        pytest.skip("only LongCat's parser cannot read a call without arguments")
    optional = {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "boolean"}},
        "additionalProperties": False,
    }
    tools = [{"type": "function", "function": {"name": "opt", "parameters": optional}}]
    a = "<longcat_arg_key>a</longcat_arg_key>\n<longcat_arg_value>3</longcat_arg_value>\n"
    b = "<longcat_arg_key>b</longcat_arg_key>\n<longcat_arg_value>true</longcat_arg_value>\n"
    end = "</longcat_tool_call>"
    assert not _accepts(tokenizer, tools, "required", _LC + "opt\n" + end)
    for body in (a, b, a + b):
        assert _accepts(tokenizer, tools, "required", _LC + "opt\n" + body + end), body
    assert not _accepts(tokenizer, tools, "required", _LC + "opt\n" + b + a + end)


def _block(tokenizer, calls: list[tuple[str, dict]]) -> str:
    """The blocks the template renders for these calls."""
    from mlx_kvserve.chat.formats import tool_format_for

    fmt = tool_format_for(tokenizer)
    text = template_text(tokenizer, calls, lambda i, _: f"call_{i}")
    start = text.index(fmt.start, text.rindex(ASK[0]["content"]))  # after the instructions
    return text[start : text.rindex(fmt.end) + len(fmt.end)]


def _json_like(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


@settings(
    max_examples=150,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(calls=weather_calls(detailed=True), cuts=st.lists(st.integers(0, 400), max_size=12))
def test_any_split_of_a_block_streams_the_same_calls(tokenizer, family, calls, cuts):
    """Whatever chunks valid calls arrive in, the same calls are announced and finished, and
    each call's streamed fragments concatenate to its final arguments, which are the ones the
    template rendered. (Muse's minimal template writes every string raw, which its parser reads
    as JSON when it can: such a string is left out; its grammar writes it as a JSON string.)"""
    calls = [(n, a) for n, a in calls if "</" not in json.dumps(a)]
    if family == "muse-spark":
        calls = [(n, a) for n, a in calls if not _json_like(a.get("city", "x"))]
    if not calls:
        return
    assert_any_split_streams_the_same_calls(
        tokenizer, "Sure." + _block(tokenizer, calls), calls, cuts
    )
