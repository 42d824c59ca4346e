"""Thread contracts of the engine: calls run on the engine thread (even mid-request), a stop
that waits does not block the event loop, and the cache's bounded write queue."""

from __future__ import annotations

import asyncio
import threading
import time

import mlx.core as mx
import pytest

from mlx_kvserve.cache import PromptCache, disk
from mlx_kvserve.engine import Engine, intake
from mlx_kvserve.engine.prompt_state import PromptStates
from mlx_kvserve.engine.requests import Done
from tests.unit.test_engine_units import PROMPT, StubTokenizer, request, tiny_model

MiB = 1 << 20


@pytest.fixture(scope="module")
def model():
    return tiny_model()


class SlowClose:
    """A stand-in prompt cache whose close (the shutdown flush) lasts until the event loop has
    ticked 10 times (or 30 s): a loop the flush blocked could not tick meanwhile."""

    def __init__(self) -> None:
        self.closed_on: str | None = None
        self.loop_ran = threading.Event()

    def close(self) -> None:
        self.loop_ran.wait(30)
        self.closed_on = threading.current_thread().name


def started(model, **kwargs) -> Engine:
    engine = Engine(lambda: (model, StubTokenizer()), cache_enabled=False, **kwargs)
    engine.start()
    assert engine.ready.wait(30), engine.load_error
    return engine


def test_call_runs_on_the_engine_thread_between_decode_steps(model):
    engine = started(model)
    try:
        long = request(max_tokens=2000)
        engine.submit(long)
        deadline = time.monotonic() + 30
        while long not in engine._active():
            assert time.monotonic() < deadline
            time.sleep(0.01)
        seen = engine.call(
            lambda: (threading.current_thread().name, long in engine._active())
        ).result(10)
        assert seen == ("mlx-engine", True)  # served while the request still runs
        long.cancel()
        assert "mlx_active_bytes" in engine.call(engine.memory.stats).result(10)
    finally:
        engine.stop()
    with pytest.raises(Exception, match="not running|stopped"):
        engine.call(lambda: None).result(1)


def test_an_idle_engine_runs_a_call_at_once_and_counts_no_wake_as_queued(model, monkeypatch):
    """`call()` wakes an idle engine's wait for requests: with that wait made a minute long,
    calls still come back (each `result` has 10 s, a hang guard), one after another, and the
    wake item is never reported as a queued request."""
    monkeypatch.setattr(intake, "IDLE_POLL", 60.0)
    engine = started(model)
    try:
        for i in range(3):
            assert engine.call(lambda i=i: i).result(10) == i
            assert engine.queued == 0
        engine.call(lambda: None)  # a wake left queued is "no request" to what comes next
        engine.submit(req := request(max_tokens=2))
        deadline = time.monotonic() + 30
        while not any(isinstance(e, Done) for e in req.events):
            assert time.monotonic() < deadline, "the request after the wakes never ended"
            time.sleep(0.01)
        assert req.done.completion_tokens == 2 and engine.queued == 0
    finally:
        engine.stop()


def test_stop_async_keeps_the_event_loop_running(model):
    cache = SlowClose()
    engine = started(model, prompt_cache=cache)
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while cache.closed_on is None:
            ticks += 1
            if ticks >= 10:
                cache.loop_ran.set()
            await asyncio.sleep(0.01)

    async def main() -> None:
        await asyncio.gather(engine.stop_async(), ticker())

    asyncio.run(main())
    assert cache.closed_on is not None and cache.closed_on != "mlx-engine"
    assert cache.loop_ran.is_set()  # the loop ran while the flush waited for it (no timing)


def test_pending_writes_count_in_the_ram_budget(model, tmp_path, monkeypatch):
    written = disk.DiskTier.write_entry

    def slow_write(self, *args, **kwargs):
        time.sleep(0.2)
        return written(self, *args, **kwargs)

    monkeypatch.setattr(disk.DiskTier, "write_entry", slow_write)
    cache = PromptCache(tmp_path, "tiny-pending", disk_budget=64 * MiB, ram_budget=1)
    states = PromptStates(model, cache)
    start = states.cold()
    model(mx.array([PROMPT]), cache=start.caches)
    peak = 0
    for n in range(4, len(PROMPT), 4):  # a chain of deltas, each queued behind a slow write
        assert cache.checkpoint(PROMPT[:n], start.caches, "interval") is not None
        stats = cache.stats()
        peak = max(peak, stats["pending_writes"])
    assert peak <= 1  # the budget holds no more than the newest write's copy
    assert cache.stats()["write_waits"] > 0
    cache.close()


def test_failure_eviction_syncs_the_directory_once_off_the_engine_thread(
    model, tmp_path, monkeypatch
):
    cache = PromptCache(tmp_path, "tiny-evict", disk_budget=64 * MiB, ram_budget=64 * MiB)
    states = PromptStates(model, cache)
    start = states.cold()
    model(mx.array([PROMPT]), cache=start.caches)
    keys = [cache.checkpoint(PROMPT[:n], start.caches, "anchor", anchor=True) for n in (8, 16, 24)]
    cache.flush()
    calls: list[str] = []
    real = disk.fsync_path

    def counting(path):
        calls.append(threading.current_thread().name)
        return real(path)

    monkeypatch.setattr(disk, "fsync_path", counting)
    removed = cache.evict(keys[0], "test")
    assert len(removed) == 3
    cache.flush()
    assert calls == ["kvcache-writer"]
    cache.close()
