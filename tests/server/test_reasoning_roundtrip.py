"""Reasoning round-trips end to end (issue 18 item 3): Anthropic `thinking` blocks with a
`signature`, Responses `reasoning` items with `encrypted_content`, and OpenAI chat
`reasoning_content`, replayed into the next turn of a real server, through the official SDKs.

The model: the tiny random-weight Qwen3.5 of model seed 2 (tests/support/thinking_models.py),
decoding greedily. Its generation prompt opens `<think>`; the server's thinking budget of BUDGET
tokens ends the reasoning by forcing `\\n`, `</think>`, `\\n\\n`, then the model answers until
max_tokens (every request asks `ignore_eos`, so no answer ends before). For the questions asked
here its greedy reasoning ("opods", six times) starts with a letter and re-encodes to the very
tokens sampled, so a faithful replay can reuse all of it (" IPS" six times, for other questions,
loses its leading space to the template and re-encodes differently, so it would reuse none).
Each test asks its own question: the cache then holds nothing of another test's conversation.

What the Qwen3.5 template does with past reasoning decides how far a replayed history can match:
* by default it drops the reasoning of turns before the last user message, so a new user
  message departs from the last prompt right before the `<think>` its generation prompt opened
  (the `stripping` server);
* with its own variable `preserve_thinking` (the `kept` server sets it by default) it renders
  every past turn as `<think>\\n` + reasoning + `\\n</think>\\n\\n` + answer. That matches what was
  generated through `</think>`; there the template's `\\n\\n` before the answer's first letter
  tokenizes as two `\\n` where the model had the single forced `\\n\\n` token (the test model
  borrows SmolLM2's tokenizer; Qwen's own pre-tokenizer keeps `\\n\\n` whole). So a replay
  reuses the previous prompt, the reasoning and 2 tokens: KEPT_EXTRA.
A replay that renders other reasoning text departs where that text starts, right after the
previous prompt (which ends in `<think>\\n`); one that renders as an earlier replay did reads
all of that replay's prompt but the one token always prefilled.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import pytest

from tests.support.servers import ServerProcess, client_for
from tests.support.thinking_models import build_thinking_model

BUDGET = 6
KEPT_EXTRA = BUDGET + 2  # the reasoning, then `\n` `</think>`
GREEDY = {"temperature": 0, "ignore_eos": True}  # and every answer runs to its max_tokens
NEXT = {"role": "user", "content": "And another."}
OTHER_TEXT = "Some other reasoning, as a client may have rewritten it."


def _serve(tmp: Path, *flags: str) -> Iterator[ServerProcess]:
    model = build_thinking_model(tmp / "qwen3.5", "qwen3.5", seed=2)
    proc = ServerProcess(tmp, "--model", str(model), "--thinking-budget", str(BUDGET), *flags)
    yield proc.wait_ready()
    proc.stop()


@pytest.fixture(scope="module")
def kept(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    flags = ("--chat-template-kwargs", '{"preserve_thinking": true}')
    yield from _serve(tmp_path_factory.mktemp("kept"), *flags)


@pytest.fixture(scope="module")
def stripping(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    yield from _serve(tmp_path_factory.mktemp("stripping"))


def claude(server: ServerProcess) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0)


def ask(server: ServerProcess, messages: list[dict], max_tokens: int = 16, **extra: Any) -> Any:
    return claude(server).messages.create(
        model="m", max_tokens=max_tokens, messages=messages, extra_body=GREEDY, **extra
    )


def prompt_of(message: Any) -> int:
    """An Anthropic response's whole prompt: prefilled plus read from the cache."""
    return message.usage.input_tokens + message.usage.cache_read_input_tokens


def blocks(message: Any) -> list[dict]:
    return [b.model_dump(exclude_none=True) for b in message.content]


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def replay(server: ServerProcess, question: dict, turn: list[dict]) -> tuple[int, int]:
    """(cache read, prompt) of the next turn after the assistant content `turn`."""
    history = [question, {"role": "assistant", "content": turn}, NEXT]
    answer = ask(server, history, max_tokens=2)
    return answer.usage.cache_read_input_tokens, prompt_of(answer)


def tampered(seal: str) -> str:
    """One character of the sealed text changed: the MAC no longer verifies."""
    i = seal.index(".") + 2
    return seal[:i] + ("A" if seal[i] != "A" else "B") + seal[i + 1 :]


# -- Anthropic ---------------------------------------------------------------------------------
def test_anthropic_thinking_block_streamed_and_not(kept: ServerProcess) -> None:
    question = user("A question about caches.")
    whole = ask(kept, [question])
    assert [b.type for b in whole.content] == ["thinking", "text"]
    thinking, text = whole.content
    assert thinking.thinking and text.text
    assert thinking.signature.startswith("mkv1.")
    with claude(kept).messages.stream(
        model="m", max_tokens=16, messages=[question], extra_body=GREEDY
    ) as stream:
        raw = [e for e in stream if e.type not in {"text", "thinking", "signature", "ping"}]
        streamed = stream.get_final_message()
    order: list[str] = []
    for event in raw:
        name = event.type
        if name == "content_block_start":
            name += ":" + event.content_block.type
        elif name == "content_block_delta":
            name = event.delta.type
        if not order or order[-1] != name:
            order.append(name)
    assert order == [
        "message_start",
        "content_block_start:thinking",
        "thinking_delta",
        "signature_delta",
        "content_block_stop",
        "content_block_start:text",
        "text_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert sum(e.type == "content_block_delta" and e.delta.type == "signature_delta" for e in raw)
    assert blocks(streamed) == blocks(whole)
    assert streamed.stop_reason == whole.stop_reason == "max_tokens"


def test_anthropic_replay_reuses_the_turn_and_never_trusts_a_bad_signature(
    kept: ServerProcess,
) -> None:
    """The signature alone renders the reasoning: replayed with it, with its text omitted (as
    `display: "omitted"` hands it out) or rewritten, the next turn reuses KEPT_EXTRA tokens of
    the turn. A signature changed by one character is ignored: the block renders from its visible
    text, so the prompt is the one a foreign signature gives and departs at that text."""
    question = user("What does the signature prove?")
    first = ask(kept, [question])
    thinking, text = blocks(first)
    cached, prompt = replay(kept, question, [thinking, text])
    assert cached == prompt_of(first) + KEPT_EXTRA
    same = (prompt - 1, prompt)  # rendered as the replay above
    omitted = ask(kept, [question], thinking={"type": "adaptive", "display": "omitted"})
    assert blocks(omitted) == [{**thinking, "thinking": ""}, text]
    assert replay(kept, question, blocks(omitted)) == same
    assert replay(kept, question, [{**thinking, "thinking": OTHER_TEXT}, text]) == same

    bad = {**thinking, "signature": tampered(thinking["signature"])}
    assert replay(kept, question, [bad, text]) == same  # the visible text is the sampled one
    rewritten = {**bad, "thinking": OTHER_TEXT}
    assert replay(kept, question, [rewritten, text])[0] == prompt_of(first)

    def count(block: dict) -> int:
        history = [question, {"role": "assistant", "content": [block, text]}, NEXT]
        return claude(kept).messages.count_tokens(model="m", messages=history).input_tokens

    foreign = {**rewritten, "signature": "EqQBCkgIARABGAIiQL3foreign"}
    assert count(rewritten) == count(foreign) != count(thinking)
    assert count({**thinking, "thinking": OTHER_TEXT}) == count(thinking)


def test_anthropic_next_turn_where_the_template_drops_past_reasoning(
    stripping: ServerProcess,
) -> None:
    """By default Qwen3.5 renders an earlier turn without its reasoning: `<|im_start|>assistant\\n`
    + answer. The last prompt ended `<|im_start|>assistant\\n<think>\\n`, so the next one departs
    at `<think>`, 2 tokens before its end, and that checkpoint ('prompt') serves exactly the rest.
    """
    question = user("A question about caches.")
    first = ask(stripping, [question])
    assert replay(stripping, question, blocks(first))[0] == prompt_of(first) - 2


# -- Responses ---------------------------------------------------------------------------------
def respond(server: ServerProcess, items: list[dict], **extra: Any) -> Any:
    return client_for(server).responses.create(
        model="m",
        input=items,
        include=["reasoning.encrypted_content"],
        reasoning={"summary": "auto"},
        temperature=0,
        extra_body={"ignore_eos": True},
        **{"max_output_tokens": 16, **extra},
    )


def items_of(response: Any) -> list[dict]:
    return [item.model_dump(exclude_none=True) for item in response.output]


def without_ids(items: list[dict]) -> list[dict]:
    return [{k: v for k, v in item.items() if k != "id"} for item in items]


def test_responses_reasoning_item_streamed_and_not(kept: ServerProcess) -> None:
    question = user("How do summaries work?")
    whole = respond(kept, [question])
    assert [item.type for item in whole.output] == ["reasoning", "message"]
    reasoning = whole.output[0]
    text = reasoning.content[0].text
    assert text and [s.text for s in reasoning.summary] == [text]
    assert text == ask(kept, [question]).content[0].thinking  # the reasoning, as Anthropic's
    assert reasoning.encrypted_content.startswith("mkv1.")
    assert whole.usage.output_tokens_details.reasoning_tokens == BUDGET
    with respond(kept, [question], stream=True) as stream:
        events = list(stream)
    done = events[-1]
    assert whole.status == done.response.status == "incomplete"  # max_output_tokens ended it
    assert done.type == "response.incomplete"
    assert without_ids(items_of(done.response)) == without_ids(items_of(whole))
    assert done.response.usage.output_tokens_details.reasoning_tokens == BUDGET
    summaries = [e.delta for e in events if e.type == "response.reasoning_summary_text.delta"]
    assert "".join(summaries) == text


def test_responses_replay_reuses_the_turn_and_never_trusts_a_bad_seal(
    kept: ServerProcess,
) -> None:
    """Replaying the output items before a new user message reuses KEPT_EXTRA tokens of the
    turn, even with the visible text rewritten; with `encrypted_content` changed by one
    character the item renders from its visible text."""
    question = user("Is the seal opaque?")
    first = respond(kept, [question])
    reasoning, message = items_of(first)

    def cached(item: dict) -> tuple[int, int]:
        answer = respond(kept, [question, item, message, NEXT], max_output_tokens=2)
        return answer.usage.input_tokens_details.cached_tokens, answer.usage.input_tokens

    def rewritten(item: dict) -> dict:
        return {
            **item,
            "content": [{"type": "reasoning_text", "text": OTHER_TEXT}],
            "summary": [{"type": "summary_text", "text": OTHER_TEXT}],
        }

    hit, prompt = cached(reasoning)
    assert hit == first.usage.input_tokens + KEPT_EXTRA
    same = (prompt - 1, prompt)  # rendered as the replay above
    assert cached(rewritten(reasoning)) == same
    bad = {**reasoning, "encrypted_content": tampered(reasoning["encrypted_content"])}
    assert cached(bad) == same  # its visible text is the sampled one
    assert cached(rewritten(bad))[0] == first.usage.input_tokens


# -- OpenAI chat -------------------------------------------------------------------------------
def test_chat_reasoning_content_replayed_reuses_the_turn(kept: ServerProcess) -> None:
    client = client_for(kept)
    question = user("What about thinking blocks?")
    first = client.chat.completions.create(
        model="m", messages=[question], max_tokens=16, extra_body=GREEDY
    )
    msg = first.choices[0].message
    reasoning = msg.model_extra["reasoning_content"]
    assert reasoning and first.usage.completion_tokens_details.reasoning_tokens == BUDGET
    turn = {"role": "assistant", "content": msg.content, "reasoning_content": reasoning}
    second = client.chat.completions.create(
        model="m", messages=[question, turn, NEXT], max_tokens=2, extra_body=GREEDY
    )
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached == first.usage.prompt_tokens + KEPT_EXTRA
