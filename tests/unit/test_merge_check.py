"""A model decodes rows merged only if its merged step answers as its solo one does
(engine/merge_check.py): Gemma 2's attention broadcasts the batch mask over its KV heads and
GPT-BigCode's reads the batch cache's offsets as one integer, so both decode one at a time, and
answer exactly as alone; the architectures whose attention honours the mask still merge."""

from __future__ import annotations

import mlx.core as mx
import pytest

from mlx_kvserve.engine.merge_check import merged_decoding_agrees
from tests.support.every_architecture import build
from tests.unit.test_batching import serve_together
from tests.unit.test_engine_units import reference, request, tokens_of

PROMPTS = [
    [(7 * i + 3) % 400 + 20 for i in range(30)],
    [5, 9, 13],
    [(3 * i) % 300 + 40 for i in range(12)],
]
LENGTHS = [12, 10, 8]


def tiny(model_type: str):
    model = build(model_type)
    assert not isinstance(model, str), model
    mx.eval(model.parameters())
    return model


@pytest.mark.parametrize(
    ("model_type", "agrees"),
    [
        ("llama", True),
        ("gemma3_text", True),
        ("qwen3_5", True),
        ("gemma2", False),
        ("gpt_bigcode", False),
    ],
)
def test_the_check_tells_the_architectures_that_merge_wrong(model_type, agrees, caplog):
    assert merged_decoding_agrees(tiny(model_type)) is agrees
    assert ("decode one at a time" in caplog.text) is not agrees


@pytest.mark.parametrize("model_type", ["gemma2", "gpt_bigcode"])
def test_such_a_model_serves_concurrent_requests_one_at_a_time_and_right(model_type):
    model = tiny(model_type)
    reqs = [request(p, max_tokens=n) for p, n in zip(PROMPTS, LENGTHS, strict=True)]
    peaks = serve_together(model, reqs, prefill_step=16)
    for req, p, n in zip(reqs, PROMPTS, LENGTHS, strict=True):
        assert tokens_of(req.text) == reference(model, p, n), req.request_id
    assert set(peaks.values()) == {1}
