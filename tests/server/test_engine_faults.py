"""A fault in the engine's work, in a real server: the stream it cut ends cleanly in the
protocol's shape, /health says the engine is alive, and the next request is served.

The in-process matrix of every engine point and disk step under every kind of fault is
tests/unit/test_fault_matrix.py; this checks what a client sees of one of them (a decode step
that fails mid-answer) through the real HTTP stack. An engine that cannot go on (/health 503
with the cause, requests refused in both protocols) is tests/unit/test_engine_failures.py's.
"""

from __future__ import annotations

import json

import httpx

MODEL = "SmolLM2-135M-Instruct"
TIMEOUT = 120
COUNT = [{"role": "user", "content": "Count from 1 to 50, separated by spaces."}]


def sse_payloads(resp: httpx.Response) -> list[str]:
    return [line[len("data: ") :] for line in resp.iter_lines() if line.startswith("data: ")]


def test_a_decode_step_that_fails_ends_the_stream_cleanly_and_the_next_is_served(start_server):
    server = start_server(env={"MLX_KVSERVE_FAULTS": "decode@3"})  # the third decode step
    body = {"model": MODEL, "messages": COUNT, "max_tokens": 16, "temperature": 0, "stream": True}
    with httpx.stream(
        "POST", server.base_url + "/v1/chat/completions", json=body, timeout=TIMEOUT
    ) as resp:
        assert resp.status_code == 200  # the stream had started
        payloads = sse_payloads(resp)
    assert payloads[-1] == "[DONE]", payloads[-3:]
    error = json.loads(payloads[-2])
    assert set(error) == {"error"}, error
    assert set(error["error"]) == {"message", "type", "param", "code"}
    assert error["error"]["type"] == "server_error"
    assert "internal error while generating" in error["error"]["message"]
    chunks = [json.loads(p) for p in payloads[:-2]]
    assert any(c["choices"] and c["choices"][0]["delta"].get("content") for c in chunks)
    assert all(c["choices"][0].get("finish_reason") is None for c in chunks if c["choices"])

    health = httpx.get(server.base_url + "/health", timeout=TIMEOUT)
    assert health.status_code == 200 and health.json()["status"] == "ok", health.json()
    assert health.json()["running"] == 0 and health.json()["queued"] == 0

    # The next request is served, in the other protocol too, its stream whole.
    messages = {"model": MODEL, "max_tokens": 8, "messages": COUNT, "stream": True}
    url = server.base_url + "/v1/messages"
    with httpx.stream("POST", url, json=messages, timeout=TIMEOUT) as r:
        assert r.status_code == 200
        events = [line[len("event: ") :] for line in r.iter_lines() if line.startswith("event: ")]
    assert events[0] == "message_start" and events[-1] == "message_stop", events
    assert "error" not in events
    body["stream"] = False
    answer = httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=TIMEOUT)
    assert answer.status_code == 200 and answer.json()["choices"][0]["message"]["content"]
    assert server.log().count("injected fault at decode") >= 1
