"""Engine lifecycle: client disconnects, a full queue, keep-alives, graceful shutdown."""

from __future__ import annotations

import re
import signal
import threading
import time

import httpx

COUNTING = {"prompt": "1, 2, 3, 4, 5, 6, 7, 8, 9, 10,", "temperature": 0}


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


def test_full_queue_answers_503_with_retry_after(start_server):
    srv = start_server("--max-queue", "1")
    long_body = {**COUNTING, "max_tokens": 4000, "stream": True}
    started = threading.Event()
    results: list[int] = []

    def hold_engine() -> None:
        with httpx.stream(
            "POST", srv.base_url + "/v1/completions", json=long_body, timeout=120
        ) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    started.set()
                    break

    holder = threading.Thread(target=hold_engine)
    holder.start()
    assert started.wait(60), srv.log()
    # Engine busy with the holder's stream until its disconnect is noticed; fill the queue.
    statuses = []
    with httpx.Client(base_url=srv.base_url, timeout=60) as client:
        waiting = client.build_request("POST", "/v1/completions", json=long_body)
        first = client.send(waiting, stream=True)
        statuses.append(first.status_code)
        for _ in range(3):
            resp = client.post("/v1/completions", json={**COUNTING, "max_tokens": 2})
            statuses.append(resp.status_code)
            if resp.status_code == 503:
                assert resp.headers["Retry-After"].isdigit()
                assert resp.json()["error"]["code"] == "server_unavailable"
        first.close()
    holder.join(60)
    results.extend(statuses)
    assert 503 in results, (results, srv.log())
    # Once the cancelled streams drain, the server answers normally again (a client honouring
    # Retry-After gets through).
    for _ in range(60):
        ok = httpx.post(
            srv.base_url + "/v1/completions", json={**COUNTING, "max_tokens": 2}, timeout=60
        )
        if ok.status_code != 503:
            break
        time.sleep(0.5)
    assert ok.status_code == 200


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
