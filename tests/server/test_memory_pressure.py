"""Memory pressure (models/pressure.py, models/pressure_watch.py): the kernel's formats parsed
from real samples (and anything else read as normal, never a crash), and a real server driven
through its pressure file: warn shrinks the RAM tiers and unloads idle models one at a time
while another model's request runs to its end; normal gives the budgets back."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from mlx_kvserve.models.pressure import (
    CRITICAL,
    FILE_ENV,
    LEVELS,
    NORMAL,
    WARN,
    FileSource,
    PsiSource,
    parse_psi,
    parse_sysctl,
    parse_word,
    pressure_source,
)
from tests.server.test_multi_model import chat, states, wait_for
from tests.support.servers import ServerProcess
from tests.support.tiny_models import make_model_dir

IDLE_PSI = (
    "some avg10=0.00 avg60=0.00 avg300=0.00 total=0\n"
    "full avg10=0.00 avg60=0.00 avg300=0.00 total=0\n"
)
RECLAIMING_PSI = (  # a machine reclaiming page cache hard while a build runs
    "some avg10=23.41 avg60=9.87 avg300=2.10 total=48391022\n"
    "full avg10=3.02 avg60=1.15 avg300=0.30 total=7810042\n"
)
THRASHING_PSI = (
    "some avg10=71.50 avg60=40.02 avg300=12.75 total=912003311\n"
    "full avg10=55.10 avg60=30.20 avg300=9.01 total=700100200\n"
)
BLIP_PSI = "some avg10=1.37 avg60=0.29 avg300=0.06 total=1203399\nfull avg10=0.00 avg60=0.00 avg300=0.00 total=203\n"  # noqa: E501


def test_psi_samples() -> None:
    assert parse_psi(IDLE_PSI) == NORMAL
    assert parse_psi(BLIP_PSI) == NORMAL
    assert parse_psi(RECLAIMING_PSI) == WARN
    assert parse_psi(THRASHING_PSI) == CRITICAL
    # only "full" high: every task stalls at once, which is thrashing whatever "some" says
    assert parse_psi("some avg10=8.00 avg60=0 avg300=0 total=1\nfull avg10=12.00") == CRITICAL
    # older kernels print only the "some" line
    assert parse_psi("some avg10=45.00 avg60=20.00 avg300=5.00 total=99") == CRITICAL


def test_sysctl_samples() -> None:
    assert parse_sysctl("1\n") == NORMAL
    assert parse_sysctl("2\n") == WARN
    assert parse_sysctl("4\n") == CRITICAL
    assert parse_sysctl("kern.memorystatus_vm_pressure_level: 2\n") == WARN
    assert parse_sysctl("kern.memorystatus_vm_pressure_level: 4") == CRITICAL
    assert parse_sysctl("3") == NORMAL  # not a level macOS defines
    assert parse_sysctl("sysctl: unknown oid 'kern.memorystatus_vm_pressure_level'") == NORMAL


@given(st.text(max_size=300))
def test_any_psi_text_is_a_level(text: str) -> None:
    assert parse_psi(text) in LEVELS


@given(
    st.lists(
        st.sampled_from(["some", "full", "avg10=", "avg60=1", "nan", "inf", "-5", "1e400",
                         "100.5", "=", " ", "\n", "total=", "12.5", "avg10=nan", "avg10=-1"]),
        max_size=20,
    ).map("".join)
)  # fmt: skip
def test_psi_like_text_is_a_level(text: str) -> None:
    level = parse_psi(text)
    assert level in LEVELS
    if "avg10=" not in text:
        assert level == NORMAL


@given(st.text(max_size=100))
def test_any_sysctl_or_file_text_is_a_level(text: str) -> None:
    assert parse_sysctl(text) in LEVELS
    assert parse_word(text) in LEVELS


def test_readers_read_normal_when_they_cannot_read(tmp_path: Path) -> None:
    assert FileSource(tmp_path / "missing").read() == NORMAL
    assert PsiSource(tmp_path / "missing").read() == NORMAL
    (tmp_path / "level").write_bytes(b"\xff\xfe warn \x00")
    assert FileSource(tmp_path / "level").read() == NORMAL
    (tmp_path / "level").write_text(" Critical\n")
    assert FileSource(tmp_path / "level").read() == CRITICAL
    (tmp_path / "psi").write_text(RECLAIMING_PSI)
    assert PsiSource(tmp_path / "psi").read() == WARN
    chosen = pressure_source({FILE_ENV: str(tmp_path / "level")})
    assert isinstance(chosen, FileSource) and chosen.read() == CRITICAL


# -- a real server ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def pressured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, Path]]:
    """Three tiny models; tiny-a (the default) pinned; pressure read from a file."""
    root = tmp_path_factory.mktemp("pressure")
    dirs = {name: make_model_dir(root / name, "llama", seed=i) for i, name in
            enumerate(("tiny-a", "tiny-b", "tiny-c"), start=1)}  # fmt: skip
    config = root / "config.toml"
    config.write_text('[[models]]\nname = "tiny-a"\npinned = true\n')
    level = root / "pressure"
    level.write_text("normal\n")
    proc = ServerProcess(
        root,
        *(arg for name, path in dirs.items() for arg in ("--model", f"{name}={path}")),
        env={"MLX_KVSERVE_CONFIG": str(config), FILE_ENV: str(level)},
    )
    yield proc.wait_ready(), level
    proc.stop()


def ram_budget(server: ServerProcess, model: str) -> int:
    return httpx.get(server.base_url + "/v1/cache", params={"model": model}).json()["ram_budget"]


def metric(server: ServerProcess, line_start: str) -> float:
    for line in httpx.get(server.base_url + "/metrics").text.splitlines():
        if line.startswith(line_start + " "):
            return float(line.split()[-1])
    raise AssertionError(f"no metric {line_start}")


@pytest.mark.slow
def test_warn_shrinks_then_unloads_idle_models_and_normal_restores(pressured) -> None:
    server, level = pressured
    for model in ("tiny-a", "tiny-b", "tiny-c"):
        chat(server, model, [{"role": "user", "content": "Hi"}], max_tokens=2)
    chat(server, "tiny-b", [{"role": "user", "content": "Hi again"}], max_tokens=2)
    assert states(server) == {"tiny-a": "loaded", "tiny-b": "loaded", "tiny-c": "loaded"}
    full = ram_budget(server, "tiny-a")
    assert httpx.get(server.base_url + "/health").json()["memory_pressure"] == NORMAL

    # tiny-c streams a long answer all through the pressure (4,000 tokens, ignore_eos: never an
    # end the random model happens to sample first); the client hangs up once that is shown
    streamed: list[str] = []
    hang_up = threading.Event()
    body = {
        "model": "tiny-c",
        "messages": [{"role": "user", "content": "Write a long story."}],
        "max_tokens": 4000,
        "ignore_eos": True,
        "stream": True,
    }

    def stream() -> None:
        with httpx.stream(
            "POST", server.base_url + "/v1/chat/completions", json=body, timeout=600
        ) as reply:
            for line in reply.iter_lines():
                if line.startswith("data:"):
                    streamed.append(line)
                if hang_up.is_set():
                    return

    running = threading.Thread(target=stream)
    running.start()
    wait_for(lambda: len(streamed) > 5, 120)
    level.write_text("warn\n")
    wait_for(lambda: states(server)["tiny-b"] == "unloaded", 60)
    log = server.log()
    assert "memory pressure is warn (was normal)" in log
    assert "memory pressure warn: model tiny-a's prompt-cache RAM tier cut to" in log
    assert "model tiny-b unloaded (memory pressure warn)" in log
    # the shrink came first, and the unload a poll later
    assert log.index("RAM tier cut to") < log.index("unloading model tiny-b")
    assert ram_budget(server, "tiny-a") == full // 4
    before = len(streamed)
    time.sleep(3)  # more polls at warn while tiny-c still streams: it is busy, so it stays
    assert running.is_alive(), "the stream ended too soon to show anything"
    assert "unloading model tiny-c" not in server.log()
    health = httpx.get(server.base_url + "/health").json()
    assert health["memory_pressure"] == WARN
    assert health["models"]["tiny-a"] == "loaded"  # pinned
    # not cut short: it went on streaming through the polls, tokens and nothing else
    assert len(streamed) > before
    assert all(json.loads(line[5:])["choices"][0]["finish_reason"] is None for line in streamed)
    hang_up.set()
    running.join(60)
    assert not running.is_alive()
    wait_for(lambda: states(server)["tiny-c"] == "unloaded", 60)  # idle now: next poll
    assert metric(server, "mlx_kvserve_memory_pressure") == 1
    assert metric(server, 'mlx_kvserve_pressure_actions_total{action="unload"}') == 2
    assert metric(server, 'mlx_kvserve_pressure_actions_total{action="shrink"}') >= 3
    assert 'mlx_kvserve_model_unloads_total{model="tiny-b",reason="pressure"}' in (
        httpx.get(server.base_url + "/metrics").text
    )

    level.write_text("normal\n")
    wait_for(lambda: ram_budget(server, "tiny-a") == full, 60)
    assert "memory pressure normal: model tiny-a has its budgets back" in server.log()
    assert metric(server, "mlx_kvserve_memory_pressure") == 0
    assert metric(server, 'mlx_kvserve_pressure_actions_total{action="restore"}') >= 1
    # a model asked for again loads with its full budgets
    chat(server, "tiny-b", [{"role": "user", "content": "Hi"}], max_tokens=2)
    assert ram_budget(server, "tiny-b") == full


@pytest.mark.slow
def test_critical_unloads_every_idle_model_at_once(pressured) -> None:
    server, level = pressured
    for model in ("tiny-b", "tiny-c"):
        chat(server, model, [{"role": "user", "content": "Hi"}], max_tokens=2)
    level.write_text("critical\n")
    try:
        wait_for(lambda: states(server) == {"tiny-a": "loaded", "tiny-b": "unloaded",
                                            "tiny-c": "unloaded"}, 60)  # fmt: skip
        assert ram_budget(server, "tiny-a") == 0
        assert "resident sessions all dropped" in server.log()
        # a request under pressure is served (its model loads again)
        assert chat(server, "tiny-b", [{"role": "user", "content": "Hi"}])["model"] == "tiny-b"
    finally:
        level.write_text("normal\n")
    wait_for(lambda: ram_budget(server, "tiny-a") > 0, 60)


def test_the_watch_can_be_turned_off(tmp_path: Path) -> None:
    model = make_model_dir(tmp_path / "m", "llama", seed=4)
    level = tmp_path / "pressure"
    level.write_text("critical\n")
    server = ServerProcess(
        tmp_path, "--model", str(model), "--no-pressure-watch", env={FILE_ENV: str(level)}
    ).wait_ready()
    try:
        assert "memory_pressure" not in httpx.get(server.base_url + "/health").json()
        assert "watching memory pressure" not in server.log()
    finally:
        server.stop()


# -- the budgets the watch turns ---------------------------------------------------------------
def test_limit_ram_moves_copies_out_of_ram_and_gives_the_budget_back(tmp_path: Path) -> None:
    from mlx_lm.models.cache import KVCache

    from mlx_kvserve.cache import PromptCache
    from tests.support.cache_testing import make_kv

    cache = PromptCache(tmp_path, "pressure", disk_budget=1 << 30, ram_budget=1 << 30)
    prompts = [[tag * 1000 + i for i in range(100)] for tag in (1, 2, 3)]
    for tokens in prompts:
        cache.checkpoint(tokens, make_kv(100), "m")
    cache.flush()
    assert cache.stats()["ram_entries"] == 3 and cache.stats()["ram_bytes"] > 0
    assert cache.limit_ram(0.25) == (1 << 30) // 4  # everything still fits a quarter
    assert cache.limit_ram(0.0) == 0
    assert cache.stats()["ram_bytes"] == 0 and cache.stats()["ram_budget"] == 0
    for tokens in prompts:  # the disk still has every conversation
        match = cache.lookup(tokens + [0])
        assert match.hit and match.source == "disk"
        cache.restore(match, [KVCache() for _ in range(2)])
    assert cache.limit_ram(1.0) == 1 << 30
    assert cache.stats()["ram_budget"] == 1 << 30
    cache.close()


def test_limit_live_drops_older_residents_then_all(tmp_path: Path) -> None:
    from mlx_lm import load

    from mlx_kvserve.engine.prompt_state import PromptStates
    from tests.support.cache_testing import make_kv

    model, _ = load(str(make_model_dir(tmp_path / "m", "llama", seed=5)))
    states = PromptStates(model, None, live_budget=1 << 30)
    for n in (10, 20, 30):
        states.keep(list(range(n)), make_kv(n))
    assert states.residents == 3
    states.limit_live(0.0)
    assert states.residents == 1 and states.live_budget == 0  # the newest stays
    states.limit_live(0.0, keep_newest=False)
    assert states.residents == 0
    states.limit_live(1.0)
    assert states.live_budget == 1 << 30
    states.keep([1, 2], make_kv(2))
    states.keep([3, 4], make_kv(2))
    assert states.residents == 2
