"""The prompt cache's continuations drafting through the engine (`--speculation auto`): a request
drafts what an earlier, finished request of its namespace went on with, verification keeps it,
and the tokens are mlx-lm's greedy ones; another namespace drafts none of it."""

from __future__ import annotations

import random
import threading

import mlx.core as mx
import pytest
from mlx.utils import tree_map

from mlx_kvserve.engine.speculation.continuations import SOURCE
from mlx_kvserve.engine.speculation.depth import VerifyCost
from mlx_kvserve.engine.worker import Engine
from tests.unit.test_cache_models import tiny_llama
from tests.unit.test_engine_units import StubTokenizer, reference, request, tokens_of


@pytest.fixture(scope="module")
def model():
    """A tiny llama whose weights are scaled up: its greedy answers wander instead of looping,
    so a row's own tokens seldom predict its next ones and only another request's can."""
    mx.random.seed(0)
    m = tiny_llama(False, vocab=512)
    m.update(tree_map(lambda p: p * 4, m.parameters()))
    mx.eval(m.parameters())
    return m


@pytest.fixture
def prior_cost(monkeypatch: pytest.MonkeyPatch) -> None:
    """Draft on the cost prior alone: a loaded machine's timings must not decide the test."""
    monkeypatch.setattr(VerifyCost, "observe", lambda self, batch, width, seconds: None)


def serve(model, reqs, **engine_args) -> dict:
    """Run `reqs` one after the other (each ends before the next starts) on a real engine
    thread with `--speculation auto`; each request's drafts by source."""
    seen = {}
    ended = threading.Semaphore(0)

    def observe(req, timings) -> None:
        seen[req.request_id] = timings
        ended.release()

    mx.eval(model(mx.array([[0]])))  # lazy arrays made on this thread (test_batching's note)
    engine = Engine(lambda: (model, StubTokenizer()), speculation="auto", **engine_args)
    engine.add_observer(observe)
    engine.start()
    assert engine.ready.wait(60), engine.load_error
    try:
        for req in reqs:
            engine.submit(req)
            assert ended.acquire(timeout=120)
    finally:
        engine.stop()
    return [seen[req.request_id].by_source for req in reqs]


def question(model) -> tuple[list[int], list[int]]:
    """A prompt, and mlx-lm's greedy answer to it (speculation off), which does not loop."""
    rng = random.Random(5)
    prompt = [rng.randrange(3, 500) for _ in range(24)]
    answer = reference(model, prompt, 40)
    assert len(set(answer)) > 30  # no loop for the row's own lookup to follow
    return prompt, answer


def test_a_request_drafts_what_another_conversation_answered(model, prior_cost) -> None:
    prompt, answer = question(model)
    # the first conversation; another one asking the same (no KV shared: the cache is off);
    # the same again under another API key's namespace
    reqs = [request(prompt, max_tokens=40) for _ in range(3)]
    reqs[2].namespace = "another key"
    first, second, other = serve(model, reqs, cache_enabled=False)
    for req in reqs:
        assert tokens_of(req.text) == answer
    assert SOURCE not in first and SOURCE not in other  # nothing of its namespace before it
    drafted, accepted, passes = second[SOURCE]
    assert accepted >= 30 and passes <= 10  # the answer came in a few passes
    assert accepted > second.get("prompt_lookup", [0, 0, 0])[1]


def test_after_a_restart_the_stored_entries_tokens_are_drafted_from(
    model, prior_cost, tmp_path
) -> None:
    """The prompt cache's stored entries fill the continuations at start, per namespace: a new
    server drafts the answer an earlier one stored (its generation checkpoint holds prompt and
    answer) for a request of the same API key, and nothing of it for another key's."""
    from mlx_kvserve.cache.store import PromptCache
    from mlx_kvserve.engine.namespaces import CacheSet

    prompt, answer = question(model)

    def caches() -> CacheSet:
        return CacheSet(
            {
                key: PromptCache(
                    tmp_path / key, "tiny-wander", disk_budget=1 << 30, ram_budget=64 << 20
                )
                for key in ("alice", "bob")
            }
        )

    first = request(prompt, max_tokens=40)
    first.namespace = "alice"
    serve(model, [first], prompt_cache=caches())
    again, other = request(prompt, max_tokens=40), request(prompt, max_tokens=40)
    again.namespace, other.namespace = "alice", "bob"
    foreign, fresh = serve(model, [other, again], prompt_cache=caches())
    assert tokens_of(first.text) == tokens_of(again.text) == tokens_of(other.text) == answer
    assert fresh[SOURCE][1] >= 30  # drafted from what the first server stored, and kept
    assert SOURCE not in foreign


def test_an_image_prompt_is_remembered_without_its_image(model, prior_cost, monkeypatch) -> None:
    """A request whose prompt holds an image: the index gets its tokens as the cache keys them
    and leaves the image out, so no draft ever holds an image's key ids; the text after the
    image and the answer are drafted from as any request's."""
    from mlx_kvserve.engine.speculation.continuations import Continuations
    from mlx_kvserve.images.spans import ImageSpan, is_image_key

    prompt, answer = question(model)
    span = ImageSpan(4, 8, "ab" * 32)
    indexes = []
    remember = Continuations.remember

    def remembering(self, namespace, tokens, cached=0) -> None:
        assert all(is_image_key(t) for t in tokens[4:12])  # keyed: the index can leave it out
        remember(self, namespace, tokens, cached)
        indexes.append(self.index(namespace))

    monkeypatch.setattr(Continuations, "remember", remembering)
    reqs = [request(prompt, max_tokens=40) for _ in range(2)]
    for req in reqs:
        req.image_spans = (span,)
    first, second = serve(model, reqs, cache_enabled=False)
    for req in reqs:
        assert tokens_of(req.text) == answer
    assert second[SOURCE][1] >= 30
    assert indexes and not [t for t in indexes[-1].tokens if is_image_key(t) and t < 1 << 40]


def test_a_replayed_conversation_drafts_its_own_earlier_answer(model, prior_cost) -> None:
    """A conversation asked again (a replayed agent loop) after another request that holds the
    same turn's opening and first answer token, then goes on otherwise (as the latest tool call
    opens as the first did, then names another tool): the latest occurrence of the row's last
    tokens is the other request's, but the first conversation's matches the row further back,
    so its answer is drafted and every draft is kept (SuffixDecoding's longest match)."""
    rng = random.Random(10)
    opening = [rng.randrange(3, 500) for _ in range(6)]
    first = [rng.randrange(3, 500) for _ in range(18)] + opening
    answer = reference(model, first, 40)
    assert len(set(answer)) > 30
    other = [rng.randrange(3, 500) for _ in range(18)] + opening + answer[:1]
    other += [rng.randrange(3, 500) for _ in range(12)]  # the other tool's name and arguments
    reqs = [request(first, max_tokens=40), request(other, max_tokens=4)]
    reqs.append(request(first, max_tokens=40))
    _, _, replay = serve(model, reqs, cache_enabled=False)
    assert tokens_of(reqs[2].text) == answer
    drafted, accepted, passes = replay[SOURCE]
    assert drafted == accepted >= 30  # no draft of what followed in the other request
