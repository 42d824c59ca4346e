"""Tiny instances of every architecture in `mlx_lm.models`, from one generic set of dimensions.

`tiny_models.py` keeps hand-written configs for the families the server is tested on end to end;
those are used as they are. The other modules' `ModelArgs` take the generic dimensions below for
the fields they have, plus a neutral value for any other required field (False, 1.0, 2, "").
Some architectures need values no generic rule can guess (layer type lists, MoE group layouts,
a vision tower); `build` then says why it could not, and the caller skips them. Vocabulary 256
and hidden size 64: built in well under a second each on a CPU.
"""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
import typing
from typing import Any

import mlx.core as mx

from tests.support.tiny_models import CONFIGS, model_config

VOCAB = 256
GENERIC: dict[str, Any] = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": VOCAB,
    "rms_norm_eps": 1e-5,
    "layer_norm_eps": 1e-5,
    "layer_norm_epsilon": 1e-5,
    "norm_eps": 1e-5,
    "max_position_embeddings": 4096,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "n_embd": 64,
    "n_layer": 2,
    "n_head": 4,
    "n_positions": 4096,
    "n_ctx": 4096,
    "d_model": 64,
    "n_layers": 2,
    "n_heads": 4,
    "dim": 64,
    "moe_intermediate_size": 64,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "n_routed_experts": 4,
    "n_shared_experts": 1,
    "num_local_experts": 4,
    "shared_expert_intermediate_size": 64,
    "kv_lora_rank": 16,
    "q_lora_rank": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "qk_nope_head_dim": 8,
    "sliding_window": 32,
    "rotary_dim": 8,
    "partial_rotary_factor": 0.5,
    "max_seq_len": 4096,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "topk_group": 1,
    "n_group": 1,
    "routed_scaling_factor": 1.0,
    "attention_bias": False,
    "mlp_bias": False,
    "hidden_act": "silu",
    "kv_channels": 16,
    "ffn_hidden_size": 128,
    "num_layers": 2,
    "seq_length": 4096,
    "model_dim": 64,
    "num_kv_heads": 2,
    "num_query_heads": 4,
    "num_gqa_groups": 2,
}
# Not building blocks of a model, or not buildable in a test process: olmo exits the process
# when ai2-olmo is missing; phi3small's kernels corrupt the heap with generic dimensions.
NOT_MODELS = frozenset(
    {
        "activations",
        "base",
        "bitlinear_layers",
        "cache",
        "gated_delta",
        "mla",
        "pipeline",
        "rope_utils",
        "ssm",
        "switch_layers",
        "olmo",
        "phi3small",
    }
)


def architectures() -> list[str]:
    import mlx_lm.models

    names = (m.name for m in pkgutil.iter_modules(mlx_lm.models.__path__))
    return sorted(n for n in names if n not in NOT_MODELS)


def config_for(module: Any, model_type: str) -> dict[str, Any]:
    args = module.ModelArgs
    hints = typing.get_type_hints(args)
    config: dict[str, Any] = {"model_type": model_type}
    for field in dataclasses.fields(args):
        if field.name in GENERIC:
            config[field.name] = GENERIC[field.name]
        elif field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
            kind = str(hints.get(field.name, ""))
            if "bool" in kind:
                config[field.name] = False
            elif "float" in kind:
                config[field.name] = 1.0
            elif "int" in kind and "ist" not in kind:
                config[field.name] = 2
            elif "str" in kind:
                config[field.name] = ""
    return config


def build(model_type: str) -> Any:
    """A tiny random-weight model of `model_type`, or a string saying why there is none."""
    module = importlib.import_module(f"mlx_lm.models.{model_type}")
    if not hasattr(module, "ModelArgs") or not hasattr(module, "Model"):
        return "no ModelArgs/Model"
    if model_type in CONFIGS:  # the hand-written tiny config of a family served end to end
        config = model_config(model_type)
    elif any(f.name == "text_config" for f in dataclasses.fields(module.ModelArgs)):
        return "a wrapper: its dimensions live in text_config (no tiny config in tiny_models.py)"
    else:
        config = config_for(module, model_type)
    try:
        args = module.ModelArgs.from_dict(config)
        mx.random.seed(0)
        model = module.Model(args)
        mx.eval(model.parameters())
    except Exception as exc:  # the generic dimensions do not fit this architecture
        return f"{type(exc).__name__}: {exc}"
    return model
