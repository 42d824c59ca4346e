"""Tiny random-weight mlx-lm model directories of mlx-lm's own architectures, for tests.

`make_model_dir(dest, "gemma3_text")` writes what `mlx_lm.load` and `serve --model DIR` read: a
``config.json`` (``model_type`` plus tiny dimensions), ``model.safetensors`` with the parameters of
``mlx_lm.models.<type>.Model`` built from a fixed seed, and the default model's tokenizer files
(SmolLM2's, 49152 tokens). Hidden size 64 and two to four layers, so a CPU serves them faster
than the real default model.

They carry the quirks real checkpoints ship with (the configs in tests/fixtures/configs): an
embedding padded past the tokenizer (`ROWS` for its 49152 ids, as Qwen, Gemma 3, gpt-oss and
DeepSeek-V3 pad theirs), tied (llama, Gemma 3: no ``lm_head`` weight at all) and untied (Qwen,
DeepSeek, gpt-oss) output projections, several end-of-sequence ids (a list in Llama's and
Gemma 3's config.json, a list in every ``generation_config.json``, Qwen3.5's own id inside its
``text_config``), rope scaling (Llama 3's ``llama3``, Gemma 3's ``linear``, gpt-oss's and
DeepSeek-V3's ``yarn``), and with ``dtype="bfloat16"`` the float32 tensors a conversion keeps.

Each family keeps the cache types its real models build: ``llama`` plain ``KVCache``,
``qwen3_next`` / ``qwen3_5`` linear-attention ``ArraysCache`` layers with one full-attention
layer, ``gemma3_text`` / ``gemma3`` sliding windows (``RotatingKVCache``), ``gpt_oss`` sliding
windows with attention sinks and experts, ``deepseek_v3`` MLA latent KV, ``mamba`` / ``mamba2``
SSM state only, ``falcon_h1`` ``CacheList(ArraysCache, KVCache)``, ``llama4`` ``ChunkedKVCache``.
The wrappers (``qwen3_5``, ``gemma3``) write their dimensions under ``text_config`` as the Hugging
Face configs do; keyword overrides go where the family keeps them (``max_position_embeddings=...``
lands in ``text_config`` for a wrapper).
"""

from __future__ import annotations

import copy
import functools
import importlib
import json
import math
import shutil
from pathlib import Path
from typing import Any

VOCAB = 49152  # SmolLM2's tokenizer
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
EOS_IDS = [2, 0]  # SmolLM2's <|im_end|> and <|endoftext|>, as Qwen lists <|im_end|>, <|endoftext|>


def padded_vocab(tokens: int) -> int:
    """The embedding rows a checkpoint ships for a tokenizer of `tokens` ids: a multiple of 128
    with at least 64 rows no token uses, as Qwen pads 151,669 tokens to 151,936 rows (Gemma 3,
    gpt-oss and DeepSeek-V3 pad too). Those rows have logits like any other, and no text."""
    return (tokens + 64 + 127) // 128 * 128


ROWS = padded_vocab(VOCAB)


_ATTN = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rms_norm_eps": 1e-5,
    "vocab_size": ROWS,
}

_QWEN_LINEAR = {
    **_ATTN,
    "num_hidden_layers": 4,  # layers 0-2 linear attention (ArraysCache), layer 3 full (KVCache)
    "full_attention_interval": 4,
    "linear_num_value_heads": 4,
    "linear_num_key_heads": 2,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4,
    "max_position_embeddings": 32768,
    "tie_word_embeddings": False,
}

_GEMMA3_TEXT = {
    **_ATTN,
    "num_hidden_layers": 3,
    "num_key_value_heads": 1,
    "query_pre_attn_scalar": 16,
    "sliding_window": 32,  # small, so a short conversation already slides
    "sliding_window_pattern": 3,  # layers 0-1 sliding (RotatingKVCache), layer 2 global
    "max_position_embeddings": 32768,
    "rope_scaling": {"factor": 8.0, "rope_type": "linear"},  # Gemma 3's global layers
    "tie_word_embeddings": True,  # written without lm_head, as Gemma 3 ships
}

# Per family: the config.json a conversion of a real checkpoint would carry, shrunk.
CONFIGS: dict[str, dict[str, Any]] = {
    "llama": {
        **_ATTN,
        "num_hidden_layers": 2,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": True,  # as Llama 3.2 1B/3B (3.1 8B unties)
        "rope_scaling": {
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 1024,
            "rope_type": "llama3",
        },
        "eos_token_id": EOS_IDS,  # a list, as Llama 3.1's config.json
    },
    "qwen3_next": {
        **_QWEN_LINEAR,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "decoder_sparse_step": 1,
        "shared_expert_intermediate_size": 64,
        "moe_intermediate_size": 32,
        "mlp_only_layers": [],
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.25,
    },
    "qwen3_5": {
        "text_config": {
            **_QWEN_LINEAR,
            "model_type": "qwen3_5_text",
            "eos_token_id": EOS_IDS[0],  # where Qwen3.5 states it (mlx-lm reads the top level)
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.25,
                "mrope_section": [2, 1, 1],
            },
        },
    },
    # Qwen3.5/3.6's MoE (Qwen3.6-35B-A3B): qwen3_5's layers, every MLP routed over experts
    # with a shared one (mlx-lm runs it as `qwen3_5`'s text model; float32 on the CPU's gather_mm)
    "qwen3_5_moe": {
        "text_config": {
            **_QWEN_LINEAR,
            "model_type": "qwen3_5_moe_text",
            "eos_token_id": EOS_IDS[0],
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "shared_expert_intermediate_size": 64,
            "moe_intermediate_size": 32,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.25,
                "mrope_section": [2, 1, 1],
            },
        },
    },
    "gemma3_text": dict(_GEMMA3_TEXT),
    "gemma3": {
        "text_config": {**_GEMMA3_TEXT, "model_type": "gemma3_text"},
        "vocab_size": ROWS,
        "eos_token_id": EOS_IDS,  # a list, as Gemma 3's config.json ([1, 106])
    },
    "gpt_oss": {
        **_ATTN,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "layer_types": ["sliding_attention", "full_attention"],
        "sliding_window": 32,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "rope_theta": 150000,
        "rope_scaling": {
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "factor": 32.0,
            "original_max_position_embeddings": 4096,
            "rope_type": "yarn",
            "truncate": False,
        },
        "tie_word_embeddings": False,
        # As the real configs: no context field mlx-lm reads, but these two for the server.
        "max_position_embeddings": 131072,
        "initial_context_length": 4096,
    },
    "deepseek_v3": {
        **_ATTN,
        "num_hidden_layers": 2,
        "num_key_value_heads": 4,
        "moe_intermediate_size": 32,
        "n_shared_experts": 1,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "n_group": 1,
        "topk_group": 1,
        "first_k_dense_replace": 1,
        "kv_lora_rank": 32,
        "q_lora_rank": 48,
        "qk_rope_head_dim": 8,
        "qk_nope_head_dim": 16,
        "v_head_dim": 16,
        "max_position_embeddings": 16384,
        "rope_scaling": {  # DeepSeek-V3's YaRN (its factor 40 on 4096)
            "type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        "tie_word_embeddings": False,
    },
    # DeepSeek-V4.1's architecture without its engram layers (mlx-lm refuses those): mlx-lm
    # keeps each layer's window and compressed groups in its own `LayerCache`, whose `state` is
    # read-only (the prompt cache turns itself off for it).
    "deepseek_v41": {
        "vocab_size": ROWS,
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "head_dim": 16,
        "q_lora_rank": 16,
        "qk_rope_head_dim": 8,
        "o_groups": 2,
        "o_lora_rank": 32,
        "moe_intermediate_size": 32,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "index_n_heads": 4,
        "index_head_dim": 16,
        "index_topk": 64,
        "sliding_window": 32,
        "max_position_embeddings": 16384,
    },
    "mamba": {
        "vocab_size": ROWS,
        "hidden_size": 64,
        "intermediate_size": 128,
        "state_size": 16,
        "num_hidden_layers": 2,
        "conv_kernel": 4,
        "use_bias": False,
        "use_conv_bias": True,
        "time_step_rank": 4,
        "tie_word_embeddings": True,
    },
    "mamba2": {
        "vocab_size": ROWS,
        "hidden_size": 64,
        "num_heads": 4,
        "head_dim": 16,
        "intermediate_size": 64,
        "expand": 1,  # transformers checks hidden_size * expand == num_heads * head_dim
        "state_size": 16,
        "num_hidden_layers": 2,
        "layer_norm_epsilon": 1e-5,
        "conv_kernel": 4,
        "n_groups": 1,
        "use_bias": False,
        "use_conv_bias": True,
        "tie_word_embeddings": True,
        "time_step_limit": [0.0, 1e9],
        "time_step_rank": "auto",
        "max_position_embeddings": 8192,
    },
    "falcon_h1": {
        **_ATTN,
        "num_hidden_layers": 2,
        "mamba_d_conv": 4,
        "mamba_d_head": 16,
        "mamba_d_ssm": 64,
        "mamba_d_state": 16,
        "mamba_n_heads": 4,
        "mamba_n_groups": 1,
        "mamba_chunk_size": 16,
        "max_position_embeddings": 8192,
    },
    "llama4": {
        "text_config": {
            **_ATTN,
            "num_hidden_layers": 4,
            "intermediate_size_mlp": 128,
            "num_local_experts": 2,
            "num_experts_per_tok": 1,
            "interleave_moe_layer_step": 2,
            "model_type": "llama4_text",
            "attention_bias": False,
            "rope_scaling": None,
            "attention_chunk_size": 32,
            "use_qk_norm": True,
            "attn_temperature_tuning": True,
            "floor_scale": 8192,
            "attn_scale": 0.1,
            "rope_theta": 500000.0,
            "max_position_embeddings": 16384,
        },
    },
}

WRAPPERS = frozenset(k for k, v in CONFIGS.items() if "text_config" in v)


@functools.cache
def default_tokenizer_dir() -> Path:
    """The converted default model (converted once into the shared data dir, as tests do)."""
    from mlx_kvserve import paths
    from mlx_kvserve.models.default_model import default_model_dir, ensure_default_model

    found = default_model_dir(paths.data_dir())
    if not (found / "tokenizer.json").is_file():
        found = ensure_default_model(paths.data_dir(), progress=False)
    return found


def model_config(model_type: str, **overrides: Any) -> dict[str, Any]:
    """The config.json of a tiny `model_type`; overrides go into `text_config` for a wrapper,
    and an override of None removes the field (a config that does not state it)."""
    if model_type not in CONFIGS:
        raise ValueError(f"no tiny config for {model_type!r}; known: {sorted(CONFIGS)}")
    config = copy.deepcopy(CONFIGS[model_type])
    target = config["text_config"] if model_type in WRAPPERS else config
    target.update(overrides)
    for name, value in overrides.items():
        if value is None:
            del target[name]
    config["model_type"] = model_type
    return config


def _long_memory(path: str, value: Any) -> Any:
    """SSM time steps as Mamba initialises them (softplus(dt_bias) in [0.001, 0.1]), not
    mlx-lm's placeholder ones (a step of about 1.3, which forgets a token within a few): a
    state restored wrongly must change the answers, as it would with real weights."""
    import mlx.core as mx

    if not (path.endswith("dt_bias") or path.endswith("dt_proj.bias")):
        return value
    dt = mx.exp(mx.random.uniform(math.log(0.001), math.log(0.1), value.shape))
    return mx.log(mx.expm1(dt)).astype(value.dtype)  # the inverse of softplus


def make_model_dir(
    dest: Path,
    model_type: str,
    *,
    dtype: str = "float32",
    seed: int = 0,
    **config_overrides: Any,
) -> Path:
    """Write a tiny random-weight `model_type` model into `dest` (created) and return it.

    `dtype` casts the floating parameters as `mlx_lm.convert` does, so a model's
    ``cast_predicate`` keeps its deliberate float32 tensors (Qwen3.5's ``A_log``, DeepSeek-V3's
    router bias) in float32.
    """
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_map_with_path

    config = model_config(model_type, **config_overrides)
    if dtype != "float32":
        config["torch_dtype"] = dtype
    module = importlib.import_module(f"mlx_lm.models.{model_type}")
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs.from_dict(config))
    model.update(tree_map_with_path(_long_memory, model.parameters()))
    target = getattr(mx, dtype)
    keep = getattr(model, "cast_predicate", lambda _path: True)

    def cast(path: str, value: Any) -> Any:
        if keep(path) and mx.issubdtype(value.dtype, mx.floating):
            return value.astype(target)
        return value

    model.update(tree_map_with_path(cast, model.parameters()))
    weights = dict(tree_flatten(model.parameters()))
    text = config.get("text_config", config)
    if text.get("tie_word_embeddings") and model_type.startswith("gemma3"):
        # Gemma 3 ships no lm_head: mlx-lm ties it to the embedding when the weight is absent
        weights = {k: v for k, v in weights.items() if not k.endswith("lm_head.weight")}
    mx.eval(weights)
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(dest / "model.safetensors"), weights, metadata={"format": "mlx"})
    (dest / "config.json").write_text(json.dumps(config, indent=2))
    generation = {"bos_token_id": 1, "eos_token_id": EOS_IDS}  # as Qwen's and Llama's lists
    (dest / "generation_config.json").write_text(json.dumps(generation, indent=2))
    source = default_tokenizer_dir()
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copyfile(source / name, dest / name)
    return dest


def scale_output_row(model: Path, token: str, scale: float) -> None:
    """Scale the output row of the added token `token` in `model`'s weights (in place), so a
    random model writes it often: a tool call's opener, or an end that comes early."""
    import mlx.core as mx

    tokenizer = json.loads((model / "tokenizer.json").read_text(encoding="utf-8"))
    (row,) = (t["id"] for t in tokenizer["added_tokens"] if t["content"] == token)
    path = str(model / "model.safetensors")
    weights = mx.load(path)
    name = output_weights(weights)
    head = weights[name]
    weights[name] = mx.concatenate([head[:row], head[row : row + 1] * scale, head[row + 1 :]])
    mx.save_safetensors(path, weights, metadata={"format": "mlx"})


def output_weights(weights: dict) -> str:
    """The name of the output projection: `lm_head`, or the embedding when they are tied."""
    return next(k for k in ("lm_head.weight", "model.embed_tokens.weight") if k in weights)


EMBEDDING_POOLING = {
    "word_embedding_dimension": 64,
    "pooling_mode_lasttoken": True,
    "include_prompt": True,
}
EMBEDDING_MODULES = [
    {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
    {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    {
        "idx": 2,
        "name": "2",
        "path": "2_Normalize",
        "type": "sentence_transformers.models.Normalize",
    },
]


def embedding_model_dir(dest: Path, context: int = 64) -> Path:
    """A tiny llama whose sentence-transformers files say last-token pooling, as
    Qwen3-Embedding's do (mlx_kvserve/embed/kind.py)."""
    model_dir = make_model_dir(dest, "llama", max_position_embeddings=context, seed=3)
    (model_dir / "modules.json").write_text(json.dumps(EMBEDDING_MODULES))
    (model_dir / "1_Pooling").mkdir()
    (model_dir / "1_Pooling" / "config.json").write_text(json.dumps(EMBEDDING_POOLING))
    return model_dir
