"""api/engine_view.py names what the endpoints ask of an engine; the real engine has all of it.

A member renamed in the engine and not in the Protocol (or the reverse) would otherwise surface
as an AttributeError in a request. The engine is the real one with the real default model loaded,
so the parts that exist only once it is ready (its KV ledger and KV shape) are checked too.
"""

from __future__ import annotations

import pytest

from mlx_kvserve import paths
from mlx_kvserve.api.engine_view import EngineView, KVLedger, KVShape, MemoryFigures
from mlx_kvserve.engine import Engine
from mlx_kvserve.models import ensure_default_model


@pytest.fixture(scope="module")
def engine():
    from mlx_lm import load

    model_dir = ensure_default_model(paths.data_dir(), progress=False)
    engine = Engine(lambda: load(str(model_dir)))
    engine.start()
    assert engine.ready.wait(120), engine.load_error
    yield engine
    engine.stop()


def test_a_loaded_engine_is_what_the_api_asks_for(engine: Engine) -> None:
    assert isinstance(engine, EngineView)
    assert isinstance(engine.room, KVLedger)
    assert isinstance(engine.layout, KVShape)
    assert isinstance(engine.memory, MemoryFigures)


def test_an_engine_without_a_member_is_not(engine: Engine) -> None:
    """The check can fail: the same engine less one member the API calls is refused."""

    class Without:
        def __getattr__(self, name: str) -> object:
            if name == "submit":
                raise AttributeError(name)
            return getattr(engine, name)

    assert not isinstance(Without(), EngineView)
