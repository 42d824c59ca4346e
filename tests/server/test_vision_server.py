"""A vision model behind a real server process, asked through the official SDKs: OpenAI's
`image_url` (chat) and `input_image` (Responses), Anthropic's `image` blocks (in a user turn and
inside a `tool_result`), Ollama's `images`. Each protocol's image reaches the model: the same
image gives the same greedy answer, another image another answer (docs/images.md)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from tests.support.images import b64, data_url, encoded
from tests.support.servers import ServerProcess, client_for, serve_model

pytest.importorskip("mlx_vlm")

RED = encoded("PNG", 64, 40, (200, 30, 30))
GREEN = encoded("PNG", 64, 40, (20, 220, 40))  # RED's size: only the pixels differ
TEXT = "What is in the picture?"
TOKENS = 8


@pytest.fixture(scope="module", params=["gemma3", "qwen2_5_vl", "qwen3_vl", "qwen3_5"])
def served(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[ServerProcess]:
    """A tiny checkpoint of each family served (Qwen's images at M-RoPE positions)."""
    from tests.support import vision_models

    build = {
        "gemma3": vision_models.gemma3_vision_dir,
        "qwen2_5_vl": vision_models.qwen2_5_vl_dir,
        "qwen3_vl": vision_models.qwen3_vl_dir,
        "qwen3_5": vision_models.qwen3_5_vision_dir,
    }[request.param]
    # (Qwen3-VL's seed 0 happens to answer the long tool_result prompt's 8 tokens alike for
    # RED and GREEN, whose 8 image tokens sit among ~200 of tool text; seed 1 does not)
    seed = 1 if request.param == "qwen3_vl" else 0
    model = build(tmp_path_factory.mktemp("vision") / "tiny-vision", seed=seed)
    # --no-cache: these tests compare the protocols' plumbing, each answer prefilled whole
    # (the cache's image keys are tests/unit/test_vision*.py's); Qwen3.5's template would open
    # `<think>` and its answer would be reasoning, which each protocol carries its own way
    off = ["--chat-template-kwargs", '{"enable_thinking": false}']
    yield from serve_model(model, "--no-cache", *(off if request.param == "qwen3_5" else []))


def openai_chat(served: ServerProcess, image: bytes) -> str:
    content = [
        {"type": "text", "text": TEXT},
        {"type": "image_url", "image_url": {"url": data_url(image)}},
    ]
    out = client_for(served).chat.completions.create(
        model="tiny-vision",
        messages=[{"role": "user", "content": content}],
        max_tokens=TOKENS,
        temperature=0,
    )
    return out.choices[0].message.content or ""


def responses(served: ServerProcess, image: bytes) -> str:
    content = [
        {"type": "input_text", "text": TEXT},
        {"type": "input_image", "image_url": data_url(image), "detail": "auto"},
    ]
    out = client_for(served).responses.create(
        model="tiny-vision",
        input=[{"role": "user", "content": content}],
        max_output_tokens=TOKENS,
        temperature=0,
    )
    return out.output_text


def _anthropic(served: ServerProcess):  # noqa: ANN202
    import anthropic

    return anthropic.Anthropic(base_url=served.base_url, api_key="unused", max_retries=0)


def _image_block(image: bytes) -> dict:
    return {
        "type": "image",
        "source": {"type": "base64", "media_type": "image/png", "data": b64(image)},
    }


def anthropic_user(served: ServerProcess, image: bytes) -> str:
    out = _anthropic(served).messages.create(
        model="tiny-vision",
        max_tokens=TOKENS,
        extra_body={"temperature": 0},  # (this SDK's create() no longer names it)
        messages=[
            {"role": "user", "content": [{"type": "text", "text": TEXT}, _image_block(image)]}
        ],
    )
    return "".join(b.text for b in out.content if b.type == "text")


def anthropic_tool_result(served: ServerProcess, image: bytes) -> str:
    """Claude Code's Read tool opening a PNG: the image inside the tool_result."""
    tool = {
        "name": "Read",
        "description": "Read a file",
        "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}},
    }
    out = _anthropic(served).messages.create(
        model="tiny-vision",
        max_tokens=TOKENS,
        extra_body={"temperature": 0},
        tools=[tool],
        tool_choice={"type": "none"},
        messages=[
            {"role": "user", "content": "Open shot.png"},
            {
                "role": "assistant",
                "content": [
                    {
                        "type": "tool_use",
                        "id": "toolu_1",
                        "name": "Read",
                        "input": {"path": "shot.png"},
                    }
                ],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_1",
                        "content": [_image_block(image)],
                    }
                ],
            },
        ],
    )
    return "".join(b.text for b in out.content if b.type == "text")


def ollama_chat(served: ServerProcess, image: bytes) -> str:
    import ollama

    out = ollama.Client(host=served.base_url).chat(
        model="tiny-vision",
        messages=[{"role": "user", "content": TEXT, "images": [b64(image)]}],
        options={"num_predict": TOKENS, "temperature": 0},
        think=False,  # Ollama's absent `think` turns reasoning on (Qwen3.5's template has it)
    )
    return out.message.content or ""


ASKS: dict[str, Callable[[ServerProcess, bytes], str]] = {
    "openai-image_url": openai_chat,
    "responses-input_image": responses,
    "anthropic-image": anthropic_user,
    "anthropic-tool_result": anthropic_tool_result,
    "ollama-images": ollama_chat,
}


@pytest.mark.parametrize("protocol", list(ASKS))
def test_each_protocols_image_reaches_the_model(served: ServerProcess, protocol: str) -> None:
    ask = ASKS[protocol]
    red = ask(served, RED)
    assert red
    assert ask(served, RED) == red
    assert ask(served, GREEN) != red
    assert "as a note" not in served.log()


def test_the_server_says_the_model_sees_images(
    served: ServerProcess, request: pytest.FixtureRequest
) -> None:
    models = client_for(served).models.list().data
    assert "vision" in models[0].model_extra["capabilities"]
    assert f"vision tower loaded ({request.node.callspec.params['served']})" in served.log()


def test_a_client_that_leaves_an_image_stream_cancels_it(served: ServerProcess) -> None:
    """The stream of an image request, left after its first chunk: the engine cancels the
    request (its log line says so), and the next image request is answered. The first chunk
    (the role) goes out before the engine takes the request, so the client may leave while it
    is still queued: it gets its line then too (tests/unit/test_engine_failures.py)."""
    import json
    import re

    import httpx

    def finishes() -> list[str]:
        return re.findall(r"chat id=\S+ .*?finish=(\w+)", served.log())

    before = len(finishes())
    body = {
        "model": "tiny-vision",
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": TEXT},
                    {"type": "image_url", "image_url": {"url": data_url(GREEN)}},
                ],
            }
        ],
        "max_tokens": 4000,  # minutes of decoding if the disconnect went unnoticed
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream(
        "POST", served.base_url + "/v1/chat/completions", json=body, timeout=120
    ) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data:") and json.loads(line[5:])["choices"]:
                break  # the first chunk came: leave
    assert openai_chat(served, RED)  # answered after it
    # a hang detector, not a time limit: a loaded CI machine notices the disconnect at the
    # stream's next write, after the image's prefill and a decode step
    served.wait_for_log("finish=cancelled", timeout=120)
    assert "cancelled" in finishes()[before:]
