"""Every client mistake gets a precise error in the OpenAI shape, never a traceback or a hang."""

from __future__ import annotations

import re
import socket

import httpx
import openai
import pytest

MODEL = "SmolLM2-135M-Instruct"
CHAT = "/v1/chat/completions"
OK_MESSAGES = [{"role": "user", "content": "Hi"}]


def assert_error(resp: httpx.Response, status: int, param: str | None = None) -> dict:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert "Traceback" not in error["message"]
    if param is not None:
        assert error["param"] == param, error
    return error


def post(server, path: str, **kwargs) -> httpx.Response:
    return httpx.post(server.base_url + path, timeout=30, **kwargs)


@pytest.mark.parametrize(
    "raw",
    [b"{not json", b"", b"[1, 2]", b'"a string"', b"\xff\xfe", b'{"messages": [}'],
)
def test_malformed_bodies_are_400(server, raw):
    resp = post(server, CHAT, content=raw, headers={"content-type": "application/json"})
    assert_error(resp, 400)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": MODEL}, "messages"),
        ({"model": MODEL, "messages": []}, "messages"),
        ({"model": MODEL, "messages": "hi"}, "messages"),
        ({"model": MODEL, "messages": [{"content": "hi"}]}, "messages.0.role"),
        ({"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            "messages.0.content.0.image_url.url",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "input_audio", "data": "x"}]}]},
            "messages.0.content",
        ),
        ({"messages": OK_MESSAGES, "temperature": "hot"}, "temperature"),
        ({"messages": OK_MESSAGES, "temperature": 5}, "temperature"),
        ({"messages": OK_MESSAGES, "temperature": -1}, "temperature"),
        ({"messages": OK_MESSAGES, "top_p": 0}, "top_p"),
        ({"messages": OK_MESSAGES, "max_tokens": 0}, "max_tokens"),
        ({"messages": OK_MESSAGES, "max_tokens": "10"}, "max_tokens"),
        ({"messages": OK_MESSAGES, "max_completion_tokens": -3}, "max_completion_tokens"),
        ({"messages": OK_MESSAGES, "n": 9}, "n"),
        ({"messages": OK_MESSAGES, "stream": "yes"}, "stream"),
        ({"messages": OK_MESSAGES, "stop": 7}, "stop"),
        ({"messages": OK_MESSAGES, "stop": ["a"] * 17}, "stop"),
        ({"messages": OK_MESSAGES, "seed": 1.5}, "seed"),
        ({"messages": OK_MESSAGES, "stream_options": {"include_usage": "x"}}, None),
        ({"model": 3, "messages": OK_MESSAGES}, "model"),
    ],
)
def test_invalid_chat_parameters_are_400(server, body, param):
    error = assert_error(post(server, CHAT, json=body), 400, param)
    assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": MODEL}, "prompt"),
        ({"prompt": 5}, "prompt"),
        ({"prompt": ["a", "b"], "stream": True}, "prompt"),
        ({"prompt": "hi", "echo": True, "stream": True}, "echo"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ],
)
def test_invalid_completion_parameters_are_400(server, body, param):
    assert_error(post(server, "/v1/completions", json=body), 400, param)


def test_unknown_path_and_wrong_method(server):
    assert_error(httpx.get(server.base_url + "/v1/nothing-here"), 404)
    assert_error(httpx.get(server.base_url + CHAT), 405)


def test_context_overflow_is_400(server):
    long_prompt = "word " * 9000  # more tokens than the model's 8192-token context
    error = assert_error(post(server, "/v1/completions", json={"prompt": long_prompt}), 400)
    assert error["code"] == "context_length_exceeded"
    # Claude Code's own pattern for this error, on which it compacts the conversation.
    found = re.search(r"prompt is too long[^0-9]*(\d+)\s*tokens?\s*>\s*(\d+)", error["message"])
    assert found and int(found[1]) > 8191 and int(found[2]) == 8191, error["message"]
    body = {"model": "x", "max_tokens": 5, "messages": [{"role": "user", "content": long_prompt}]}
    reply = post(server, "/v1/messages", json=body)
    assert reply.status_code == 400
    assert reply.json()["error"]["type"] == "invalid_request_error"
    assert re.search(r"prompt is too long[^0-9]*\d+\s*tokens?\s*>\s*8191", reply.text)


def test_oversize_body_is_413(start_server):
    srv = start_server("--max-body-bytes", "2000")
    big = {"messages": [{"role": "user", "content": "x" * 5000}]}
    error = assert_error(post(srv, CHAT, json=big), 413)
    assert error["code"] == "request_too_large"
    # Without a Content-Length header the limit is enforced while reading the stream.
    chunks = (b"x" * 1000 for _ in range(5))
    assert_error(post(srv, CHAT, content=chunks, headers={"content-type": "application/json"}), 413)
    assert post(srv, CHAT, json={"messages": OK_MESSAGES, "max_tokens": 1}).status_code == 200


def test_api_key_required_when_configured(start_server):
    srv = start_server("--api-key", "sekrit")
    body = {"messages": OK_MESSAGES, "max_tokens": 1}
    assert_error(post(srv, CHAT, json=body), 401)
    assert_error(post(srv, CHAT, json=body, headers={"Authorization": "Bearer wrong"}), 401)
    assert_error(httpx.get(srv.base_url + "/v1/models"), 401)
    ok = post(srv, CHAT, json=body, headers={"Authorization": "Bearer sekrit"})
    assert ok.status_code == 200
    assert httpx.get(srv.base_url + "/health").status_code == 200  # probes need no key
    assert httpx.head(srv.base_url + "/").status_code == 200  # Claude Code's first probe
    bad = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    good = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="sekrit", max_retries=0)
    assert good.models.list().data[0].id == MODEL


def test_api_key_from_environment(start_server):
    srv = start_server(env={"MLX_KVSERVE_API_KEY": "from-env"})
    assert_error(httpx.get(srv.base_url + "/v1/models"), 401)
    auth = {"Authorization": "Bearer from-env"}
    assert httpx.get(srv.base_url + "/v1/models", headers=auth).status_code == 200


def test_truncated_request_does_not_hang_server(server):
    """A client that promises a body and vanishes must not wedge the server."""
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b'Content-Type: application/json\r\nContent-Length: 500\r\n\r\n{"messages"'
        )
    resp = post(server, CHAT, json={"messages": OK_MESSAGES, "max_tokens": 1})
    assert resp.status_code == 200
