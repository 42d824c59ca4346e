"""Images in every protocol, on the real app and engine in this process (a tiny text model).

A text model never fails a turn over an image: each protocol's image field is read, and the
model is shown a note in the image's place, the same note every turn, so the next turn reuses
the prompt cache. `--images reject` makes it a 400 naming the model; bad images are a 400 in
the protocol's own error shape naming the field, never a 5xx, and no URL is fetched that
`--image-urls` did not allow (docs/images.md).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from mlx_kvserve.config.settings import Settings
from mlx_kvserve.engine import Engine
from mlx_kvserve.images.fetch import Fetcher
from mlx_kvserve.images.reader import ImageReader
from tests.support.agent_clis import agent_model_dir
from tests.support.images import SVG, b64, data_url, encoded, huge_png, image_server

LOCAL = "http://localhost"
FIXTURES = Path(__file__).parents[1] / "fixtures" / "images"
PNG = encoded("PNG", 64, 40)
NOTE = "[image: PNG 64x40, not shown: this model does not see images]"
PROTOCOLS = ["openai", "anthropic", "responses", "ollama", "ollama-generate"]


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    from mlx_lm import load

    from mlx_kvserve.api.app import create_app
    from mlx_kvserve.models.pool import ModelPool

    model_dir = agent_model_dir(tmp_path_factory.mktemp("images") / "m")
    engine = Engine(lambda: load(str(model_dir)))  # live reuse on: turn 2 finds turn 1's KV
    with TestClient(create_app(Settings(), ModelPool.single(engine, "tiny")), base_url=LOCAL) as c:
        yield c


# -- each protocol's request with one image in a user turn, and its prompt size ----------------


def image_body(protocol: str, image: dict | str, text: str = "What is this?") -> tuple[str, dict]:
    """(route, body) of a one-turn request: `text`, then the image (each protocol's field)."""
    if protocol == "openai":
        parts = [{"type": "text", "text": text}, {"type": "image_url", "image_url": image}]
        return "/v1/chat/completions", {"messages": [{"role": "user", "content": parts}]}
    if protocol == "anthropic":
        parts = [{"type": "text", "text": text}, {"type": "image", "source": image}]
        return "/v1/messages", {"messages": [{"role": "user", "content": parts}]}
    if protocol == "responses":
        parts = [{"type": "input_text", "text": text}, {"type": "input_image", "image_url": image}]
        return "/v1/responses", {"input": [{"role": "user", "content": parts}]}
    if protocol == "ollama":
        message = {"role": "user", "content": text, "images": [image]}
        return "/api/chat", {"messages": [message]}
    return "/api/generate", {"prompt": text, "images": [image]}


def good_image(protocol: str, data: bytes = PNG) -> dict | str:
    if protocol == "openai":
        return {"url": data_url(data, "image/jpeg")}  # mislabelled: the bytes decide
    if protocol == "anthropic":
        return {"type": "base64", "media_type": "image/gif", "data": b64(data)}
    if protocol == "responses":
        return data_url(data)
    return b64(data)


def text_body(protocol: str, text: str) -> tuple[str, dict]:
    if protocol == "openai":
        return "/v1/chat/completions", {"messages": [{"role": "user", "content": text}]}
    if protocol == "anthropic":
        return "/v1/messages", {"messages": [{"role": "user", "content": text}]}
    if protocol == "responses":
        return "/v1/responses", {"input": [{"role": "user", "content": text}]}
    if protocol == "ollama":
        return "/api/chat", {"messages": [{"role": "user", "content": text}]}
    return "/api/generate", {"prompt": text}


def post(client: TestClient, route: str, body: dict, tokens: int = 2):
    body = {"model": "tiny", "temperature": 0.0, **body}
    if route.startswith("/api/"):
        body |= {"stream": False, "options": {"num_predict": tokens, "temperature": 0.0}}
    elif route == "/v1/responses":
        body["max_output_tokens"] = tokens
    else:
        body["max_tokens"] = tokens
    return client.post(route, json=body)


def prompt_tokens(route: str, reply: dict) -> int:
    if route == "/v1/messages":
        usage = reply["usage"]
        return usage["input_tokens"] + usage["cache_read_input_tokens"]
    if route == "/v1/responses":
        return reply["usage"]["input_tokens"]
    if route.startswith("/api/"):
        return reply["prompt_eval_count"]
    return reply["usage"]["prompt_tokens"]


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_a_text_model_is_shown_a_note_in_the_image_place(
    client: TestClient, protocol: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The image request answers, and its prompt is the one with the note written in: the
    same number of tokens as that text sent alone. The note is logged once per request."""
    route, body = image_body(protocol, good_image(protocol))
    with caplog.at_level(logging.INFO, logger="mlx_kvserve.api"):
        reply = post(client, route, body)
    assert reply.status_code == 200, reply.text
    shown = [r for r in caplog.records if "does not see images" in r.getMessage()]
    assert len(shown) == 1 and "PNG image, 64x40" in shown[0].getMessage()
    # Ollama places images before the turn's text, as Ollama does; the others where they stood
    noted = f"{NOTE}\nWhat is this?" if protocol.startswith("ollama") else f"What is this?\n{NOTE}"
    plain = post(client, *text_body(protocol, noted))
    assert plain.status_code == 200, plain.text
    assert prompt_tokens(route, reply.json()) == prompt_tokens(route, plain.json())


def test_images_in_tool_results_are_noted_too(client: TestClient) -> None:
    """Anthropic `tool_result` images, Responses `function_call_output` images, OpenAI tool
    messages with image parts: each answers with the note in the tool's turn."""
    call = {"type": "tool_use", "id": "toolu_1", "name": "Read", "input": {"file_path": "a.png"}}
    result = {
        "type": "tool_result",
        "tool_use_id": "toolu_1",
        "content": [
            {"type": "text", "text": "the file:"},
            {
                "type": "image",
                "source": {"type": "base64", "media_type": "image/png", "data": b64(PNG)},
            },
        ],
    }
    anthropic = {
        "messages": [
            {"role": "user", "content": "Read a.png"},
            {"role": "assistant", "content": [call]},
            {"role": "user", "content": [result]},
        ]
    }
    responses = {
        "input": [
            {"role": "user", "content": "Look at a.png"},
            {"type": "function_call", "call_id": "c1", "name": "view_image", "arguments": "{}"},
            {
                "type": "function_call_output",
                "call_id": "c1",
                "output": [{"type": "input_image", "image_url": data_url(PNG)}],
            },
        ]
    }
    openai = {
        "messages": [
            {"role": "user", "content": "Look at a.png"},
            {
                "role": "assistant",
                "tool_calls": [
                    {
                        "id": "c1",
                        "type": "function",
                        "function": {"name": "view", "arguments": "{}"},
                    }
                ],
            },
            {
                "role": "tool",
                "tool_call_id": "c1",
                "content": [{"type": "image_url", "image_url": {"url": data_url(PNG)}}],
            },
        ]
    }
    for route, body in [
        ("/v1/messages", anthropic),
        ("/v1/responses", responses),
        ("/v1/chat/completions", openai),
    ]:
        reply = post(client, route, body)
        assert reply.status_code == 200, (route, reply.text)


def test_turn_two_after_a_screenshot_reuses_the_cache(client: TestClient) -> None:
    """The note is the same text every turn: the turn after a screenshot finds the first
    turn's prompt in the cache (at least 90% of it)."""
    shot = encoded("PNG", 320, 200, color=(9, 99, 199))
    first = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Here is my screen. Remember it; I will ask about it."},
                {"type": "image_url", "image_url": {"url": data_url(shot)}},
            ],
        }
    ]
    one = post(client, "/v1/chat/completions", {"messages": first, "seed": 1}, tokens=4)
    assert one.status_code == 200, one.text
    answer = one.json()["choices"][0]["message"]["content"]
    second = [*first, {"role": "assistant", "content": answer}, {"role": "user", "content": "So?"}]
    two = post(client, "/v1/chat/completions", {"messages": second, "seed": 1})
    assert two.status_code == 200, two.text
    before = one.json()["usage"]["prompt_tokens"]
    cached = two.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= 0.9 * before, (cached, before)


@contextmanager
def setting(client: TestClient, **changes: object) -> Iterator[None]:
    app = client.app
    kept = app.state.settings
    app.state.settings = dataclasses.replace(kept, **changes)
    try:
        yield
    finally:
        app.state.settings = kept


@contextmanager
def reader(client: TestClient, images: ImageReader) -> Iterator[None]:
    kept = client.app.state.image_reader
    client.app.state.image_reader = images
    try:
        yield
    finally:
        client.app.state.image_reader = kept


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_images_reject_is_a_400_naming_the_model(client: TestClient, protocol: str) -> None:
    route, body = image_body(protocol, good_image(protocol))
    with setting(client, images="reject"):
        reply = post(client, route, body)
        text_only = post(client, *text_body(protocol, "Hi"))
    assert reply.status_code == 400, reply.text
    assert "'tiny' does not see images" in error_message(route, reply.json())
    assert text_only.status_code == 200


def error_message(route: str, body: dict) -> str:
    """The error's message, after checking the protocol's error shape."""
    if route.startswith("/api/"):
        assert set(body) == {"error"} and isinstance(body["error"], str), body
        return body["error"]
    if route == "/v1/messages":
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error", body
        return body["error"]["message"]
    assert body["error"]["type"] == "invalid_request_error", body
    return body["error"]["message"] + f" (param: {body['error']['param']})"


def bad_image(protocol: str, case: str, server_url: Callable[[str], str]) -> dict | str:
    """The image field of `protocol` holding the bad input `case`."""
    data = {
        "text": b"this is not an image at all",
        "truncated": PNG[: len(PNG) // 2],
        "huge": huge_png(),
        "svg": SVG,
    }.get(case)
    if data is not None:
        return good_image(protocol, data)
    url = server_url("/image.png" if case == "url-off" else "/redirect?to=http://10.1.2.3/x.png")
    if protocol == "openai":
        return {"url": url}
    if protocol == "anthropic":
        return {"type": "url", "url": url}
    if protocol == "responses":
        return url
    return url  # Ollama takes base64 only: a URL is not valid base64


FIELD = {  # the field each protocol's error names
    "openai": "messages[0].content[1].image_url",
    "anthropic": "messages.0.content.1.source",
    "responses": "input[0].content[1].image_url",
    "ollama": "messages[0].images[0]",
    "ollama-generate": "images[0]",
}
WHY = {
    "text": "not an image",
    "truncated": "truncated",
    "huge": "pixels",
    "svg": "SVG",
    "url-off": "image URLs are off",
    "url-private": "private",
}


@pytest.mark.parametrize("case", list(WHY))
@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_bad_images_are_a_400_naming_the_field(client: TestClient, protocol: str, case: str):
    with image_server(PNG) as server:
        hosts = ("127.0.0.1", "10.1.2.3")  # both allowed: only the address check refuses
        allowed = Fetcher(hosts, trusted=frozenset({("127.0.0.1", server.port)}))
        images = ImageReader(fetcher=allowed) if case == "url-private" else ImageReader()
        route, body = image_body(protocol, bad_image(protocol, case, server.url))
        with reader(client, images):
            reply = post(client, route, body)
        fetched = list(server.hits)
    assert reply.status_code == 400, reply.text
    message = error_message(route, reply.json())
    assert FIELD[protocol] in message
    if case.startswith("url") and protocol.startswith("ollama"):
        assert "base64" in message and fetched == []
        return
    assert WHY[case] in message, message
    if case == "url-off":
        assert fetched == []  # never a fetch the flag did not allow
    if case == "url-private":
        assert fetched == ["/redirect?to=http://10.1.2.3/x.png"]  # and not the private hop


def test_an_allowed_url_is_fetched_and_noted(client: TestClient) -> None:
    with image_server(encoded("PNG", 30, 20)) as server:
        allowed = Fetcher(("127.0.0.1",), trusted=frozenset({("127.0.0.1", server.port)}))
        with reader(client, ImageReader(fetcher=allowed)):
            for protocol in ["openai", "anthropic", "responses"]:
                image = bad_image(protocol, "url-off", server.url)  # the good URL, now allowed
                reply = post(client, *image_body(protocol, image))
                assert reply.status_code == 200, reply.text
        assert server.hits == ["/image.png"] * 3


def test_models_say_whether_they_see_images(client: TestClient) -> None:
    cards = client.get("/v1/models").json()["data"]
    assert all("vision" not in card["capabilities"] for card in cards)
    assert all("completion" in card["capabilities"] for card in cards)
    show = client.post("/api/show", json={"model": "tiny"}).json()
    assert "vision" not in show["capabilities"] and "completion" in show["capabilities"]


# -- the agents' own shapes, recorded as fixtures ----------------------------------------------


@pytest.mark.parametrize(
    "name, route",
    [
        ("claude-code-pasted-screenshot", "/v1/messages"),
        ("claude-code-read-image", "/v1/messages"),
        ("codex-input-image", "/v1/responses"),
        ("codex-view-image-output", "/v1/responses"),
    ],
)
def test_the_agents_image_shapes_answer(
    client: TestClient, name: str, route: str, caplog: pytest.LogCaptureFixture
) -> None:
    body = json.loads((FIXTURES / f"{name}.json").read_text())
    body |= {"model": "tiny", "stream": False, "temperature": 0.0}
    body["max_tokens" if route == "/v1/messages" else "max_output_tokens"] = 2
    body.pop("include", None) if route == "/v1/responses" else None
    with caplog.at_level(logging.INFO, logger="mlx_kvserve.api"):
        reply = client.post(route, json=body)
    assert reply.status_code == 200, reply.text
    assert sum("does not see images" in r.getMessage() for r in caplog.records) == 1


# -- fuzzing the image fields ------------------------------------------------------------------


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_fuzzed_image_fields_are_answered_or_a_400(client: TestClient, protocol: str) -> None:
    """Whatever the image field holds: a 200, or a 400 in the protocol's shape; never a 5xx,
    and nothing fetched (URLs are off)."""
    fuzz_image_field(client, protocol, "tiny", examples=50)


def fuzz_image_field(client: TestClient, protocol: str, model: str, examples: int) -> None:
    """Hypothesis's values in `protocol`'s image field, each answered 200 or a 400 in the
    protocol's error shape (tests/unit/test_vision.py runs it on a vision model too)."""
    from hypothesis import HealthCheck, given, settings

    from tests.support.fuzz_images import field

    @settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck))
    @given(value=field(protocol))
    def probe(value: object) -> None:
        route, body = image_body(protocol, value)  # type: ignore[arg-type]
        body = {"model": model, "temperature": 0.0, **body}
        if route.startswith("/api/"):
            body |= {"stream": False, "options": {"num_predict": 1}}
        else:
            body["max_output_tokens" if route == "/v1/responses" else "max_tokens"] = 1
        reply = client.post(
            route, content=json.dumps(body), headers={"content-type": "application/json"}
        )
        assert reply.status_code in (200, 400), reply.text
        if reply.status_code == 400:
            error_message(route, reply.json())

    probe()


def test_count_tokens_counts_the_note(client: TestClient) -> None:
    """Anthropic's count_tokens reads images as /v1/messages does: the note's tokens."""
    _, body = image_body("anthropic", good_image("anthropic"))
    _, plain = text_body("anthropic", f"What is this?\n{NOTE}")
    route = "/v1/messages/count_tokens"
    counted = client.post(route, json={"model": "tiny", **body})
    assert counted.status_code == 200, counted.text
    expected = client.post(route, json={"model": "tiny", **plain}).json()["input_tokens"]
    assert counted.json()["input_tokens"] == expected


def test_the_official_sdks_send_images(client: TestClient) -> None:
    """The OpenAI and Anthropic SDKs' own image shapes, through the same app."""
    import anthropic
    import openai

    oai = openai.OpenAI(base_url=f"{LOCAL}/v1", api_key="unused", http_client=client)
    chat = oai.chat.completions.create(
        model="tiny",
        max_tokens=2,
        temperature=0.0,
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "What is this?"},
                    {"type": "image_url", "image_url": {"url": data_url(PNG), "detail": "low"}},
                ],
            }
        ],
    )
    response = oai.responses.create(
        model="tiny",
        max_output_tokens=2,
        temperature=0.0,
        input=[
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "What is this?"},
                    {"type": "input_image", "image_url": data_url(PNG), "detail": "auto"},
                ],
            }
        ],
    )
    claude = anthropic.Anthropic(base_url=LOCAL, api_key="unused", http_client=client)
    message = claude.messages.create(
        model="tiny",
        max_tokens=2,
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "What is this?"},
                    {
                        "type": "image",
                        "source": {"type": "base64", "media_type": "image/png", "data": b64(PNG)},
                    },
                ],
            }
        ],
    )
    _, plain = text_body("openai", f"What is this?\n{NOTE}")
    expected = post(client, "/v1/chat/completions", plain).json()["usage"]["prompt_tokens"]
    assert chat.usage.prompt_tokens == response.usage.input_tokens == expected
    usage = message.usage
    assert usage.input_tokens + (usage.cache_read_input_tokens or 0) == expected
    with pytest.raises(openai.BadRequestError) as refused:
        oai.chat.completions.create(
            model="tiny",
            max_tokens=2,
            messages=[
                {
                    "role": "user",
                    "content": [{"type": "image_url", "image_url": {"url": data_url(SVG)}}],
                }
            ],
        )
    assert refused.value.body["param"] == "messages[0].content[0].image_url"


@pytest.mark.parametrize(
    "extra", [{"raw": True}, {"suffix": "return x"}, {"template": "{{ .Prompt }}"}]
)
def test_a_generate_prompt_built_without_the_chat_template_takes_no_images(
    client: TestClient, extra: dict
) -> None:
    route, body = image_body("ollama-generate", good_image("ollama-generate"))
    reply = post(client, route, {**body, **extra})
    assert reply.status_code == 400, reply.text
    assert "does not support images" in error_message(route, reply.json())
