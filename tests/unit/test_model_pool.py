"""The model pool's decisions (models/pool.py) on real engines of tiny random-weight models:
loading on first use, keep-alive, least-recently-used swaps that drain first, pinning, a model
too large for the budget, a model that fails to load, and the specs it is built from."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mlx_kvserve.engine import Engine
from mlx_kvserve.models.pool import (
    LOADED,
    UNLOADED,
    ModelLoadFailed,
    ModelPool,
    ModelTooLarge,
    Slot,
)
from mlx_kvserve.models.specs import (
    ModelSpec,
    merge_specs,
    parse_duration,
    parse_model_flag,
    parse_model_table,
)
from tests.support.tiny_models import make_model_dir


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("pool-models")
    return {
        "a": make_model_dir(root / "a", "llama", seed=1),
        "b": make_model_dir(root / "b", "llama", seed=2),
        "c": make_model_dir(root / "c", "llama", seed=3),
    }


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make_pool(model_dirs, *, budget=1 << 40, max_loaded=3, pinned=(), keep_alive=60.0, clock=None):
    from mlx_lm import load

    def start_engine(slot: Slot) -> Engine:
        path = model_dirs.get(slot.name) or Path(slot.spec.source or "")
        return Engine(lambda: load(str(path)), cache_enabled=False)

    slots = [
        Slot(ModelSpec(name, str(path), pinned=name in pinned), name, footprint=100)
        for name, path in model_dirs.items()
    ]
    return ModelPool(
        slots,
        start_engine,
        memory_budget=budget,
        max_loaded=max_loaded,
        keep_alive=keep_alive,
        clock=clock or Clock(),
    )


def states(pool: ModelPool) -> dict[str, str]:
    return {s.name: s.state for s in pool.slots}


def test_models_load_on_first_use_and_unload_when_idle(model_dirs) -> None:
    clock = Clock()

    async def run() -> None:
        pool = make_pool(model_dirs, keep_alive=60.0, clock=clock)
        assert set(states(pool).values()) == {UNLOADED}
        slot = pool.find("b")
        engine = await pool.acquire(slot)
        assert engine.ready.is_set() and states(pool)["b"] == LOADED
        assert states(pool)["a"] == UNLOADED  # only what was asked for
        pool.release(slot)
        clock.now += 59
        assert await pool.unload_idle() == []
        clock.now += 2
        assert await pool.unload_idle() == ["b"]
        assert states(pool)["b"] == UNLOADED and slot.engine is None
        again = await pool.acquire(slot)  # a reload
        assert again is not engine and again.ready.is_set()
        pool.release(slot)
        await pool.close()

    asyncio.run(run())


def test_a_busy_model_is_not_unloaded_for_idleness(model_dirs) -> None:
    clock = Clock()

    async def run() -> None:
        pool = make_pool(model_dirs, keep_alive=1.0, clock=clock)
        slot = pool.find("a")
        await pool.acquire(slot)  # held: a request in flight
        clock.now += 100
        assert await pool.unload_idle() == []
        pool.release(slot)
        clock.now += 100
        assert await pool.unload_idle() == ["a"]
        await pool.close()

    asyncio.run(run())


def test_least_recently_used_model_makes_room_after_draining(model_dirs) -> None:
    clock = Clock()

    async def run() -> None:
        pool = make_pool(model_dirs, max_loaded=2, clock=clock)
        a, b, c = (pool.find(n) for n in "abc")
        await pool.acquire(a)
        clock.now += 1
        await pool.acquire(b)
        pool.release(b)
        clock.now += 1
        # a is older but busy; b is idle. Loading c unloads the least recently used one (a)
        # only after its request ends: the load waits meanwhile.
        loading = asyncio.create_task(pool.acquire(c))
        await asyncio.sleep(0.5)
        assert not loading.done() and states(pool)["a"] == "unloading"
        pool.release(a)
        await asyncio.wait_for(loading, 120)
        assert states(pool) == {"a": UNLOADED, "b": LOADED, "c": LOADED}
        pool.release(c)
        await pool.close()

    asyncio.run(run())


def test_pinned_models_stay_and_a_model_too_large_is_refused(model_dirs) -> None:
    async def run() -> None:
        pool = make_pool(model_dirs, max_loaded=1, pinned=("a",))
        a, b = pool.find("a"), pool.find("b")
        await pool.acquire(a)
        pool.release(a)
        with pytest.raises(ModelTooLarge, match="pinned"):
            await pool.acquire(b)
        assert states(pool)["a"] == LOADED and b.leases == 0
        await pool.close()
        small = make_pool(model_dirs, budget=50)
        with pytest.raises(ModelTooLarge, match="--memory-budget"):
            await small.acquire(small.find("a"))

    asyncio.run(run())


def test_a_model_that_fails_to_load_says_why_and_is_tried_again(model_dirs, tmp_path) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text('{"model_type": "llama"}')

    clock = Clock()

    async def run() -> None:
        pool = make_pool({"broken": broken}, clock=clock)
        slot = pool.find("broken")
        for _ in range(3):  # the second time without trying again; the third after a while
            with pytest.raises(ModelLoadFailed, match="failed to load"):
                await pool.acquire(slot)
            assert slot.state == UNLOADED and slot.leases == 0 and "load" in slot.error
            clock.now += 20
        await pool.close()

    asyncio.run(run())


def test_concurrent_requests_share_one_load(model_dirs) -> None:
    async def run() -> None:
        pool = make_pool(model_dirs)
        slot = pool.find("c")
        engines = await asyncio.gather(*(pool.acquire(slot) for _ in range(5)))
        assert len({id(e) for e in engines}) == 1 and slot.leases == 5
        for _ in engines:
            pool.release(slot)
        assert pool.describe()[2]["loaded"] and pool.describe()[2]["idle_seconds"] == 0
        await pool.close()

    asyncio.run(run())


def test_names_and_aliases_find_their_model(model_dirs) -> None:
    pool = make_pool(model_dirs)
    assert pool.find(None) is pool.slots[0]
    assert pool.find("b") is pool.slots[1] and pool.find("nope") is None
    assert pool.names() == ["a", "b", "c"]


# -- specs ------------------------------------------------------------------------------------
def test_model_flags() -> None:
    assert parse_model_flag("haiku=/models/qwen") == ModelSpec("haiku", "/models/qwen")
    assert parse_model_flag("mlx-community/Qwen3-4B") == ModelSpec(None, "mlx-community/Qwen3-4B")
    assert parse_model_flag("./dir=odd") == ModelSpec(None, "./dir=odd")  # a path, whole
    for bad in ("", "=x", "bad name=/x", "haiku="):
        with pytest.raises(ValueError):
            parse_model_flag(bad)


def test_model_tables_and_merging() -> None:
    table = parse_model_table(
        {"name": "haiku", "model": "/m/small", "aliases": ["claude-haiku-4-5"], "keep_alive": "5m"},
        "models[0]",
    )
    assert table.keep_alive == 300 and table.aliases == ("claude-haiku-4-5",)
    bad_tables = [
        {"name": 3},
        {"model": "/x", "keep_alive": "soon"},
        {"model": "/x", "extra": 1},
        {"pinned": "yes", "model": "/x"},
        {},
        {"model": "/x", "aliases": [""]},
    ]
    for bad in bad_tables:
        with pytest.raises(ValueError, match="models\\[0\\]"):
            parse_model_table(bad, "models[0]")
    merged = merge_specs([ModelSpec("main", "/m/big"), ModelSpec("haiku", "/m/other")], [table])
    assert [m.name for m in merged] == ["main", "haiku"]
    assert (
        merged[1].source == "/m/other" and merged[1].keep_alive == 300
    )  # flag's source, file's policy
    assert merge_specs([], []) == [ModelSpec(None, None)]  # the embedded default


@given(st.one_of(st.text(max_size=12), st.floats(), st.integers(), st.booleans()))
def test_durations_parse_or_refuse_cleanly(value) -> None:
    try:
        seconds = parse_duration(value)
    except ValueError:
        return
    assert 0 <= seconds < float("inf")


def test_duration_units() -> None:
    assert [parse_duration(x) for x in ("30s", "5m", "1h", "0", "250ms", 90, "2d")] == [
        30, 300, 3600, 0, 0.25, 90, 172800
    ]  # fmt: skip
