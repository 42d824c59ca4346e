"""Bodies that used to answer 500 (or a 200 stream carrying an error): each is now a 400 that
names the parameter, and an internal error answers once without dropping the connection."""

from __future__ import annotations

import json
import socket

import httpx
import pytest

from tests.support.rawhttp import read_response

CHAT = "/v1/chat/completions"
TEXT = "/v1/completions"
HI = [{"role": "user", "content": "Hi"}]


def post_raw(server, path: str, raw: str | bytes) -> httpx.Response:
    data = raw.encode() if isinstance(raw, str) else raw
    headers = {"content-type": "application/json"}
    return httpx.post(server.base_url + path, content=data, headers=headers, timeout=60)


def assert_400(resp: httpx.Response, param: str | None) -> dict:
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param, error
    return error


# Lone surrogates arrive as JSON escapes; written here exactly as a client sends them.
SURROGATES = [
    (CHAT, r'{"model": "\udfff", "messages": [{"role": "user", "content": "Hi"}]}', "model"),
    (TEXT, r'{"model": "a\ud800", "prompt": "Hi"}', "model"),
    (TEXT, r'{"prompt": "a\ud800b", "max_tokens": 1}', "prompt"),
    (TEXT, r'{"prompt": ["a\udc00"], "max_tokens": 1}', "prompt.0"),
    (CHAT, r'{"messages": [{"role": "user", "content": "\ud800"}]}', "messages.0.content"),
    (
        CHAT,
        r'{"messages": [{"role": "user", "content": [{"type": "text", "text": "x\udbff"}]}]}',
        "messages.0.content.0.text",
    ),
    (CHAT, r'{"messages": [{"role": "user", "content": "Hi"}], "stop": ["\udfff"]}', "stop.0"),
    (CHAT, r'{"messages": [{"role": "user", "content": "Hi"}], "user": "\ud800"}', "user"),
    (TEXT, r'{"prompt": "Hi", "\ud800": 1}', "\\ud800"),
]


@pytest.mark.parametrize(("path", "raw", "param"), SURROGATES)
def test_lone_surrogates_are_400(server, path, raw, param):
    error = assert_400(post_raw(server, path, raw), param)
    assert "surrogate" in error["message"]


def test_paired_surrogates_are_fine(server):
    raw = r'{"prompt": "smile \ud83d\ude00", "max_tokens": 1}'
    assert post_raw(server, TEXT, raw).status_code == 200


def _nested(depth: int, opener: str = "[") -> str:
    closer = "]" if opener == "[" else "}"
    return opener * depth + "1" + closer * depth


@pytest.mark.parametrize("depth", [65, 1000, 100_000])
@pytest.mark.parametrize("opener", ["[", '{"a":'])
def test_deep_nesting_is_400(server, depth, opener):
    raw = '{"prompt": "Hi", "max_tokens": 1, "tools": ' + _nested(depth, opener) + "}"
    error = assert_400(post_raw(server, TEXT, raw), "tools")
    assert error["code"] == "invalid_json"


def test_moderate_nesting_is_accepted(server):
    raw = '{"prompt": "Hi", "max_tokens": 1, "metadata": ' + _nested(40, '{"a":') + "}"
    assert post_raw(server, TEXT, raw).status_code == 200


@pytest.mark.parametrize("seed", [-1, -(2**63), 2**64, 2**64 + 5, 10**30])
@pytest.mark.parametrize("stream", [False, True])
def test_seed_out_of_range_is_400(server, seed, stream):
    body = {"messages": HI, "max_tokens": 1, "seed": seed, "stream": stream}
    assert_400(post_raw(server, CHAT, json.dumps(body)), "seed")


@pytest.mark.parametrize("seed", [0, 2**63, 2**64 - 1])
def test_seed_edges_work_streaming_too(server, seed):
    body = {"messages": HI, "max_tokens": 2, "seed": seed, "temperature": 1.0, "stream": True}
    with httpx.stream("POST", server.base_url + CHAT, json=body, timeout=60) as resp:
        assert resp.status_code == 200
        text = resp.read().decode()
    assert '"error"' not in text
    assert text.rstrip().endswith("data: [DONE]")


@pytest.mark.parametrize(
    "raw",
    [
        '{"prompt": "Hi", "max_tokens": NaN}',
        '{"prompt": "Hi", "temperature": Infinity}',
        '{"prompt": "Hi", "max_tokens": -Infinity}',
        '{"prompt": "Hi", "max_tokens": ' + "9" * 5000 + "}",
    ],
)
def test_non_json_numbers_are_400(server, raw):
    error = assert_400(post_raw(server, TEXT, raw), None)
    assert error["code"] == "invalid_json"


def _send(sock: socket.socket, port: int, body: bytes) -> None:
    sock.sendall(
        f"POST {TEXT} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )


def test_internal_error_answers_once_and_keeps_the_connection(start_server):
    srv = start_server(env={"MLX_KVSERVE_FAULTS": "read_body:1"})
    body = b'{"prompt": "Hi", "max_tokens": 1}'
    with socket.create_connection(("127.0.0.1", srv.port), timeout=60) as sock:
        _send(sock, srv.port, body)
        first = read_response(sock)
        assert first is not None and first.status == 500
        assert first.json()["error"]["code"] == "internal_error"
        assert first.headers.get("connection") != "close"
        _send(sock, srv.port, body)  # the same connection serves the next request
        second = read_response(sock)
        assert second is not None and second.status == 200, second
    log = srv.log()
    assert log.count("Traceback") == 1, log  # logged once, by us; uvicorn saw nothing
    assert "Exception in ASGI application" not in log
