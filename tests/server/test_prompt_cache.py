"""The persistent prompt cache, end to end: real servers, the real model, exact accounting.

Every answer from a cache-on server is compared with a `--no-cache` server's answer to the same
request (greedy decoding), so reuse can never buy speed with wrong output. The references are
sent while the cache-on server works (the no-cache server batches them; batched greedy answers
equal solo ones, tests/server/test_concurrency.py).

Tests that only need their own conversation share one cache-on server per file (`shared`), each
with a system prompt of its own that starts with a word no other test's does, so every
conversation starts cold there; what a test asserts of the cache is measured against its own
first request (the shared chat template's first tokens may be cached from another test) or as a
difference before and after. Tests that need an empty cache, stop their server or start it with
other flags start their own.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import httpx
import pytest

from tests.support.concurrently import concurrently
from tests.support.servers import ServerProcess, client_for

MODEL = "SmolLM2-135M-Instruct"
SYSTEM = {
    "role": "system",
    "content": "You are a terse assistant for a gardening shop. Answer in one short sentence. "
    "Our shop sells seeds, soil, pots and tools, and is open from nine to five.",
}
QUESTIONS = [
    "Which pots do you sell?",
    "Do you have tomato seeds?",
    "When do you open?",
    "What soil is best for herbs?",
]


def system(opening: str) -> dict:
    """The shop's system prompt, opened by a word of the test's own (see the module docstring)."""
    return {"role": "system", "content": f"{opening}! {SYSTEM['content']}"}


def chat(client, messages, max_tokens=24):
    resp = client.chat.completions.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=max_tokens
    )
    return resp.choices[0].message.content, resp.usage


def converse(client, questions, system=SYSTEM, max_tokens=24, ask=None):
    """Run a multi-turn conversation; returns [(messages sent, answer, usage, reference)] per
    turn, the reference the no-cache server's Future for the same request when `ask` (the
    `references` fixture) is given, sent as soon as the turn's answer is in (else None)."""
    messages = [system]
    turns = []
    for question in questions:
        messages = [*messages, {"role": "user", "content": question}]
        answer, usage = chat(client, messages, max_tokens)
        turns.append((messages, answer, usage, ask and ask(messages, max_tokens)))
        messages = [*messages, {"role": "assistant", "content": answer}]
    return turns


def cache_stats(server: ServerProcess) -> dict:
    return httpx.get(server.base_url + "/v1/cache").json()


@pytest.fixture
def references(nocache_server) -> Iterator:
    """`ask(messages)`: the no-cache server's (answer, usage), a Future, sent at once."""
    client = client_for(nocache_server)
    with ThreadPoolExecutor(4) as pool:

        def ask(messages, max_tokens=24) -> Future:
            return pool.submit(chat, client, messages, max_tokens)

        yield ask


@pytest.fixture(scope="module")
def shared(tmp_path_factory) -> Iterator[ServerProcess]:
    """One cache-on server for the tests that only need a conversation of their own."""
    work = tmp_path_factory.mktemp("shared-cache")
    proc = ServerProcess(work, env={"MLX_KVSERVE_CACHE_DIR": str(work / "kv")})
    yield proc.wait_ready()
    proc.stop()


@pytest.fixture
def cache_server(start_server, tmp_path) -> ServerProcess:
    """A cache-on server of the test's own, on an empty cache directory."""
    return start_server(env={"MLX_KVSERVE_CACHE_DIR": str(tmp_path / "kv")})


def test_multi_turn_prefills_only_what_each_turn_adds(cache_server, references):
    """Its own server: the first turn finds an empty cache. Every turn's request is also sent to
    the no-cache server: equal answers at every turn make the two the same conversation."""
    turns = converse(client_for(cache_server), QUESTIONS, ask=references)
    first_usage = turns[0][2]
    assert first_usage.prompt_tokens_details.cached_tokens == 0
    for (_, _, prev, _), (_, _, usage, _) in zip(turns, turns[1:], strict=False):
        cached = usage.prompt_tokens_details.cached_tokens
        # The whole previous prompt (and most of the previous answer) is reused.
        assert prev.prompt_tokens <= cached < usage.prompt_tokens
    reference = [t[3].result() for t in turns]
    assert [t[1] for t in turns] == [answer for answer, _ in reference]
    for _, usage in reference:
        assert usage.prompt_tokens_details.cached_tokens == 0


def test_streaming_reports_exact_cached_tokens(shared):
    client = client_for(shared)
    messages = [system("Streaming"), {"role": "user", "content": QUESTIONS[0]}]
    _, first = chat(client, messages, max_tokens=8)
    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        temperature=0,
        max_tokens=8,
        stream=True,
        stream_options={"include_usage": True},
    )
    usage = [c.usage for c in stream if c.usage][0]
    # An identical prompt: everything but the last token comes from the cache.
    assert usage.prompt_tokens == first.prompt_tokens
    assert usage.prompt_tokens_details.cached_tokens == first.prompt_tokens - 1


def test_shortened_history_is_trimmed_back(shared, references):
    client = client_for(shared)
    own = system("Shortened")
    summary = [
        own,
        {"role": "user", "content": "Summary so far: we talked about pots and seeds."},
        {"role": "user", "content": QUESTIONS[3]},
    ]
    reference = references(summary)
    turns = converse(client, QUESTIONS[:3], own, max_tokens=8)  # (the history's answers)
    answer, usage = chat(client, summary)
    assert answer == reference.result()[0]
    cached = usage.prompt_tokens_details.cached_tokens
    cold = turns[0][2].prompt_tokens_details.cached_tokens  # 0 on an empty cache
    assert cold < cached < usage.prompt_tokens  # the system prompt, and no more than is shared
    assert cached < turns[-1][2].prompt_tokens


def test_prompt_diverging_mid_history(shared, references):
    client = client_for(shared)
    turns = converse(client, QUESTIONS[:3], system("Diverging"), max_tokens=8)
    edited = [dict(m) for m in turns[-1][0]]
    edited[3]["content"] = "Do you have pepper seeds?"  # the second user message changes
    reference = references(edited)
    answer, usage = chat(client, edited)
    ref_answer, ref_usage = reference.result()
    assert answer == ref_answer
    cached = usage.prompt_tokens_details.cached_tokens
    assert turns[0][2].prompt_tokens <= cached < usage.prompt_tokens
    assert usage.prompt_tokens == ref_usage.prompt_tokens


def test_restart_hits_disk_with_identical_output(start_server, tmp_path, references):
    env = {"MLX_KVSERVE_CACHE_DIR": str(tmp_path / "kv")}
    first = start_server(env=env)
    turns = converse(client_for(first), QUESTIONS[:2], max_tokens=8)
    follow = [*turns[-1][0], {"role": "assistant", "content": turns[-1][1]}]
    follow.append({"role": "user", "content": QUESTIONS[2]})
    reference = references(follow)
    assert first.stop() == 0
    second = start_server(env=env)
    answer, usage = chat(client_for(second), follow)
    assert usage.prompt_tokens_details.cached_tokens >= turns[-1][2].prompt_tokens
    assert answer == reference.result()[0]
    assert cache_stats(second)["restores_from_disk"] >= 1


def test_conversations_share_the_system_prompt_anchor(shared):
    client = client_for(shared)
    anchors = cache_stats(shared)["anchors"]
    own = system("Anchored")
    _, a = chat(client, [own, {"role": "user", "content": QUESTIONS[0]}], max_tokens=8)
    _, b = chat(client, [own, {"role": "user", "content": "Can I return a broken rake?"}], 8)
    cached = b.prompt_tokens_details.cached_tokens
    assert cached > a.prompt_tokens_details.cached_tokens  # that is 0 on an empty cache
    assert cached < a.prompt_tokens
    assert cache_stats(shared)["anchors"] > anchors


def test_interleaved_conversations(shared, references):
    client = client_for(shared)
    own = system("Interleaved")
    other_system = {"role": "system", "content": "You are a pirate. Answer like one, briefly."}
    a = [own, {"role": "user", "content": QUESTIONS[0]}]
    b = [other_system, {"role": "user", "content": "Where is the treasure?"}]
    a_answer, a_usage = chat(client, a)
    b_answer, b_usage = chat(client, b)
    a2 = [*a, {"role": "assistant", "content": a_answer}, {"role": "user", "content": "Why?"}]
    b2 = [*b, {"role": "assistant", "content": b_answer}, {"role": "user", "content": "Why?"}]
    a2_reference, b2_reference = references(a2), references(b2)
    a2_answer, a2_usage = chat(client, a2)
    b2_answer, b2_usage = chat(client, b2)
    assert a2_usage.prompt_tokens_details.cached_tokens >= a_usage.prompt_tokens
    assert b2_usage.prompt_tokens_details.cached_tokens >= b_usage.prompt_tokens
    assert a2_answer == a2_reference.result()[0]
    assert b2_answer == b2_reference.result()[0]


def test_text_completions_reuse_the_cache(shared):
    body = {"prompt": "Once upon a time, in a small village,", "max_tokens": 6, "temperature": 0}
    url = shared.base_url + "/v1/completions"
    first = httpx.post(url, json=body, timeout=60).json()
    longer = {**body, "prompt": body["prompt"] + first["choices"][0]["text"] + " Then"}
    second = httpx.post(url, json=longer, timeout=60).json()
    assert (
        second["usage"]["prompt_tokens_details"]["cached_tokens"] >= first["usage"]["prompt_tokens"]
    )


def test_no_cache_reports_zero_and_cache_endpoint(nocache_server):
    client = client_for(nocache_server)
    messages = [SYSTEM, {"role": "user", "content": QUESTIONS[0]}]
    chat(client, messages, max_tokens=4)
    _, usage = chat(client, messages, max_tokens=4)
    assert usage.prompt_tokens_details.cached_tokens == 0
    body = httpx.get(nocache_server.base_url + "/v1/cache").json()
    assert body["enabled"] is False and "entries_list" not in body
    memory = body["memory"]  # MLX's own figures, read on the engine thread
    assert memory["mlx_active_bytes"] > 0  # the weights at least
    assert memory["mlx_peak_bytes"] >= memory["mlx_active_bytes"]
    assert memory["mlx_cache_bytes"] >= 0


def test_cache_endpoint_and_cli(cache_server, tmp_path):
    client = client_for(cache_server)
    converse(client, QUESTIONS[:2], max_tokens=8)
    stats = cache_stats(cache_server)
    for key in ("entries", "tokens", "disk_bytes", "hits", "hit_rate", "bytes_written"):
        assert key in stats
    assert stats["entries"] >= 1 and stats["hits"] >= 1 and stats["bytes_written"] > 0
    env = {**cache_server.env}
    cli = [sys.executable, "-m", "mlx_kvserve", "cache"]

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([*cli, *args], env=env, capture_output=True, text=True, timeout=120)

    listing, totals, verified, busy = concurrently(  # read-only beside the server, a refused clear
        lambda args: run(*args), [("--json", "ls"), ("stats",), ("--json", "verify"), ("clear",)]
    )
    assert listing.returncode == 0, listing.stderr
    assert len(json.loads(listing.stdout)) == stats["entries"]
    assert totals.returncode == 0
    assert verified.returncode == 0 and json.loads(verified.stdout)["problems"] == []
    # the running server holds the lock
    assert busy.returncode == 1 and "stop the server" in busy.stdout
    assert cache_server.stop() == 0
    cleared = run("--json", "clear")
    assert cleared.returncode == 0 and json.loads(cleared.stdout)["removed"] >= 1
    assert json.loads(run("--json", "ls").stdout) == []


def test_second_server_on_same_cache_dir_refuses(shared, tmp_path):
    proc = ServerProcess(
        tmp_path, env={"MLX_KVSERVE_CACHE_DIR": shared.env["MLX_KVSERVE_CACHE_DIR"]}
    )
    assert proc.proc.wait(120) == 2
    proc.stop()
    assert "in use by another process" in proc.log()
    assert httpx.get(shared.base_url + "/health").status_code == 200  # the first one serves on


LONG_TEXT = " ".join(
    f"Record {i}: sensor {i % 7} read {i * 37 % 101} units at minute {i * 13 % 60}."
    for i in range(40)
)


def test_interval_checkpoints_during_long_prefill(start_server, tmp_path):
    srv = start_server(
        "--prefill-step", "64", "--checkpoint-interval", "128",
        env={"MLX_KVSERVE_CACHE_DIR": str(tmp_path / "kv")},
    )  # fmt: skip
    body = {"prompt": LONG_TEXT, "max_tokens": 1, "temperature": 0}
    first = httpx.post(srv.base_url + "/v1/completions", json=body, timeout=300).json()
    assert first["usage"]["prompt_tokens"] > 512
    entries = httpx.get(srv.base_url + "/v1/cache").json()["entries_list"]
    interval = sorted(e["n_tokens"] for e in entries if e["reason"] == "interval")
    assert interval and all(n % 128 == 0 for n in interval)
    # A longer prompt sharing the text reuses the stored chain.
    longer = {**body, "prompt": LONG_TEXT + " Summary:"}
    second = httpx.post(srv.base_url + "/v1/completions", json=longer, timeout=300).json()
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= max(interval)


def test_prefill_progress_survives_a_disconnect(start_server, tmp_path):
    """Without interval checkpoints, only the "partial" checkpoint can keep the prefill's work
    (nothing else is stored before the answer): it must exist, cover what was prefilled, and
    serve the same prompt sent again."""
    srv = start_server(
        "--prefill-step", "32", "--checkpoint-interval", "0", "--keepalive-seconds", "0.05",
        env={"MLX_KVSERVE_CACHE_DIR": str(tmp_path / "kv")},
    )  # fmt: skip
    body = {"prompt": LONG_TEXT, "max_tokens": 1, "temperature": 0, "stream": True}
    with httpx.stream("POST", srv.base_url + "/v1/completions", json=body, timeout=300) as r:
        keepalives = 0
        for line in r.iter_lines():
            keepalives += line.startswith(": keep-alive")
            assert not line.startswith("data: "), "the prefill ended before the disconnect"
            if keepalives >= 20:
                break  # leave mid-prefill (about one second in)
    srv.wait_for_log("finish=cancelled")
    entries = httpx.get(srv.base_url + "/v1/cache").json()["entries_list"]
    assert [e["reason"] for e in entries] == ["partial"], entries
    kept = entries[0]["n_tokens"]
    assert kept >= 32
    again = httpx.post(
        srv.base_url + "/v1/completions", json={**body, "stream": False}, timeout=300
    ).json()
    usage = again["usage"]
    assert kept < usage["prompt_tokens"]
    assert usage["prompt_tokens_details"]["cached_tokens"] >= kept
