"""`GET /metrics`: Prometheus text from prometheus_client, whose numbers agree with what the
server answered (usage, /v1/cache), guarded by the API key, and never a 5xx for any client."""

from __future__ import annotations

import concurrent.futures
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support import rawhttp

SYSTEM = "You are a concise assistant. Answer in one short sentence. " * 12


def scrape(base_url: str, **headers: str) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} from one scrape."""
    resp = httpx.get(base_url + "/metrics", headers=headers, timeout=30)
    assert resp.status_code == 200, resp.text
    assert resp.headers["content-type"].startswith("text/plain; version=")
    out = {}
    for family in text_string_to_metric_families(resp.text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def value(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def chat(base_url: str, messages: list[dict], **extra) -> dict:
    body = {"messages": messages, "temperature": 0, "max_tokens": 8, **extra}
    resp = httpx.post(base_url + "/v1/chat/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    return resp.json()


def wait_for_writes(base_url: str, headers: dict | None = None) -> dict:
    for _ in range(600):
        stats = httpx.get(base_url + "/v1/cache", headers=headers or {}, timeout=30).json()
        if stats["pending_writes"] == 0:
            return stats
        time.sleep(0.05)
    raise AssertionError(f"writes still pending: {stats}")


def conversation(turns: int) -> list[list[dict]]:
    """The message lists of a growing conversation, one per turn."""
    history = [{"role": "system", "content": SYSTEM}]
    out = []
    for i in range(turns):
        history = [*history, {"role": "user", "content": f"Question {i}: name a colour."}]
        out.append(history)
        history = [*history, {"role": "assistant", "content": f"Colour {i}."}]
    return out


def test_metrics_agree_with_usage_and_the_cache(start_server):
    server = start_server("--speculation", "off")  # it counts one token per step and row
    base = server.base_url
    usages = [chat(base, messages)["usage"] for messages in conversation(3)]
    anthropic = httpx.post(
        base + "/v1/messages",
        json={"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]},
        timeout=120,
    )
    assert anthropic.status_code == 200
    a_usage = anthropic.json()["usage"]
    assert httpx.get(base + "/no/such/path", timeout=10).status_code == 404
    assert httpx.get(base + "/v1/chat/completions", timeout=10).status_code == 405
    stats = wait_for_writes(base)
    m = scrape(base)

    requests = "mlx_kvserve_requests_total"
    chat_route = {"route": "/v1/chat/completions", "protocol": "openai_chat"}
    assert value(m, requests, **chat_route, status="200") == 3
    assert value(m, requests, **chat_route, status="405") == 1
    assert value(m, requests, route="/v1/messages", protocol="anthropic", status="200") == 1
    assert value(m, requests, route="unmatched", protocol="none", status="404") == 1

    prompt = sum(u["prompt_tokens"] for u in usages) + a_usage["input_tokens"]
    cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages)
    cached += a_usage["cache_read_input_tokens"]
    prompt += a_usage["cache_read_input_tokens"]  # Anthropic's input_tokens exclude cached ones
    generated = sum(u["completion_tokens"] for u in usages) + a_usage["output_tokens"]
    assert value(m, "mlx_kvserve_prompt_tokens_total") == prompt
    assert value(m, "mlx_kvserve_cached_tokens_total") == cached > 0
    assert value(m, "mlx_kvserve_generated_tokens_total") == generated
    assert value(m, "mlx_kvserve_time_to_first_token_seconds_count") == 4
    assert value(m, "mlx_kvserve_prefill_tokens_per_second_count") == 4
    assert value(m, "mlx_kvserve_decode_tokens_per_second_count") >= 1

    lookups = "mlx_kvserve_cache_lookups_total"
    hits = sum(value(m, lookups, outcome="hit", tier=t) for t in ("live", "ram", "disk"))
    misses = value(m, lookups, outcome="miss", tier="none")
    assert hits + misses == 4
    assert value(m, lookups, outcome="hit", tier="live") >= 2  # turns 2 and 3 continue turn 1
    assert misses >= 1  # the first turn

    assert value(m, "mlx_kvserve_cache_written_bytes_total") == stats["bytes_written"] > 0
    assert value(m, "mlx_kvserve_cache_disk_bytes") == stats["disk_bytes"] > 0
    assert value(m, "mlx_kvserve_cache_disk_budget_bytes") == stats["disk_budget"] > 0
    assert value(m, "mlx_kvserve_cache_entries") == stats["entries"]
    assert value(m, "mlx_kvserve_cache_evictions_total", reason="dominated") == stats["pruned"]
    for reason in ("budget", "failed", "suspect"):
        assert ("mlx_kvserve_cache_evictions_total", (("reason", reason),)) in m
    assert value(m, "mlx_kvserve_queue_depth") == 0
    assert value(m, "mlx_kvserve_running_requests") == 0
    assert value(m, "mlx_kvserve_engine_busy_seconds_total") > 0
    steps = value(m, "mlx_kvserve_decode_steps_total")
    assert 0 < steps <= generated  # one token per step for each sequence decoding
    assert 0 < value(m, "mlx_kvserve_decode_readbacks_total") <= steps
    memory = stats["memory"]  # /v1/cache and /metrics read the same MLX figures
    active = value(m, "mlx_kvserve_mlx_memory_bytes", kind="active")
    peak = value(m, "mlx_kvserve_mlx_memory_bytes", kind="peak")
    assert 0 < active <= peak and memory["mlx_peak_bytes"] <= peak
    assert ("mlx_kvserve_mlx_memory_bytes", (("kind", "cache"),)) in m
    # The scrape itself was counted by the next one.
    again = scrape(base)
    assert value(again, requests, route="/metrics", protocol="none", status="200") == 1


def test_hostile_and_concurrent_scrapes_never_fail(start_server):
    server = start_server()
    base = server.base_url
    odd_headers = [
        {"Accept": "application/openmetrics-text; version=1.0.0"},
        {"Accept": "*/*;q=" + "9" * 4000},
        {"Accept-Encoding": "gzip, deflate, br, zstd, \x7f"},
        {"X-Junk": "a" * 7000},
        {"Authorization": "Bearer not-needed-here"},
    ]
    for headers in odd_headers:
        resp = httpx.get(base + "/metrics", headers=headers, timeout=30)
        assert resp.status_code == 200, (headers, resp.status_code)
    for method in ("POST", "PUT", "DELETE"):  # 415 from the guard for a non-JSON POST
        assert httpx.request(method, base + "/metrics", timeout=10).status_code in (405, 415)
    assert httpx.get(base + "/metrics?name[]=x&%zz", timeout=10).status_code == 200
    for path in ("/metrics/", "/metrics/../metrics", "/METRICS", "//metrics"):
        status = httpx.get(base + path, timeout=10).status_code
        assert status < 500, (path, status)
    host = ("Host", f"127.0.0.1:{server.port}")
    raw_cases = [
        ([host, ("Accept", "a"), ("Accept", "b"), ("X-Bytes", "\xff\xfe")], 200),
        ([("Host", "evil.example")], 403),  # DNS rebinding guard applies to /metrics too
        ([host, ("Origin", "http://evil.example")], 403),
        ([host], 200),
    ]
    for headers, want in raw_cases:
        assert rawhttp.request(server.port, "GET", "/metrics", headers).status == want, headers
    assert rawhttp.request(server.port, "GET", "/metrics", [], version="HTTP/1.0").status < 500

    def generate(i: int) -> int:
        return chat(base, conversation(1)[0][:1] + [{"role": "user", "content": f"n{i}"}])["usage"][
            "completion_tokens"
        ]

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        jobs = [pool.submit(generate, i) for i in range(3)]
        scrapes = [pool.submit(httpx.get, base + "/metrics", timeout=60) for _ in range(40)]
        assert all(j.result() > 0 for j in jobs)
        assert all(s.result().status_code == 200 for s in scrapes)
    # Hundreds of distinct junk paths add no series: the route label is the matched template.
    for i in range(200):
        httpx.get(f"{base}/junk/{i}", timeout=10)
    m = scrape(base)
    routes = {dict(labels).get("route") for name, labels in m if name.startswith("mlx_kvserve_re")}
    assert "unmatched" in routes and not any(r and r.startswith("/junk") for r in routes)
    assert (
        value(m, "mlx_kvserve_requests_total", route="unmatched", protocol="none", status="404")
        >= 200
    )


def test_metrics_need_the_api_key_when_one_is_set(start_server):
    server = start_server("--api-key", "metrics-key")
    base = server.base_url
    assert httpx.get(base + "/metrics", timeout=10).status_code == 401
    assert (
        httpx.get(base + "/metrics", headers={"Authorization": "Bearer wrong"}).status_code == 401
    )
    m = scrape(base, Authorization="Bearer metrics-key")
    assert (
        value(m, "mlx_kvserve_requests_total", route="/metrics", protocol="none", status="401") == 2
    )
    assert httpx.get(base + "/health", timeout=10).status_code == 200  # probes need no key


@pytest.mark.parametrize("how", ["isolated"])
def test_isolated_caches_are_summed(start_server, how):
    server = start_server("--api-keys", "k1,k2", "--isolate-cache")
    base = server.base_url
    for key in ("k1", "k2"):
        headers = {"Authorization": f"Bearer {key}"}
        body = {"messages": conversation(1)[0], "max_tokens": 4, "temperature": 0}
        resp = httpx.post(base + "/v1/chat/completions", json=body, headers=headers, timeout=120)
        assert resp.status_code == 200
    per_key = [
        wait_for_writes(base, {"Authorization": f"Bearer {k}"})["disk_bytes"] for k in ("k1", "k2")
    ]
    m = scrape(base, Authorization="Bearer k1")
    assert value(m, "mlx_kvserve_cache_disk_bytes") == sum(per_key) > 0
    assert value(m, "mlx_kvserve_cache_lookups_total", outcome="miss", tier="none") == 2
