"""Several models in one real server: the embedded default and two tiny random-weight models,
loaded on first use, found by alias, unloaded when idle and reloaded with their conversations
restored from the prompt cache, swapped out least-recently-used while another model's request
runs, refused when too large, and shown by `ps`, `models` and `unload`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.concurrently import concurrently
from tests.support.servers import ServerProcess
from tests.support.tiny_models import make_model_dir

DEFAULT = "SmolLM2-135M-Instruct"


def chat(server: ServerProcess, model: str, messages: list[dict], max_tokens: int = 8) -> dict:
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0}
    reply = httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=300)
    assert reply.status_code == 200, reply.text
    return reply.json()


def states(server: ServerProcess) -> dict[str, str]:
    return httpx.get(server.base_url + "/health").json()["models"]


def wait_for(predicate, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError("condition not reached")


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {
        "tiny-a": make_model_dir(root / "a", "llama", seed=1),
        "tiny-b": make_model_dir(root / "b", "llama", seed=2),
        "big": make_model_dir(root / "big", "llama", seed=3, intermediate_size=4096),
    }


@pytest.fixture(scope="module")
def multi(tmp_path_factory: pytest.TempPathFactory, models) -> Iterator[ServerProcess]:
    """Default, tiny-a (alias claude-haiku-4-5, keep-alive 2 s) and tiny-b."""
    work = tmp_path_factory.mktemp("multi")
    config = work / "config.toml"
    config.write_text(
        '[[models]]\nname = "tiny-a"\naliases = ["claude-haiku-4-5"]\nkeep_alive = "2s"\n'
    )
    proc = ServerProcess(
        work,
        "--model", "default",
        "--model", f"tiny-a={models['tiny-a']}",
        "--model", f"tiny-b={models['tiny-b']}",
        env={"MLX_KVSERVE_CONFIG": str(config)},
    )  # fmt: skip
    yield proc.wait_ready()
    proc.stop()


def test_models_load_on_first_use(multi: ServerProcess) -> None:
    assert states(multi) == {DEFAULT: "loaded", "tiny-a": "unloaded", "tiny-b": "unloaded"}
    listed = httpx.get(multi.base_url + "/v1/models").json()["data"]
    assert [(m["id"], m["loaded"]) for m in listed] == [
        (DEFAULT, True), ("tiny-a", False), ("claude-haiku-4-5", False), ("tiny-b", False)
    ]  # fmt: skip
    answer = chat(multi, "tiny-b", [{"role": "user", "content": "Hello"}])
    assert answer["model"] == "tiny-b"
    assert states(multi)["tiny-b"] == "loaded"
    assert "loading model tiny-b" in multi.log() and "model tiny-b loaded in" in multi.log()
    unknown = chat(multi, "gpt-4o", [{"role": "user", "content": "Hello"}])
    assert unknown["model"] == DEFAULT  # any other name: the default model


def test_first_requests_share_one_load(multi: ServerProcess) -> None:
    httpx.post(multi.base_url + "/v1/models/tiny-b/unload", json={}, timeout=60)
    before = multi.log().count("loading model tiny-b")
    results: list[int] = []

    def ask() -> None:
        body = {"model": "tiny-b", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
        reply = httpx.post(multi.base_url + "/v1/chat/completions", json=body, timeout=300)
        results.append(reply.status_code)

    threads = [threading.Thread(target=ask) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert results == [200] * 4
    assert multi.log().count("loading model tiny-b") == before + 1


def test_an_alias_reaches_its_model_through_the_anthropic_api(multi: ServerProcess) -> None:
    import anthropic

    client = anthropic.Anthropic(base_url=multi.base_url, api_key="unused", max_retries=0)
    message = client.messages.create(
        model="claude-haiku-4-5", max_tokens=4, messages=[{"role": "user", "content": "Hi"}]
    )
    assert message.model == "tiny-a"


def test_idle_model_unloads_and_its_conversation_comes_back_from_the_cache(
    multi: ServerProcess,
) -> None:
    """tiny-a unloads 2 s after its last request; a returning conversation is served from its
    prompt cache as fully as a resident one was."""
    messages = [{"role": "user", "content": "Count from one to five, slowly, please."}]
    first = chat(multi, "tiny-a", messages)
    messages += [first["choices"][0]["message"], {"role": "user", "content": "And again."}]
    second = chat(multi, "tiny-a", messages)  # the model is resident: the live state
    resident_cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    # what a turn adds besides the previous prompt and answer (the template's turn markers)
    overhead = (
        resident_cached - first["usage"]["prompt_tokens"] - first["usage"]["completion_tokens"]
    )
    wait_for(lambda: states(multi)["tiny-a"] == "unloaded", 30)
    assert "model tiny-a unloaded (idle for" in multi.log()
    messages += [second["choices"][0]["message"], {"role": "user", "content": "Once more."}]
    third = chat(multi, "tiny-a", messages)  # reloads, then restores from the cache
    expected = second["usage"]["prompt_tokens"] + second["usage"]["completion_tokens"] + overhead
    assert third["usage"]["prompt_tokens_details"]["cached_tokens"] == expected
    metrics = httpx.get(multi.base_url + "/metrics").text
    assert 'mlx_kvserve_model_unloads_total{model="tiny-a",reason="idle"}' in metrics


def test_ps_models_and_unload_commands(multi: ServerProcess) -> None:
    chat(multi, "tiny-b", [{"role": "user", "content": "Hi"}])

    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "mlx_kvserve", *args, "--port", str(multi.port)],
            capture_output=True, text=True, timeout=300, env=multi.env,
        )  # fmt: skip

    ps = cli("ps")
    assert ps.returncode == 0, ps.stderr
    assert ps.stdout.splitlines()[0].split() == ["NAME", "SIZE", "IDLE", "UNLOADS", "AT"]
    assert f"{DEFAULT} (default)" in ps.stdout and "tiny-b" in ps.stdout
    listing = cli("models")
    assert listing.returncode == 0 and "claude-haiku-4-5" in listing.stdout
    unload = cli("unload", "tiny-b")
    assert unload.returncode == 0 and unload.stdout.strip() == "unloaded tiny-b"
    assert states(multi)["tiny-b"] == "unloaded" and "tiny-b" not in cli("ps").stdout
    again = cli("unload", "tiny-b")
    assert again.returncode == 0 and "was not loaded" in again.stdout
    missing = cli("unload", "nope")
    assert missing.returncode == 1 and "HTTP 404" in missing.stdout
    down = subprocess.run(
        [sys.executable, "-m", "mlx_kvserve", "ps", "--port", "1"],
        capture_output=True, text=True, timeout=120, env=multi.env,
    )  # fmt: skip
    assert down.returncode == 1 and "no server answers" in down.stdout


def test_an_unloaded_default_model_still_looks_healthy_and_comes_back(multi: ServerProcess):
    """Unloading the default (idle, memory pressure, or asked) is not a failure: /health stays
    200 (service managers and probes must not restart it) and the next request reloads it."""
    reply = httpx.post(multi.base_url + f"/v1/models/{DEFAULT}/unload", json={}, timeout=120)
    assert reply.status_code == 200 and reply.json()["unloaded"], reply.text
    health = httpx.get(multi.base_url + "/health")
    assert health.status_code == 200 and health.json()["models"][DEFAULT] == "unloaded"
    assert chat(multi, DEFAULT, [{"role": "user", "content": "Hi"}])["model"] == DEFAULT
    assert states(multi)[DEFAULT] == "loaded"


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(name=st.text(max_size=60))
def test_any_model_name_is_answered_without_a_server_error(multi: ServerProcess, name) -> None:
    body = {"model": name, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
    reply = httpx.post(multi.base_url + "/v1/chat/completions", json=body, timeout=300)
    assert reply.status_code in (200, 400), reply.text
    path = f"/v1/models/{urllib.parse.quote(name, safe='')}/unload"
    unload = httpx.post(multi.base_url + path, json={}, timeout=300)
    assert unload.status_code == 200 or 400 <= unload.status_code < 500, unload.text


@pytest.mark.parametrize("limit", ["count", "memory"])
def test_least_recently_used_model_is_swapped_out_after_its_request_ends(
    tmp_path: Path, models, limit: str
) -> None:
    """Room for two models (by --max-loaded-models, or by a --memory-budget that holds two):
    loading tiny-b while tiny-a streams a long answer waits for that answer to end, then
    unloads tiny-a (the least recently used); no request fails."""
    if limit == "count":
        room = ["--max-loaded-models", "2"]
    else:
        from mlx_kvserve import paths
        from mlx_kvserve.models import ensure_default_model
        from mlx_kvserve.models.budget import footprint

        default_dir = ensure_default_model(paths.data_dir(), progress=False)
        two = footprint(default_dir, None) + footprint(models["tiny-a"], None)
        room = ["--memory-budget", str(two + footprint(models["tiny-b"], None) // 2)]
    proc = ServerProcess(
        tmp_path,
        "--model", "default",
        "--model", f"tiny-a={models['tiny-a']}",
        "--model", f"tiny-b={models['tiny-b']}",
        *room,
    ).wait_ready()  # fmt: skip
    try:
        chat(proc, "tiny-a", [{"role": "user", "content": "Hi"}], max_tokens=1)  # loaded
        streamed: list[str] = []
        body = {
            "model": "tiny-a",
            "messages": [{"role": "user", "content": "Write a long story."}],
            "max_tokens": 400,
            "ignore_eos": True,  # all 400 tokens: an end the model sampled would prove nothing
            "stream": True,
            "stream_options": {"include_usage": True},
        }

        def stream() -> None:
            with httpx.stream(
                "POST", proc.base_url + "/v1/chat/completions", json=body, timeout=600
            ) as reply:
                streamed.extend(line for line in reply.iter_lines() if line.startswith("data:"))

        running = threading.Thread(target=stream)
        running.start()
        wait_for(lambda: len(streamed) > 5, 120)
        chat(proc, DEFAULT, [{"role": "user", "content": "Hi"}], max_tokens=1)  # default: recent
        answer = chat(proc, "tiny-b", [{"role": "user", "content": "Hi"}], max_tokens=2)
        running.join(600)
        assert answer["model"] == "tiny-b"
        assert streamed[-1] == "data: [DONE]"
        # The answer ran to its end, not cut by the swap: its 400 tokens.
        chunks = [json.loads(line[5:]) for line in streamed[:-1]]
        (finish,) = [c["finish_reason"] for k in chunks for c in k["choices"] if c["finish_reason"]]
        assert (finish, chunks[-1]["usage"]["completion_tokens"]) == ("length", 400)
        assert states(proc) == {DEFAULT: "loaded", "tiny-a": "unloaded", "tiny-b": "loaded"}
        log = proc.log()
        assert "unloading model tiny-a (to make room for tiny-b)" in log
        assert log.index("unloading model tiny-a") < log.index("loading model tiny-b")
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def limited(tmp_path_factory: pytest.TempPathFactory, models) -> Iterator[ServerProcess]:
    """tiny-a, a model too large for the memory budget (big) and one that cannot load (broken)."""
    work = tmp_path_factory.mktemp("limited")
    broken = work / "broken"
    broken.mkdir()
    # a config the preflight accepts (tiny-a's), weights that are not: it fails when it loads
    (broken / "config.json").write_text((models["tiny-a"] / "config.json").read_text())
    (broken / "model.safetensors").write_bytes(b"not weights")
    small = sum(p.stat().st_size for p in models["tiny-a"].glob("*.safetensors"))
    proc = ServerProcess(
        work,
        "--model", f"tiny-a={models['tiny-a']}",
        "--model", f"big={models['big']}",
        "--model", f"broken={broken}",
        "--memory-budget", str(int(1.6 * small)),  # tiny-a's estimate is 1.5x its weights
    )  # fmt: skip
    yield proc.wait_ready()
    proc.stop()


def test_a_model_too_large_for_the_budget_is_a_clear_400(limited: ServerProcess) -> None:
    body = {"model": "big", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
    reply = httpx.post(limited.base_url + "/v1/chat/completions", json=body, timeout=300)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["code"] == "model_too_large" and "--memory-budget" in error["message"]
    assert chat(limited, "tiny-a", [{"role": "user", "content": "Hi"}])["model"] == "tiny-a"


def test_a_model_that_fails_to_load_says_why_and_the_others_serve(limited: ServerProcess):
    body = {"model": "broken", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
    reply = httpx.post(limited.base_url + "/v1/chat/completions", json=body, timeout=300)
    assert reply.status_code == 503, reply.text
    assert "'broken' could not be loaded" in reply.json()["error"]["message"]
    assert chat(limited, "tiny-a", [{"role": "user", "content": "Hi"}])["model"] == "tiny-a"
    health = httpx.get(limited.base_url + "/health")
    assert health.status_code == 200 and health.json()["models"]["broken"] == "unloaded"


@pytest.mark.parametrize(
    ("table", "needle"),
    [
        ('name = "x"\nmodel = "{a}"\nkeep = true', "unknown key"),
        ('name = "x"\nmodel = "{a}"\n\n[[models]]\nname = "x"\nmodel = "{b}"', "'x'"),
        ('name = "x"\nmodel = "{a}"\naliases = ["y"]\n\n[[models]]\nname = "y"', "'y'"),
        ('name = "x"\nmodel = "/no/such/model"', "does not exist"),
    ],
    ids=["unknown-key", "duplicate-name", "duplicate-alias", "missing-path"],
)
def test_a_bad_models_section_is_refused_naming_file_line_and_key(
    tmp_path: Path, models, table: str, needle: str
) -> None:
    config = tmp_path / "config.toml"
    text = table.format(a=models["tiny-a"], b=models["tiny-b"])
    config.write_text(f"port = 8080\n\n[[models]]\n{text}\n")
    run = subprocess.run(
        [sys.executable, "-m", "mlx_kvserve", "serve", "--port", "0"],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "MLX_KVSERVE_CONFIG": str(config)},
    )  # fmt: skip
    assert run.returncode == 2, run.stderr[-500:]
    assert f"{config}, line 3" in run.stderr and "models[" in run.stderr, run.stderr[-500:]
    assert needle in run.stderr, run.stderr[-500:]


def test_bad_model_settings_stop_the_start(tmp_path: Path, models) -> None:
    cases = (
        (["--model", "=x"], "--model"),
        (["--model", f"same={models['tiny-a']}", "--model", f"same={models['tiny-b']}"], "two"),
        (["--keep-alive", "soon"], "keep_alive"),
        (["--model", str(tmp_path / "missing")], "missing"),
    )

    def serve(args: list[str]) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "mlx_kvserve", "serve", "--port", "0", *args],
            capture_output=True, text=True, timeout=300,
            env={**os.environ, "MLX_KVSERVE_CONFIG": str(tmp_path / "none.toml")},
        )  # fmt: skip

    runs = concurrently(serve, [args for args, _ in cases], len(cases))  # independent starts
    for (args, needle), run in zip(cases, runs, strict=True):
        assert run.returncode == 2, (args, run.stderr[-500:])
        assert needle in run.stderr, (args, run.stderr[-500:])
