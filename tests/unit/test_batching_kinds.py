"""Batched greedy equals solo greedy for every architecture whose caches merge, in-process on a
real Engine thread with tiny random-weight models of mlx-lm's own architectures: windows
(`BatchRotatingKVCache`), SSM states (`ArraysCache` rows), `CacheList`, MLA latent KV. Prompts of
different lengths slide past the tiny windows (32) and the rows join and leave at different
steps. A model whose caches cannot merge (llama4's ChunkedKVCache) runs one at a time, correctly.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache

from mlx_kvserve.cache.state import cache_offsets
from mlx_kvserve.engine.requests import Done, Prefilled, TextChunk
from tests.support.tiny_models import make_model_dir
from tests.unit.test_batching import Driver, serve_together
from tests.unit.test_engine_units import reference, request, tokens_of

pytestmark = pytest.mark.slow

PROMPTS = [
    [(7 * i + 3) % 4000 + 100 for i in range(50)],
    [(11 * i + 5) % 4000 + 100 for i in range(9)],
    [(5 * i + 1) % 4000 + 100 for i in range(37)],
    [3000, 1000, 4000, 1000, 5000],
]
LENGTHS = [40, 30, 20, 25]
BATCHED = ["llama", "qwen3_5", "gemma3_text", "gpt_oss", "deepseek_v3", "mamba2", "falcon_h1"]


@pytest.mark.parametrize("name", [*BATCHED, "llama4"])
def test_batched_greedy_equals_solo_greedy(tmp_path, name):
    model = load(str(make_model_dir(tmp_path / name, name)))[0]
    mx.eval(model.parameters())
    reqs = [request(p, max_tokens=n) for p, n in zip(PROMPTS, LENGTHS, strict=True)]
    peaks = serve_together(model, reqs, prefill_step=16)
    for req, p, n in zip(reqs, PROMPTS, LENGTHS, strict=True):
        assert tokens_of(req.text) == reference(model, p, n), req.request_id
        assert req.done.completion_tokens == n
    if name in BATCHED:
        assert max(peaks.values()) >= 2
    else:
        assert set(peaks.values()) == {1}


@pytest.mark.parametrize("name", BATCHED)
def test_caches_leaving_a_batch_continue_like_a_solo_prefill(tmp_path, name):
    """`extract` hands each leaving row its own caches: they hold exactly its tokens (their
    checkpoint and its next turn build on them) and the next token's logits match a prefill."""
    model = load(str(make_model_dir(tmp_path / name, name)))[0]
    driver = Driver(model)
    reqs = [request(p, max_tokens=n) for p, n in zip(PROMPTS, LENGTHS, strict=True)]
    driver.join(reqs[0])
    driver.join(reqs[1])
    driver.step()
    driver.join(reqs[2])
    driver.join(reqs[3])
    driver.drain()
    assert max(driver.sizes) >= 3
    for seq in driver.ended:
        tokens = seq.live.tokens
        assert set(cache_offsets(seq.live.caches)) <= {len(tokens)}
        got = model(mx.array([[11]]), cache=seq.live.caches)[:, -1, :]
        want = model(mx.array([[*tokens, 11]]), cache=make_prompt_cache(model))[:, -1, :]
        np.testing.assert_allclose(np.array(got), np.array(want), atol=1e-3, rtol=1e-3)


def test_a_model_that_cannot_merge_keeps_its_queue_moving(tmp_path):
    """llama4's ChunkedKVCache cannot merge, so its requests decode one at a time; a request
    that arrives meanwhile is looked up, restored from the prompt cache and prefilled while the
    first one generates (its Prefilled event comes before the first one's Done), then decodes
    alone, and both answers are their solo greedy answers."""
    import threading
    import time

    from mlx_kvserve.cache import PromptCache
    from mlx_kvserve.engine.worker import Engine
    from tests.unit.test_engine_units import Recorder, StubTokenizer

    model = load(str(make_model_dir(tmp_path / "llama4", "llama4")))[0]
    mx.eval(model.parameters())
    order: list[tuple[str, object]] = []
    lock = threading.Lock()

    class Logged(Recorder):
        def emit(self, event) -> None:  # type: ignore[override]
            with lock:
                order.append((self.request_id, event))
            super().emit(event)

    def logged(prompt, n) -> Logged:
        base = request(prompt, max_tokens=n)
        return Logged(base.prompt_tokens, base.params, base.kind)

    history = PROMPTS[0]  # an earlier turn of the second conversation, cached
    first, second = PROMPTS[2], [*history, 500, 600, 700]
    pc = PromptCache(tmp_path / "cache", "tiny-llama4", disk_budget=64 << 20, ram_budget=64 << 20)
    engine = Engine(lambda: (model, StubTokenizer()), prompt_cache=pc, prefill_step=16)
    engine.start()
    assert engine.ready.wait(60), engine.load_error
    try:
        warm = logged(history, 1)
        engine.submit(warm)
        while not _has_done(warm):
            time.sleep(0.01)
        a, b = logged(first, 120), logged(second, 12)
        engine.submit(a)
        while not any(isinstance(e, TextChunk) for e in a.events):
            time.sleep(0.005)
        engine.submit(b)
        deadline = time.monotonic() + 120
        while not (_has_done(a) and _has_done(b)) and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        engine.stop()
    assert _has_done(a) and _has_done(b)
    events = [(rid, type(e).__name__) for rid, e in order]
    b_prefilled = events.index((b.request_id, "Prefilled"))
    a_done = events.index((a.request_id, "Done"))
    assert b_prefilled < a_done  # looked up, restored and prefilled while `a` generated
    b_ready = next(e for rid, e in order if rid == b.request_id and isinstance(e, Prefilled))
    assert b_ready.cached_tokens >= len(history) - 1  # a restore from the prompt cache
    a_before = sum(1 for rid, name in events[:b_prefilled] if rid == a.request_id)
    assert 1 <= a_before < a.done.completion_tokens  # `a` had started and not finished
    assert tokens_of(a.text) == reference(model, first, 120)
    assert tokens_of(b.text) == reference(model, second, 12)
    assert a.done.completion_tokens == 120 and b.done.completion_tokens == 12


def _has_done(req) -> bool:
    return any(isinstance(e, Done) for e in req.events)
