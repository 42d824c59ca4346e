"""An engine that cannot die silently (engine/failures.py), on the real Engine and a tiny model.

A fault raised at each named point of the engine loop (engine/faults.py) fails the requests it
touched with a clean error, leaves no KV hold behind, and the next request is served; a fault
the loop cannot go on from ends every request it held with an error and refuses new ones at
once, and /health says why. Reservations are released on every exit (a request cancelled while
it was held for room), the resident session a returning conversation is about to take is not
shed under contention, and loading a model on demand does not stall /health.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from mlx_kvserve.config.settings import Settings
from mlx_kvserve.engine import Engine, faults
from mlx_kvserve.engine.failures import BLAMELESS_TURNS
from mlx_kvserve.engine.requests import Done, EngineError, TextChunk
from mlx_kvserve.engine.worker import EngineNotReady
from tests.unit.test_engine_units import PROMPT, Recorder, StubTokenizer, request, tiny_model

PER_TOKEN = 256  # KV bytes per position of the tiny llama (both layers)
LOCAL = "http://localhost"  # the Host guard answers only to names of this server
CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "temperature": 0}


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture
def inject(monkeypatch):
    """`inject("point:N")` arms the named fault points (MLX_KVSERVE_FAULTS) from now on."""

    def arm(spec: str) -> None:
        monkeypatch.setenv(faults.ENV, spec)
        faults.reset()

    yield arm
    monkeypatch.delenv(faults.ENV, raising=False)
    faults.reset()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    from tests.support.tiny_models import make_model_dir

    return make_model_dir(tmp_path_factory.mktemp("failures") / "m", "llama", seed=1)


def started(model, **options) -> Engine:
    options.setdefault("cache_enabled", False)
    engine = Engine(lambda: (model, StubTokenizer()), **options)
    engine.start()
    assert engine.ready.wait(60), engine.load_error
    return engine


def final(req: Recorder, timeout: float = 120) -> Done | EngineError:
    """The request's last event, once it has one (Done or EngineError)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ends = [e for e in req.events if isinstance(e, Done | EngineError)]
        if ends:
            assert len(ends) == 1, req.events  # one end, never two
            return ends[0]
        time.sleep(0.01)
    raise AssertionError(f"request {req.request_id} never ended: {req.events}")


def submit_together(engine: Engine, reqs: list[Recorder]) -> None:
    """Queue `reqs` while the engine thread is held in a call: it finds them all queued."""
    hold, held = threading.Event(), threading.Event()
    engine.call(lambda: (held.set(), hold.wait(30)))
    assert held.wait(30)
    try:
        for req in reqs:
            engine.submit(req)
    finally:
        hold.set()


def holds(engine: Engine) -> dict:
    assert engine.room is not None
    return engine.call(lambda: dict(engine.room.ledger.holds)).result(30)


def decoding(req: Recorder, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not any(isinstance(e, TextChunk) for e in req.events):
        assert time.monotonic() < deadline, req.events
        time.sleep(0.01)


# -- a fault at each point of the loop ---------------------------------------------------------
# Two requests of 30 + 40 tokens with a growth reserve of 8: both are admitted (38 tokens each,
# as two rows of one batch), the younger pauses when they grow past the budget and resumes once
# the older is done; so every point below is reached.
BUDGET = 2 * 40 * PER_TOKEN
POINTS = ["turn", "admission", "prefill", "before_step", "decode", "pause", "resume"]
# How many of the two fail: a turn's start touches no one; admission, the first request; a
# pause, the whole batch (both rows); a resumption, the paused one; else one or both rows.
FAILED = {"turn": (0,), "admission": (1,), "pause": (2,), "resume": (1,)}


@pytest.mark.parametrize("point", POINTS)
def test_a_fault_fails_what_it_touched_and_the_next_request_is_served(model, inject, point):
    inject(f"{point}:1")
    engine = started(model, prefill_step=8, kv_reserve=8, kv_budget=BUDGET)
    try:
        a, b = request(PROMPT, max_tokens=40), request(PROMPT[::-1], max_tokens=40)
        submit_together(engine, [a, b])
        ends = [final(a), final(b)]
        failed = [e for e in ends if isinstance(e, EngineError)]
        assert len(failed) in FAILED.get(point, (1, 2)), ends  # what the fault touched
        assert all("internal error" in e.message for e in failed)
        assert holds(engine) == {}  # nothing reserved for the requests that ended
        after = request(PROMPT[:12], max_tokens=5)
        engine.submit(after)
        assert isinstance(final(after), Done) and after.done.completion_tokens == 5
        assert engine.failure is None and holds(engine) == {}
    finally:
        engine.stop()


def test_a_fault_the_engine_cannot_go_on_from_ends_every_request_and_refuses_new_ones(
    model, inject
):
    engine = started(model, prefill_step=8)
    try:
        running = request(PROMPT, max_tokens=5000)
        engine.submit(running)
        decoding(running)
        inject("turn:1000")  # every turn fails before it touches anyone: nothing to blame
        end = final(running)
        assert isinstance(end, EngineError) and "engine stopped" in end.message
        engine.join(30)
        failure = engine.failure
        assert failure is not None and f"{BLAMELESS_TURNS} turns in a row" in failure
        assert "injected fault at turn" in failure
        started_at = time.monotonic()
        with pytest.raises(EngineNotReady, match="injected fault at turn"):
            engine.submit(request(PROMPT[:5], max_tokens=2))  # refused at once, not queued
        assert time.monotonic() - started_at < 5
        assert engine.queued == 0 and engine.running == 0
        assert engine.room is not None and engine.room.ledger.holds == {}
        with pytest.raises(EngineNotReady):
            engine.call(lambda: None).result(5)
    finally:
        engine.stop()


def test_health_says_why_the_engine_stopped_and_requests_get_a_503(model_dir, inject):
    from mlx_lm import load

    from mlx_kvserve.api.app import create_app
    from mlx_kvserve.models.pool import ModelPool

    inject("turn:1000")
    engine = Engine(lambda: load(str(model_dir)), cache_enabled=False)
    app = create_app(Settings(), ModelPool.single(engine, "tiny"))
    with TestClient(app, base_url=LOCAL) as client:
        deadline = time.monotonic() + 120
        health = client.get("/health")
        # the engine may fail its first turns before the pool has marked the model loaded
        while health.json().get("status") != "error" or health.json()["models"]["tiny"] != "loaded":
            assert time.monotonic() < deadline, health.json()
            time.sleep(0.05)
            health = client.get("/health")
        assert health.status_code == 503
        assert "injected fault at turn" in health.json()["error"]
        assert health.json()["models"]["tiny"] == "loaded"
        chat = client.post("/v1/chat/completions", json=CHAT)
        assert chat.status_code == 503
        assert "injected fault at turn" in chat.json()["error"]["message"]
        messages = {"model": "tiny", "max_tokens": 2, "messages": CHAT["messages"]}
        anthropic = client.post("/v1/messages", json=messages)
        assert anthropic.status_code == 503 and anthropic.json()["type"] == "error"
        assert "injected fault at turn" in anthropic.json()["error"]["message"]
        listed = client.get("/v1/models")
        assert listed.status_code == 200  # the server itself still answers


# -- reservations ------------------------------------------------------------------------------
def test_a_request_cancelled_while_held_for_room_leaves_no_hold(model, caplog):
    """The held request's client leaves just as the request in its way ends: the engine must
    end it, not admit it (which left its hold behind: a lone request then paused and resumed
    every reserve, as if a second one were running). It still gets its log line."""
    caplog.set_level("INFO", logger="mlx_kvserve.engine")
    engine = started(model, kv_budget=60 * PER_TOKEN)  # one request of 30 + 20, not two
    blocker = request(PROMPT, max_tokens=20)
    held = request(PROMPT[::-1], max_tokens=20)
    engine.add_observer(lambda req, timings: held.cancel() if req is blocker else None)
    try:
        submit_together(engine, [blocker, held])
        assert isinstance(final(blocker), Done)
        end = final(held)
        assert isinstance(end, Done) and end.finish_reason == "cancelled"
        lines = [
            r.getMessage() for r in caplog.records if f"id={held.request_id} " in r.getMessage()
        ]
        assert len(lines) == 1 and "finish=cancelled" in lines[0], lines
        assert holds(engine) == {}
        alone = request(PROMPT[:20], max_tokens=30)
        engine.submit(alone)
        assert isinstance(final(alone), Done) and alone.done.completion_tokens == 30
        assert engine.room is not None and engine.room.pauses == 0
    finally:
        engine.stop()


def test_a_request_cancelled_while_queued_ends_with_its_log_line(model, caplog):
    """A streamed request's first chunk goes out before the engine takes it, so its client can
    leave while it is still queued: it gives its place back at once (`queued` drops it), and it
    still ends, on the engine thread, with a cancelled Done and its one log line. (The queue
    used to drop it silently: no line, and a non-streaming reader waited forever.) The engine
    is held in a `call()` meanwhile, so the request is certainly still queued."""
    caplog.set_level("INFO", logger="mlx_kvserve.engine")
    engine = started(model)
    left = request(PROMPT, max_tokens=20)
    hold, held = threading.Event(), threading.Event()
    try:
        engine.call(lambda: (held.set(), hold.wait(30)))
        assert held.wait(30)
        try:
            engine.submit(left)
            left.cancel()  # the client leaves
            assert engine.queued == 0  # its place is free at once
        finally:
            hold.set()
        end = final(left, timeout=30)
        assert isinstance(end, Done) and end.finish_reason == "cancelled", left.events
        lines = [
            r.getMessage() for r in caplog.records if f"id={left.request_id} " in r.getMessage()
        ]
        assert len(lines) == 1 and "finish=cancelled" in lines[0], lines
        assert "completion_tokens=0 " in lines[0]
        assert holds(engine) == {}
        after = request(PROMPT, max_tokens=3)
        engine.submit(after)
        assert isinstance(final(after), Done) and after.done.completion_tokens == 3
    finally:
        engine.stop()


def test_a_request_still_queued_at_shutdown_ends_with_its_log_line(model, caplog):
    """Stopping ends a request that is still queued with the shutdown's error, and it gets its
    one log line (`finish=shutdown`) like every other request the server took. The engine is
    held in a `call()`, so the request is certainly still queued when the stop comes."""
    caplog.set_level("INFO", logger="mlx_kvserve.engine")
    engine = started(model)
    queued = request(PROMPT, max_tokens=20)
    hold, held = threading.Event(), threading.Event()
    engine.call(lambda: (held.set(), hold.wait(30)))
    assert held.wait(30)
    engine.submit(queued)
    stopper = threading.Thread(target=engine.stop)
    stopper.start()
    try:
        end = final(queued, timeout=30)
    finally:
        hold.set()
        stopper.join(60)
    assert isinstance(end, EngineError) and "shutting down" in str(end), queued.events
    lines = [r.getMessage() for r in caplog.records if f"id={queued.request_id} " in r.getMessage()]
    assert len(lines) == 1 and "finish=shutdown" in lines[0], lines
    assert "completion_tokens=0 " in lines[0]


def test_a_non_streaming_request_whose_client_left_while_queued_returns(model_dir):
    """The app itself, called with a client that disconnects as soon as its body is read,
    while the engine is held in a `call()`: the request is cancelled while still queued. The
    handler must return (a 499, its model lease given back), not wait for ever for an end the
    engine never sent."""
    from mlx_lm import load

    from mlx_kvserve.api.app import create_app
    from mlx_kvserve.models.pool import ModelPool

    engine = Engine(lambda: load(str(model_dir)), cache_enabled=False)
    pool = ModelPool.single(engine, "tiny")
    app = create_app(Settings(), pool)
    body = json.dumps({**CHAT, "max_tokens": 50}).encode()
    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/chat/completions",
        "raw_path": b"/v1/chat/completions",
        "query_string": b"",
        "root_path": "",
        "headers": [
            (b"host", b"localhost"),
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
        ],
        "client": ("127.0.0.1", 50000),
        "server": ("localhost", 80),
    }
    hold, held = threading.Event(), threading.Event()

    async def leave() -> list[dict]:
        sent: list[dict] = []
        left = asyncio.Event()
        pending = [{"type": "http.request", "body": body, "more_body": False}]

        async def receive() -> dict:
            if pending:
                return pending.pop(0)
            left.set()  # read by the disconnect watch, once the request is queued
            return {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            sent.append(message)

        answered = asyncio.ensure_future(app({**scope, "state": {}}, receive, send))
        await left.wait()
        while engine.queued:  # the watch cancels it: the queue gives its place back
            await asyncio.sleep(0.01)
        hold.set()  # only now may the engine look at its queue
        await asyncio.wait_for(answered, 30)  # a hang guard
        return sent

    with TestClient(app, base_url=LOCAL) as client:
        assert client.post("/v1/chat/completions", json=CHAT).status_code == 200  # loaded
        engine.call(lambda: (held.set(), hold.wait(30)))
        assert held.wait(30)
        try:
            sent = client.portal.call(leave)
        finally:
            hold.set()
        assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 499
        assert pool.default.leases == 0


# -- the resident a returning conversation takes ----------------------------------------------
def test_under_contention_the_resident_a_request_reuses_is_not_shed(model):
    """Conversation A's turn comes back while B decodes and memory is short: the other
    resident (C) is dropped, A's own stays and is moved into its request (counted once)."""
    sources: dict[str, str] = {}
    engine = started(model, cache_enabled=True, live_budget=1 << 30, kv_reserve=2048)
    engine.add_observer(
        lambda req, timings: (
            sources.__setitem__(req.request_id, timings.cache_source) if timings else None
        )
    )
    try:
        a = request(PROMPT, max_tokens=4)
        engine.submit(a)
        final(a)
        c = request([(5 * i + 1) % 97 for i in range(23)], max_tokens=4)
        engine.submit(c)
        final(c)
        b = request(list(range(60, 68)), max_tokens=1000)  # shares no token with A or C
        engine.submit(b)
        decoding(b)
        a2 = request(PROMPT + a.sampled + [11, 12, 13], max_tokens=4)
        states = engine.generator.states if engine.generator is not None else None
        assert states is not None and engine.room is not None
        room = engine.room

        def tighten_and_submit() -> tuple[int, int]:
            """Budget: B and A2 fit beside one resident (not two), so one must go."""
            reused = states.reusable(a2.prompt_tokens, a2.namespace)
            assert reused is not None  # A's resident, the newest but one
            before = states.resident_bytes
            room.ledger.budget = 0
            room.refresh()
            every_copy = room.ledger.shortfall(len(a2.prompt_tokens), 4)  # B, A2, A, C
            room.ledger.budget = every_copy - reused.nbytes - 1
            engine.submit(a2)
            return before, reused.nbytes

        before, reused = engine.call(tighten_and_submit).result(30)
        assert before > reused  # C's resident is there too
        assert isinstance(final(a2), Done)
        assert sources[a2.request_id] == "live"  # A's resident, not a cold prefill
        assert a2.done.cached_tokens == len(PROMPT) + len(a.sampled) - 1
        b.cancel()
        final(b)
        assert holds(engine) == {}
    finally:
        engine.stop()


# -- loading on demand ---------------------------------------------------------------------------
def test_a_model_loading_on_demand_does_not_stall_health(model_dir):
    """The second model's engine takes long to make (its prompt cache opening: a directory
    scan); /health and the other model answer meanwhile."""
    from mlx_lm import load

    from mlx_kvserve.api.app import create_app
    from mlx_kvserve.models.pool import ModelPool, Slot
    from mlx_kvserve.models.specs import ModelSpec

    opening, gate = threading.Event(), threading.Event()

    def start_engine(slot: Slot) -> Engine:
        if slot.name == "slow":
            opening.set()
            gate.wait(60)  # stands in for a slow prompt-cache open
        return Engine(lambda: load(str(model_dir)), cache_enabled=False)

    slots = [
        Slot(ModelSpec("fast", str(model_dir)), "fast", footprint=1),
        Slot(ModelSpec("slow", str(model_dir)), "slow", footprint=1),
    ]
    pool = ModelPool(slots, start_engine, memory_budget=1 << 40, max_loaded=2)
    with TestClient(create_app(Settings(), pool), base_url=LOCAL) as client:
        answers: list = []
        asking = threading.Thread(
            target=lambda: answers.append(
                client.post("/v1/chat/completions", json={**CHAT, "model": "slow"})
            )
        )
        asking.start()
        try:
            assert opening.wait(60)
            seen: list = []
            health = threading.Thread(target=lambda: seen.append(client.get("/health")))
            health.start()
            health.join(30)  # while the slow engine is still being made
            assert seen and seen[0].status_code in (200, 503), "/health did not answer"
            assert seen[0].json()["models"]["slow"] == "loading"
            fast = client.post("/v1/chat/completions", json={**CHAT, "model": "fast"})
            assert fast.status_code == 200 and not gate.is_set()
        finally:
            gate.set()
            asking.join(120)
        assert answers and answers[0].status_code == 200, answers
