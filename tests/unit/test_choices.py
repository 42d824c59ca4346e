"""Several choices of one request (OpenAI's `n`) in the engine, on the tiny random llama.

A request with forks is prefilled once; each fork decodes as its own row of the batch from a
copy of that prefill's KV. Checked: the prompt runs through the model once whatever `n`, greedy
choices all equal mlx-lm's loop, seeded choice i equals a lone request seeded seed+i, every row's
caches hold exactly its tokens, only choice 0's output reaches the prompt cache and the resident
session, and cancelled choices leave the batch.
"""

from __future__ import annotations

import dataclasses

import pytest

from mlx_kvserve.cache import PromptCache
from mlx_kvserve.engine.generate import Generator
from mlx_kvserve.engine.prompt_state import PromptStates
from mlx_kvserve.engine.requests import Prefilled
from tests.unit.test_batching import Driver, check_caches
from tests.unit.test_engine_units import (
    PROMPT,
    Recorder,
    StubTokenizer,
    reference,
    request,
    tiny_model,
    tokens_of,
)

MiB = 1 << 20


@pytest.fixture(scope="module")
def model():
    return tiny_model()


class CountingModel:
    """The model, counting the prompt tokens of its passes (inputs longer than one token per
    row are prefill: decode feeds one token per row)."""

    def __init__(self, model) -> None:
        self.model = model
        self.prefilled = 0

    def __call__(self, inputs, cache=None):
        if inputs.shape[1] > 1:
            self.prefilled += inputs.shape[1]
        return self.model(inputs, cache=cache)

    def __getattr__(self, name):
        return getattr(self.model, name)


def with_choices(primary: Recorder, n: int) -> list[Recorder]:
    """`primary` and its n-1 forks, as api/generation.py makes them (seed + i)."""
    seed = primary.params.seed
    for i in range(1, n):
        params = dataclasses.replace(primary.params, seed=None if seed is None else seed + i)
        fork = Recorder(list(primary.prompt_tokens), params, primary.kind, choice=i)
        primary.forks.append(fork)
    return [primary, *primary.forks]


def sampled(seed: int | None, max_tokens: int = 10) -> Recorder:
    req = request(PROMPT, max_tokens=max_tokens)
    req.params = dataclasses.replace(req.params, temperature=1.0, seed=seed)
    return req


def join_all(driver: Driver, req: Recorder) -> None:
    """Prefill `req` and add it and its forks to the batch, as the engine does."""
    _, seq = driver.gen.start(req)
    assert seq is not None
    for row in [seq, *seq.forks]:
        driver.batch.add(row)


@pytest.mark.parametrize("mergeable", [True, False], ids=["merged", "one-at-a-time"])
def test_one_prefill_for_n_greedy_choices(model, mergeable):
    driver = Driver(model)
    driver.batch.mergeable = mergeable  # False: each row runs solo, on its own caches in place
    counting = driver.gen.model = CountingModel(model)
    choices = with_choices(request(max_tokens=12), 4)
    join_all(driver, choices[0])
    driver.drain()
    assert counting.prefilled == len(PROMPT)  # not 4x: the forks copied its KV
    check_caches(driver.ended)
    want = reference(model, PROMPT, 12)
    for req in choices:
        assert tokens_of(req.text) == want, req.choice  # temperature 0: all equal
        assert req.done.finish_reason == "length" and req.done.completion_tokens == 12
        assert [type(e) for e in req.events][0] is Prefilled
    assert choices[0].done.prompt_tokens == len(PROMPT)
    assert {r.done.prompt_tokens for r in choices[1:]} == {0}  # the prompt counted once


def test_seeded_choice_i_is_seed_plus_i(model):
    driver = Driver(model)
    choices = with_choices(sampled(seed=7), 3)
    join_all(driver, choices[0])
    driver.drain()
    check_caches(driver.ended)
    texts = [req.text for req in choices]
    assert len(set(texts)) == 3  # different seeds, different samples
    for i, text in enumerate(texts):
        alone = sampled(seed=7 + i)
        Generator(model, StubTokenizer(), PromptStates(model, None), prefill_step=8).run(alone)
        assert alone.text == text, i
    again = with_choices(sampled(seed=7), 3)  # a seeded n-request reproduces
    Generator(model, StubTokenizer(), PromptStates(model, None), prefill_step=8).run(again[0])
    assert [req.text for req in again] == texts


def test_only_choice_zero_extends_the_cache_chain(model):
    cache = PromptCache(None, "tiny-choices", disk_budget=None, ram_budget=64 * MiB)
    states = PromptStates(model, cache)
    gen = Generator(model, StubTokenizer(), states, prefill_step=8)
    choices = with_choices(sampled(seed=3, max_tokens=8), 3)
    gen.run(choices[0])
    outputs = [tokens_of(req.text) for req in choices]
    assert outputs[1] != outputs[0] and outputs[2] != outputs[0]
    ends = {entry.n_tokens for entry in cache.entries()}
    assert max(ends) == len(PROMPT) + 7  # choice 0: prompt + its tokens fed back
    mine = cache.lookup(PROMPT + outputs[0] + [1])
    assert mine.usable == len(PROMPT) + 7
    for other in outputs[1:]:  # the forks' tokens are nowhere in the cache
        common = next(i for i, (a, b) in enumerate(zip(other, outputs[0], strict=True)) if a != b)
        assert cache.lookup(PROMPT + other + [1]).usable <= len(PROMPT) + common
    (resident,) = states._residents
    assert resident.tokens == PROMPT + outputs[0][:-1]


def test_cancelled_choices_leave_the_batch(model):
    driver = Driver(model)
    choices = with_choices(request(max_tokens=40), 3)
    join_all(driver, choices[0])
    driver.step()
    driver.step()
    for req in choices:
        req.cancel()
    driver.drain()
    assert not driver.batch
    assert {req.done.finish_reason for req in choices} == {"cancelled"}
    check_caches([s for s in driver.ended if s.live.caches])
