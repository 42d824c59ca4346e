"""The prompt cache keys images by their content (issue 33, item 3), on the engine in-process.

A tiny random-weight text model and synthetic image spans over ordinary token ids: what is
checked is the cache's side, which is the same for any model. A span's ids are the same for
every image (a vision model's placeholder token), so only the span's digest tells two images
apart, as in vllm-mlx #718. The engine keys every cache operation by `key_tokens` and feeds the
model the real ids; a reused prefix and every checkpoint end outside an image.
"""

from __future__ import annotations

import hashlib
import json

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mlx_lm.models import llama

from mlx_kvserve.cache import PromptCache
from mlx_kvserve.cache.kinds import describe_model
from mlx_kvserve.engine import faults
from mlx_kvserve.engine.batch import DecodeBatch
from mlx_kvserve.engine.generate import Generator
from mlx_kvserve.engine.prompt_state import PromptStates
from mlx_kvserve.engine.requests import SamplingParams
from mlx_kvserve.engine.room import Room
from mlx_kvserve.engine.speculation.continuations import Continuations
from mlx_kvserve.images.spans import (
    IMAGE_KEY_BASE,
    ImageSpan,
    find_spans,
    is_image_key,
    key_tokens,
    whole_spans,
)
from tests.unit.test_cache_models import tiny_llama
from tests.unit.test_engine_units import Recorder, StubTokenizer, tiny_model, tokens_of

MiB = 1 << 20
FINGERPRINT = "tiny-image-keys"
PAD = 5  # the placeholder id every image's span is made of, as a vision model's prompt has
SYSTEM = [(11 * i + 7) % 90 + 6 for i in range(24)]
IMAGE_AT, IMAGE_LEN = len(SYSTEM), 16
QUESTION = [(13 * i + 2) % 90 + 6 for i in range(10)]
PROMPT = SYSTEM + [PAD] * IMAGE_LEN + QUESTION


def digest(name: str) -> str:
    return hashlib.sha256(name.encode()).hexdigest()


def image(name: str, start: int = IMAGE_AT, length: int = IMAGE_LEN) -> ImageSpan:
    return ImageSpan(start, length, digest(name))


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture
def fed(monkeypatch):
    """Every id the model is fed, in order (prefill chunks, decode steps, probes)."""
    seen: list[list[int]] = []
    forward = llama.Model.__call__

    def recording(self, inputs, *args, **kwargs):
        seen.append(np.asarray(inputs).reshape(-1).tolist())
        return forward(self, inputs, *args, **kwargs)

    monkeypatch.setattr(llama.Model, "__call__", recording)
    return seen


def ask(gen: Generator, prompt, spans=(), max_tokens=6, boundaries=None) -> Recorder:
    req = Recorder(
        list(prompt),
        SamplingParams(temperature=0.0, max_tokens=max_tokens),
        "text",
        boundaries=dict(boundaries or {}),
        image_spans=tuple(spans),
    )
    gen.run(req)
    return req


def engine(model, cache=None, *, step=8, interval=0) -> Generator:
    states = PromptStates(model, cache, enabled=cache is not None)
    return Generator(
        model, StubTokenizer(), states, prefill_step=step, checkpoint_interval=interval
    )


def ram_cache(name: str = FINGERPRINT) -> PromptCache:
    return PromptCache(None, name, disk_budget=None, ram_budget=64 * MiB)


def disk_cache(path) -> PromptCache:
    return PromptCache(path, FINGERPRINT, disk_budget=256 * MiB, ram_budget=64 * MiB)


def answer_of(model, prompt, spans=(), max_tokens=6) -> list[int]:
    """The greedy answer with no cache at all (`--no-cache`)."""
    return tokens_of(ask(engine(model), prompt, spans, max_tokens).text)


# ------------------------------------------------------------------------------ the key --
def test_key_tokens_replace_each_span_and_nothing_else():
    a, b = image("a"), image("b")
    key_a, key_b = key_tokens(PROMPT, [a]), key_tokens(PROMPT, [b])
    assert key_a[:IMAGE_AT] == PROMPT[:IMAGE_AT] and key_a[a.end :] == PROMPT[a.end :]
    assert all(is_image_key(t) for t in key_a[a.start : a.end])
    assert len(set(key_a[a.start : a.end])) == IMAGE_LEN  # no two positions share an id
    assert key_a[a.start] != key_b[b.start]  # another picture differs from its first position
    assert key_tokens(PROMPT, [a]) == key_a  # the same pixels, the same key, in any run
    # The same pixels read as another number of tokens are other features: no shared ids.
    longer = ImageSpan(IMAGE_AT, IMAGE_LEN + 4, a.digest)
    assert key_tokens(PROMPT + [7] * 4, [longer])[IMAGE_AT] != key_a[IMAGE_AT]
    assert key_tokens(PROMPT, []) == PROMPT
    with pytest.raises(ValueError):
        key_tokens(PROMPT[:30], [a])
    with pytest.raises(ValueError):
        ImageSpan(0, 0, a.digest)
    # A request whose images do not fit its prompt is a bug of whoever placed them: refused.
    params = SamplingParams(temperature=0.0, max_tokens=1)
    for bad in ([image("a", start=len(PROMPT) - 2)], [image("a"), image("b", start=IMAGE_AT + 4)]):
        with pytest.raises(ValueError):
            Recorder(list(PROMPT), params, "text", image_spans=tuple(bad))


def test_whole_spans_cuts_back_to_an_image_start():
    spans = [image("a"), image("b", start=60, length=8)]
    assert whole_spans(IMAGE_AT, spans) == IMAGE_AT
    assert whole_spans(IMAGE_AT + 1, spans) == IMAGE_AT
    assert whole_spans(IMAGE_AT + IMAGE_LEN - 1, spans) == IMAGE_AT
    assert whole_spans(IMAGE_AT + IMAGE_LEN, spans) == IMAGE_AT + IMAGE_LEN
    assert whole_spans(63, spans) == 60 and whole_spans(68, spans) == 68


# ------------------------------------------------------------------------ conversations --
def test_turn_two_after_an_image_reuses_turn_one_also_after_a_restart(model, tmp_path, fed):
    spans = [image("screenshot")]
    cache = disk_cache(tmp_path)
    gen = engine(model, cache)
    first = ask(gen, PROMPT, spans, boundaries={IMAGE_AT: "anchor"})
    turn_two = PROMPT + tokens_of(first.text) + [9, 8, 7, 6]
    second = ask(gen, turn_two, spans)
    assert second.done.cached_tokens >= 0.9 * len(PROMPT)
    assert tokens_of(second.text) == answer_of(model, turn_two, spans)
    # What the cache stores is the key: the image's positions hold its key ids, on disk too.
    cache.flush()
    stored = [t for stream in cache.token_streams(1 << 16) for t in stream.tolist()]
    assert any(is_image_key(t) for t in stored) and PAD not in stored
    cache.close()

    # A restart: a new cache on the same directory, no resident session.
    cache = disk_cache(tmp_path)
    gen = engine(model, cache)
    third = ask(gen, turn_two, spans)  # the same turn again: all of it but one token
    assert third.done.cached_tokens == len(turn_two) - 1
    assert tokens_of(third.text) == tokens_of(second.text)
    turn_three = turn_two + tokens_of(third.text) + [10, 11]
    cache.close()
    cache = disk_cache(tmp_path)
    fourth = ask(engine(model, cache), turn_three, spans)
    assert fourth.done.cached_tokens >= 0.9 * len(turn_two)
    assert tokens_of(fourth.text) == answer_of(model, turn_three, spans)
    cache.close()
    assert max(max(ids) for ids in fed) < IMAGE_KEY_BASE  # never a key id fed to the model


@pytest.mark.parametrize("where", ["live", "cache"])
def test_another_image_at_the_same_place_reuses_only_up_to_it(model, where):
    cache = ram_cache()
    gen = engine(model, cache)
    ask(gen, PROMPT, [image("page 1")])
    if where == "cache":
        gen.states.reset()  # no resident session: the prompt cache alone serves it
    other = ask(gen, PROMPT, [image("page 2")])
    assert other.done.cached_tokens == IMAGE_AT  # the ids are the same; the pictures are not
    assert tokens_of(other.text) == answer_of(model, PROMPT, [image("page 2")])
    again = ask(gen, PROMPT, [image("page 2")])  # its own KV is now cached
    assert again.done.cached_tokens == len(PROMPT) - 1


def test_a_different_image_never_reuses_the_first_ones_kv(model):
    """Where the pictures' spans differ in ids too (as their features would), the answers show
    it: every one equals the no-cache answer."""
    cache = ram_cache()
    gen = engine(model, cache)
    pictures = {
        name: [(31 * i + n) % 90 + 6 for i in range(IMAGE_LEN)]
        for n, name in enumerate(["red", "green", "blue"])
    }
    for name, ids in pictures.items():
        prompt = SYSTEM + ids + QUESTION
        got = ask(gen, prompt, [image(name)], max_tokens=8)
        assert got.done.cached_tokens in (0, IMAGE_AT)
        assert tokens_of(got.text) == answer_of(model, prompt, [image(name)], 8)


@pytest.mark.parametrize("order", ["image first", "text first"])
def test_a_text_only_prompt_shares_the_prefix_up_to_the_image(model, order):
    cache = ram_cache()
    gen = engine(model, cache)
    runs = [(PROMPT, [image("diagram")]), (PROMPT, [])]
    if order == "text first":
        runs.reverse()
    ask(gen, *runs[0])
    gen.states.reset()
    got = ask(gen, *runs[1])
    assert got.done.cached_tokens == IMAGE_AT
    assert tokens_of(got.text) == answer_of(model, *runs[1])


# ---------------------------------------------------------------------- never inside one --
def test_a_match_never_ends_inside_an_image(model):
    spans = [image("photo")]
    key = key_tokens(PROMPT, spans)
    inside = IMAGE_AT + 5
    # An entry and a resident session that end inside the image (no engine stores one; say an
    # older build did): each serves the prompt only up to the image's start.
    cache = ram_cache()
    states = PromptStates(model, cache)
    start = states.cold()
    model(mx.array([PROMPT[:inside]]), cache=start.caches)
    assert cache.checkpoint(key[:inside], start.caches, "message") is not None
    got = states.acquire(PROMPT, spans=spans)
    assert got.source == "ram" and got.usable == IMAGE_AT
    assert got.tokens == PROMPT[:IMAGE_AT] and {c.offset for c in got.caches} == {IMAGE_AT}
    states.keep(key[:inside], start.caches)
    got = states.acquire(PROMPT, spans=spans)
    assert got.usable == IMAGE_AT
    # A retry below a link that failed (`at_most`) inside the image starts at its start.
    assert states.acquire(PROMPT, spans=spans, at_most=inside).usable == IMAGE_AT
    # A prompt that ends with its image: the one token always prefilled would split it.
    states.reset()
    tail = PROMPT[: IMAGE_AT + IMAGE_LEN]
    gen = Generator(model, StubTokenizer(), states, prefill_step=8, checkpoint_interval=0)
    ask(gen, tail, spans)
    states.reset()
    assert ask(gen, tail, spans).done.cached_tokens == IMAGE_AT


def test_chunks_and_checkpoints_move_out_of_images(model, fed, monkeypatch):
    """Prefill chunks of 8 and checkpoints every 12 tokens and at a boundary inside the image:
    each one that would end inside it ends at its start instead."""
    spans = [image("chart", start=20, length=14)]  # 20..34: chunk ends 24, 32; interval 24
    prompt = SYSTEM[:20] + [PAD] * 14 + QUESTION * 8
    cache = ram_cache()
    stored: list[int] = []
    checkpoint = cache.checkpoint

    def recording(tokens, *args, **kwargs):
        stored.append(len(tokens))
        assert not any(is_image_key(t) for t in tokens[:20] + tokens[34:])
        return checkpoint(tokens, *args, **kwargs)

    monkeypatch.setattr(cache, "checkpoint", recording)
    gen = engine(model, cache, step=8, interval=12)
    fed.clear()  # (the engine's one-token pass that reads the KV dtype)
    ask(gen, prompt, spans, max_tokens=2, boundaries={30: "message", 40: "message"})
    ends, position = [], 0
    for ids in fed:
        position += len(ids)
        ends.append(position)
    prefill_ends = ends[: ends.index(len(prompt)) + 1]
    assert not [e for e in prefill_ends if 20 < e < 34]
    assert 20 in prefill_ends
    assert not [n for n in stored if 20 < n < 34]
    assert {12, 20, 36, 40, 48, 60, len(prompt) + 1} <= set(stored)
    assert max(max(ids) for ids in fed) < IMAGE_KEY_BASE


# ------------------------------------------------------------------- never fed, never drafted --
def test_key_ids_never_reach_the_continuations_index(model):
    spans = [image("logo")]
    key = key_tokens(PROMPT, spans) + [1, 2, 3]
    index = Continuations(n_max=4, n_min=2).index(None)
    index.add(key)
    assert not any(is_image_key(t) for t in index.tokens if t < 1 << 40)
    # The text on each side of the image is its own document: no n-gram crosses the image.
    assert index.propose(SYSTEM[-3:], 8) is None  # the system prompt's end: an image follows
    draft = index.propose(SYSTEM[4:7], 4)
    assert draft is not None and draft.tokens == tuple(SYSTEM[7:11])
    assert index.propose(QUESTION[:3], 20).tokens == tuple(QUESTION[3:] + [1, 2, 3])
    # A stored entry's stream (what a restart feeds the index) is keyed the same way.
    cache = ram_cache()
    gen = engine(model, cache)
    ask(gen, PROMPT, spans)
    continuations = Continuations()
    for tokens in cache.token_streams(continuations.max_tokens):
        assert any(is_image_key(t) for t in tokens.tolist())
        continuations.remember(None, tokens)
    kept = continuations.index(None).tokens
    assert kept and not any(is_image_key(t) for t in kept if t < 1 << 40)


# ----------------------------------------------------------- the text cache's invariants hold --
def test_entries_of_a_run_that_died_are_checked_then_used(model, tmp_path):
    """After an unclean shutdown an image prompt's entries are suspect: the restore re-prefills
    the probe position with the prompt's real ids, the logits match, and the chain is used."""
    spans = [image("screenshot")]
    cache = disk_cache(tmp_path)
    gen = engine(model, cache)
    first = ask(gen, PROMPT, spans, boundaries={IMAGE_AT: "anchor"})
    run_id = cache.run_id
    cache.close()
    marker = tmp_path / FINGERPRINT / "RUNNING"  # what the dead run would have left
    marker.write_text(json.dumps({"run_id": run_id, "pid": 1, "started": 0}))
    cache = disk_cache(tmp_path)
    assert cache.unclean_start and all(e.suspect for e in cache.entries())
    suspect = cache.stats()["suspect"]
    turn_two = PROMPT + tokens_of(first.text) + [9, 8, 7, 6]
    second = ask(engine(model, cache), turn_two, spans)
    assert second.done.cached_tokens >= 0.9 * len(PROMPT)
    assert tokens_of(second.text) == answer_of(model, turn_two, spans)
    stats = cache.stats()
    assert stats["failure_evictions"] == 0 and stats["suspect"] < suspect  # checked: verified
    cache.close()


def test_a_failure_after_restoring_an_image_prompt_blames_the_newest_link(model, monkeypatch):
    spans = [image("screenshot")]
    cache = ram_cache()
    gen = engine(model, cache)
    first = ask(gen, PROMPT, spans, boundaries={IMAGE_AT: "anchor"})
    gen.states.reset()
    monkeypatch.setenv(faults.ENV, "prefill_after_restore:1")
    monkeypatch.setattr(faults, "_rules", None)
    monkeypatch.setattr(faults, "_calls", {})
    turn_two = PROMPT + tokens_of(first.text) + [9, 8, 7, 6]
    second = ask(gen, turn_two, spans)
    assert second.done.cached_tokens == IMAGE_AT  # from the anchor before the image
    assert tokens_of(second.text) == answer_of(model, turn_two, spans)
    assert cache.stats()["failure_evictions"] >= 1


def test_a_paused_image_request_checkpoints_its_key_and_resumes_on_real_ids(model, fed):
    """Paused for memory: its KV is checkpointed under its key, freed, and rebuilt from that
    checkpoint; the model is fed real ids, and the answer is the no-cache one."""
    spans = [image("screenshot")]
    cache = ram_cache()
    gen = engine(model, cache)
    params = SamplingParams(temperature=0.0, max_tokens=6)
    req = Recorder(list(PROMPT), params, "text", image_spans=tuple(spans))
    _, seq = gen.start(req)
    ended: list = []
    batch = DecodeBatch(model, ended.append)
    batch.add(seq)
    for _ in range(2):
        batch.step()
    room = Room(describe_model(model).layers, 1 << 30, gen.states, cache, 16, True)
    gen.states.reset()
    room._pause(seq, batch, 0)
    held = key_tokens(seq.live.tokens, spans)
    paused = cache.lookup(held + [0])
    assert paused.hit and paused.usable == len(held)  # stored under the key, not the real ids
    assert cache.lookup(seq.live.tokens + [0]).usable <= IMAGE_AT
    task = room.next_resume(model, 8, busy=False)
    assert task is not None
    while not task.advance():
        pass
    assert seq.live.tokens[: len(PROMPT)] == PROMPT and seq.live.spans == tuple(spans)
    batch.add(seq)
    while batch.seqs:
        batch.step()
    gen.finish(ended[0])
    assert tokens_of(req.text) == answer_of(model, PROMPT, spans)
    assert max(max(ids) for ids in fed) < IMAGE_KEY_BASE


# ------------------------------------------------------------------------------- fuzzing --
@st.composite
def prompts_with_images(draw, pictures=("a", "b")):
    """A prompt of a few ids with 0-2 images of placeholder ids, each one of `pictures`: small
    alphabets, so that prompts often share prefixes, images and places."""
    text = st.lists(st.integers(6, 8), min_size=0, max_size=3)
    tokens, spans = draw(text), []
    for _ in range(draw(st.integers(0, 2))):
        length = draw(st.integers(2, 4))
        spans.append(ImageSpan(len(tokens), length, digest(draw(st.sampled_from(pictures)))))
        tokens += [PAD] * length + draw(text)
    tokens += draw(text)
    if len(tokens) < 2:
        tokens = [6, 7] + tokens
        spans = [ImageSpan(s.start + 2, s.length, s.digest) for s in spans]
    return tokens, spans


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    stored=st.lists(st.tuples(prompts_with_images(), st.floats(0.1, 1.0)), min_size=1, max_size=3),
    query=prompts_with_images(),
)
def test_any_reuse_is_a_whole_image_prefix_of_the_same_key(model, stored, query):
    """Whatever was stored (a shared prefix, other pictures at the same places, text where an
    image was, even a state cut inside an image, which no engine stores), a start holds the
    query's real ids, never ends inside one of its images, and its state is that of a stored
    prompt whose key agrees with the query's that far."""
    cache = ram_cache()
    states = PromptStates(model, cache)
    keys = []
    for (tokens, spans), part in stored:
        cut = max(1, int(len(tokens) * part))
        key = key_tokens(tokens, spans)[:cut]
        start = states.cold()
        model(mx.array([tokens[:cut]]), cache=start.caches)
        keys.append(key)
        cache.checkpoint(key, start.caches, "message")
        states.keep(key, start.caches)
    tokens, spans = query
    got = states.acquire(tokens, spans=spans)
    n = got.usable
    assert n <= len(tokens) - 1 and whole_spans(n, spans) == n
    assert got.tokens == tokens[:n] and not any(is_image_key(t) for t in got.tokens)
    assert all(c.offset == n for c in got.caches)
    want = key_tokens(tokens, spans)[:n]
    assert n == 0 or any(key[:n] == want for key in keys)


@settings(max_examples=100, deadline=None)
@given(parts=st.lists(st.tuples(st.lists(st.integers(6, 96), max_size=5), st.integers(1, 9))))
def test_find_spans_pairs_each_run_of_image_tokens_with_its_image(parts):
    """A rendered prompt: for each image some text, a start marker, a run of placeholder ids
    and an end marker. Each run is found and paired with its image, in order; a count of
    images that does not match the runs is refused."""
    tokens, want = [], []
    for n, (text, length) in enumerate(parts):
        tokens += text + [7]  # the image's start marker
        want.append(ImageSpan(len(tokens), length, digest(str(n))))
        tokens += [PAD] * length + [8]  # its end marker
    got = find_spans(tokens, PAD, [digest(str(n)) for n in range(len(parts))])
    assert got == tuple(want)
    with pytest.raises(ValueError):
        find_spans(tokens, PAD, [digest("x")] * (len(parts) + 1))


def test_a_sliding_window_model_checkpoints_outside_images_too(fed, monkeypatch):
    """Caches that cannot be cut back (a sliding window) run a chunk to each checkpoint,
    the chat prompt's one-before-the-end point included: none of them ends inside an image,
    and the next turn restores the exact prefix it stored."""
    mx.random.seed(1)
    sliding = tiny_llama(True)
    mx.eval(sliding.parameters())
    spans = [image("chart", start=20, length=14)]
    prompt = SYSTEM[:20] + [PAD] * 14 + QUESTION * 8
    cache = ram_cache("tiny-image-keys-sliding")
    stored: list[int] = []
    checkpoint = cache.checkpoint

    def recording(tokens, *args, **kwargs):
        stored.append(len(tokens))
        return checkpoint(tokens, *args, **kwargs)

    monkeypatch.setattr(cache, "checkpoint", recording)
    states = PromptStates(sliding, cache)
    gen = Generator(sliding, StubTokenizer(), states, prefill_step=8, checkpoint_interval=12)
    params = SamplingParams(temperature=0.0, max_tokens=4)
    first = Recorder(list(prompt), params, "chat", boundaries={30: "message"})
    first.image_spans = tuple(spans)
    fed.clear()
    gen.run(first)
    ends, position = [], 0
    for ids in fed:
        position += len(ids)
        ends.append(position)
    assert not [e for e in ends if 20 < e < 34] and not [n for n in stored if 20 < n < 34]
    assert 20 in stored and len(prompt) - 1 in stored
    states.reset()
    again = Recorder(list(prompt), params, "chat", image_spans=(*spans,))
    gen.run(again)
    assert again.done.cached_tokens == len(prompt) - 1
    assert tokens_of(again.text) == tokens_of(first.text)
