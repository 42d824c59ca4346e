"""`PromptStates` and `Generator` in-process, on the tiny random-weight models of the cache tests.

No server, no tokenizer files: a stub tokenizer spells token t as "<t>". What is checked is the
engine's own contract: where a prefill starts (live, RAM, cold), that the KV caches and the token
list that describes them never disagree, that greedy output equals mlx-lm's own loop, exact
completion_tokens, stop strings, EOS, cancellation within one step, and the cold retry.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_sampler

from mlx_kvserve.cache import PromptCache
from mlx_kvserve.engine import decode as decode_module
from mlx_kvserve.engine import faults
from mlx_kvserve.engine.generate import Generator
from mlx_kvserve.engine.prompt_state import PromptStates
from mlx_kvserve.engine.requests import Done, GenerationRequest, SamplingParams, TextChunk
from tests.unit.test_cache_models import tiny_llama

MiB = 1 << 20
PROMPT = [(7 * i + 3) % 97 for i in range(30)]


class StubDetokenizer:
    def __init__(self) -> None:
        self.text = ""
        self._emitted = 0

    def add_token(self, token: int) -> None:
        self.text += f"<{token}>"

    @property
    def last_segment(self) -> str:
        out, self._emitted = self.text[self._emitted :], len(self.text)
        return out

    def finalize(self) -> None:
        pass


class StubTokenizer:
    def __init__(self, eos: tuple[int, ...] = ()) -> None:
        self.eos_token_ids = set(eos)

    @property
    def detokenizer(self) -> StubDetokenizer:
        return StubDetokenizer()


class Recorder(GenerationRequest):
    """Keeps the events instead of handing them to an event loop."""

    def emit(self, event) -> None:  # type: ignore[override]
        self.__dict__.setdefault("events", []).append(event)

    @property
    def events(self) -> list:
        return self.__dict__.setdefault("events", [])

    @property
    def text(self) -> str:
        return "".join(e.text for e in self.events if isinstance(e, TextChunk))

    @property
    def done(self) -> Done:
        (done,) = [e for e in self.events if isinstance(e, Done)]
        return done


def request(prompt=PROMPT, max_tokens=12, **params) -> Recorder:
    return Recorder(
        list(prompt), SamplingParams(temperature=0.0, max_tokens=max_tokens, **params), "text"
    )


def tiny_model():
    """The tiny random llama of the cache tests, with fixed weights."""
    mx.random.seed(0)
    m = tiny_llama(False)
    mx.eval(m.parameters())
    return m


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def reference(model, prompt, n) -> list[int]:
    """mlx-lm's own greedy loop."""
    steps = generate_step(mx.array(prompt), model, max_tokens=n, sampler=make_sampler(temp=0.0))
    return [int(t) for t, _ in steps]


def tokens_of(text: str) -> list[int]:
    return [int(t) for t in text.strip("<>").split("><")] if text else []


def offsets(caches) -> set[int]:
    return {c.offset for c in caches}


# ---------------------------------------------------------------------------- PromptStates --
def test_live_state_is_trimmed_to_the_common_prefix(model):
    states = PromptStates(model, None)
    start = states.cold()
    model(mx.array([PROMPT])[:, :20], cache=start.caches)
    states.keep(PROMPT[:20], start.caches)
    # A prompt that diverges at 12: the live state is cut back to 12 tokens, in place.
    other = PROMPT[:12] + [5, 6, 7, 8]
    got = states.acquire(other)
    assert got.source == "live" and got.tokens == other[:12]
    assert offsets(got.caches) == {12}
    # Taken: a second acquire has nothing live to reuse.
    assert states.acquire(other).source == "cold"


def test_exact_repeat_still_prefills_one_token(model):
    states = PromptStates(model, None)
    start = states.cold()
    model(mx.array([PROMPT]), cache=start.caches)
    states.keep(PROMPT, start.caches)
    got = states.acquire(PROMPT)
    assert got.usable == len(PROMPT) - 1 and offsets(got.caches) == {len(PROMPT) - 1}


def test_disabled_states_never_reuse(model):
    states = PromptStates(model, None, enabled=False)
    start = states.cold()
    model(mx.array([PROMPT]), cache=start.caches)
    states.keep(PROMPT, start.caches)
    assert states.acquire(PROMPT).source == "cold"


def test_rotating_live_state_is_not_trimmed():
    mx.random.seed(1)
    sliding = tiny_llama(True)
    mx.eval(sliding.parameters())
    states = PromptStates(sliding, None)
    start = states.cold()
    sliding(mx.array([PROMPT[:20]]), cache=start.caches)
    states.keep(PROMPT[:20], start.caches)
    assert states.acquire(PROMPT[:12] + [1, 2, 3]).source == "cold"  # would need a trim
    start = states.cold()
    sliding(mx.array([PROMPT[:20]]), cache=start.caches)
    states.keep(PROMPT[:20], start.caches)
    assert states.acquire(PROMPT).usable == 20  # an exact prefix is reused


def test_cache_hit_restores_and_evict_forgets(model):
    cache = PromptCache(None, "tiny-units", disk_budget=None, ram_budget=64 * MiB)
    states = PromptStates(model, cache)
    start = states.cold()
    model(mx.array([PROMPT[:16]]), cache=start.caches)
    assert cache.checkpoint(PROMPT[:16], start.caches, "message") is not None
    got = states.acquire(PROMPT)  # nothing live: the RAM tier serves it
    assert got.source == "ram" and got.usable == 16 and offsets(got.caches) == {16}
    key, first = states.newest_link(got)
    assert first == 0
    states.evict_link(key, "test failure")
    assert states.acquire(PROMPT).source == "cold"
    assert cache.stats()["failure_evictions"] == 1
    # Nothing is barred: the same tokens' state, computed again, is stored again.
    assert cache.checkpoint(PROMPT[:16], got.caches, "message") == key


# ------------------------------------------------------------------------------- Generator --
@pytest.mark.parametrize("pipelined", [True, False], ids=["pipelined", "one-step"])
def test_greedy_output_equals_mlx_lm(model, monkeypatch, pipelined):
    if not pipelined:
        monkeypatch.setattr(decode_module.Decoder, "pipelined", property(lambda self: False))
    gen = Generator(model, StubTokenizer(), PromptStates(model, None), prefill_step=8)
    req = request(max_tokens=12)
    timings = gen.run(req)
    want = reference(model, PROMPT, 12)
    assert tokens_of(req.text) == want
    assert req.done.finish_reason == "length" and req.done.completion_tokens == 12
    assert timings.completion_tokens == 12
    # The live state: the prompt and every completion token fed back (not the last one).
    live = gen.states._residents[0]
    assert live.tokens == PROMPT + want[:-1]
    assert offsets(live.caches) == {len(live.tokens)}


@pytest.mark.parametrize("pipelined", [True, False], ids=["pipelined", "one-step"])
def test_eos_counts_and_the_cache_matches_its_tokens(model, monkeypatch, pipelined):
    if not pipelined:
        monkeypatch.setattr(decode_module.Decoder, "pipelined", property(lambda self: False))
    want = reference(model, PROMPT, 12)
    eos = want[4]
    first = want.index(eos)
    gen = Generator(model, StubTokenizer(eos=(eos,)), PromptStates(model, None), prefill_step=8)
    req = request(max_tokens=12)
    gen.run(req)
    assert req.done.finish_reason == "stop"
    assert req.done.completion_tokens == first + 1  # the EOS token counts, its text does not
    assert tokens_of(req.text) == want[:first]
    live = gen.states._residents[0]
    assert live.tokens[: len(PROMPT) + first] == PROMPT + want[:first]
    assert offsets(live.caches) == {len(live.tokens)}  # whatever was fed is accounted for


@pytest.mark.parametrize("pipelined", [True, False], ids=["pipelined", "one-step"])
def test_ignore_eos_runs_to_max_tokens(model, monkeypatch, pipelined):
    """`ignore_eos`: the end-of-sequence ids are never drawn, greedy or sampled, so the length
    is max_tokens."""
    if not pipelined:
        monkeypatch.setattr(decode_module.Decoder, "pipelined", property(lambda self: False))
    want = reference(model, PROMPT, 12)
    eos = want[4]
    first = want.index(eos)
    gen = Generator(model, StubTokenizer(eos=(eos,)), PromptStates(model, None), prefill_step=8)
    req = request(max_tokens=12, ignore_eos=True)
    gen.run(req)
    assert req.done.finish_reason == "length" and req.done.completion_tokens == 12
    got = tokens_of(req.text)
    assert len(got) == 12 and eos not in got and got[:first] == want[:first]
    # sampled, with every token greedy would pick taken as an end: none of them is drawn
    ends = tuple(set(want))
    gen = Generator(model, StubTokenizer(eos=ends), PromptStates(model, None), prefill_step=8)
    req = Recorder(list(PROMPT), SamplingParams(1.0, max_tokens=12, seed=3, ignore_eos=True))
    gen.run(req)
    assert req.done.finish_reason == "length" and req.done.completion_tokens == 12
    assert not set(tokens_of(req.text)) & set(ends)


class EndsAfter:
    """A grammar that allows any token `n` times, then only `end`."""

    grammar = None

    def __init__(self, n: int, end: int) -> None:
        self.n, self.end, self.seen = n, end, 0

    def allowed(self, n_logits: int):
        if self.seen < self.n:
            return None
        mask = np.zeros(n_logits, dtype=bool)
        mask[self.end] = True
        return mask

    def advance(self, token: int) -> None:
        self.seen += 1

    def forced(self, limit: int) -> list[int]:
        return []

    @property
    def finished(self) -> bool:
        return False


def test_ignore_eos_still_ends_where_the_grammar_allows_nothing_else(model):
    eos = reference(model, PROMPT, 1)[0] + 1
    gen = Generator(model, StubTokenizer(eos=(eos,)), PromptStates(model, None), prefill_step=8)
    req = request(max_tokens=12, ignore_eos=True)
    req.constraint = EndsAfter(3, eos)
    gen.run(req)
    assert req.done.finish_reason == "stop" and req.done.completion_tokens == 4
    assert len(tokens_of(req.text)) == 3


def test_stop_string_ends_the_text(model):
    want = reference(model, PROMPT, 12)
    stop = f"<{want[3]}>"
    first = want.index(want[3])
    gen = Generator(model, StubTokenizer(), PromptStates(model, None), prefill_step=8)
    req = request(max_tokens=12, stop=(stop,))
    gen.run(req)
    assert req.done.finish_reason == "stop" and req.done.stop_sequence == stop
    assert tokens_of(req.text) == want[:first]
    assert req.done.completion_tokens == first + 1


def test_cancel_stops_within_one_step_and_keeps_the_state(model):
    gen = Generator(model, StubTokenizer(), PromptStates(model, None), prefill_step=8)
    req = request(max_tokens=50)
    original = Recorder.emit

    def emit(self, event) -> None:
        original(self, event)
        if isinstance(event, TextChunk) and len(tokens_of(self.text)) == 3:
            self.cancel()

    req.emit = emit.__get__(req)  # type: ignore[method-assign]
    gen.run(req)
    assert req.done.finish_reason == "cancelled"
    assert req.done.completion_tokens <= 4
    live = gen.states._residents[0]
    assert live is not None and offsets(live.caches) == {len(live.tokens)}
    assert live.tokens[: len(PROMPT)] == PROMPT


def test_failure_after_a_restore_evicts_and_retries_cold(model, monkeypatch):
    cache = PromptCache(None, "tiny-units-retry", disk_budget=None, ram_budget=64 * MiB)
    states = PromptStates(model, cache)
    gen = Generator(model, StubTokenizer(), states, prefill_step=8, checkpoint_interval=0)
    start = states.cold()
    model(mx.array([PROMPT[:16]]), cache=start.caches)
    cache.checkpoint(PROMPT[:16], start.caches, "message")
    monkeypatch.setenv(faults.ENV, "prefill_after_restore:1")
    monkeypatch.setattr(faults, "_rules", None)
    monkeypatch.setattr(faults, "_calls", {})
    req = request(max_tokens=6)
    timings = gen.run(req)
    assert timings.retried and req.done.cached_tokens == 0
    assert tokens_of(req.text) == reference(model, PROMPT, 6)
    assert cache.stats()["failure_evictions"] == 1
