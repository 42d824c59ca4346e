"""Unit tests: the package in this process (no server): engines on tiny models, the cache on a
temporary directory, the chat layer, the app through Starlette's TestClient.

`MLX_KVSERVE_TEST_MACOS_OS=1` runs them with macOS's Python surface: the names CPython on macOS
lacks are removed first (tests/support/macos_surface.py), so every fallback the package takes on
a Mac runs here.
"""

from __future__ import annotations

import pytest

from tests.support import macos_surface
from tests.support.model_fixtures import tokenizer  # noqa: F401 (fixture)

if macos_surface.requested():
    macos_surface.apply()


@pytest.fixture(autouse=True)
def _verify_cost_on_its_prior(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch):
    """Speculation's tests count drafts on tiny CPU models, where a wide pass timed against a
    plain one seldom pays: a batch size whose plain pass was never timed keeps the cost prior
    (`VerifyCost.retime` None, the named seam) unless a test is marked `timed_cost`."""
    if request.node.get_closest_marker("timed_cost") is None:
        from mlx_kvserve.engine.speculation.depth import VerifyCost

        monkeypatch.setattr(VerifyCost, "retime", None)


def pytest_report_header(config: pytest.Config) -> str | None:
    if not macos_surface.removed:
        return None
    return f"macOS's os surface: {len(macos_surface.removed)} Linux-only names removed"
