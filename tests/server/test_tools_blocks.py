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

from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.support.block_tools import FAMILIES, build_family_model, hostile_block_tool
from tests.support.seeded import PLAIN
from tests.support.servers import ServerProcess, serve_model
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
from tests.support.tool_parsing import server_prompt
from tests.support.tool_schemas import ASK, NAMED, TOOLS

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def model_dir(family: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    dest = tmp_path_factory.mktemp("block_tools") / family
    return build_family_model(dest, family)


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
    forced_replies(client, named, max_tokens=160)


def test_parallel_calls_share_a_block_and_all_validate(client):
    """With parallel calls allowed, every call of the block validates and has its own id."""
    counts = set()
    for seed in range(8):
        reply = client.chat.completions.create(
            model=model_id(client),
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
            valid(call)
        assert len({c.id for c in choice.message.tool_calls}) == len(choice.message.tool_calls)
        counts.add(len(choice.message.tool_calls))
    # (that the grammar allows several calls per block is test_the_grammar_admits_...; whether a
    # random-weight model writes a second one depends on its weights)
    assert counts


@pytest.mark.parametrize("choice", ["required", "named"])
def test_streamed_calls_reassemble_to_the_non_streamed_ones(client, family, choice):
    kwargs = dict(
        model=model_id(client),
        messages=ASK,
        tools=TOOLS,
        tool_choice=NAMED if choice == "named" else "required",
        temperature=1.0,
        seed=3,
        extra_body=PLAIN,  # compared token for token: tests/support/seeded.py
        max_tokens=300,
    )
    whole = client.chat.completions.create(**kwargs).choices[0].message.tool_calls
    streamed = streamed_calls(client, **kwargs).calls
    if family == "kimi-k2":  # the model writes its calls' ids: the same with the same seed
        assert streamed == [(c.id, c.function.name, c.function.arguments) for c in whole]
    else:
        assert [s[1:] for s in streamed] == named_arguments(whole)


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
        reply = loop_turn(client, messages, turn, max_tokens=200, forced=forced)
        choice = reply.choices[0]
        prompt = server_prompt(tokenizer, messages)
        if turn == 0:  # later prompts hold replayed calls as sampled (chat.reasoning.sampled_turns)
            assert len(prompt) == reply.usage.prompt_tokens
        sampled = b"".join(bytes(t.bytes) for t in choice.logprobs.content)
        answer_call(messages, choice)
        following = server_prompt(tokenizer, messages)
        assert following[: len(prompt)] == prompt
        text = tokenizer.decode(following[len(prompt) :]).encode()
        opening = tool_format_for(tokenizer).start.encode()
        block = sampled[sampled.index(opening) :]
        assert block in text, (text, sampled)  # the call, byte for byte
        cached = next_usage(client, messages).prompt_tokens_details.cached_tokens
        assert cached >= reply.usage.prompt_tokens, turn
        # as far as the next prompt's tokens are the ones sampled, the cache has them (the
        # last sampled token ended the generation, so it was never fed)
        rest, tokens = following[len(prompt) :], [bytes(t.bytes) for t in choice.logprobs.content]
        same = tokens_alike(tokenizer, rest, tokens)
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
    [*BAD_TOOLS, ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools")],
)
def test_bad_tools_are_400s_naming_the_field(served, body, param):
    assert_bad_tools_400(served, body, param)


@SERVED_FUZZ
@given(
    tools=st.lists(hostile_block_tool, min_size=1, max_size=2),
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
    post_fuzzed(served, body)
