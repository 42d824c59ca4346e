"""Clients that leave: a non-streaming request stops at the next decode step, and requests whose
clients left while queued give their place back at once (and still get their log line)."""

from __future__ import annotations

import json
import re
import socket
import threading
import time

import httpx

# ignore_eos: every answer runs to its max_tokens ("length"), and a long one is still running
# when its client leaves
COUNTING = {"prompt": "1, 2, 3, 4, 5, 6, 7, 8, 9, 10,", "temperature": 0, "ignore_eos": True}


def engine_lines(server) -> list[dict[str, str]]:
    lines = [ln for ln in server.log().splitlines() if "text id=" in ln]
    return [dict(re.findall(r"(\w+)=(\S+)", ln)) for ln in lines]


def open_request(server, body: dict) -> socket.socket:
    """Send a POST and leave it waiting for its answer; closing the socket is the disconnect."""
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=60)
    sock.sendall(
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n".encode()
        + data
    )
    return sock


def queued(server) -> int:
    return httpx.get(server.base_url + "/health", timeout=30).json()["queued"]


def poll(predicate, guard: float = 60.0) -> bool:
    deadline = time.monotonic() + guard  # a guard against hanging, not a timing assertion
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def test_non_streaming_disconnect_cancels_generation(server):
    before = engine_lines(server)
    max_tokens = 2000  # minutes of decoding if the disconnect went unnoticed
    sock = open_request(server, {**COUNTING, "max_tokens": max_tokens})
    time.sleep(2)  # let it reach the decode loop (tokens flow every few tens of ms)
    sock.close()
    follow = httpx.post(
        server.base_url + "/v1/completions", json={**COUNTING, "max_tokens": 1}, timeout=120
    )
    assert follow.status_code == 200
    server.wait_for_log("text id=", after=len(before) + 1)  # logged just after answering
    new = engine_lines(server)[len(before) :]
    assert [e["finish"] for e in new] == ["cancelled", "length"], new  # one cancel, then ours
    assert 0 < int(new[0]["completion_tokens"]) < max_tokens


def test_queued_clients_that_leave_free_their_slots(start_server):
    srv = start_server("--max-queue", "4", "--max-concurrency", "1")  # the others must queue
    holding = threading.Event()
    release = threading.Event()

    def hold_engine() -> None:
        body = {**COUNTING, "max_tokens": 4000, "stream": True}
        with httpx.stream("POST", srv.base_url + "/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    holding.set()
                if release.is_set():
                    return

    holder = threading.Thread(target=hold_engine)
    holder.start()
    try:
        assert holding.wait(60)
        waiting = [
            open_request(srv, {**COUNTING, "max_tokens": 1, "stream": s}) for s in (True, False)
        ]
        waiting += [
            open_request(srv, {**COUNTING, "max_tokens": 1, "stream": s}) for s in (True, False)
        ]
        assert poll(lambda: queued(srv) == 4)
        full = httpx.post(srv.base_url + "/v1/completions", json=COUNTING, timeout=30)
        assert full.status_code == 503  # the queue really is full
        for sock in waiting:
            sock.close()
        assert poll(lambda: queued(srv) == 0)  # freed while the engine is still busy
        assert holder.is_alive()
        results: list[int] = []

        def post() -> None:
            body = {**COUNTING, "max_tokens": 1}
            results.append(
                httpx.post(srv.base_url + "/v1/completions", json=body, timeout=120).status_code
            )

        newcomers = [threading.Thread(target=post) for _ in range(4)]
        for t in newcomers:
            t.start()
        assert poll(lambda: queued(srv) == 4)  # all four got a place: no 503 for anyone
    finally:
        release.set()
        holder.join(120)
    for t in newcomers:
        t.join(120)
    assert results == [200] * 4
    srv.wait_for_log("text id=", after=8)  # logged just after answering
    lines = engine_lines(srv)
    ends = [(e["finish"], e["completion_tokens"] == "0") for e in lines]
    # Every request gets its one line: the four that left while queued never ran (no tokens),
    # then the holder (cancelled when it left), then the four newcomers.
    unstarted, holder, newcomer = ("cancelled", True), ("cancelled", False), ("length", False)
    assert ends == [unstarted] * 4 + [holder] + [newcomer] * 4, lines


def scored_prompts(server) -> dict[str, float]:
    text = httpx.get(server.base_url + "/metrics", timeout=30).text
    found = re.findall(r'mlx_kvserve_scored_prompts_total\{outcome="(\w+)"\} ([0-9.e+]+)', text)
    return {outcome: float(value) for outcome, value in found}


def test_a_scoring_client_that_leaves_drops_its_prompts(server):
    """64 prompts of 600 tokens to score (echo with logprobs, as lm-eval asks), and the client
    hangs up: the prompts not yet scored are dropped (counted), and the server serves on."""
    before = scored_prompts(server)
    rows = [[(7 * i + j) % 5000 + 10 for j in range(600)] for i in range(64)]
    sock = open_request(server, {"prompt": rows, "echo": True, "logprobs": 1, "max_tokens": 0})
    time.sleep(1.0)  # the server reads the body and starts (no assertion rests on it)
    sock.close()

    def moved() -> float:
        now = scored_prompts(server)
        return sum(now.values()) - sum(before.values())

    assert poll(lambda: moved() >= len(rows), guard=300)
    now = scored_prompts(server)
    assert now.get("dropped", 0) - before.get("dropped", 0) > 0

    def serves() -> bool:  # a 503 (the model reloading after memory pressure) is retried
        follow = httpx.post(
            server.base_url + "/v1/completions",
            json={"prompt": "Hi there", "echo": True, "logprobs": 1, "max_tokens": 0},
            timeout=120,
        )
        assert follow.status_code in (200, 503), follow.text
        return follow.status_code == 200 and follow.json()["choices"][0]["logprobs"] is not None

    assert poll(serves, guard=120)
