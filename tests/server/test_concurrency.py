"""Several clients at once against the real server: continuous batching end to end.

Greedy answers must not depend on whether a request decoded alone or in a batch (cache on and
off), `cached_tokens` stays exact, a client that leaves mid-stream leaves the others' answers
intact. Admission by KV memory is tests/server/test_memory_admission.py.
Which requests shared passes is read from the engine's one log line per request (`batch=N`).
"""

from __future__ import annotations

import re
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

PROMPTS = ["1, 2, 3, 4, 5, 6,", "10, 20, 30, 40,", "a, b, c, d, e,"]
KV_BYTES_PER_TOKEN = 46080  # KV bytes per token of the default model on the CPU (float32)


def complete(srv, prompt: str, max_tokens: int = 24) -> str:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    resp = httpx.post(srv.base_url + "/v1/completions", json=body, timeout=300)
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]["text"]


def request_lines(srv, after: int = 0) -> list[dict[str, str]]:
    lines = [ln for ln in srv.log().splitlines() if " completion_tokens=" in ln][after:]
    return [dict(re.findall(r"(\w+)=(\S+)", ln)) for ln in lines]


def together(fn, args: list) -> list:
    with ThreadPoolExecutor(len(args)) as pool:
        return list(pool.map(fn, args))


@pytest.mark.parametrize("which", ["server", "nocache_server"], ids=["cache", "no-cache"])
def test_batched_greedy_equals_solo(which, request):
    srv = request.getfixturevalue(which)
    solo = [complete(srv, p) for p in PROMPTS]
    mark = len(request_lines(srv))
    batched = together(lambda p: complete(srv, p), PROMPTS)
    assert batched == solo
    lines = request_lines(srv, mark)
    assert len(lines) == 3
    assert max(int(line["batch"]) for line in lines) >= 2, lines  # they shared passes
    for line in lines:
        prompt, cached = int(line["prompt_tokens"]), int(line["cached_tokens"])
        # Seen whole in the solo round: all but the last prompt token is reused (and nothing
        # when the cache is off), whichever way the request was served.
        assert cached == (prompt - 1 if which == "server" else 0), line


def test_a_client_leaving_mid_stream_leaves_the_others_intact(server):
    solo = [complete(server, p, 32) for p in PROMPTS]
    mark = len(request_lines(server))
    started = threading.Barrier(3)

    def leaver() -> None:
        body = {"prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", server.base_url + "/v1/completions", json=body, timeout=300) as r:
            chunks = 0
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                chunks += 1
                if chunks == 1:
                    started.wait(60)
                if chunks >= 4:
                    break  # disconnects while the others decode beside it

    def stayer(prompt: str) -> str:
        started.wait(60)
        return complete(server, prompt, 32)

    before = server.log().count("finish=cancelled")
    thread = threading.Thread(target=leaver)
    thread.start()
    answers = together(stayer, PROMPTS[:2])
    thread.join(120)
    server.wait_for_log("finish=cancelled", after=before)
    assert answers == solo[:2]
    lines = request_lines(server, mark)
    cancelled = [ln for ln in lines if ln["finish"] == "cancelled"]
    assert cancelled and int(cancelled[0]["completion_tokens"]) < 400, lines
    assert max(int(ln["batch"]) for ln in lines) >= 2, lines
