"""The soak's own parts in process: how answers with tool calls compare, the history a client
sends back after them, the requests of each target, and the models `scripts/soak.py` builds
(tests/support/soak_workload.py, tests/support/soak_models.py)."""

from __future__ import annotations

import json

import mlx.core as mx
import pytest

from tests.support.soak_models import (
    CALL_SCALE,
    TOKENS,
    model_dir,
    rows,
    soak_target,
)
from tests.support.soak_workload import (
    DEFAULT,
    MODEL,
    TOOLS,
    Answer,
    Target,
    replies,
)
from tests.support.thinking_models import TOOL_TOKENS, build_thinking_model
from tests.support.tiny_models import output_weights


def _message(content, *calls: tuple[str, str], reasoning: str | None = None) -> dict:
    message = {"role": "assistant", "content": content}
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    if calls:
        message["tool_calls"] = [
            {"id": f"call_{i}", "type": "function", "function": {"name": n, "arguments": a}}
            for i, (n, a) in enumerate(calls)
        ]
    return message


def test_calls_compare_by_name_and_parsed_arguments():
    one = Answer.of_message(_message(None, ("get_weather", '{"city": "Oslo", "days": 2}')))
    same = Answer.of_message(_message("", ("get_weather", '{"days":2,"city":"Oslo"}')))
    assert one == same and one.content == ""
    assert one != Answer.of_message(_message("", ("get_weather", '{"city": "Oslo", "days": 3}')))
    assert one != Answer.of_message(_message("", ("get_time", '{"city": "Oslo", "days": 2}')))
    assert one != Answer.of_message(_message("x", ("get_weather", '{"city": "Oslo", "days": 2}')))
    cut = Answer.of_message(_message("", ("get_time", '{"zone": "Eu')))
    assert cut.calls == (("get_time", '{"zone": "Eu'),)  # not JSON: compared as written
    thought = Answer.of_message(_message("hi", reasoning="hmm"))
    assert thought != Answer.of_message(_message("hi")) and thought.reasoning == "hmm"


def test_the_history_sends_back_whole_calls_with_the_clients_ids():
    answer = Answer("Let me see.", "", (("get_weather", '{"city": "Lima", "days": 1}'),))
    answer = Answer(answer.content, "", (*answer.calls, ("get_time", '{"zone": "')))
    assistant, result = replies(answer, 2, 3)
    assert assistant == {
        "role": "assistant",
        "content": "Let me see.",
        "tool_calls": [
            {
                "id": "call_2_3_0",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Lima", "days": 1}'},
            }
        ],
    }
    assert result["role"] == "tool" and result["tool_call_id"] == "call_2_3_0"
    assert json.loads(result["content"])
    assert replies(Answer("Hello."), 0, 0) == [{"role": "assistant", "content": "Hello."}]


def test_each_target_sends_its_model_and_only_a_tools_target_sends_tools():
    messages = [{"role": "user", "content": "Hi"}]
    assert DEFAULT.body(messages) == {
        "model": MODEL,
        "messages": messages,
        "temperature": 0,
        "max_tokens": 8,
    }
    body = Target("window", "window", tools=True, max_tokens=48).body(messages, stream=True)
    assert body["model"] == "window" and body["max_tokens"] == 48 and body["stream"] is True
    assert body["tools"] == TOOLS and body["tool_choice"] == "auto"


@pytest.mark.parametrize("padded", [False, True], ids=["exact", "padded"])
def test_the_window_model_has_the_rows_asked_for_and_a_louder_call_token(tmp_path, padded):
    target = soak_target("window", tmp_path, tools=True, padded=padded)
    model = model_dir("window", tmp_path, padded=padded)
    assert ("--model", str(model)) == target.server_args[:2]
    config = json.loads((model / "config.json").read_text())
    assert config["vocab_size"] == rows(padded)
    if padded:
        assert rows(padded) > TOKENS and rows(padded) % 128 == 0
    else:
        assert rows(padded) == TOKENS
    tokenizer = json.loads((model / "tokenizer.json").read_text())
    ids = {t["content"]: t["id"] for t in tokenizer["added_tokens"]}
    assert max(ids.values()) == TOKENS - 1
    weights = mx.load(str(model / "model.safetensors"))
    head = weights[output_weights(weights)]
    assert head.shape[0] == rows(padded)
    plain = build_thinking_model(  # the same model as built, before the scaling
        tmp_path / "plain",
        "qwen3",
        architecture="gemma3_text",
        tool_tokens=TOOL_TOKENS,
        vocab_size=rows(padded),
    )
    original = mx.load(str(plain / "model.safetensors"))[output_weights(weights)]
    call = ids[TOOL_TOKENS[0]]
    assert mx.allclose(head[call], original[call] * CALL_SCALE).item()
    assert mx.array_equal(head[:call], original[:call]).item()
    assert mx.array_equal(head[call + 1 :], original[call + 1 :]).item()
