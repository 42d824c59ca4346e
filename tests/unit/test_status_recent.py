"""`/v1/status`'s recent requests name the model that served each one: its served name, also when
the client asked for it by an alias or named no model (the default's).

Two tiny random-weight models behind the real app, pool and engines, driven in-process through
Starlette's TestClient.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from starlette.testclient import TestClient

from mlx_kvserve.api.app import create_app
from mlx_kvserve.config.settings import Settings
from mlx_kvserve.engine import Engine
from mlx_kvserve.models.pool import ModelPool, Slot
from mlx_kvserve.models.specs import ModelSpec
from tests.support.tiny_models import make_model_dir

LOCAL = "http://localhost"  # the Host guard answers only to names of this server


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("status-models")
    names = ("tiny-a", "tiny-b")
    return {name: make_model_dir(root / name, "llama", seed=n) for n, name in enumerate(names)}


def _pool(model_dirs: dict[str, Path]) -> ModelPool:
    from mlx_lm import load

    def start_engine(slot: Slot) -> Engine:
        path = model_dirs[slot.name]
        return Engine(lambda: load(str(path)), cache_enabled=False)

    slots = [
        Slot(ModelSpec("tiny-a", str(model_dirs["tiny-a"]), ("haiku",)), "a-id", footprint=1),
        Slot(ModelSpec("tiny-b", str(model_dirs["tiny-b"])), "b-id", footprint=1),
    ]
    return ModelPool(slots, start_engine, memory_budget=1 << 40, max_loaded=2)


def test_recent_requests_name_the_model_that_served_them(model_dirs: dict[str, Path]) -> None:
    with TestClient(create_app(Settings(), _pool(model_dirs)), base_url=LOCAL) as client:
        for model in ("tiny-b", "haiku", None):  # by name, by alias, the default (tiny-a)
            body = {
                "messages": [{"role": "user", "content": "Hi"}],
                "max_tokens": 2,
                "temperature": 0,
            }
            if model is not None:
                body["model"] = model
            reply = client.post("/v1/chat/completions", json=body)
            assert reply.status_code == 200, reply.text
        recent = client.get("/v1/status").json()["recent"]
    assert [r["model"] for r in recent] == ["tiny-a", "tiny-a", "tiny-b"]  # newest first
