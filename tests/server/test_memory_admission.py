"""Admission by what requests hold, against the real server with a tiny --kv-budget.

Requests without max_tokens are charged their prompt and a growth reserve, not the whole
context: they all run, the youngest pauses when the budget runs out mid-decode and resumes
from its checkpoint, and every greedy answer equals the answer it gets alone. A prompt that
cannot fit even alone is a 400 in each protocol's shape. /health, /v1/cache and /metrics show
the accounted parts and the pauses.
"""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

# the default model on the CPU (float32), as tests/server/test_concurrency.py
KV_BYTES_PER_TOKEN = 46080
# Answers the default model ends by itself (24, 42 and 87 tokens): short, but the three grow
# past the budget (room for the longest alone) within about 14 tokens, so one pauses mid-decode.
QUESTIONS = ["Name five fruits.", "List the four seasons.", "What is a cat?"]
SHORT_CHAT_PROMPT = "<|im_start|>user\nName five fruits.<|im_end|>\n<|im_start|>assistant\n"


def chat(srv, question: str) -> tuple[str, dict]:
    body = {"messages": [{"role": "user", "content": question}], "temperature": 0}
    resp = httpx.post(srv.base_url + "/v1/chat/completions", json=body, timeout=600)
    assert resp.status_code == 200, resp.text
    data = resp.json()
    return data["choices"][0]["message"]["content"], data["usage"]


def metric(srv, name: str) -> float:
    text = httpx.get(srv.base_url + "/metrics", timeout=30).text
    found = re.search(rf"^{name} (\S+)$", text, re.M)
    assert found, name
    return float(found.group(1))


@pytest.mark.slow
def test_requests_without_max_tokens_all_complete_pausing_the_youngest(server, start_server):
    solo = [chat(server, q) for q in QUESTIONS]
    longest = max(u["prompt_tokens"] + u["completion_tokens"] for _, u in solo)
    assert all(u["completion_tokens"] >= 20 for _, u in solo), solo  # long enough to grow
    # Room for the longest alone (and a bit), not for three at once as they grow.
    budget = (longest + 24) * KV_BYTES_PER_TOKEN
    srv = start_server("--kv-budget", str(budget), "--kv-reserve", "8")
    with ThreadPoolExecutor(len(QUESTIONS)) as pool:
        together = list(pool.map(lambda q: chat(srv, q), QUESTIONS))
    assert [text for text, _ in together] == [text for text, _ in solo]
    assert [u["completion_tokens"] for _, u in together] == [
        u["completion_tokens"] for _, u in solo
    ]
    log = srv.log()
    assert "paused at" in log, log[-3000:]
    assert metric(srv, "mlx_kvserve_request_pauses_total") >= 1
    assert metric(srv, "mlx_kvserve_request_resumes_total") >= 1
    assert metric(srv, "mlx_kvserve_paused_requests") == 0
    assert "finish=length" not in log  # none ran out: they took turns
    health = httpx.get(srv.base_url + "/health", timeout=30).json()
    assert health["paused"] == 0 and health["kv_memory"]["budget_bytes"] == budget
    assert health["kv_memory"]["requests_bytes"] == 0  # all done: nothing held


def test_a_prompt_that_cannot_fit_alone_is_a_400_and_the_parts_are_shown(start_server):
    srv = start_server("--kv-budget", str(60 * KV_BYTES_PER_TOKEN))
    long_prompt = " ".join(str(i) for i in range(200))
    resp = httpx.post(srv.base_url + "/v1/completions", json={"prompt": long_prompt}, timeout=60)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == "prompt" and error["code"] == "kv_budget_exceeded"
    assert "prompt is too long" in error["message"] and "--kv-budget" in error["message"]
    anthropic = {
        "model": "x",
        "max_tokens": 10,
        "messages": [{"role": "user", "content": long_prompt}],
    }
    resp = httpx.post(srv.base_url + "/v1/messages", json=anthropic, timeout=60)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["type"] == "invalid_request_error"
    assert "prompt is too long" in resp.json()["error"]["message"]
    # A short prompt without max_tokens runs (the old rule charged it the whole context). In
    # the chat markup, so the model ends its answer by itself within a few dozen tokens.
    resp = httpx.post(
        srv.base_url + "/v1/completions",
        json={"prompt": SHORT_CHAT_PROMPT, "temperature": 0},
        timeout=300,
    )
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["finish_reason"] == "stop", resp.text
    kv = httpx.get(srv.base_url + "/v1/cache", timeout=60).json()["memory"]["kv"]
    for part in ("requests", "padding", "resident_sessions", "ram_tier", "pending_writes"):
        assert kv[f"{part}_bytes"] >= 0, kv
    assert kv["budget_bytes"] == 60 * KV_BYTES_PER_TOKEN
    assert kv["requests_bytes"] == 0 and kv["running"] == 0, kv  # nothing runs now
    parts = ("requests", "resident_sessions", "ram_tier", "pending_writes")
    assert kv["total_bytes"] == sum(kv[f"{p}_bytes"] for p in parts), kv
    # the finished request's live KV stays resident for its next turn (dropped when room is
    # needed), and it is counted: what it really holds (allocated in steps of 256 positions)
    assert kv["resident_sessions_bytes"] >= 10 * KV_BYTES_PER_TOKEN, kv
