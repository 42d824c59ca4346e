"""The real app on one model, in this process, for Starlette's TestClient: the unit tests of a
protocol that need a model but no server process, and of a vision checkpoint."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from starlette.testclient import TestClient

from mlx_kvserve.config.settings import Settings

if TYPE_CHECKING:
    from mlx_kvserve.engine.loading import Loaded

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


def vision_loader(model_dir: Path) -> Callable[[], Loaded]:
    """What an `Engine` loads for a vision checkpoint: mlx-lm's text model and the
    checkpoint's tower (vision/encoder.py's `load_vision`)."""

    def load() -> Loaded:
        from mlx_lm import load

        from mlx_kvserve.engine.loading import Loaded
        from mlx_kvserve.vision.encoder import load_vision

        model, tokenizer = load(str(model_dir))
        vision = load_vision(model_dir, tokenizer.convert_ids_to_tokens, model)
        return Loaded(model, tokenizer, vision=vision)

    return load


def serve_vision(model_dir: Path, name: str, **engine: object) -> TestClient:
    """A client of the app serving the vision checkpoint `model_dir` as `name`, its engine
    made with the `engine` keywords (`cache_enabled=False`, `prompt_cache=...`, ...)."""
    from mlx_kvserve.engine import Engine

    return serve(model_dir, name, Engine(vision_loader(model_dir), **engine))  # type: ignore[arg-type]
