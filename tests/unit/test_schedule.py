"""How the engine shares its thread between prefill chunks and decode steps (engine/schedule.py).

The Scheduler's rules are checked on their own with fake tasks and reported durations (no clock
is read); the engine's loop is checked in-process on the tiny random-weight llama, by the order
in which requests' events arrive and by their tokens, which must equal mlx-lm's solo greedy
tokens whatever ran in between.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace

import mlx.core as mx
import pytest

from mlx_kvserve.cache.kinds import describe_model
from mlx_kvserve.engine.requests import Done, Prefilled, SamplingParams
from mlx_kvserve.engine.schedule import Scheduler
from mlx_kvserve.engine.worker import Engine
from tests.unit.test_engine_units import (
    Recorder,
    StubTokenizer,
    reference,
    tiny_model,
    tokens_of,
)


# ------------------------------------------------------------------------- the rules alone --
def task(
    remaining: int, *, started: bool = True, cancelled: bool = False, of: int | None = None
) -> SimpleNamespace:
    """A prefill task with `remaining` tokens left of `of` (default: the same)."""
    flag = threading.Event()
    if cancelled:
        flag.set()
    return SimpleNamespace(
        remaining=remaining,
        to_prefill=remaining if of is None else of,
        started=started,
        req=SimpleNamespace(cancelled=flag),
    )


def scheduler(*tasks: SimpleNamespace, chunk: int = 512) -> Scheduler:
    s = Scheduler(chunk)
    for t in tasks:
        s.add(t)  # type: ignore[arg-type]
    return s


def test_unlooked_up_and_cancelled_tasks_go_first_then_the_shortest_short_one_then_the_oldest():
    old, young = task(5000), task(3000)
    assert scheduler(old, young).choose(decoding=False) is old
    short, shorter = task(400), task(100)
    assert scheduler(old, young, short).choose(decoding=False) is short
    assert scheduler(old, short, shorter).choose(decoding=False) is shorter
    fresh = task(9000, started=False)
    assert scheduler(old, short, fresh).choose(decoding=False) is fresh
    gone = task(9000, cancelled=True)
    assert scheduler(old, short, gone).choose(decoding=False) is gone


def test_nothing_to_prefill_means_decode():
    assert scheduler().choose(decoding=True) is None


def test_decoders_get_a_slice_as_long_as_the_next_chunk():
    long = task(5000)
    s = scheduler(long)
    assert s.choose(decoding=False) is long  # nobody decodes: prefill straight on
    s.prefilled(long, 512, 5.12)  # 10 ms a token
    assert s.choose(decoding=True) is None  # the slice starts: decode first
    s.decoded(3.0)
    assert s.choose(decoding=True) is None
    s.decoded(2.2)  # 5.2 s >= the 5.12 s the next chunk should take
    assert s.choose(decoding=True) is long
    s.prefilled(long, 512, 5.12)
    assert s.choose(decoding=True) is None  # a new slice


def test_short_prefills_run_at_once_within_one_chunk_between_decode_steps():
    first_, second = task(300), task(300)
    s = scheduler(first_, second)
    assert s.choose(decoding=True) is first_  # short: no slice to wait for
    s.prefilled(first_, 300, 3.0)
    s.remove(first_)
    assert s.choose(decoding=True) is None  # 600 tokens would stall the batch two chunks
    s.decoded(0.1)  # one step: not yet a slice as long as 300 tokens, but a step since
    assert s.choose(decoding=True) is second


def test_one_decode_step_is_always_owed_between_two_long_chunks():
    s = scheduler(task(5000))  # nothing measured yet
    assert s.choose(decoding=True) is None
    s.decoded(0.001)
    assert s.choose(decoding=True) is not None


def test_a_lookup_is_not_a_chunk():
    long = task(5000)
    s = scheduler(long)
    s.prefilled(long, 512, 5.12)
    s.decoded(5.2)
    s.prefilled(long, 0, 0.3)  # a restore: the decoders' slice is not reset
    assert s.choose(decoding=True) is long


def test_long_prefills_take_turns():
    a, b, c = task(5000), task(4000), task(3000)
    s = scheduler(a, b, c)
    order = []
    for _ in range(6):
        t = s.choose(decoding=False)
        order.append(t)
        s.prefilled(t, 512, 5.0)
    assert order == [a, b, c, a, b, c]
    tail = task(300, of=5000)  # the last pass of a long prefill is not a short prefill
    assert scheduler(a, tail).choose(decoding=False) is a


# ------------------------------------------------------------------------- the engine loop --
class Ordered(Recorder):
    """A request that also logs (name, event class) into a log shared with other requests."""

    def __init__(self, name: str, log: list, prompt: list[int], max_tokens: int) -> None:
        super().__init__(
            list(prompt), SamplingParams(temperature=0.0, max_tokens=max_tokens), "text"
        )
        self.__dict__["name"], self.__dict__["log"] = name, log

    def emit(self, event) -> None:  # type: ignore[override]
        super().emit(event)
        self.__dict__["log"].append((self.__dict__["name"], type(event).__name__))


def first(log: list, name: str, kind: type) -> int:
    return log.index((name, kind.__name__))


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def run_paused(model, reqs, *, cancel_when_begun=None, **engine_args) -> int:
    """Submit `reqs` while the engine thread is held in a call, so it finds them all queued
    (in this order) when it resumes; wait for every Done. `cancel_when_begun` is cancelled on
    the engine thread as soon as its prefill has begun. Returns the most requests that were
    prefilling or decoding at once, seen between every two pieces of the engine's work."""
    engine = Engine(lambda: (model, StubTokenizer()), cache_enabled=False, **engine_args)
    done = threading.Semaphore(0)
    engine.add_observer(lambda req, timings: done.release())
    engine.start()
    assert engine.ready.wait(60), engine.load_error
    hold, held = threading.Event(), threading.Event()
    most = [0]

    def watch() -> None:
        most[0] = max(most[0], engine.running)
        engine.call(watch)

    def cancel_once_begun() -> None:
        if any(t.req is cancel_when_begun and t.started for t in engine.schedule):
            cancel_when_begun.cancel()
        else:
            engine.call(cancel_once_begun)

    try:
        engine.call(lambda: (held.set(), hold.wait(30)))
        assert held.wait(30)
        for req in reqs:
            engine.submit(req)
        if cancel_when_begun is not None:
            engine.call(cancel_once_begun)
        engine.call(watch)
        hold.set()
        for _ in reqs:
            assert done.acquire(timeout=120)
    finally:
        hold.set()
        engine.stop()
    return most[0]


LONG = [(7 * i + 3) % 97 for i in range(300)]
SHORT = [5, 9, 2]


def test_a_short_prefill_runs_before_the_rest_of_a_long_one(model):
    log: list = []
    long, short = Ordered("long", log, LONG, 4), Ordered("short", log, SHORT, 4)
    run_paused(model, [long, short], prefill_step=4)
    assert first(log, "short", Done) < first(log, "long", Prefilled)
    assert tokens_of(long.text) == reference(model, LONG, 4)
    assert tokens_of(short.text) == reference(model, SHORT, 4)


def test_a_decoding_request_keeps_stepping_through_a_long_prefill(model):
    """75 chunks of prefill; the running request needs 30 steps and gets one or more between
    every two chunks, so it ends first, with the tokens it gets alone."""
    log: list = []
    decoding = Ordered("decoding", log, SHORT, 30)
    long = Ordered("long", log, LONG, 3)
    run_paused(model, [decoding, long], prefill_step=4)
    assert first(log, "decoding", Done) < first(log, "long", Prefilled)
    assert tokens_of(decoding.text) == reference(model, SHORT, 30)
    assert tokens_of(long.text) == reference(model, LONG, 3)


def test_a_request_cancelled_while_waiting_to_prefill_ends_at_once(model):
    log: list = []
    a, b = Ordered("a", log, LONG, 3), Ordered("b", log, LONG[:200], 3)
    run_paused(model, [a, b], cancel_when_begun=b, prefill_step=4)
    assert b.done.finish_reason == "cancelled" and b.done.completion_tokens == 0
    assert first(log, "b", Done) < first(log, "a", Prefilled)
    assert tokens_of(a.text) == reference(model, LONG, 3)


def test_prefills_count_against_the_kv_budget(model):
    """Two requests whose KV cannot fit together never run at once, not even both prefilling;
    with room for both they do."""
    per_token = describe_model(model).bytes_per_token
    budget = int(per_token * (len(LONG) + 4) * 1.5)
    a, b = Ordered("a", [], LONG, 4), Ordered("b", [], LONG[::-1], 4)
    assert run_paused(model, [a, b], prefill_step=4, kv_budget=budget) == 1
    assert tokens_of(b.text) == reference(model, LONG[::-1], 4)
    a, b = Ordered("a", [], LONG, 4), Ordered("b", [], LONG[::-1], 4)
    assert run_paused(model, [a, b], prefill_step=4, kv_budget=3 * budget) == 2


def test_a_request_cancelled_before_its_lookup_restores_nothing(model):
    """Its prefill ends at once, cancelled: the checkpoint that would serve it is not read."""
    from mlx_kvserve.cache import PromptCache
    from mlx_kvserve.engine.generate import Generator
    from mlx_kvserve.engine.prompt_state import PromptStates

    cache = PromptCache(None, "tiny-cancelled", disk_budget=None, ram_budget=64 << 20)
    states = PromptStates(model, cache)
    start = states.cold()
    prompt = LONG[:40]
    model(mx.array([prompt[:32]]), cache=start.caches)
    cache.checkpoint(prompt[:32], start.caches, "message")
    gen = Generator(model, StubTokenizer(), states, prefill_step=8)
    req = Ordered("gone", [], prompt, 4)
    req.cancel()
    timings, seq = gen.start(req)
    assert seq is None and timings.finish_reason == "cancelled"
    assert req.done.finish_reason == "cancelled" and req.done.completion_tokens == 0
    assert cache.stats()["restores"] == 0
    live = Ordered("live", [], prompt, 4)  # the checkpoint still serves the next one
    gen.run(live)
    assert cache.stats()["restores"] == 1 and live.done.cached_tokens == 32
