"""Engine lifecycle: client disconnects, a full queue, keep-alives, graceful shutdown."""

from __future__ import annotations

import re
import signal
import threading
import time

import httpx

# ignore_eos: every answer runs to its max_tokens ("length"), and a long one is still running
# when its client leaves
COUNTING = {"prompt": "1, 2, 3, 4, 5, 6, 7, 8, 9, 10,", "temperature": 0, "ignore_eos": True}


def _log_lines(server, kind: str) -> list[dict[str, str]]:
    lines = [ln for ln in server.log().splitlines() if f"{kind} id=" in ln]
    return [dict(re.findall(r"(\w+)=(\S+)", ln)) for ln in lines]


def test_disconnect_mid_stream_stops_generation(server):
    body = {**COUNTING, "max_tokens": 4000, "stream": True}
    with httpx.stream("POST", server.base_url + "/v1/completions", json=body, timeout=60) as resp:
        assert resp.status_code == 200
        received = 0
        for line in resp.iter_lines():
            if line.startswith("data: "):
                received += 1
            if received >= 5:
                break  # leaving the block closes the connection mid-stream
    server.wait_for_log("finish=cancelled")
    cancelled = [e for e in _log_lines(server, "text") if e["finish"] == "cancelled"]
    assert cancelled, server.log()
    assert int(cancelled[-1]["completion_tokens"]) < 4000
    follow = httpx.post(
        server.base_url + "/v1/completions", json={**COUNTING, "max_tokens": 4}, timeout=60
    )
    assert follow.status_code == 200
    assert follow.json()["choices"][0]["finish_reason"] == "length"


def _queued(srv) -> int:
    return httpx.get(srv.base_url + "/health", timeout=10).json().get("queued", 0)


def test_full_queue_answers_503_with_retry_after(start_server):
    """No race: the holder keeps reading its stream (the engine stays busy) until released."""
    srv = start_server("--max-queue", "1", "--max-concurrency", "1")
    long_body = {**COUNTING, "max_tokens": 4000, "stream": True}
    started, release = threading.Event(), threading.Event()

    def hold_engine() -> None:
        with httpx.stream(
            "POST", srv.base_url + "/v1/completions", json=long_body, timeout=120
        ) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    started.set()
                if release.is_set():
                    break  # leaving the block disconnects: cancelled within one decode step

    holder = threading.Thread(target=hold_engine)
    holder.start()
    try:
        assert started.wait(60), srv.log()
        with httpx.Client(base_url=srv.base_url, timeout=60) as client:
            waiting = client.send(
                client.build_request("POST", "/v1/completions", json=long_body), stream=True
            )
            deadline = time.monotonic() + 30
            while _queued(srv) < 1:  # the one queue slot is taken
                assert time.monotonic() < deadline, srv.log()
                time.sleep(0.05)
            resp = client.post("/v1/completions", json={**COUNTING, "max_tokens": 2}, timeout=20)
            assert resp.status_code == 503, (resp.status_code, resp.text)
            assert resp.headers["Retry-After"].isdigit()
            assert resp.json()["error"]["code"] == "server_unavailable"
            waiting.close()  # a queued client that leaves gives up its slot at once
    finally:
        release.set()
        holder.join(60)
    assert not holder.is_alive()
    # Both streams are gone: the server answers normally again, without either having run its
    # 4000 tokens (a client honouring Retry-After gets through). Counted in the engine's one
    # log line per request, not timed.
    ok = httpx.post(
        srv.base_url + "/v1/completions", json={**COUNTING, "max_tokens": 2}, timeout=120
    )
    assert ok.status_code == 200, ok.text
    lines = [line for line in srv.log().splitlines() if " completion_tokens=" in line]
    assert len(lines) == 3, lines  # one per request, the queued stream's too

    def tokens(line: str) -> int:
        return int(line.split(" completion_tokens=")[1].split()[0])

    queued, holder = sorted(lines[:2], key=tokens)
    # the queued stream never ran; the holder was cancelled well before its 4000 tokens
    assert "finish=cancelled" in queued and tokens(queued) == 0, queued
    assert "finish=cancelled" in holder and tokens(holder) < 4000, holder
    assert "finish=length" in lines[2] and tokens(lines[2]) == 2, lines[2]


def test_keepalive_comments_during_prefill(start_server):
    srv = start_server("--keepalive-seconds", "0.01", "--prefill-step", "32")
    prompt = "The quick brown fox jumps over the lazy dog. " * 60
    body = {"prompt": prompt, "max_tokens": 2, "stream": True}
    with httpx.stream("POST", srv.base_url + "/v1/completions", json=body, timeout=120) as resp:
        text = resp.read().decode()
    assert ": keep-alive" in text
    assert text.rstrip().endswith("data: [DONE]")


def test_sigterm_with_stream_in_flight_exits_cleanly(start_server):
    srv = start_server("--shutdown-grace", "2")
    body = {**COUNTING, "max_tokens": 4000, "stream": True}
    got_data = threading.Event()
    outcome: dict[str, object] = {}

    def stream() -> None:
        try:
            with httpx.stream("POST", srv.base_url + "/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        got_data.set()
                        outcome["last"] = line
        except httpx.HTTPError as exc:
            outcome["error"] = type(exc).__name__

    reader = threading.Thread(target=stream)
    reader.start()
    assert got_data.wait(60)
    assert srv.stop(signal.SIGTERM) == 0
    reader.join(30)
    assert not reader.is_alive()
    assert "shutting down" in srv.log()
    assert "Traceback" not in srv.log()


def test_sigint_idle_exits_zero(start_server):
    srv = start_server()
    assert srv.stop(signal.SIGINT) == 0
    assert "Traceback" not in srv.log()
