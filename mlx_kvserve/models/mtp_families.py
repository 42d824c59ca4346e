"""Per model family: where a checkpoint keeps its MTP heads and which of mlx-lm's decoder layers
hold them (models/mtp_heads.py builds and loads the block).

Three layouts ship:
- `mtp.*` tensors in the block's own names (Qwen3.5/3.6, Qwen3-Next; `mtp_num_hidden_layers`);
- DeepSeek's nextn layer `model.layers.{num_hidden_layers}` (one decoder layer with its own
  enorm/hnorm/eh_proj and shared_head; `num_nextn_predict_layers`): DeepSeek-V3/V3.2, GLM-4.5/4.6
  (`glm4_moe`), GLM-4.7-Flash (`glm4_moe_lite`) and GLM-5 (`glm_moe_dsa`); MiMo's
  `model.mtp_layers.{i}` is the same shape under other names, its fc reading [hidden, embedding]
  (as vLLM's `mimo_mtp` reads it);
- Nemotron-H's `mtp.layers.{i}`: one prediction module of several hybrid blocks (attention `*`,
  experts `E`; `mtp_hybrid_override_pattern`), enorm/hnorm/eh_proj on the first, the final norm
  on the last (as mlx-vlm's `speculative/drafters/nemotron_h_mtp`, MIT, reads it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import CacheList, KVCache

# a nextn layer's names -> the block's (its embed_tokens and shared_head.head: the target's)
NEXTN = {
    "enorm.": "pre_fc_norm_embedding.",
    "hnorm.": "pre_fc_norm_hidden.",
    "eh_proj.": "fc.",
    "shared_head.norm.": "norm.",
}
# MiMo's MTP layer `model.mtp_layers.{i}`: its own fc and norms beside a Qwen2 decoder layer
MIMO = {
    "token_layernorm.": "pre_fc_norm_embedding.",
    "hidden_layernorm.": "pre_fc_norm_hidden.",
    "input_proj.": "fc.",
    "final_layernorm.": "norm.",
}


@dataclass(frozen=True)
class Family:
    field: str  # the config field stating its MTP layers
    prefix: str = "mtp."  # where its tensors are ("{n}": the config's num_hidden_layers)
    # one decoder layer beside its own fc and norms, these the names of those (DeepSeek's nextn
    # layer, MiMo's): loaded as the block's layer 0, a second such layer not built (a chain)
    single: dict[str, str] | None = None
    centred: bool = False  # zero-centred norms in a Hugging Face layout (Qwen)
    target_prefix: str = "model."  # where the target's `sanitize` finds its layers
    hidden_first: bool = False  # its fc reads [hidden, embedding] (MiMo), ours the reverse


_NEXTN_LAYER = "model.layers.{n}."
FAMILIES = {
    "qwen3_5": Family("mtp_num_hidden_layers", centred=True, target_prefix="language_model.model."),
    "qwen3_5_moe": Family(
        "mtp_num_hidden_layers", centred=True, target_prefix="language_model.model."
    ),
    "qwen3_next": Family("mtp_num_hidden_layers", centred=True),
    "deepseek_v3": Family("num_nextn_predict_layers", _NEXTN_LAYER, NEXTN),
    "deepseek_v32": Family("num_nextn_predict_layers", _NEXTN_LAYER, NEXTN),  # MLA, indexer
    "glm4_moe": Family("num_nextn_predict_layers", _NEXTN_LAYER, NEXTN),  # GLM's layer
    "glm4_moe_lite": Family("num_nextn_predict_layers", _NEXTN_LAYER, NEXTN),  # GLM-4.7-Flash
    "glm_moe_dsa": Family("num_nextn_predict_layers", _NEXTN_LAYER, NEXTN),  # GLM-5: V3.2's
    "nemotron_h": Family("num_nextn_predict_layers", target_prefix="backbone."),
    "mimo": Family("num_nextn_predict_layers", "model.mtp_layers.0.", MIMO, hidden_first=True),
}


@dataclass
class Stack:
    """The block's decoder layers, and per layer the cache it takes (None: it attends nowhere)."""

    layers: list[nn.Module]
    caches: list[Callable[[], object] | None]
    hidden_size: int
    eps: float


def stack(config: dict, target: nn.Module, layers: int) -> Stack:
    """Empty decoder layers of the target's family for `layers` MTP layers, on its args."""
    model_type = config["model_type"]
    if model_type == "nemotron_h":
        return _nemotron(config, target)
    if model_type == "mimo":
        from mlx_lm.models.mimo import TransformerBlock

        args = target.args
        return Stack(
            [TransformerBlock(args) for _ in range(layers)],
            [KVCache] * layers,
            args.hidden_size,
            args.rms_norm_eps,
        )
    if model_type in ("qwen3_5", "qwen3_5_moe"):
        from mlx_lm.models.qwen3_5 import DecoderLayer as Layer

        args = target.language_model.args
        index = args.full_attention_interval - 1  # an index whose layer attends (not linear)
    elif model_type == "qwen3_next":
        from mlx_lm.models.qwen3_next import Qwen3NextDecoderLayer as Layer

        args = target.args
        index = args.full_attention_interval - 1
    else:
        Layer = _NEXTN_LAYERS[model_type]()
        args = target.args
        index = args.num_hidden_layers  # the nextn layer's own index: a MoE layer
    cache = _indexed if model_type in ("deepseek_v32", "glm_moe_dsa") else KVCache
    return Stack(
        [Layer(args, layer_idx=index) for _ in range(layers)],
        [cache] * layers,
        args.hidden_size,
        args.rms_norm_eps,
    )


def _indexed() -> CacheList:
    """DeepSeek-V3.2's cache of a layer: the latent KV and its indexer's keys (its make_cache)."""
    return CacheList(KVCache(), KVCache())


def _glm4_moe():
    from mlx_lm.models.glm4_moe import DecoderLayer

    return DecoderLayer


def _glm4_moe_lite():
    from mlx_lm.models.glm4_moe_lite import Glm4MoeLiteDecoderLayer

    return Glm4MoeLiteDecoderLayer


def _deepseek_v3():
    from mlx_lm.models.deepseek_v3 import DeepseekV3DecoderLayer

    return DeepseekV3DecoderLayer


def _deepseek_v32():
    from mlx_lm.models.deepseek_v32 import DeepseekV32DecoderLayer

    return DeepseekV32DecoderLayer


_NEXTN_LAYERS = {
    "deepseek_v3": _deepseek_v3,
    "deepseek_v32": _deepseek_v32,
    "glm_moe_dsa": _deepseek_v32,  # mlx-lm's glm_moe_dsa is DeepSeek-V3.2's model
    "glm4_moe": _glm4_moe,
    "glm4_moe_lite": _glm4_moe_lite,
}


def nemotron_pattern(config: dict) -> list[str]:
    """The block types of Nemotron-H's prediction module (`*` attention, `E` experts)."""
    from mlx_lm.models.nemotron_h import ModelArgs

    pattern = config.get("mtp_hybrid_override_pattern")
    if pattern is None:
        kinds = ModelArgs._block_type_to_char
        pattern = [kinds[t] for t in config.get("mtp_layers_block_type") or ()]
    return list(pattern)


def _nemotron(config: dict, target: nn.Module) -> Stack:
    from mlx_lm.models.nemotron_h import NemotronHBlock

    args = target.args
    pattern = nemotron_pattern(config)
    return Stack(
        [NemotronHBlock(args, kind) for kind in pattern],
        [KVCache if kind == "*" else None for kind in pattern],
        args.hidden_size,
        args.layer_norm_epsilon,
    )


def nemotron_names(depth: int) -> dict[str, str]:
    """Nemotron-H's MTP names (prefix cut) -> the block's: the first layer's enorm/hnorm/eh_proj
    and the last's final_layernorm are the block's own."""
    return {
        "layers.0.enorm.": "pre_fc_norm_embedding.",
        "layers.0.hnorm.": "pre_fc_norm_hidden.",
        "layers.0.eh_proj.": "fc.",
        f"layers.{depth - 1}.final_layernorm.": "norm.",
    }


def renamed(weights: dict, names: dict[str, str]) -> dict:
    """`weights` with each key's first matching prefix in `names` replaced by its value."""
    out = {}
    for key, value in weights.items():
        for theirs, ours in names.items():
            if key.startswith(theirs):
                key = ours + key[len(theirs) :]
                break
        out[key] = value
    return out


def one_layer(weights: dict, names: dict[str, str]) -> dict:
    """A single MTP layer's tensors (DeepSeek's nextn layer, MiMo's) in the block's names:
    `names` its own fc and norms, the rest its decoder layer, as the block's layer 0."""
    out = {}
    for key, value in weights.items():
        if key.startswith(("embed_tokens.", "shared_head.head.")):
            continue  # copies of the target's embedding and output head
        if key.endswith("rotary_emb.inv_freq"):
            continue  # a buffer some exports keep (GLM-4.7-Flash's): RoPE is recomputed
        for theirs, ours in names.items():
            if key.startswith(theirs):
                out[ours + key[len(theirs) :]] = value
                break
        else:
            out["layers.0." + key] = value
    return out


def hidden_first(weights: dict) -> dict:
    """An fc that reads [hidden, embedding] (MiMo's) as the block's, which reads [embedding,
    hidden]: its input columns' halves swapped (a quantized one's scales and biases too: the
    halves are whole groups)."""
    out = dict(weights)
    for name in ("fc.weight", "fc.scales", "fc.biases"):
        if name in out:
            w = out[name]
            half = w.shape[1] // 2
            out[name] = mx.concatenate([w[:, half:], w[:, :half]], axis=1)
    return out
