"""The status page at `/` (for a browser; other clients get Ollama's "Ollama is running"): its
files, its data endpoints, and the page itself in a real browser (Debian's chromium driven by
Playwright), whose numbers must equal /v1/cache's and /metrics'."""

from __future__ import annotations

import json
import os
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from tests.support.servers import ServerProcess

KEY = "status-page-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
BROWSER = {"Accept": "text/html,application/xhtml+xml,*/*;q=0.8"}  # what a browser asks for
ARTIFACTS = Path(
    os.environ.get("MLX_KVSERVE_TEST_ARTIFACTS", Path(__file__).parents[2] / "test-artifacts")
)
CHROMIUM = os.environ.get("MLX_KVSERVE_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """One server with an API key and speculation on, a few requests served (a miss, then a
    hit)."""
    folder = tmp_path_factory.mktemp("status")
    proc = ServerProcess(folder, "--api-key", KEY, "--speculation", "auto").wait_ready()
    messages = [{"role": "user", "content": "Name three colours of the rainbow."}]
    with httpx.Client(base_url=proc.base_url, headers=AUTH, timeout=120) as http:
        for _ in range(2):
            body = {"model": "default", "messages": messages, "max_tokens": 8, "temperature": 0}
            reply = http.post("/v1/chat/completions", json=body)
            assert reply.status_code == 200, reply.text
            messages += [
                reply.json()["choices"][0]["message"],
                {"role": "user", "content": "More."},
            ]
    yield proc
    proc.stop()


def metric(base_url: str, name: str) -> float:
    """A metric's value, summed over its labels (the draft sources of speculation's)."""
    text = httpx.get(base_url + "/metrics", headers=AUTH, timeout=30).text
    values = [
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name
    ]
    assert values, f"{name} not in /metrics"
    return sum(values)


def status(base_url: str) -> dict:
    reply = httpx.get(base_url + "/v1/status", headers=AUTH, timeout=30)
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_page_and_files_are_served_without_the_key(keyed: ServerProcess) -> None:
    page = httpx.get(keyed.base_url + "/", headers=BROWSER)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    probe = httpx.get(keyed.base_url + "/")  # not a browser: Ollama's reachability answer
    assert probe.status_code == 200 and probe.text == "Ollama is running"
    assert "script-src 'self'" in page.headers["content-security-policy"]
    assert httpx.head(keyed.base_url + "/").status_code == 200  # Claude Code's probe
    for asset in ("/ui/status.js", "/ui/status.css", "/ui/vendor/uPlot.iife.min.js"):
        assert asset in page.text or asset.endswith(".js") and "uPlot" in page.text
        reply = httpx.get(keyed.base_url + asset)
        assert reply.status_code == 200 and len(reply.content) > 100, asset
    assert "javascript" in httpx.get(keyed.base_url + "/ui/status.js").headers["content-type"]


def test_data_needs_the_key(keyed: ServerProcess) -> None:
    for path in ("/v1/status", "/v1/status/events"):
        reply = httpx.get(keyed.base_url + path)
        assert reply.status_code == 401
        assert reply.json()["error"]["code"] == "invalid_api_key"
        wrong = httpx.get(keyed.base_url + path, headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401


def test_foreign_host_and_origin_are_refused(keyed: ServerProcess) -> None:
    for path in ("/", "/v1/status", "/ui/status.js"):
        host = httpx.get(keyed.base_url + path, headers={**AUTH, "Host": "evil.example"})
        assert host.status_code in (400, 403), (path, host.status_code)
        origin = httpx.get(
            keyed.base_url + path, headers={**AUTH, "Origin": "https://evil.example"}
        )
        assert origin.status_code == 403, (path, origin.status_code)


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    tail=st.one_of(
        st.text(
            st.characters(min_codepoint=0x20, max_codepoint=0x7E, exclude_characters="?#"),
            max_size=40,
        ),
        st.sampled_from(
            [
                "../pyproject.toml",
                "..%2f..%2fetc%2fpasswd",
                "vendor/../status.js",
                "static/index.html",
                "%00",
                "index.html",
                "vendor/",
                "/",
            ]
        ),
    )
)
def test_no_other_path_is_a_file(keyed: ServerProcess, tail: str) -> None:
    reply = httpx.get(keyed.base_url + "/ui/" + tail)
    assert reply.status_code < 500
    known = {
        "status.js",
        "status.css",
        "vendor/uPlot.iife.min.js",
        "vendor/uPlot.min.css",
        "vendor/uPlot-LICENSE.txt",
        "vendor/README.txt",
    }
    if reply.status_code == 200:
        assert httpx.URL(reply.url).path.removeprefix("/ui/") in known


def test_status_agrees_with_the_api(keyed: ServerProcess) -> None:
    s = status(keyed.base_url)
    cache = httpx.get(keyed.base_url + "/v1/cache", headers=AUTH, timeout=30).json()
    for field in ("hits", "misses", "entries", "disk_bytes", "checkpoints", "hit_rate"):
        assert s["cache"][field] == cache[field], field
    assert s["cache"]["hits"] >= 1 and s["cache"]["misses"] >= 1
    assert "directory" not in s["cache"]  # no path of the machine on the page
    totals = s["totals"]
    assert totals["requests"] == 2 == len(s["recent"])
    assert totals["prompt_tokens"] == metric(keyed.base_url, "mlx_kvserve_prompt_tokens_total")
    assert totals["cached_tokens"] == metric(keyed.base_url, "mlx_kvserve_cached_tokens_total")
    assert totals["generated_tokens"] == metric(
        keyed.base_url, "mlx_kvserve_generated_tokens_total"
    )
    assert s["recent"][0]["cached_tokens"] > 0 and s["recent"][1]["cached_tokens"] == 0
    drafted = metric(keyed.base_url, "mlx_kvserve_speculation_drafted_tokens_total")
    accepted = metric(keyed.base_url, "mlx_kvserve_speculation_accepted_tokens_total")
    assert (totals["drafted_tokens"], totals["accepted_tokens"]) == (drafted, accepted)
    rate = s["speculation"]["acceptance_rate"]
    assert rate is None if not drafted else rate == pytest.approx(accepted / drafted)
    chain = s["cache"]["chains"][0]
    assert chain["tokens"] == max(e["n_tokens"] for e in cache["entries_list"])
    assert [link["tokens"] for link in chain["links"]] == sorted(
        link["tokens"] for link in chain["links"]
    )
    model = s["models"][0]
    assert model["loaded"] and model["context_length"] > 0 and model["kv_bytes_per_token"] > 0
    assert s["requests"] == {"running": 0, "queued": 0}
    assert len(s["series"]["time"]) == len(s["series"]["tokens_per_second"]) >= 1


def read_events(base_url: str, count: int) -> list[dict]:
    events = []
    with httpx.stream("GET", base_url + "/v1/status/events", headers=AUTH, timeout=30) as reply:
        assert reply.status_code == 200
        assert reply.headers["content-type"].startswith("text/event-stream")
        for line in reply.iter_lines():
            if line.startswith("data:"):
                events.append(json.loads(line[5:]))
                if len(events) == count:
                    break  # leaving the block closes the connection mid-stream
    return events


def test_events_stream_snapshots_and_survive_disconnects(keyed: ServerProcess) -> None:
    events = read_events(keyed.base_url, 2)
    assert events[1]["time"] > events[0]["time"]
    assert events[0]["totals"]["requests"] >= 2
    results: list[int] = []
    threads = [
        threading.Thread(target=lambda: results.append(len(read_events(keyed.base_url, 1))))
        for _ in range(8)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results == [1] * 8
    assert httpx.get(keyed.base_url + "/health").json()["status"] == "ok"
    assert status(keyed.base_url)["totals"]["failed"] == 0


def test_the_page_in_a_real_browser(keyed: ServerProcess) -> None:
    """Chromium opens the page, is asked for the key, shows figures equal to the API's, and the
    charts draw; the screenshot is kept as a test artifact."""
    if not Path(CHROMIUM).exists():
        if os.environ.get("CI"):
            pytest.fail(f"no chromium at {CHROMIUM}: .ci/run installs Debian's chromium")
        pytest.skip("no chromium here (set MLX_KVSERVE_CHROMIUM to a Chromium binary)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=CHROMIUM,
            headless=True,
            args=[
                "--no-sandbox",
                "--disable-gpu",
                "--disable-quic",
                "--no-first-run",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
            ],
        )
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 1400})
            errors: list[str] = []
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.on(
                "console",
                lambda m: (
                    errors.append(m.text) if m.type == "error" and "401" not in m.text else None
                ),
            )
            page.goto(keyed.base_url + "/")
            page.wait_for_selector("#key-form:not([hidden])", timeout=30_000)
            page.fill("#key-input", KEY)
            page.click("#key-form button")
            # selectors, not script: the page's CSP rightly forbids evaluating strings
            page.wait_for_selector("body[data-updated]", timeout=60_000)
            page.wait_for_selector('[data-field="totals.requests"][data-value="2"]', timeout=60_000)

            def shown(field: str) -> str:
                return page.get_attribute(f'[data-field="{field}"]', "data-value")

            cache = httpx.get(keyed.base_url + "/v1/cache", headers=AUTH, timeout=30).json()
            for field in ("hits", "misses", "entries", "disk_bytes"):
                assert shown(f"cache.{field}") == str(cache[field]), field
            assert float(shown("cache.hit_rate")) == pytest.approx(cache["hit_rate"])
            for field, name in (
                ("prompt_tokens", "mlx_kvserve_prompt_tokens_total"),
                ("cached_tokens", "mlx_kvserve_cached_tokens_total"),
                ("generated_tokens", "mlx_kvserve_generated_tokens_total"),
            ):
                assert float(shown(f"totals.{field}")) == metric(keyed.base_url, name), field
            drafted = metric(keyed.base_url, "mlx_kvserve_speculation_drafted_tokens_total")
            assert float(shown("totals.drafted_tokens")) == drafted
            rate = status(keyed.base_url)["speculation"]["acceptance_rate"]
            page_rate = shown("speculation.acceptance_rate")
            assert page_rate == "" if rate is None else float(page_rate) == pytest.approx(rate)
            assert shown("requests.running") == "0"
            assert page.locator("#recent tbody tr").count() == 2
            assert page.locator("#chains tbody tr").count() >= 1
            assert page.locator("#models tbody tr").count() == 1
            assert page.locator("#chart-throughput canvas").count() == 1
            assert page.locator("#chart-ttft canvas").count() == 1
            assert page.inner_text("#server-status") == "ok"
            ARTIFACTS.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(ARTIFACTS / "status-page.png"), full_page=True)
            assert not errors, errors
        finally:
            browser.close()
