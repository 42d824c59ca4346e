"""The whole suite: an optimised BLAS for MLX's CPU backend, loaded before any test imports mlx.

Tests live by kind, each kind with its own conftest (tests/README.md says what to run when):
tests/unit (in process), tests/server (server processes), tests/cluster (`mlx.launch` jobs),
tests/clients (SDKs, agent CLIs, a browser).
"""

from __future__ import annotations

import pytest

from mlx_kvserve.blas import preload_optimised_blas
from tests.support import macos_beside
from tests.support.calm_memory import calm_memory_pressure

preload_optimised_blas()  # before any test module imports mlx: in-process tests run fast too
calm_memory_pressure()  # the machine's own pressure never unloads a model under test


def pytest_sessionstart(session: pytest.Session) -> None:
    macos_beside.start(session)  # only with MLX_KVSERVE_TEST_MACOS_BESIDE=1 (.ci/run sets it)


def pytest_sessionfinish(session: pytest.Session) -> None:
    macos_beside.finish(session)


def pytest_terminal_summary(terminalreporter) -> None:  # noqa: ANN001
    macos_beside.report(terminalreporter)
