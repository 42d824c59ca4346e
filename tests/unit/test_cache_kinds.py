"""Per-layer descriptions asked of mlx-lm's cache objects, and every cache type's round trip
through the prompt cache: prefill, checkpoint, restart, restore, then the next token's logits
equal the live caches' exactly. In-process, on tiny random-weight models of mlx-lm's own
architectures (tests/support/tiny_models.py)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load
from mlx_lm.models.cache import KVCache, make_prompt_cache

from mlx_kvserve.cache import PromptCache
from mlx_kvserve.cache.kinds import (
    STATE,
    TOKENS,
    WINDOW,
    can_cut_back,
    describe,
    describe_model,
)
from mlx_kvserve.engine.batch import can_batch
from tests.support.tiny_models import make_model_dir, model_config

MiB = 1 << 20
PROMPT = [(7 * i + 3) % 4000 + 100 for i in range(90)]  # slides past every tiny window (32)
KINDS = {
    "llama": [TOKENS] * 2,
    "qwen3_next": [STATE] * 3 + [TOKENS],
    "qwen3_5": [STATE] * 3 + [TOKENS],
    "gemma3_text": [WINDOW, WINDOW, TOKENS],
    "gemma3": [WINDOW, WINDOW, TOKENS],
    "gpt_oss": [WINDOW, TOKENS],
    "deepseek_v3": [TOKENS] * 2,
    "mamba": [STATE] * 2,
    "mamba2": [STATE] * 2,
    "falcon_h1": [TOKENS] * 2,  # CacheList(ArraysCache, KVCache): its KV part grows
    "llama4": [WINDOW] * 3 + [TOKENS],
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    loaded = {}

    def get(name: str):
        if name not in loaded:
            loaded[name] = load(str(make_model_dir(root / name, name)))[0]
        return loaded[name]

    return get


@pytest.mark.parametrize("name", list(KINDS))
def test_layers_are_described_by_their_caches(models, name):
    layout = describe_model(models(name))
    assert [layer.kind for layer in layout.layers] == KINDS[name]
    assert layout.kv_dtype == mx.float32 and layout.activation_dtype == mx.float32
    assert not layout.unknown
    assert layout.sliceable == (name in ("llama", "deepseek_v3"))
    assert can_batch(layout) == layout.mergeable == (name != "llama4")  # ChunkedKVCache
    for layer in layout.layers:
        if layer.kind == WINDOW:
            assert layer.window == 32 and layer.fixed_bytes == 32 * layer.bytes_per_token
        if layer.kind == STATE:
            assert layer.bytes_per_token == 0 and layer.fixed_bytes > 0
    # Windows and states cost the same at any length; only growing KV scales.
    grows = layout.bytes_for(2000) - layout.bytes_for(1000)
    assert grows == 1000 * layout.bytes_per_token


@pytest.mark.parametrize("name", ["llama", "gemma3_text", "gpt_oss"])
def test_bytes_per_token_count_only_the_layers_that_grow(models, name):
    """2 (K and V) x KV heads x head dim x 4 bytes per full-attention layer; windows are fixed."""
    cfg = model_config(name)
    per_layer = 2 * cfg["num_key_value_heads"] * cfg["head_dim"] * 4
    full = KINDS[name].count(TOKENS)
    windows = KINDS[name].count(WINDOW)
    layout = describe_model(models(name))
    assert layout.bytes_per_token == full * per_layer
    assert layout.fixed_bytes == windows * 32 * per_layer


def test_mla_latent_kv_is_counted_per_token(models):
    """DeepSeek-V3 keeps the compressed latent (kv_lora_rank) and the RoPE part per token."""
    cfg = model_config("deepseek_v3")
    per_layer = (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]) * 4
    assert describe_model(models("deepseek_v3")).bytes_per_token == 2 * per_layer


def _next_logits(model, caches, token: int) -> np.ndarray:
    out = model(mx.array([[token]]), cache=caches)[:, -1, :]
    mx.eval(out)
    return np.array(out)


def _round_trip(tmp_path, model, live, make_fresh) -> None:
    """Checkpoint `live` (holding PROMPT[:-1]), restart the cache, restore into fresh caches:
    the last prompt token's logits are identical."""
    n = len(PROMPT) - 1
    pc = PromptCache(tmp_path / "kv", "tiny", disk_budget=64 * MiB, ram_budget=64 * MiB)
    assert pc.checkpoint(PROMPT[:n], live, "message") is not None
    pc.close()
    pc = PromptCache(tmp_path / "kv", "tiny", disk_budget=64 * MiB, ram_budget=64 * MiB)
    match = pc.lookup(PROMPT)
    assert match.hit and match.usable == n and match.source == "disk"
    fresh = make_fresh()
    pc.restore(match, fresh, tokens=PROMPT)
    pc.close()
    want = _next_logits(model, live, PROMPT[-1])
    got = _next_logits(model, fresh, PROMPT[-1])
    np.testing.assert_array_equal(got, want)


def _prefill(model, caches, chunk: int = 16) -> list:
    for lo in range(0, len(PROMPT) - 1, chunk):
        model(mx.array([PROMPT[lo : min(lo + chunk, len(PROMPT) - 1)]]), cache=caches)
        mx.eval([c.state for c in caches])
    return caches


@pytest.mark.parametrize("name", list(KINDS))
def test_every_cache_type_checkpoints_and_restores(tmp_path, models, name):
    model = models(name)
    live = _prefill(model, make_prompt_cache(model))
    _round_trip(tmp_path, model, live, lambda: make_prompt_cache(model))


def test_quantized_kv_checkpoints_and_restores(tmp_path):
    """QuantizedKVCache (mlx-lm's --kv-bits): grows per token, cannot merge, stored whole."""
    model = load(str(make_model_dir(tmp_path / "model", "llama", head_dim=32)))[0]
    live = [c.to_quantized(group_size=32, bits=8) for c in make_prompt_cache(model)]
    live = _prefill(model, live)
    assert [type(c).__name__ for c in live] == ["QuantizedKVCache"] * 2
    for layer in map(describe, live):
        assert layer.kind == TOKENS and layer.known
        assert not layer.mergeable and not layer.sliceable
    _round_trip(
        tmp_path, model, live, lambda: [KVCache().to_quantized(group_size=32, bits=8) for _ in live]
    )


class ForeignCache(KVCache):
    """A cache class mlx-lm does not define (as a model's own code might bring)."""


class ForeignModel:
    """A model whose layers use ForeignCache."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.layers = inner.layers

    def make_cache(self) -> list:
        return [ForeignCache() for _ in self.layers]

    def __call__(self, *args, **kwargs):
        return self.inner(*args, **kwargs)


def test_an_unknown_cache_class_is_stored_whole_and_never_batched(tmp_path, models):
    model = ForeignModel(models("llama"))
    layout = describe_model(model)
    assert layout.unknown == ["ForeignCache"]
    assert not layout.sliceable and not layout.mergeable and not can_batch(layout)
    assert [layer.kind for layer in layout.layers] == [TOKENS, TOKENS]
    live = _prefill(model, make_prompt_cache(model))
    _round_trip(tmp_path, model, live, lambda: make_prompt_cache(model))


def test_a_chunked_cache_that_dropped_positions_is_not_cut_back(models):
    """ChunkedKVCache reports is_trimmable() even after dropping its oldest positions; cut back
    below them it would answer wrongly, so a resident holding one is reused only whole."""
    model = models("llama4")
    short = make_prompt_cache(model)
    model(mx.array([PROMPT[:20]]), cache=short)
    assert can_cut_back(short, 10)
    long = _prefill(model, make_prompt_cache(model))
    assert all(c.is_trimmable() for c in long)  # what mlx-lm says
    assert not can_cut_back(long, 10)
    assert can_cut_back(_prefill(models("llama"), make_prompt_cache(models("llama"))), 10)
    assert not can_cut_back(_prefill(models("mamba2"), make_prompt_cache(models("mamba2"))), 10)
