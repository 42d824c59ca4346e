"""The real Claude Code, Codex, opencode and Qwen Code CLIs, installed from npm, run headless
against a real server.

The model is a tiny random-weight llama with a 128k context (tests/support/agent_clis.py): these
agents' prompts (8k-20k tokens) do not fit the default model. A recording proxy between CLI and
server sees every request: each must be answered 2xx, each CLI run must end without an API error,
and the prompt cache must serve what the agents resend (a second session's shared system prompt and
tools; a continued session's history). Run with MLX_KVSERVE_RECORD_CLI_SHAPES=1 to rewrite the
redacted request fixtures of Claude Code and Codex that tests/clients/test_cli_shapes.py replays
without npm.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

import pytest

from tests.support.agent_clis import (
    CLAUDE_CODE,
    CODEX,
    Clis,
    agent_model_dir,
    install_clis,
    run_claude,
    run_codex,
    run_opencode,
    run_qwen,
)
from tests.support.cli_proxy import Exchange, RecordingProxy
from tests.support.cli_shapes import write_fixture
from tests.support.servers import ServerProcess

pytestmark = pytest.mark.slow

RECORD = os.environ.get("MLX_KVSERVE_RECORD_CLI_SHAPES") == "1"


@pytest.fixture(scope="module")
def clis() -> Clis:
    found = install_clis()
    if isinstance(found, str):
        pytest.skip(f"the agent CLIs cannot be installed here: {found}")
    return found


def served(exchanges: list[Exchange]) -> None:
    """Every request the CLI sent was answered 2xx (and a line per request for the record)."""
    for e in exchanges:
        print(f"{e.method} {e.path}{'?' + e.query if e.query else ''} -> {e.status}", end=" ")
        print("(prompt, cached) =", e.cached_tokens())
    failed = [(e.method, e.path, e.query, e.status, e.response[:300]) for e in exchanges]
    failed = [f for f in failed if not 200 <= f[3] < 300]
    assert exchanges and not failed, failed


def prompt_of(usage: dict) -> int:
    return usage["input_tokens"] + usage["cache_read_input_tokens"]


def test_claude_code_sessions_are_served_and_cached(clis, agent_server, tmp_path):
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    with RecordingProxy(agent_server.base_url) as proxy:
        first = run_claude(clis, proxy.base_url, home, work, "-p", "Say hello.", "--max-turns", "3")
        second = run_claude(
            clis, proxy.base_url, home, work, "-p", "List the files here.", "--max-turns", "3"
        )
        resumed = run_claude(
            clis, proxy.base_url, home, work, "-p", "--continue", "And now?", "--max-turns", "3"
        )
        exchanges = proxy.exchanges
    if RECORD:
        write_fixture("claude-code", exchanges, f"{CLAUDE_CODE}: -p, a second -p, -p --continue")
    served(exchanges)
    results = []
    for run in (first, second, resumed):
        result = run.json_lines()[-1]
        assert run.returncode == 0 and not result["is_error"], (run.stdout, run.stderr)
        results.append(result)
    # The second session shares the system prompt and tools: at least 80% comes from the cache.
    usage = results[1]["usage"]
    assert usage["cache_read_input_tokens"] >= 0.8 * prompt_of(usage), usage
    # --continue resends the previous session (the second) and adds a turn.
    resumed_usage = results[2]["usage"]
    assert resumed_usage["cache_read_input_tokens"] >= prompt_of(usage) * 0.9, (
        usage,
        resumed_usage,
    )


def test_codex_exec_and_resume_are_served_and_cached(clis, agent_server, tmp_path):
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    with RecordingProxy(agent_server.base_url) as proxy:
        first = run_codex(clis, proxy.base_url, home, work, "Say hello.")
        resumed = run_codex(clis, proxy.base_url, home, work, "resume", "--last", "And now?")
        exchanges = proxy.exchanges
    if RECORD:
        write_fixture("codex", exchanges, f"{CODEX}: exec, then exec resume --last")
    served(exchanges)
    usages = []
    for run in (first, resumed):
        events = run.json_lines()
        errors = [e for e in events if e.get("type") in ("error", "turn.failed")]
        assert run.returncode == 0 and not errors, (run.stdout, run.stderr)
        usages.append(next(e["usage"] for e in reversed(events) if e["type"] == "turn.completed"))
    first_usage, resumed_usage = usages
    assert resumed_usage["cached_input_tokens"] >= 0.9 * first_usage["input_tokens"], usages


def run_and_continue(run, clis, server, tmp_path):
    """A CLI's first run, then `--continue` in the same home and project, through a recording
    proxy: both runs and every exchange, each already checked to be a 2xx."""
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    with RecordingProxy(server.base_url) as proxy:
        first = run(clis, proxy.base_url, home, work, "Say hello.")
        resumed = run(clis, proxy.base_url, home, work, "--continue", "And now?")
        exchanges = proxy.exchanges
    served(exchanges)
    return first, resumed, exchanges


def test_opencode_run_and_continue_are_served_and_cached(clis, agent_server, tmp_path):
    """opencode over chat completions: `run`, then `run --continue`, which resends the session's
    system prompt, tools and history; the continued request reads nearly all of it from the cache.
    (Each run also asks, in a request of its own, for a title.)"""
    first, resumed, exchanges = run_and_continue(run_opencode, clis, agent_server, tmp_path)
    steps = []
    for run in (first, resumed):
        events = run.json_lines()
        errors = [e for e in events if e.get("type") == "error"]
        assert run.returncode == 0 and not errors, (run.stdout, run.stderr)
        steps.append([e["part"]["tokens"] for e in events if e.get("type") == "step_finish"])
    assert steps[0] and steps[1], steps
    first_prompt = steps[0][0]["input"] + steps[0][0]["cache"]["read"]
    assert steps[1][0]["cache"]["read"] >= 0.9 * first_prompt, steps
    # The server's own count, from the usage it streamed: the agent's requests (with its tools)
    # after the first read at least 90% of their prompt from the cache.
    agent = [e.cached_tokens() for e in exchanges if e.body.get("tools")]
    assert len(agent) >= 2 and all(cached >= 0.9 * prompt for prompt, cached in agent[1:]), agent


def test_qwen_code_prompt_and_continue_are_served_and_cached(clis, agent_server, tmp_path):
    """Qwen Code over chat completions: a prompt, then `--continue` with another; the continued
    request reads the first one's system prompt, tools and history from the cache (Qwen Code
    drops a date reminder from the first user turn when it resumes, so not all of it)."""
    first, resumed, exchanges = run_and_continue(run_qwen, clis, agent_server, tmp_path)
    for run in (first, resumed):
        result = json.loads(run.stdout)[-1]
        assert run.returncode == 0 and result["subtype"] == "success", (run.stdout, run.stderr)
        assert not result["is_error"], result
    usage = [e.cached_tokens() for e in exchanges]
    assert len(usage) >= 2 and all(cached >= 0.9 * usage[0][0] for _, cached in usage[1:]), usage


@pytest.fixture(scope="module")
def thinking_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """The agent model with Qwen3.5's template, whose generation prompt opens `<think>`: it
    reasons until the server's thinking budget ends the reasoning, then answers."""
    workdir = tmp_path_factory.mktemp("thinking-agent")
    model = agent_model_dir(workdir / "tiny-thinker", thinking=True)
    proc = ServerProcess(workdir, "--model", str(model), "--thinking-budget", "12")
    yield proc.wait_ready()
    proc.stop()


def test_reasoning_round_trips_through_the_real_clis(clis, thinking_server, tmp_path):
    """Claude Code gets thinking blocks with a signature; Codex gets reasoning items with
    `encrypted_content`, replays them on `exec resume`, and the replayed history renders as it
    was generated: the resumed request reads the whole previous prompt from the cache but its
    tail, the generation prompt (`<|im_start|>assistant\n<think>\n`), where Qwen3.5's template
    departs for its next turn (usually 2 tokens short; 5 was seen once)."""
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    with RecordingProxy(thinking_server.base_url) as proxy:
        claude = run_claude(clis, proxy.base_url, home, work, "-p", "Hi.", "--max-turns", "2")
        first = run_codex(clis, proxy.base_url, home, work, "Say hello.")
        resumed = run_codex(clis, proxy.base_url, home, work, "resume", "--last", "And now?")
        exchanges = proxy.exchanges
    served(exchanges)
    assert claude.returncode == 0 and not claude.json_lines()[-1]["is_error"], claude.stdout
    for run in (first, resumed):
        assert run.returncode == 0, (run.stdout, run.stderr)
    messages = [e for e in exchanges if e.path == "/v1/messages"]
    blocks = [
        event["content_block"]
        for event in messages[0].events()
        if event.get("type") == "content_block_start"
    ]
    assert blocks[0]["type"] == "thinking", blocks
    signatures = [
        event["delta"]["signature"]
        for event in messages[0].events()
        if event.get("type") == "content_block_delta"
        and event["delta"]["type"] == "signature_delta"
    ]
    assert len(signatures) == 1 and signatures[0].startswith("mkv1."), signatures
    responses = [e for e in exchanges if e.path == "/v1/responses"]
    replayed = [item for item in responses[1].body["input"] if item.get("type") == "reasoning"]
    assert replayed and replayed[0]["encrypted_content"].startswith("mkv1."), replayed
    prompt, _ = responses[0].cached_tokens()
    _, cached = responses[1].cached_tokens()
    assert prompt - 8 <= cached < prompt, (prompt, cached)
