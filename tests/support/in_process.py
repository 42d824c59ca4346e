"""The real app on one model, in this process, for Starlette's TestClient: the unit tests of a
protocol that need a model but no server process."""

from __future__ import annotations

from pathlib import Path

from starlette.testclient import TestClient

from mlx_kvserve.config.settings import Settings

LOCAL = "http://localhost"


def serve(model_dir: Path, name: str, engine: object | None = None) -> TestClient:
    """A client of the app serving `model_dir` as `name` (an mlx-lm engine on it, unless an
    `engine` is given), its prompt cache off."""
    from mlx_lm import load

    from mlx_kvserve.api.app import create_app
    from mlx_kvserve.engine import Engine
    from mlx_kvserve.models.pool import ModelPool

    if engine is None:
        engine = Engine(lambda: load(str(model_dir)), cache_enabled=False)
    pool = ModelPool.single(engine, name)  # type: ignore[arg-type]  # an EngineView
    pool.default.model_dir = model_dir
    return TestClient(create_app(Settings(), pool), base_url=LOCAL)
