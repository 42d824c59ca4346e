"""The decode batch in-process, on the tiny random-weight llama of the engine unit tests.

What is checked is the contract of continuous batching: a request's greedy tokens are the same
whether it decodes alone or beside others (joining and leaving at different steps, free and
grammar-constrained), a cancelled sequence leaves without disturbing the rest, every sequence
that leaves has caches holding exactly its token list, resident sessions, and seeded sampling
that does not depend on the company a request keeps.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlx_kvserve.engine.batch import DecodeBatch
from mlx_kvserve.engine.generate import Generator
from mlx_kvserve.engine.prompt_state import PromptStates
from mlx_kvserve.engine.sequence import Sequence
from tests.unit.test_engine_units import (
    PROMPT,
    StubTokenizer,
    offsets,
    reference,
    request,
    tiny_model,
    tokens_of,
)

PROMPTS = [PROMPT, PROMPT[:9], [(5 * i + 1) % 97 for i in range(23)], [3, 1, 4, 1, 5]]


@pytest.fixture(scope="module")
def model():
    return tiny_model()


class AllowAll:
    """A grammar that allows every token: the constrained (read-first) path, same tokens."""

    finished = False

    def allowed(self, n_logits: int) -> np.ndarray:
        return np.ones(n_logits, dtype=bool)

    def advance(self, token: int) -> None:
        pass

    def forced(self, limit: int) -> list[int]:
        return []


class Driver:
    """Starts requests and steps one batch the way the engine does, prefill steps included."""

    def __init__(self, model, live_budget: int = 0) -> None:
        self.states = PromptStates(model, None, live_budget=live_budget)
        self.gen = Generator(
            model, StubTokenizer(), self.states, prefill_step=8, between_steps=self.step
        )
        self.ended: list[Sequence] = []
        self.sizes: list[int] = []
        self.batch = DecodeBatch(model, self._end)

    def _end(self, seq: Sequence) -> None:
        self.ended.append(seq)
        self.gen.finish(seq)

    def step(self) -> None:
        if self.batch:
            self.sizes.append(len(self.batch))
            self.batch.step()

    def join(self, req) -> None:
        _, seq = self.gen.start(req)
        if seq is not None:
            self.batch.add(seq)

    def drain(self) -> None:
        while self.batch:
            self.step()


def check_caches(seqs: list[Sequence]) -> None:
    for seq in seqs:
        assert offsets(seq.live.caches) == {len(seq.live.tokens)}, seq.req.request_id
        assert seq.live.tokens[: len(seq.req.prompt_tokens)] == seq.req.prompt_tokens


@pytest.mark.parametrize("constrained", [(), (1,), (0, 2, 3)], ids=["free", "one", "most"])
def test_batched_greedy_equals_solo(model, constrained):
    lengths = [12, 5, 9, 16]
    want = [reference(model, p, n) for p, n in zip(PROMPTS, lengths, strict=True)]
    driver = Driver(model)
    reqs = [request(p, max_tokens=n) for p, n in zip(PROMPTS, lengths, strict=True)]
    for i in constrained:
        reqs[i].constraint = AllowAll()
    driver.join(reqs[0])
    driver.join(reqs[1])  # prefills while the first decodes
    driver.step()
    driver.step()
    driver.join(reqs[2])
    driver.join(reqs[3])
    driver.drain()
    assert max(driver.sizes) >= 3  # they really shared passes
    for req, expected, n in zip(reqs, want, lengths, strict=True):
        assert tokens_of(req.text) == expected, req.request_id
        assert req.done.finish_reason == "length" and req.done.completion_tokens == n
    check_caches(driver.ended)


def test_eos_and_stop_strings_end_one_sequence_only(model):
    want = [reference(model, p, 12) for p in PROMPTS]
    driver = Driver(model)
    driver.gen.tokenizer = StubTokenizer(eos=(want[0][4],))
    stop = f"<{want[1][2]}>"
    reqs = [request(PROMPTS[0]), request(PROMPTS[1], stop=(stop,)), request(PROMPTS[2])]
    for req in reqs:
        driver.join(req)
    driver.drain()
    eos_at = want[0].index(want[0][4])
    assert tokens_of(reqs[0].text) == want[0][:eos_at]
    assert reqs[0].done.finish_reason == "stop"
    assert reqs[1].done.stop_sequence == stop
    assert tokens_of(reqs[1].text) == want[1][: want[1].index(want[1][2])]
    third = want[2][: want[2].index(want[0][4])] if want[0][4] in want[2] else want[2]
    assert tokens_of(reqs[2].text) == third
    check_caches(driver.ended)


def test_cancelling_one_sequence_leaves_the_others_intact(model):
    want = [reference(model, p, 14) for p in PROMPTS[:3]]
    driver = Driver(model)
    reqs = [request(p, max_tokens=14) for p in PROMPTS[:3]]
    for req in reqs:
        driver.join(req)
    for _ in range(3):
        driver.step()
    reqs[1].cancel()
    driver.step()  # within one step
    assert reqs[1].done.finish_reason == "cancelled"
    assert reqs[1].done.completion_tokens <= 4
    driver.drain()
    for i in (0, 2):
        assert tokens_of(reqs[i].text) == want[i]
    check_caches(driver.ended)


def test_resident_sessions_serve_each_conversation_its_own_kv(model):
    driver = Driver(model, live_budget=64 << 20)
    reqs = [request(p, max_tokens=4) for p in PROMPTS[:3]]
    for req in reqs:
        driver.join(req)
    driver.drain()
    assert driver.states.residents == 3
    for req in reqs:  # each next turn finds its own conversation, whole
        follow = req.prompt_tokens + tokens_of(req.text) + [7, 8]
        start = driver.states.acquire(follow)
        assert start.source == "live"
        assert start.usable >= len(req.prompt_tokens) + 3
    assert driver.states.residents == 0


def test_live_budget_zero_keeps_only_the_newest(model):
    driver = Driver(model, live_budget=0)
    for p in PROMPTS[:3]:
        driver.join(request(p, max_tokens=3))
    driver.drain()
    assert driver.states.residents == 1


def test_seeded_sampling_does_not_depend_on_the_company(model):
    def sample(companions: int) -> str:
        driver = Driver(model)
        seeded = request(PROMPT, max_tokens=10, seed=42)
        seeded.params = type(seeded.params)(temperature=1.0, max_tokens=10, seed=42)
        driver.join(seeded)
        for p in PROMPTS[1 : 1 + companions]:
            other = request(p, max_tokens=10)
            other.params = type(other.params)(
                temperature=1.0,  # unseeded: the company is random, the seeded row's is not
                max_tokens=10,
            )
            driver.join(other)
        driver.drain()
        return seeded.text

    alone = sample(0)
    assert sample(2) == alone
    assert sample(3) == alone


def test_solo_pass_uses_plain_caches(model):
    """A lone request never pays for batching: its pass runs on its own KVCache layers."""
    driver = Driver(model)
    req = request(PROMPT, max_tokens=6)
    driver.join(req)
    driver.step()
    assert driver.batch._merged is None
    driver.join(request(PROMPTS[1], max_tokens=2))
    assert driver.batch._merged is not None
    driver.drain()
    assert tokens_of(req.text) == reference(model, PROMPT, 6)
    mx.eval([c.keys for s in driver.ended for c in s.live.caches])


# ------------------------------------------------------------------------ the engine's loop --
def serve_together(model, reqs, started=None, **engine_args) -> dict[str, int]:
    """Submit `reqs` at once to a real Engine thread; the batch size each decoded in.
    `started(engine)`, if given, sees the engine once it is ready."""
    import threading

    from mlx_kvserve.engine.worker import Engine
    from tests.unit.test_engine_failures import submit_together

    peaks: dict[str, int] = {}
    finished = threading.Semaphore(0)

    def observe(req, timings) -> None:
        peaks[req.request_id] = timings.batch_peak if timings else 0
        finished.release()

    # A model loaded on this thread may hold lazy arrays that are not parameters (rope scaling's
    # frequencies): one pass here makes them, since MLX's streams belong to a thread.
    mx.eval(model(mx.array([[0]])))
    engine = Engine(lambda: (model, StubTokenizer()), cache_enabled=False, **engine_args)
    engine.add_observer(observe)
    engine.start()
    assert engine.ready.wait(60), engine.load_error
    if started is not None:
        started(engine)
    try:
        # queued while the engine thread is held, so it finds them all at once: on a loaded
        # machine a submit loop could lose the race and the rows would never merge
        submit_together(engine, reqs)
        for _ in reqs:  # a hang detector, not a time limit: a niced run beside a full suite is slow
            assert finished.acquire(timeout=600)
    finally:
        engine.stop()
    return peaks


@pytest.mark.parametrize("sliding", [False, True], ids=["kv", "rotating"])
def test_engine_batches_what_it_can_and_answers_the_same(sliding):
    from tests.unit.test_cache_models import tiny_llama

    mx.random.seed(1)
    m = tiny_llama(sliding)
    mx.eval(m.parameters())
    lengths = [40, 30, 20, 25]
    reqs = [request(p, max_tokens=n) for p, n in zip(PROMPTS, lengths, strict=True)]
    peaks = serve_together(m, reqs, prefill_step=8)
    for req, p, n in zip(reqs, PROMPTS, lengths, strict=True):
        assert tokens_of(req.text) == reference(m, p, n)
        assert req.done.completion_tokens == n
    assert max(peaks.values()) >= 2  # rotating windows merge too (BatchRotatingKVCache)


def test_engine_concurrency_cap():
    m = tiny_model()
    reqs = [request(p, max_tokens=30) for p in PROMPTS]
    assert set(serve_together(m, reqs, max_concurrency=1).values()) == {1}
    reqs = [request(p, max_tokens=30) for p in PROMPTS]
    assert max(serve_together(m, reqs, max_concurrency=2).values()) == 2


def test_a_resident_is_not_cut_for_another_conversation(model):
    """Two conversations share a prefix; the cache has that prefix too. The other
    conversation's resident stays whole (the cache serves the shared part), though it is the
    newest; a conversation whose own resident differs only in its last tokens gets it back."""
    from mlx_kvserve.cache import PromptCache

    cache = PromptCache(None, "tiny-residents", disk_budget=None, ram_budget=64 << 20)
    states = PromptStates(model, cache, live_budget=64 << 20)
    shared = PROMPT[:12]
    a, b = shared + [1] * 18, shared + [2] * 18
    for tokens in (a, b):  # a resident each, and the shared prefix as a checkpoint
        start = states.cold()
        model(mx.array([tokens]), cache=start.caches)
        states.keep(tokens, start.caches)
    start = states.cold()
    model(mx.array([shared]), cache=start.caches)
    cache.checkpoint(shared, start.caches, "anchor", anchor=True)
    # A third conversation on the shared prefix: served by the cache, both residents stay.
    got = states.acquire(shared + [3] * 5)
    assert got.source == "ram" and got.usable == 12 and states.residents == 2
    # A returns with its last two tokens re-rendered differently: its own resident, cut by 2.
    got = states.acquire(a[:-2] + [4, 4, 5])
    assert got.source == "live" and got.usable == len(a) - 2
    assert states.residents == 1
