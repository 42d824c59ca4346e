"""The recorded request shapes of the real Claude Code and Codex CLIs, replayed without npm.

tests/clients/test_agent_clis.py records them (MLX_KVSERVE_RECORD_CLI_SHAPES=1) from real runs, with
every vendor text replaced by filler of the same length (tests/support/cli_shapes.py). Each is
sent here as the CLI sent it (method, path and query string, protocol headers, body) to a server
on a long-context tiny model: each must be a 2xx whose stream is complete, and a later session
must read its shared prompt from the cache, so a protocol regression shows in the fast tests.
"""

from __future__ import annotations

import json

import httpx
import pytest

from tests.support.cli_shapes import load_fixture

SHAPES = {name: load_fixture(name) for name in ("claude-code", "codex")}
LAST_EVENT = {"/v1/messages": "message_stop", "/v1/responses": "response.completed"}


def replay(server, shape: dict) -> httpx.Response:
    url = server.base_url + shape["path"] + ("?" + shape["query"] if shape["query"] else "")
    headers = {**shape["headers"], "x-api-key": "unused"}
    return httpx.request(
        shape["method"], url, content=json.dumps(shape["body"]), headers=headers, timeout=600
    )


def events(reply: httpx.Response) -> list[dict]:
    return [json.loads(line[6:]) for line in reply.text.splitlines() if line.startswith("data: {")]


def prompt_and_cached(path: str, stream: list[dict]) -> tuple[int, int]:
    if path == "/v1/messages":
        usage = stream[0]["message"]["usage"]
        return usage["input_tokens"] + usage["cache_read_input_tokens"], usage[
            "cache_read_input_tokens"
        ]
    usage = stream[-1]["response"]["usage"]
    return usage["input_tokens"], usage["input_tokens_details"]["cached_tokens"]


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_recorded_session_is_served_and_cached(agent_server, name):
    """Replayed in order, every request is a 2xx with a complete stream, and every request after
    the first reads most of its prompt from the cache (the shared system prompt and tools; a
    continued session's history)."""
    for i, shape in enumerate(SHAPES[name]):
        reply = replay(agent_server, shape)
        assert 200 <= reply.status_code < 300, (i, reply.text[:500])
        if not shape["body"].get("stream"):
            continue
        stream = events(reply)
        assert stream and stream[-1]["type"] == LAST_EVENT[shape["path"]], (i, stream[-3:])
        prompt, cached = prompt_and_cached(shape["path"], stream)
        if i:
            assert cached >= 0.8 * prompt, (name, i, prompt, cached)
