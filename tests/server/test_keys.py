"""API keys: several keys, either header, any-case scheme; per-key cache isolation."""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest

from mlx_kvserve.engine.namespaces import namespace_of
from tests.support.servers import ServerProcess

SYSTEM = "You are a careful assistant. " * 12  # long enough for a checkpoint worth reusing


def chat(server, key: str, question: str, header: str = "authorization") -> dict:
    value = f"Bearer {key}" if header == "authorization" else key
    reply = httpx.post(
        server.base_url + "/v1/chat/completions",
        json={
            "messages": [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": question},
            ],
            "max_tokens": 2,
            "temperature": 0,
        },
        headers={header: value},
        timeout=120,
    )
    assert reply.status_code == 200, reply.text
    return reply.json()


def cached(reply: dict) -> int:
    return reply["usage"]["prompt_tokens_details"]["cached_tokens"]


@pytest.fixture(scope="module")
def isolated(tmp_path_factory):
    work = tmp_path_factory.mktemp("keys")
    proc = ServerProcess(
        work, "--api-key", "alice-key", "--api-keys", "bob-key,carol-key", "--isolate-cache"
    ).wait_ready()
    yield proc
    proc.stop()


@pytest.mark.parametrize(
    ("headers", "status"),
    [
        ({"Authorization": "Bearer alice-key"}, 200),
        ({"Authorization": "bearer bob-key"}, 200),
        ({"Authorization": "BEARER   carol-key"}, 200),
        ({"x-api-key": "carol-key"}, 200),
        ({"Authorization": "Basic alice-key"}, 401),
        ({"Authorization": "Bearer alice-key2"}, 401),
        ({"Authorization": "Bearer"}, 401),
        ({}, 401),
    ],
)
def test_key_forms(isolated, headers, status):
    reply = httpx.get(isolated.base_url + "/v1/models", headers=headers)
    assert reply.status_code == status
    if status == 401:
        assert reply.json()["error"]["code"] == "invalid_api_key"


def test_each_key_sees_only_its_own_cache(isolated):
    first = chat(isolated, "alice-key", "What is two plus two?")
    again = chat(isolated, "alice-key", "What is three plus three?")
    assert cached(again) > 0  # alice reuses her own system prompt
    # bob sends alice's exact prompt: nothing of it may count as cached for him
    assert cached(chat(isolated, "bob-key", "What is two plus two?")) == 0
    assert cached(chat(isolated, "bob-key", "What is two plus two?", "x-api-key")) > 0
    assert cached(chat(isolated, "alice-key", "What is four plus four?")) > 0  # still hers
    assert first["choices"][0]["message"]["content"] is not None

    def entries(key: str) -> list[dict]:
        headers = {"Authorization": f"Bearer {key}"}
        body = httpx.get(isolated.base_url + "/v1/cache", headers=headers, timeout=30).json()
        return body["entries_list"]

    alice, bob, carol = entries("alice-key"), entries("bob-key"), entries("carol-key")
    assert alice and bob and carol == []
    root = Path(isolated.env["MLX_KVSERVE_CACHE_DIR"])
    names = sorted(os.listdir(root / "keys"))
    assert names == sorted(namespace_of(k) for k in ("alice-key", "bob-key", "carol-key"))
    assert not any("key" in name for name in names)  # directory names do not reveal keys
    # Each key's checkpoints are files in its own directory; none are shared at the top.
    assert list(root.glob("*/*.kvc")) == []
    for key, listed in (("alice-key", alice), ("bob-key", bob)):
        files = list((root / "keys" / namespace_of(key)).glob("*/*.kvc"))
        assert files and listed
