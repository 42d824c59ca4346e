"""A checkpoint whose embedding has more rows than its tokenizer has ids, served end to end.

Qwen2.5/3/3.5, Gemma 3 and DeepSeek-V3 ship so (Qwen: 151,669 tokens in 151,936 rows). Here a
tiny random hybrid (qwen3_5: linear attention and one full-attention layer) with Qwen3.5's real
template, `<think>` and Qwen's `<tool_call>` tags as tokens, and its vocabulary padded as a real
checkpoint's is (tests/support/tiny_models.py `padded_vocab`). Every request an agent sends
carries tools: with thinking off the grammar masks the first token, with thinking on the first
token after the reasoning ends (the server's thinking budget of 6 ends it), in the OpenAI and
Anthropic protocols alike; a JSON schema masks every token. None of it may answer a 5xx. The
weights are bf16 with the float32 `A_log` a conversion keeps, as Qwen3.5 ships.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import mlx.core as mx
import pytest

from tests.support.servers import ServerProcess
from tests.support.thinking_models import TOOL_TOKENS, VOCAB, build_thinking_model
from tests.support.tiny_models import make_model_dir, padded_vocab

pytestmark = pytest.mark.slow

TOKENS = VOCAB + 2 + len(TOOL_TOKENS)  # SmolLM2's ids, <think> </think>, <tool_call> </tool_call>
ROWS = padded_vocab(TOKENS)
HI = [{"role": "user", "content": "What is the weather in Paris?"}]
OFF = {"chat_template_kwargs": {"enable_thinking": False}}
SAMPLING = {"temperature": 1.0, "seed": 11}
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Lyon"]}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
SCHEMA = {"type": "json_schema", "json_schema": {"name": "weather", "schema": WEATHER}}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    dest = tmp_path_factory.mktemp("padded") / "qwen3.5"
    model = build_thinking_model(
        dest, "qwen3.5", architecture="qwen3_5", tool_tokens=TOOL_TOKENS, dtype="bfloat16"
    )
    config = json.loads((model / "config.json").read_text())
    assert config["text_config"]["vocab_size"] == ROWS > TOKENS
    dtypes = {str(v.dtype) for v in mx.load(str(model / "model.safetensors")).values()}
    assert dtypes == {"mlx.core.bfloat16", "mlx.core.float32"}
    return model


@pytest.fixture(scope="module")
def server(model_dir: Path) -> Iterator[ServerProcess]:
    proc = ServerProcess(model_dir.parent, "--model", str(model_dir), "--thinking-budget", "6")
    yield proc.wait_ready()
    proc.stop()


def _chat(server: ServerProcess, **body) -> dict:
    body = {"model": "m", "messages": HI, "max_tokens": 64, **SAMPLING, **body}
    r = httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


@pytest.mark.parametrize("thinking", [False, True], ids=["thinking-off", "thinking-on"])
@pytest.mark.parametrize("choice", ["auto", "required"])
def test_tools_answer_on_a_padded_vocabulary(server: ServerProcess, thinking: bool, choice: str):
    extra = {} if thinking else dict(OFF)
    if choice == "auto":  # free text until a call begins: a few tokens past the reasoning show it
        extra["max_tokens"] = 16
    answer = _chat(server, tools=TOOLS, tool_choice=choice, parallel_tool_calls=False, **extra)
    message = answer["message"]
    assert bool(message.get("reasoning_content")) == thinking
    if choice == "required":
        (call,) = message["tool_calls"]
        assert json.loads(call["function"]["arguments"])["city"] in {"Paris", "Lyon"}
        assert answer["finish_reason"] == "tool_calls"


@pytest.mark.parametrize("thinking", [False, True], ids=["thinking-off", "thinking-on"])
def test_a_json_schema_answers_on_a_padded_vocabulary(server: ServerProcess, thinking: bool):
    extra = {} if thinking else dict(OFF)
    answer = _chat(server, response_format=SCHEMA, **extra)
    assert json.loads(answer["message"]["content"])["city"] in {"Paris", "Lyon"}
    assert answer["finish_reason"] == "stop"


def test_a_streamed_tool_call_after_the_reasoning(server: ServerProcess):
    body = {
        "model": "m",
        "messages": HI,
        "max_tokens": 64,
        "tools": TOOLS,
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "stream": True,
        **SAMPLING,
    }
    reasoning, arguments, finish = "", "", None
    with httpx.stream(
        "POST", server.base_url + "/v1/chat/completions", json=body, timeout=300
    ) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"][0]
            delta = choice["delta"]
            reasoning += delta.get("reasoning_content") or ""
            for call in delta.get("tool_calls") or []:
                arguments += call.get("function", {}).get("arguments") or ""
            finish = choice["finish_reason"] or finish
    assert reasoning and finish == "tool_calls"
    assert json.loads(arguments)["city"] in {"Paris", "Lyon"}


@pytest.mark.parametrize("thinking", [False, True], ids=["thinking-off", "thinking-on"])
def test_anthropic_tools_answer_on_a_padded_vocabulary(server: ServerProcess, thinking: bool):
    body = {
        "model": "m",
        "max_tokens": 64,
        "messages": HI,
        "tools": [{"name": "get_weather", "input_schema": WEATHER}],
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        "thinking": {"type": "adaptive"} if thinking else {"type": "disabled"},
        **SAMPLING,
    }
    r = httpx.post(server.base_url + "/v1/messages", json=body, timeout=300)
    assert r.status_code == 200, r.text
    blocks = r.json()["content"]
    assert any(b["type"] == "thinking" for b in blocks) == thinking
    (use,) = [b for b in blocks if b["type"] == "tool_use"]
    assert use["input"]["city"] in {"Paris", "Lyon"}


def test_token_ids_past_the_tokenizer_are_refused(server: ServerProcess):
    """Ids the embedding has rows for but the tokenizer has no text for: a 400, not a 5xx."""
    for bad in (TOKENS, ROWS - 1, ROWS):
        r = httpx.post(
            server.base_url + "/v1/completions",
            json={"model": "m", "prompt": [1, 2, bad], "max_tokens": 2},
            timeout=60,
        )
        assert r.status_code == 400, r.text
        assert str(bad) in r.json()["error"]["message"]


def test_no_5xx_was_logged(server: ServerProcess):
    assert "Invalid buffer size" not in server.log()
    assert " 500 " not in server.log()


def test_a_tokenizer_larger_than_the_embedding_is_refused_at_start(tmp_path: Path):
    """No loader can give ids past the embedding a row: the server says so and exits."""
    model = make_model_dir(tmp_path / "model", "llama", vocab_size=VOCAB - 100)
    proc = ServerProcess(tmp_path, "--model", str(model))
    assert proc.proc.wait(120) == 2
    log = proc.log()
    proc.stop()
    assert f"its tokenizer writes {VOCAB} token ids but its embedding has only {VOCAB - 100}" in log
    assert "Traceback" not in log
