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


def pytest_report_header(config: pytest.Config) -> str | None:
    if not macos_surface.removed:
        return None
    return f"macOS's os surface: {len(macos_surface.removed)} Linux-only names removed"
