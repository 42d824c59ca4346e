"""What rank 0 of a job sends its other ranks: a request as JSON, rebuilt alike on every rank.

Property-based: any request the API can make survives the trip (prompt, settings, checkpoint
boundaries, id), an unseeded sampled request is seeded once on rank 0 so every rank draws the
same tokens, and a grammar is recompiled by the other rank into a matcher that allows and
forces exactly what rank 0's does. The cancel latch makes a client's cancel take effect only
at the engine's turn once the request is shared, and at once before.
"""

from __future__ import annotations

import json
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx_lm.tokenizer_utils import load as load_tokenizer

from mlx_kvserve.chat.grammar import GrammarCompiler
from mlx_kvserve.distributed.request_wire import RequestWire
from mlx_kvserve.engine.requests import CancelLatch, GenerationRequest, SamplingParams
from mlx_kvserve.images.spans import ImageSpan
from tests.support.tiny_models import default_tokenizer_dir

REASONS = st.sampled_from(["anchor", "message", "prompt", "interval"])

params = st.builds(
    SamplingParams,
    temperature=st.sampled_from([0.0, 0.5, 1.0, 2.0]),
    top_p=st.floats(0.01, 1.0),
    top_k=st.integers(0, 100),
    seed=st.none() | st.integers(0, 2**63 - 1),
    max_tokens=st.integers(1, 100_000),
    stop=st.lists(st.text(min_size=1, max_size=8), max_size=4).map(tuple),
    logprobs=st.booleans(),
    top_logprobs=st.integers(0, 20),
    ignore_eos=st.booleans(),
    speculative=st.booleans(),
)


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    tokenizer = load_tokenizer(default_tokenizer_dir())
    return GrammarCompiler(tokenizer)


def travel(wire: RequestWire, req: GenerationRequest) -> GenerationRequest:
    """Encoded on rank 0, through JSON as the collective carries it, decoded on another."""
    return wire.decode(json.loads(json.dumps(wire.encode(req))))


@settings(max_examples=150, deadline=None)
@given(
    prompt=st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=300),
    params=params,
    boundaries=st.dictionaries(st.integers(1, 10_000), REASONS, max_size=6),
    kind=st.sampled_from(["chat", "text"]),
    cancelled=st.booleans(),
    images=st.lists(
        st.tuples(st.integers(0, 40), st.integers(1, 80), st.binary(min_size=32, max_size=32)),
        max_size=3,
    ),
)
def test_a_request_arrives_as_it_left(prompt, params, boundaries, kind, cancelled, images):
    wire = RequestWire(lambda: pytest.fail("no grammar and no logprobs: no compiler"))
    spans, end = [], 0
    for gap, length, raw in images:  # placed in order within the prompt, as a renderer does
        if end + gap + length > len(prompt):
            break
        spans.append(ImageSpan(end + gap, length, raw.hex()))
        end += gap + length
    sent = GenerationRequest(
        prompt, params, kind=kind, boundaries=boundaries, image_spans=tuple(spans)
    )
    sent.cancelled = CancelLatch()
    if cancelled:
        sent.cancel()
    got = travel(wire, sent)
    assert got.prompt_tokens == prompt and got.boundaries == boundaries and got.kind == kind
    assert got.request_id == sent.request_id
    assert got.image_spans == sent.image_spans  # every rank keys its cache by the same images
    assert got.params == sent.params  # rank 0 keeps the seed it gave
    if params.temperature > 0:
        assert got.params.seed is not None
        assert params.seed is None or got.params.seed == params.seed
    else:
        assert got.params.seed == params.seed
    assert got.cancelled.is_set() is cancelled is sent.cancelled.is_set()
    assert got.constraint is None and got.token_bytes is None


def test_two_unseeded_requests_get_their_own_seeds():
    wire = RequestWire(lambda: None)
    unseeded = SamplingParams(temperature=1.0)  # unseeded: rank 0 gives it a seed
    seeds = {travel(wire, GenerationRequest([1], unseeded)).params.seed for _ in range(20)}
    assert len(seeds) == 20


def test_a_grammar_is_recompiled_to_the_same_matcher(compiler):
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city", "days"],
    }
    sent = GenerationRequest([1, 2], SamplingParams(temperature=0, logprobs=True))
    sent.constraint = compiler.json_constraint(schema, "response_format")
    sent.token_bytes = compiler.token_bytes
    got = travel(RequestWire(lambda: compiler), sent)
    assert got.constraint is not None and got.constraint.grammar == sent.constraint.grammar
    assert got.constraint.lazy == sent.constraint.lazy
    assert got.token_bytes is not None and got.token_bytes(42) == sent.token_bytes(42)
    vocab = len(compiler._tokenizer.get_vocab())
    text = '{"city": "Paris", "days": 3}'
    for token in compiler._tokenizer.encode(text, add_special_tokens=False):
        assert (got.constraint.allowed(vocab) == sent.constraint.allowed(vocab)).all()
        assert got.constraint.forced(8) == sent.constraint.forced(8)
        if sent.constraint.finished:
            break
        if sent.constraint.allowed(vocab)[token]:
            sent.constraint.advance(token)
            got.constraint.advance(token)
    assert got.constraint.finished == sent.constraint.finished


def test_a_constraint_without_its_grammar_text_is_refused():
    class Opaque:
        lazy = False

    req = GenerationRequest([1], SamplingParams(temperature=0))
    req.constraint = Opaque()
    with pytest.raises(TypeError, match="grammar's text"):
        RequestWire(lambda: None).encode(req)


def test_a_shared_request_is_cancelled_at_the_engines_turn_only():
    latch = CancelLatch()
    latch.set()
    assert latch.is_set()  # queued, not shared: gives up its place at once
    other = CancelLatch()
    assert other.hold() is False
    seen = []
    thread = threading.Thread(target=other.set)  # a client leaves from the event loop
    thread.start()
    thread.join()
    seen.append(other.is_set())
    assert other.latch() is True  # the turn starts: now every rank hears of it
    seen.append(other.is_set())
    assert other.latch() is False  # once
    assert seen == [False, True]
    now = CancelLatch()
    now.hold()
    now.set_now()  # the engine stopping: at this point on every rank
    assert now.is_set()
