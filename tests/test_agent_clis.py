"""The real Claude Code and Codex CLIs, installed from npm, run headless against a real server.

The model is a tiny random-weight llama with a 128k context (tests/support/agent_clis.py): these
agents' prompts (10k-20k tokens) do not fit the default model. A recording proxy between CLI and
server sees every request: each must be answered 2xx, each CLI run must end without an API error,
and the prompt cache must serve what the agents resend (a second session's shared system prompt and
tools; a continued session's history). Run with MLX_KVSERVE_RECORD_CLI_SHAPES=1 to rewrite the
redacted request fixtures that tests/test_cli_shapes.py replays without npm.
"""

from __future__ import annotations

import os

import pytest

from tests.support.agent_clis import (
    CLAUDE_CODE,
    CODEX,
    Clis,
    install_clis,
    run_claude,
    run_codex,
)
from tests.support.cli_proxy import Exchange, RecordingProxy
from tests.support.cli_shapes import write_fixture

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
