"""Fixtures for test files that build a model of their own (the tool-format tests): a file that
defines `model_dir` gets its `tokenizer`, and one that defines `served`, a server of it, gets an
OpenAI `client` of that server. The kinds' conftests import them; a file may define its own."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.servers import ServerProcess, client_for


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path):
    from mlx_lm import load

    return load(str(model_dir))[1]


@pytest.fixture(scope="module")
def client(served: ServerProcess):
    return client_for(served)
