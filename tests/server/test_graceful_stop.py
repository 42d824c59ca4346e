"""What a service manager relies on: SIGTERM mid-generation drains, flushes the cache and exits
0 within the grace time with a clean-shutdown mark; after a SIGKILL (which launchd's KeepAlive
and systemd's Restart=on-failure answer with a restart) the next server process serves the
same conversation from disk."""

from __future__ import annotations

import signal
import sys
import threading
import time

import httpx

from tests.server.test_metrics import SYSTEM, chat, scrape, value, wait_for_writes
from tests.support.servers import ServerProcess

GRACE = 3.0
TURN_1 = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Name a fruit."}]


def turn_2(first_answer: str) -> list[dict]:
    return [
        *TURN_1,
        {"role": "assistant", "content": first_answer},
        {"role": "user", "content": "And a vegetable?"},
    ]


def served_from_disk(base: str, messages: list[dict]) -> tuple[dict, dict]:
    body = chat(base, messages)
    return body, scrape(base)


def test_sigterm_mid_generation_drains_flushes_and_exits_zero(start_server, tmp_path):
    env = {"MLX_KVSERVE_CACHE_DIR": str(tmp_path / "kv")}
    first = start_server("--shutdown-grace", str(GRACE), env=env)
    answer_1 = chat(first.base_url, TURN_1)["choices"][0]["message"]["content"]
    long_body = {
        "messages": turn_2(answer_1),
        "max_tokens": 4000,
        "ignore_eos": True,  # still generating when SIGTERM comes, however the answer goes
        "temperature": 0,
        "stream": True,
    }
    got_data = threading.Event()
    ended: dict[str, object] = {}

    def stream() -> None:
        try:
            with httpx.stream(
                "POST", first.base_url + "/v1/chat/completions", json=long_body, timeout=60
            ) as resp:
                for line in resp.iter_lines():
                    if line.startswith("data: "):
                        got_data.set()
                        ended["last"] = line
        except httpx.HTTPError as exc:
            ended["error"] = repr(exc)

    reader = threading.Thread(target=stream)
    reader.start()
    assert got_data.wait(60)
    started = time.monotonic()
    assert first.stop(signal.SIGTERM) == 0
    took = time.monotonic() - started
    reader.join(30)
    assert took < GRACE + 10, f"exit took {took:.1f} s"  # the manager's SIGKILL comes later
    assert ended.get("last") == "data: [DONE]", ended  # the stream was ended, not torn down
    log = first.log()
    assert "stopped cleanly: checkpoint writes flushed, clean shutdown recorded" in log
    assert "Traceback" not in log
    assert not list((tmp_path / "kv").rglob("RUNNING"))  # no unclean-run marker left
    assert not list((tmp_path / "kv").rglob(".tmp*"))

    second = start_server(env=env)
    assert "uncleanly" not in second.log()
    body, metrics = served_from_disk(second.base_url, TURN_1)
    assert body["choices"][0]["message"]["content"] == answer_1
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert value(metrics, "mlx_kvserve_cache_lookups_total", outcome="hit", tier="disk") == 1
    assert httpx.get(second.base_url + "/v1/cache", timeout=30).json()["unclean_start"] is False


def test_after_sigkill_the_restarted_server_serves_the_conversation_from_disk(
    start_server, nocache_server, tmp_path
):
    env = {"MLX_KVSERVE_CACHE_DIR": str(tmp_path / "kv")}
    reference_1 = chat(nocache_server.base_url, TURN_1)["choices"][0]["message"]
    reference_2 = chat(nocache_server.base_url, turn_2(reference_1["content"]))
    crashed = start_server(env=env)
    assert chat(crashed.base_url, TURN_1)["choices"][0]["message"] == reference_1
    wait_for_writes(crashed.base_url)
    assert crashed.stop(signal.SIGKILL) == -signal.SIGKILL  # what launchd/systemd restart

    restarted = start_server(env=env)
    assert "the last run ended uncleanly" in restarted.log()
    body, m = served_from_disk(restarted.base_url, turn_2(reference_1["content"]))
    assert body["choices"][0]["message"] == reference_2["choices"][0]["message"]
    cached = body["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached > 0
    assert value(m, "mlx_kvserve_cache_lookups_total", outcome="hit", tier="disk") == 1
    assert value(m, "mlx_kvserve_cache_restores_total", tier="disk") == 1
    assert value(m, "mlx_kvserve_cache_restore_seconds_count", tier="disk") == 1
    assert value(m, "mlx_kvserve_cache_read_bytes_total") > 0
    assert value(m, "mlx_kvserve_cached_tokens_total") == cached


def test_sigterm_before_serving_exits_zero(tmp_path):
    """A stop that arrives while the server still prepares (here: right after the BLAS is
    loaded, while MLX is imported; on macOS after the cache opened) must not look like a crash,
    or the service manager would restart what the user just stopped."""
    proc = ServerProcess(tmp_path, env={"MLX_KVSERVE_CACHE_DIR": str(tmp_path / "kv")})
    proc.wait_for_log("BLAS" if sys.platform.startswith("linux") else "prompt cache:", 300)
    assert proc.stop(signal.SIGTERM) == 0, proc.log()
    assert "stopped" in proc.log()
