"""What each layer's KV cache will hold, read from a config.json alone (no weights, no MLX).

The server asks the cache objects themselves (cache/kinds.py, after a one-token pass). This
module states the same description from the config, as mlx-lm's `make_cache` of each family
builds the caches, so the memory table in docs/memory.md (scripts/memory_table.py) can be
computed for models too large to load here by the same admission code the server runs
(engine/ledger.py). tests/unit/test_kv_shape.py checks that both descriptions agree on tiny
models of each family.

Families: plain attention (llama, qwen3, qwen3_moe, mistral, ...: every layer grows per token),
gemma3 (a window of `sliding_window` positions on all but every `sliding_window_pattern`-th
layer), gpt_oss (`layer_types`: sliding or full), qwen3_next / qwen3_5 / qwen3_5_moe (a full
attention layer every `full_attention_interval` layers, the others a gated-delta state: a
convolution state in the activation dtype and a float32 recurrent state).
"""

from __future__ import annotations

from dataclasses import dataclass

from mlx_kvserve.json_value import JSON
from mlx_kvserve.models.context import NESTED

TOKENS, WINDOW, STATE = "tokens", "window", "state"  # as cache/kinds.py names them
LINEAR = ("qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")
GEMMA3 = ("gemma3", "gemma3_text")


@dataclass(frozen=True)
class LayerShape:
    """One layer, in the terms of `cache.kinds.LayerKind` that admission reads."""

    kind: str
    bytes_per_token: int
    fixed_bytes: int
    window: int | None


def text_config(config: dict[str, JSON]) -> dict[str, JSON]:
    """The language model's section: a wrapper's `text_config` over its top level."""
    for key in NESTED:
        inner = config.get(key)
        if isinstance(inner, dict):
            return {**config, **inner}
    return config


def layers_from_config(config: dict[str, JSON], dtype_bytes: int = 2) -> list[LayerShape]:
    """Per-layer cache description; `dtype_bytes` is the KV (activation) dtype's size."""
    c = text_config(config)
    family = str(config.get("model_type", c.get("model_type", "")))
    n = int(c["num_hidden_layers"])
    heads = int(c.get("num_key_value_heads") or c["num_attention_heads"])
    head_dim = int(c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"])
    per_token = 2 * heads * head_dim * dtype_bytes  # keys and values

    def grows() -> LayerShape:
        return LayerShape(TOKENS, per_token, 0, None)

    def window(size: int) -> LayerShape:
        return LayerShape(WINDOW, per_token, per_token * size, size)

    if family in GEMMA3:
        pattern, size = int(c.get("sliding_window_pattern", 6)), int(c["sliding_window"])
        return [grows() if i % pattern == pattern - 1 else window(size) for i in range(n)]
    if family == "gpt_oss":
        kinds = c.get("layer_types") or ["sliding_attention", "full_attention"] * (n // 2)
        size = int(c["sliding_window"])
        return [grows() if k == "full_attention" else window(size) for k in kinds[:n]]
    if family in LINEAR:
        interval = int(c.get("full_attention_interval", 4))
        return [
            grows() if (i + 1) % interval == 0 else _linear_state(c, dtype_bytes) for i in range(n)
        ]
    return [grows() for _ in range(n)]


def _linear_state(c: dict[str, JSON], dtype_bytes: int) -> LayerShape:
    """A gated-delta layer: conv state (kernel - 1, q+k+v dims) in the activation dtype and a
    (value heads, value dim, key dim) float32 state (mlx_lm/models/gated_delta.py)."""
    key_heads, value_heads = int(c["linear_num_key_heads"]), int(c["linear_num_value_heads"])
    key_dim, value_dim = int(c["linear_key_head_dim"]), int(c["linear_value_head_dim"])
    conv_dim = 2 * key_heads * key_dim + value_heads * value_dim
    conv = (int(c.get("linear_conv_kernel_dim", 4)) - 1) * conv_dim * dtype_bytes
    recurrent = value_heads * value_dim * key_dim * 4
    return LayerShape(STATE, 0, conv + recurrent, None)
