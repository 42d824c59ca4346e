"""Speculation's exactness across the architecture matrix, for the models it serves (every
layer a `KVCache`): a verify-wide pass then a per-row rollback continues exactly as plain
decoding of the kept tokens does, solo and merged (engine/speculation/rewind.py `roll_back`).

Rows of a merged batch are compared by their greedy next token and, loosely, their logits: a
wide pass runs other kernels than a one-token pass (docs/speculation.md)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import BatchKVCache, KVCache, make_prompt_cache

from mlx_kvserve.engine.merge_check import merged_decoding_agrees
from mlx_kvserve.engine.speculation.rewind import roll_back
from mlx_kvserve.engine.speculation.snapshot import (
    Snapshot,
    needs_snapshot,
    replay,
    replay_agrees,
    restorable,
)
from tests.support.every_architecture import VOCAB, architectures, build

pytestmark = pytest.mark.slow
RNG = np.random.default_rng(1)
PROMPTS = [[int(t) for t in RNG.integers(3, VOCAB - 1, n)] for n in (23, 31)]
FED = [[7, 9, 11, 13, 15, 17], [21, 23, 25, 27, 29, 31]]  # one verify pass, 6 wide
REJECTED = [1, 4]
# Architectures whose recurrent layers advance every row by the whole pass (no `lengths`): the
# check at load (snapshot.py `replay_agrees`) keeps their merged rows from speculating.
IGNORE_LENGTHS = {"bailing_moe_linear", "mamba", "olmo_hybrid", "rwkv7"}
# mlx-lm's plamo3 masks its window one wider than its `RotatingKVCache` keeps, so once the
# window wraps a wide pass answers otherwise than one-token steps, solo as well (its own
# prefill too: 0.27 apart here); against plain decoding no replay can be exact.
WIDE_PASS_DIFFERS = {"plamo3": "a wrapped window's wide pass differs from steps in mlx-lm"}


def plain_next(model, prompt: list[int], tokens: list[int]) -> mx.array:
    """The logits after `tokens`, fed one at a time after `prompt`."""
    cache = make_prompt_cache(model)
    model(mx.array(prompt)[None], cache=cache)
    for t in tokens:
        out = model(mx.array([[t]]), cache=cache)
    return out[0, -1]


def merge(model) -> list:
    rows = [make_prompt_cache(model) for _ in PROMPTS]
    for cache, prompt in zip(rows, PROMPTS, strict=True):
        model(mx.array(prompt)[None], cache=cache)
    return [BatchKVCache.merge(list(layer)) for layer in zip(*rows, strict=True)]


@pytest.mark.parametrize("model_type", architectures())
def test_a_rolled_back_verify_pass_continues_like_plain_decoding(model_type):
    model = build(model_type)
    if isinstance(model, str):
        pytest.skip(f"no generic tiny {model_type}")
    try:
        rows = [make_prompt_cache(model) for _ in PROMPTS]
        for cache, prompt in zip(rows, PROMPTS, strict=True):
            model(mx.array(prompt)[None], cache=cache)
    except Exception as exc:  # the generic dimensions break the model's own forward pass
        pytest.skip(f"generic tiny {model_type} does not run: {exc!r}"[:200])
    if not rows[0] or not all(type(c) is KVCache for c in rows[0]):
        pytest.skip(f"{model_type}: not every layer is a KVCache (speculation stays off)")

    solo = rows[0]
    model(mx.array([FED[0]]), cache=solo)
    roll_back(solo, [REJECTED[0]])
    kept = FED[0][: len(FED[0]) - REJECTED[0]]
    got = model(mx.array([[5]]), cache=solo)[0, -1]
    want = plain_next(model, PROMPTS[0], [*kept, 5])
    assert mx.allclose(got, want, atol=1e-4).item(), model_type

    if not merged_decoding_agrees(model):  # the engine decodes such a model one at a time
        pytest.skip(f"{model_type}: merged decoding differs from solo (engine/merge_check.py)")
    merged = merge(model)
    model(mx.array(FED), cache=merged)
    roll_back(merged, REJECTED)
    got = model(mx.array([[5], [5]]), cache=merged)[:, -1]
    for i, (prompt, fed, r) in enumerate(zip(PROMPTS, FED, REJECTED, strict=True)):
        want = plain_next(model, prompt, [*fed[: len(fed) - r], 5])
        assert mx.argmax(got[i]).item() == mx.argmax(want).item(), (model_type, i)
        assert mx.allclose(got[i], want, atol=1e-3).item(), (model_type, i)


@pytest.mark.parametrize("model_type", architectures())
def test_a_lone_rows_snapshot_and_replay_continue_like_plain_decoding(model_type):
    """Architectures with a layer trimming cannot roll back (sliding windows, recurrent states,
    `CacheList`s of them), decoded alone: a snapshot before the 6-wide pass, then the
    snapshot restored and the kept prefix replayed (engine/speculation/snapshot.py), continue
    exactly as plain decoding of the kept tokens does."""
    model = build(model_type)
    if isinstance(model, str):
        pytest.skip(f"no generic tiny {model_type}")
    try:
        cache = make_prompt_cache(model)
        model(mx.array(PROMPTS[0])[None], cache=cache)
    except Exception as exc:  # the generic dimensions break the model's own forward pass
        pytest.skip(f"generic tiny {model_type} does not run: {exc!r}"[:200])
    if not cache or not needs_snapshot(cache):
        pytest.skip(f"{model_type}: every layer rewinds (plain KV, windows: the tests around)")
    if not all(restorable(c) for c in cache):
        pytest.skip(f"{model_type}: a cache kind speculation leaves alone")
    snapshot = Snapshot(cache)
    model(mx.array([FED[0]]), cache=cache)
    kept = FED[0][: len(FED[0]) - REJECTED[1]]
    snapshot.restore()
    model(mx.array([kept]), cache=cache)
    got = model(mx.array([[5]]), cache=cache)[0, -1]
    want = plain_next(model, PROMPTS[0], [*kept, 5])
    assert mx.argmax(got).item() == mx.argmax(want).item(), model_type
    assert mx.allclose(got, want, atol=1e-3).item(), model_type


@pytest.mark.parametrize("model_type", architectures())
def test_merged_rows_snapshot_and_replay_continue_like_plain_decoding(model_type):
    """The same architectures merged, the two rows rejecting different amounts (1 and 4) of
    one 6-wide pass: the snapshot restored and each row's kept prefix replayed with its own
    length (snapshot.py `replay`) continue exactly as plain decoding of each row's kept tokens
    does, for the models `replay_agrees` accepts; the others' merged rows step plainly."""
    model = build(model_type)
    if isinstance(model, str):
        pytest.skip(f"no generic tiny {model_type}")
    try:
        cache = make_prompt_cache(model)
        model(mx.array(PROMPTS[0])[None], cache=cache)
    except Exception as exc:  # the generic dimensions break the model's own forward pass
        pytest.skip(f"generic tiny {model_type} does not run: {exc!r}"[:200])
    if not cache or not needs_snapshot(cache) or not all(restorable(c) for c in cache):
        pytest.skip(f"{model_type}: the tests above")
    if not merged_decoding_agrees(model):
        pytest.skip(f"{model_type}: merged decoding differs from solo (engine/merge_check.py)")
    if model_type in WIDE_PASS_DIFFERS:
        pytest.skip(f"{model_type}: {WIDE_PASS_DIFFERS[model_type]}")
    agrees = replay_agrees(model)
    assert agrees == (model_type not in IGNORE_LENGTHS), model_type
    if not agrees:
        pytest.skip(f"{model_type}: ignores the rows' lengths, its merged rows step plainly")
    rows = [make_prompt_cache(model) for _ in PROMPTS]
    for c, prompt in zip(rows, PROMPTS, strict=True):
        model(mx.array(prompt)[None], cache=c)
    merged = [type(layer[0]).merge(list(layer)) for layer in zip(*rows, strict=True)]
    snapshot = Snapshot(merged)
    model(mx.array(FED), cache=merged)
    snapshot.restore()
    kept = [fed[: len(fed) - r] for fed, r in zip(FED, REJECTED, strict=True)]
    replay(model, merged, kept)
    got = model(mx.array([[5], [5]]), cache=merged)[:, -1]
    for i, (prompt, row) in enumerate(zip(PROMPTS, kept, strict=True)):
        want = plain_next(model, prompt, [*row, 5])
        assert mx.argmax(got[i]).item() == mx.argmax(want).item(), (model_type, i)
        assert mx.allclose(got[i], want, atol=1e-3).item(), (model_type, i)


# Two verify passes, each row rejecting its own amount, after prompts that wrap the window (32
# positions) or not: the second pass starts from the first's rolled-back window.
LONG = [int(t) for t in RNG.integers(3, VOCAB - 1, 45)]
ROUNDS = [(FED, [1, 4]), ([[33, 35, 37, 39, 41], [43, 45, 47, 49, 51]], [4, 0])]


def _plain_after_rounds(model, prompt: list[int], row: int) -> mx.array:
    kept = [t for fed, rejected in ROUNDS for t in fed[row][: len(fed[row]) - rejected[row]]]
    return plain_next(model, prompt, [*kept, 5])


@pytest.mark.parametrize("model_type", architectures())
def test_windows_roll_back_without_a_replay(model_type):
    """Models whose every layer is plain KV or a sliding window (Gemma 3, gpt-oss...): a verify
    pass's rejected positions are cut off the window, or merged rolled into each row's
    padding (engine/speculation/rewind.py), with no snapshot and no replay, and decoding goes
    on exactly as plain decoding of the kept tokens, solo and merged, wrapped or not."""
    model = build(model_type)
    if isinstance(model, str):
        pytest.skip(f"no generic tiny {model_type}")
    try:
        cache = make_prompt_cache(model)
        model(mx.array(LONG)[None], cache=cache)
    except Exception as exc:  # the generic dimensions break the model's own forward pass
        pytest.skip(f"generic tiny {model_type} does not run: {exc!r}"[:200])
    if not cache or needs_snapshot(cache) or all(type(c) is KVCache for c in cache):
        pytest.skip(f"{model_type}: no window, or a layer that takes a snapshot")
    if model_type in WIDE_PASS_DIFFERS:
        pytest.skip(f"{model_type}: {WIDE_PASS_DIFFERS[model_type]}")
    prompts = [LONG, PROMPTS[0]]
    for row, prompt in enumerate(prompts):  # solo: wrapped, then not
        solo = make_prompt_cache(model)
        model(mx.array(prompt)[None], cache=solo)
        for fed, rejected in ROUNDS:
            model(mx.array([fed[row]]), cache=solo)
            roll_back(solo, [rejected[row]])
        got = model(mx.array([[5]]), cache=solo)[0, -1]
        want = _plain_after_rounds(model, prompt, row)
        assert mx.argmax(got).item() == mx.argmax(want).item(), (model_type, row)
        assert mx.allclose(got, want, atol=1e-3).item(), (model_type, row)

    if not merged_decoding_agrees(model):
        pytest.skip(f"{model_type}: merged decoding differs from solo (engine/merge_check.py)")
    rows = [make_prompt_cache(model) for _ in prompts]
    for c, prompt in zip(rows, prompts, strict=True):
        model(mx.array(prompt)[None], cache=c)
    merged = [type(layer[0]).merge(list(layer)) for layer in zip(*rows, strict=True)]
    for fed, rejected in ROUNDS:
        model(mx.array(fed), cache=merged)
        roll_back(merged, rejected)
    got = model(mx.array([[5], [5]]), cache=merged)[:, -1]
    for i, prompt in enumerate(prompts):
        want = _plain_after_rounds(model, prompt, i)
        assert mx.argmax(got[i]).item() == mx.argmax(want).item(), (model_type, i)
        assert mx.allclose(got[i], want, atol=1e-3).item(), (model_type, i)
