"""The shared server fixtures: one default server per worker and file group, a cache-off
reference, the agents' long-context server, and `start_server` for servers with their own flags.

A kind's conftest imports the ones its tests use (tests/server, tests/clients, tests/cluster).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.servers import ServerProcess, client_for


@pytest.fixture(scope="session")
def session_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("servers")


@pytest.fixture(scope="session")
def server(session_dir: Path) -> Iterator[ServerProcess]:
    """The shared default server: embedded model, no API key."""
    proc = ServerProcess(session_dir).wait_ready()
    yield proc
    proc.stop()


@pytest.fixture
def start_server(tmp_path: Path) -> Iterator:
    """Start extra servers with their own flags; all are stopped after the test."""
    started: list[ServerProcess] = []

    def _start(
        *args: str, env: dict[str, str] | None = None, prefix: tuple[str, ...] = ()
    ) -> ServerProcess:
        proc = ServerProcess(tmp_path, *args, env=env, prefix=prefix)
        started.append(proc)
        return proc.wait_ready()

    yield _start
    for proc in started:
        proc.stop()


@pytest.fixture(scope="session")
def nocache_server(session_dir: Path) -> Iterator[ServerProcess]:
    """A server with the whole prompt cache off: the reference for 'same answers'."""
    proc = ServerProcess(session_dir, "--no-cache").wait_ready()
    yield proc
    proc.stop()


@pytest.fixture(scope="session")
def agent_server(session_dir: Path) -> Iterator[ServerProcess]:
    """A server on a tiny random-weight llama with a 128k context, for the agents' long prompts
    (tests/support/agent_clis.py); shared by the real-CLI tests and the replayed request shapes."""
    from tests.support.agent_clis import agent_model_dir

    model = agent_model_dir(session_dir / "tiny-agent")
    proc = ServerProcess(session_dir, "--model", str(model), "--served-model-name", "tiny-agent")
    yield proc.wait_ready()
    proc.stop()


@pytest.fixture(scope="session")
def openai_client(server: ServerProcess):
    return client_for(server)
