"""LFM2's, Gemma 4's, Mistral's, DeepSeek-V3.1's and Llama 3's tool calls, constrained and
streamed.

Each family's tiny random-weight model carries its real chat template (tests/fixtures/templates)
and its tokenizer's tool markers as tokens; mlx-lm picks the parser from the template:

* LFM2.5, `pythonic`: `<|tool_call_start|>[name(key='value', n=3), other()]<|tool_call_end|>`;
* Gemma 4, `gemma4`: `<|tool_call>call:name{key:<|"|>value<|"|>,n:3}<tool_call|>`;
* Mistral's v13 templates, `mistral`: `[TOOL_CALLS]name[ARGS]{"key": "value"}` per call, with no
  closing marker (the call ends the answer);
* DeepSeek-V3.1, our own `deepseek_v31` (mlx-lm has no parser for it):
  `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>name<｜tool▁sep｜>{json}<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>`;
* Llama 3.1/3.3, our own `llama3_json` (mlx-lm has no parser for it): the answer is one call,
  `{"name": "name", "parameters": {"key": "value"}}`, and nothing else.

Whatever such a model samples at temperature 1, a forced call must parse (by mlx-lm's own parser)
to arguments valid against the function's schema, and re-render as it was sampled.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support.call_formats import (
    AT_START,
    FAMILIES,
    HISTORY,
    KWARGS,
    NINE_CHAR_IDS,
    ONE_CALL,
    history_for,
    kw_tool,
)
from tests.support.seeded import PLAIN
from tests.support.servers import ServerProcess, serve_model
from tests.support.thinking_models import build_thinking_model
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
    valid,
)
from tests.support.tool_parsing import acceptor, assert_admits_only_declared_tools, server_prompt
from tests.support.tool_schemas import ASK, NAMED, PING, TOOLS

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def model_dir(family: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    dest = tmp_path_factory.mktemp("kw_tools") / family
    return build_thinking_model(dest, family, tool_tokens=FAMILIES[family][0])


@pytest.fixture(scope="module")
def served(model_dir: Path, family: str) -> Iterator[ServerProcess]:
    yield from serve_model(model_dir, "--chat-template-kwargs", json.dumps(KWARGS.get(family, {})))


def test_the_format_is_named_once_at_start_up(served, family):
    assert_format_named_once(served, FAMILIES[family][1])


def _prompt(tokenizer, messages: list[dict], family: str) -> list[int]:
    return server_prompt(tokenizer, messages, "required", KWARGS.get(family, {}))


def test_history_renders_as_the_template_renders_it(tokenizer, family):
    """Tools, parallel calls and their results: the server's prompt is the template's own."""
    history = history_for(family)
    messages = [
        {**m, "tool_calls": [_as_objects(c) for c in m["tool_calls"]]} if "tool_calls" in m else m
        for m in history
    ]
    tools = [t for t in TOOLS]
    if family in {"deepseek-v3.1", "mistral-v7"}:  # templates that read arguments as text
        messages = [dict(m) for m in history]
        messages[2]["tool_calls"] = [_as_text(c) for c in messages[2]["tool_calls"]]
    if family == "deepseek-v3.1":  # its template lists no tools
        from mlx_kvserve.chat.formats.deepseek_v31 import tools_prompt

        messages[0]["content"] += "\n\n" + tools_prompt(TOOLS)
    own = tokenizer.apply_chat_template(
        messages,
        tools=tools,
        tokenize=False,
        add_generation_prompt=True,
        **KWARGS.get(family, {}),
    )
    ours = _prompt(tokenizer, history, family)
    assert ours == tokenizer.encode(own, add_special_tokens=False)
    assert "get_weather" in own and "sunny" in own
    assert ("CET" in own) == (family not in ONE_CALL)


def _as_text(call: dict) -> dict:
    arguments = json.dumps(json.loads(call["function"]["arguments"]), ensure_ascii=False)
    return {**call, "function": {**call["function"], "arguments": arguments}}


def _as_objects(call: dict) -> dict:
    function = {**call["function"], "arguments": json.loads(call["function"]["arguments"])}
    return {**call, "function": function}


@pytest.mark.parametrize("named", [True, False], ids=["named", "required"])
def test_forced_calls_always_validate(client, named):
    """20 seeds per mode at temperature 1: every call is a declared tool with valid arguments,
    and nothing of the call's syntax leaks into content."""
    forced_replies(client, named, max_tokens=120)


def test_parallel_forced_calls_validate(client):
    """With parallel calls allowed the model may write several (one list, or one block each):
    each is declared and valid."""
    for seed in range(6):
        reply = client.chat.completions.create(
            model=model_id(client),
            messages=ASK,
            tools=TOOLS,
            tool_choice="required",
            temperature=1.0,
            seed=seed,
            max_tokens=200,
        )
        calls = reply.choices[0].message.tool_calls
        assert calls and len(calls) <= 4
        for call in calls:
            valid(call)
        assert len({c.id for c in calls}) == len(calls)


def test_streamed_call_reassembles_to_the_non_streamed_one(client, family):
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
    if family != "mistral-v7":  # v7's call id follows its arguments: they come whole
        # `{"key": ` and the value per parameter as each is written (three required ones)
        assert streamed.fragments >= 6
    assert [c[1:] for c in streamed.calls] == named_arguments(whole)


def test_tool_loop_hits_the_cache(client, tokenizer, family):
    """The call re-renders byte for byte as the model sampled it, and the next turn reads the
    previous prompt and the call from the cache, as far as the sampled tokens are the ones the
    tokenizer makes of that text (all of them for a call the grammar wrote alone, `ping`)."""
    messages = list(ASK)
    for turn in range(4):
        forced = turn % 2 == 0
        reply = loop_turn(client, messages, turn, max_tokens=120, forced=forced)
        choice = reply.choices[0]
        prompt = _prompt(tokenizer, messages, family)
        if turn == 0:  # later prompts hold replayed calls as sampled (chat.reasoning.sampled_turns)
            assert len(prompt) == reply.usage.prompt_tokens
        sampled = [bytes(t.bytes) for t in choice.logprobs.content]
        call = answer_call(messages, choice)
        following = _prompt(tokenizer, messages, family)
        shared = _shared(prompt, following)
        if shared < len(prompt):
            # Gemma 4's empty thinking channel is left out of history; and the test tokenizer
            # (GPT-2's pre-tokenizer) splits the "\n\n" that ends Llama 3's generation prompt
            # once `{` follows it (Llama 3's own keeps it whole; the server splices the turn)
            tail = tokenizer.decode(prompt[shared:])
            assert tail == ("\n\n" if family in AT_START else "<|channel>thought\n<channel|>")
        rest = following[shared:]
        if shared < len(prompt) and family in AT_START:  # past the re-split "\n\n"
            rest = rest[next(k for k in range(len(rest)) if tokenizer.decode(rest[:k]) == tail) :]
        text = tokenizer.decode(rest).encode()
        assert text.startswith(b"".join(sampled)), (text, sampled)  # byte for byte
        same = tokens_alike(tokenizer, rest, sampled)
        if forced and family in NINE_CHAR_IDS:
            # the nine-character id is the model's to choose, its tokens too (the re-render
            # may spell it otherwise): everything before it was forced
            before = b"".join(sampled).index(call.id.encode())
            assert len(b"".join(sampled[:same])) >= before, (sampled, same)
        elif forced:
            assert same == len(sampled), (sampled, [tokenizer.decode([t]) for t in rest])
        cached = next_usage(client, messages).prompt_tokens_details.cached_tokens
        kept = reply.usage.prompt_tokens - (len(prompt) - shared)  # the server's own count
        assert cached >= kept + min(same, len(sampled) - 1), (turn, same, shared, len(prompt))


def _shared(prompt: list[int], following: list[int]) -> int:
    """How much of the previous prompt the next one keeps: all of it, or (Gemma 4, whose
    generation prompt closes an empty thinking channel that its template leaves out of history,
    as the real model's does) all but that channel."""
    n = 0
    while n < min(len(prompt), len(following)) and prompt[n] == following[n]:
        n += 1
    return n


@pytest.mark.parametrize(
    ("body", "param"),
    [
        *BAD_TOOLS,
        (
            {"tools": [{"type": "function", "function": {"name": 'a "b', "parameters": PING}}]},
            "tools",
        ),
    ],
)
def test_bad_tools_are_400s_naming_the_field(served, body, param):
    assert_bad_tools_400(served, body, param)


@SERVED_FUZZ
@given(
    tools=st.lists(kw_tool, min_size=1, max_size=2), choice=st.sampled_from(["auto", "required"])
)
def test_fuzzed_tools_never_break_the_grammar(served, tools, choice):
    post_fuzzed(served, {"messages": ASK, "tools": tools, "tool_choice": choice, "max_tokens": 4})


def test_the_grammar_admits_only_declared_tools(tokenizer, family):
    """In `auto` the text is free until the opening marker; from there only a declared
    function's name and its declared parameters can follow (an invented tool is impossible)."""
    _, parser, call, invented, undeclared, missing, _ = FAMILIES[family]
    texts = (call, "", invented, undeclared, missing, None)
    assert_admits_only_declared_tools(tokenizer, parser, texts, at_start=family in AT_START)


@settings(max_examples=200, deadline=None, database=None)
@given(cuts=st.lists(st.integers(0, 400), max_size=12), family=st.sampled_from(list(FAMILIES)))
def test_any_chunking_of_a_block_streams_the_same_calls(cuts, family):
    """However the block's text arrives, the stream passes on the same names and arguments, and
    each call's fragments plus `finish`'s last one are the JSON of what the parser reads."""
    from mlx_lm.tool_parsers import function_gemma, gemma4, mistral, pythonic

    from mlx_kvserve.chat import formats
    from mlx_kvserve.chat.formats.mistral_legacy import MISTRAL_V7, MISTRAL_V11, parse_v11

    parser = FAMILIES[family][1]
    layouts = {
        "mistral-v11": (MISTRAL_V11, parse_v11),
        "mistral-v7": (MISTRAL_V7, mistral.parse_tool_call),
    }
    syntax, parse = (
        layouts.get(family)
        or {
            "pythonic": (formats.pythonic.syntax, pythonic.parse_tool_call),
            "gemma4": (formats.gemma4.syntax, gemma4.parse_tool_call),
            "mistral": (formats.mistral.syntax, mistral.parse_tool_call),
            "deepseek_v31": (formats.deepseek_v31.syntax, formats.deepseek_v31.parse_tool_call),
            "llama3_json": (formats.llama3_json.syntax, formats.llama3_json.parse_tool_call),
            "function_gemma": (formats.function_gemma.syntax, function_gemma.parse_tool_call),
        }[parser]
    )
    text = FAMILIES[family][6]

    def pieces(points: list[int]) -> list:
        stream = syntax.stream(parse, None)
        out = []
        for at in [*sorted({p % (len(text) + 1) for p in points}), len(text)]:
            out += stream.feed(text[:at])
        return out, stream

    def calls(found: list) -> list:
        slots = sorted({p.slot for p in found})
        return [
            ([p.name for p in found if p.slot == s and p.name], _joined(found, s)) for s in slots
        ]

    whole, _ = pieces([])
    chunked, stream = pieces(cuts)
    assert calls(chunked) == calls(whole)
    if parser in {"pythonic", "gemma4", "function_gemma"}:  # whole keys and values, however cut
        assert [(p.slot, p.name, p.fragment) for p in chunked] == [
            (p.slot, p.name, p.fragment) for p in whole
        ]
    parsed = parse(text, None)
    parsed = parsed if isinstance(parsed, list) else [parsed]
    assert [p.name for p in chunked if p.name] == [c["name"] for c in parsed]
    for slot, call in enumerate(parsed):
        sent = _joined(chunked, slot)
        last, args = stream.finish(slot, call["arguments"])
        assert sent + last == args == json.dumps(call["arguments"], ensure_ascii=False)


def _joined(pieces: list, slot: int) -> str:
    return "".join(p.fragment for p in pieces if p.slot == slot)


def test_older_mistral_layouts_call_with_ids_their_templates_accept(client, family):
    """v11 and v7 calls carry the id the model wrote: 9 letters or digits, which the template
    accepts when the client sends the call and its result back."""
    if family not in NINE_CHAR_IDS:
        pytest.skip("only Mistral's v11 and v7 templates need 9-character ids")
    messages = list(ASK)
    for seed in range(3):
        reply = client.chat.completions.create(
            model=model_id(client),
            messages=messages,
            tools=TOOLS,
            tool_choice="required",
            parallel_tool_calls=False,
            temperature=1.0,
            seed=seed,
            max_tokens=120,
        )
        (call,) = reply.choices[0].message.tool_calls
        assert len(call.id) == 9 and call.id.isalnum(), call.id
        messages.append(reply.choices[0].message.model_dump(exclude_none=True))
        messages.append({"role": "tool", "tool_call_id": call.id, "content": "sunny"})


def test_other_call_ids_are_fitted_for_templates_that_need_nine(tokenizer, family):
    """Ids of another shape (another server's, a client's own: HISTORY's `c1`, `c2`) render as
    the stable 9-character digest both the call and its result get, not as a template error."""
    if family not in NINE_CHAR_IDS:
        pytest.skip("only Mistral's v11 and v7 templates need 9-character ids")
    from mlx_kvserve.chat.formats.mistral_legacy import fitted_id

    ids = {c["id"]: fitted_id(c["id"]) for c in HISTORY[2]["tool_calls"]}
    fitted = [
        {**m, "tool_calls": [{**_as_text(c), "id": ids[c["id"]]} for c in m["tool_calls"]]}
        if "tool_calls" in m
        else {**m, "tool_call_id": ids[m["tool_call_id"]]}
        if "tool_call_id" in m
        else m
        for m in HISTORY
    ]
    own = tokenizer.apply_chat_template(
        fitted, tools=TOOLS, tokenize=False, add_generation_prompt=True
    )
    assert _prompt(tokenizer, HISTORY, family) == tokenizer.encode(own, add_special_tokens=False)
    assert all(i in own for i in ids.values())


@settings(max_examples=200, deadline=None, database=None)
@given(call_id=st.text(max_size=40))
def test_a_fitted_id_is_nine_letters_or_digits_and_stable(call_id):
    from mlx_kvserve.chat.formats.mistral_legacy import fitted_id

    fitted = fitted_id(call_id)
    assert len(fitted) == 9 and fitted.isascii() and fitted.isalnum()
    assert fitted_id(call_id) == fitted and fitted_id(fitted) == fitted


def test_function_gemma_writes_sorted_keys_and_flat_values_only(tokenizer, family):
    """Its parser reads only flat values back whole, and `dictsort` renders keys sorted: the
    grammar allows exactly that (a list-valued parameter is left out)."""
    if family != "function-gemma":
        pytest.skip("FunctionGemma's layout")
    call = acceptor(tokenizer, TOOLS[:1], complete=True)  # get_weather alone

    def accepts(args: str) -> bool:
        text = f"<start_function_call>call:get_weather{{{args}}}<end_function_call>"
        return call("required", text)

    city, unit = "city:<escape>Paris<escape>", "unit:<escape>celsius<escape>"
    assert accepts(f"{city},days:3,{unit}")
    assert accepts(f"{city},days:3,detailed:true,{unit}")
    assert not accepts(f"{unit},{city},days:3")  # not sorted
    assert not accepts(f"{city},days:3,hours:[1,2],{unit}")  # a list: the parser splits it
    assert not accepts("city:<escape>Pa}ris<escape>,days:3," + unit)  # `}` ends the parser's read


@pytest.mark.parametrize(
    "prop",
    [
        {"type": ["string", "null"]},  # nullable, as many clients declare optional values
        {"type": ["integer", "string"]},
        {"enum": ["celsius", "fahrenheit"]},  # an enum without a type
        {},  # no schema at all
    ],
    ids=["nullable", "two-types", "untyped-enum", "empty"],
)
def test_common_parameter_schemas_are_served(served, family, prop):
    """Schemas real clients send (a list of types, an enum without a type, none) are served in
    every format, never a 5xx (Gemma 4's grammar raised on a list of types)."""
    tool = {
        "type": "function",
        "function": {
            "name": "get_thing",
            "parameters": {"type": "object", "properties": {"a": prop}, "required": ["a"]},
        },
    }
    body = {"messages": ASK, "tools": [tool], "tool_choice": "required", "max_tokens": 8}
    reply = httpx.post(f"{served.base_url}/v1/chat/completions", json=body, timeout=120)
    if family == "gemma4" and "type" not in prop:  # its template reads every `type`
        assert reply.status_code == 400 and "chat template rejected" in reply.text, reply.text
        return
    assert reply.status_code == 200, reply.text  # (a random model's call may be cut short)
