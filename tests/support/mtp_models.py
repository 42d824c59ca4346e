"""Tiny Qwen3.5 checkpoints that carry MTP heads, as Qwen3.5/3.6 ship them (`mtp.*` tensors in
the model's safetensors, `mtp_num_hidden_layers` in its `text_config`); Qwen3.5-MoE and
Qwen3-Next too; DeepSeek-V3, DeepSeek-V3.2, GLM-4 MoE, GLM-4.7-Flash (`glm4_moe_lite`) and GLM-5
(`glm_moe_dsa`) with their nextn layer `model.layers.{num_hidden_layers}` and the copies of the
embedding and head it ships; Nemotron-H with its `mtp.layers.{i}` module of an attention and an
experts block, as each family's real checkpoints name them.

`mtp_model_dir(dest)` writes `tiny_models.make_model_dir(dest, "qwen3_5")` plus one random MTP
layer: random heads guess badly, so they show exactness (every guess checked) but not
acceptance. `predictable=True` makes heads that guess right: the target's decoder layers add
nothing to the residual stream (their output projections zeroed), so its next token depends on
the current token alone, h_p = norm(embedding of t_p); the MTP block's `fc` passes the next
token's normed embedding through and its layer adds nothing either, so its output is the
target's hidden state one position on, and through the target's head it predicts exactly what
the target will. `leak` keeps that fraction of the target's layers (its answers then depend on
context, and the heads guess right only sometimes: drafts kept and rejected).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.support.tiny_models import make_model_dir

# the projections whose output joins the residual stream
_OUTPUTS = ("o_proj.weight", "out_proj.weight", "down_proj.weight", "fc2.weight")


# Qwen3.5-MoE is Qwen3.5's classes with experts (mlx-lm's qwen3_5_moe differs in `sanitize`)
MOE = {
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 64,
}


def mtp_model_dir(
    dest: Path,
    *,
    family: str = "qwen3_5",
    layers: int = 1,
    predictable: bool = False,
    leak: float = 0.0,
    seed: int = 0,
    **overrides: Any,
) -> Path:
    """A tiny `family` (qwen3_5, qwen3_5_moe, qwen3_next, or one of `TINY`) directory whose
    safetensors also hold `layers` MTP layers."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import load_model

    from mlx_kvserve.models.mtp_heads import _block

    moe = family == "qwen3_5_moe"
    base = "qwen3_5" if moe else family
    extra: dict[str, Any] = dict(MOE) if moe else {}
    nextn = family in NEXTN_FAMILIES
    nemotron = family == "nemotron_h"
    own = nextn or family in ("nemotron_h", "mimo")  # DeepSeek's config field (theirs too)
    extra["num_nextn_predict_layers" if own else "mtp_num_hidden_layers"] = layers
    if family in TINY:
        _family_dir(dest, family, seed, {**extra, **overrides})
    else:
        make_model_dir(dest, base, seed=seed, **extra, **overrides)
    config = json.loads((dest / "config.json").read_text())
    config["model_type"] = family
    (dest / "config.json").write_text(json.dumps(config, indent=2))
    target, _ = load_model(dest)
    mx.random.seed(seed + 1)
    block = _block(config, target, layers)
    heads = {f"mtp.{k}": v for k, v in tree_flatten(block.parameters())}
    width = len(block.layers)
    path = dest / "model.safetensors"
    weights = dict(mx.load(str(path)))
    if predictable:
        hidden = config.get("text_config", config)["hidden_size"]
        for key in weights:
            if key.endswith(_OUTPUTS):
                weights[key] = weights[key] * leak
        for key in heads:
            if key.endswith(_OUTPUTS):
                heads[key] = mx.zeros_like(heads[key])
        eye = mx.eye(hidden, dtype=heads["mtp.fc.weight"].dtype)
        heads["mtp.fc.weight"] = mx.concatenate([eye, mx.zeros_like(eye)], axis=1)
    if nextn:  # DeepSeek's names, with the copies of the embedding and head it ships
        heads = _as_nextn(heads, config["num_hidden_layers"], weights, family)
    elif family == "mimo":
        heads = _as_mimo(heads)
    elif nemotron:
        heads = _as_nemotron(heads, width)
    weights.update(heads)
    mx.eval(weights)
    mx.save_safetensors(str(path), weights, metadata={"format": "mlx"})
    return dest


# a small MoE stack, as GLM's and DeepSeek's configs spell it (tiny_models.py has neither GLM
# family; the rest as its models are built)
MOE_STACK = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_attention_heads": 4,
    "num_hidden_layers": 2,
    "first_k_dense_replace": 1,
    "n_routed_experts": 4,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "n_group": 1,
    "topk_group": 1,
    "routed_scaling_factor": 1.0,
    "norm_topk_prob": True,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
}
# GLM-4.5's shape, shrunk
GLM = {
    **MOE_STACK,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "use_qk_norm": True,
    "partial_rotary_factor": 0.5,
    "rope_theta": 10000.0,
    "rope_scaling": None,
    "attention_bias": True,
}
# DeepSeek's MLA (tiny_models.py's deepseek_v3 shape, without YaRN)
MLA = {
    **MOE_STACK,
    "num_key_value_heads": 4,
    "kv_lora_rank": 32,
    "q_lora_rank": 48,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 16,
    "v_head_dim": 16,
    "attention_bias": False,
}
# DeepSeek-V3.2's sparse attention: an indexer keeps `index_topk` positions (few here, so the
# tests' answers outgrow it and the sparse path runs, in the target and in the MTP layer)
DSA = {"index_head_dim": 16, "index_n_heads": 2, "index_topk": 12}
TINY = {
    "glm4_moe": GLM,
    "glm4_moe_lite": {**MLA, "rope_theta": 10000.0, "partial_rotary_factor": 1.0},
    "deepseek_v32": {**MLA, **DSA, "rope_theta": 10000.0},
    # GLM-5 as its config.json states it: transformers' rope_parameters, no rope_theta
    "glm_moe_dsa": {
        **MLA,
        **DSA,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "moe_layer_freq": 1,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
    },
    # Nemotron-H (Nemotron 3): Mamba, attention and experts blocks; its MTP module an attention
    # and an experts block (`mtp_hybrid_override_pattern`)
    "nemotron_h": {
        "hidden_size": 64,
        "intermediate_size": 128,
        "max_position_embeddings": 4096,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "attention_bias": False,
        "mamba_num_heads": 4,
        "mamba_head_dim": 16,
        "mamba_proj_bias": False,
        "ssm_state_size": 16,
        "conv_kernel": 4,
        "n_groups": 1,
        "mlp_bias": False,
        "layer_norm_epsilon": 1e-5,
        "use_bias": False,
        "use_conv_bias": True,
        "hybrid_override_pattern": "ME*E",
        "mtp_hybrid_override_pattern": "*E",
        "moe_intermediate_size": 32,
        "moe_shared_expert_intermediate_size": 32,
        "n_group": 1,
        "n_routed_experts": 4,
        "n_shared_experts": 1,
        "topk_group": 1,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
        "routed_scaling_factor": 1.0,
        "tie_word_embeddings": False,
    },
}
TINY["mimo"] = {  # MiMo-7B's shape (Qwen2's layers), shrunk; one MTP layer as it ships
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
}
NEXTN_FAMILIES = ("deepseek_v3", "deepseek_v32", "glm4_moe", "glm4_moe_lite", "glm_moe_dsa")


def _family_dir(dest: Path, family: str, seed: int, overrides: dict) -> None:
    """A tiny random `family` directory (a `TINY` shape), as `make_model_dir` writes its
    families."""
    import importlib
    import shutil

    import mlx.core as mx
    from mlx.utils import tree_flatten

    from tests.support.tiny_models import EOS_IDS, ROWS, TOKENIZER_FILES, default_tokenizer_dir

    config = {"model_type": family, **TINY[family], "vocab_size": ROWS, **overrides}
    config["eos_token_id"] = EOS_IDS
    module = importlib.import_module(f"mlx_lm.models.{family}")
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs.from_dict(config))
    weights = dict(tree_flatten(model.parameters()))
    mx.eval(weights)
    dest.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(dest / "model.safetensors"), weights, metadata={"format": "mlx"})
    (dest / "config.json").write_text(json.dumps(config, indent=2))
    for name in TOKENIZER_FILES:
        if (default_tokenizer_dir() / name).is_file():
            shutil.copyfile(default_tokenizer_dir() / name, dest / name)


def _as_nemotron(heads: dict, depth: int) -> dict:
    """The block's tensors as Nemotron-H ships its MTP module: `mtp.layers.{i}.*`, the fc and
    its norms on the first block, the final norm on the last."""
    from mlx_kvserve.models.mtp_families import nemotron_names, renamed

    theirs = {f"mtp.{ours}": f"mtp.{name}" for name, ours in nemotron_names(depth).items()}
    return renamed(heads, theirs)


def _as_single(heads: dict, prefix: str, names: dict[str, str]) -> dict:
    """The block's tensors as a family ships its single MTP layer: under `prefix`, its own fc
    and norms named `names` (theirs -> ours), its decoder layer's tensors beside them."""
    out = {}
    for key, value in heads.items():
        key = key.removeprefix("mtp.")
        for name, ours in names.items():
            if key.startswith(ours):
                key = name + key[len(ours) :]
                break
        else:
            key = key.removeprefix("layers.0.")
        out[prefix + key] = value
    return out


def _as_mimo(heads: dict) -> dict:
    """The block's tensors as MiMo ships its MTP layer: `model.mtp_layers.0.*`, its fc reading
    [hidden, embedding] (the block's halves swapped)."""
    from mlx_kvserve.models.mtp_families import MIMO, hidden_first

    ours = hidden_first({k.removeprefix("mtp."): v for k, v in heads.items()})
    return _as_single(ours, "model.mtp_layers.0.", MIMO)


def _as_nextn(heads: dict, index: int, weights: dict, family: str) -> dict:
    """The block's tensors as DeepSeek-V3 ships its nextn layer: `model.layers.{index}.*`."""
    import mlx.core as mx

    from mlx_kvserve.models.mtp_families import NEXTN

    out = _as_single(heads, f"model.layers.{index}.", NEXTN)
    if family == "glm4_moe_lite":  # a RoPE buffer mlx-vlm's splitter skips in GLM-4.7-Flash's
        out[f"model.layers.{index}.self_attn.rotary_emb.inv_freq"] = mx.ones((4,))
    out[f"model.layers.{index}.embed_tokens.weight"] = weights["model.embed_tokens.weight"]
    out[f"model.layers.{index}.shared_head.head.weight"] = weights["lm_head.weight"]
    return out


# heads: random (guesses), right (the target's own next token), leaky (right only sometimes)
HEADS = {"random": {}, "right": {"predictable": True}, "leaky": {"predictable": True, "leak": 0.05}}


def loaded_qwens(make_dir: Any, kinds: Any = tuple(HEADS)) -> dict[str, tuple]:
    """Tiny Qwen3.5 checkpoints (hybrid: GatedDeltaNet and attention) with one MTP layer, per
    kind of heads: (model, its `MTPHeads`, its directory); `make_dir(name)` gives a fresh one
    (pytest's `tmp_path_factory.mktemp`)."""
    from mlx_lm.utils import load_model

    from mlx_kvserve.models.mtp_heads import load_heads

    out = {}
    for name in kinds:
        path = mtp_model_dir(make_dir(name), **HEADS[name])
        model, _ = load_model(path)
        out[name] = (model, load_heads(path, model), path)
    return out


def predictable_llama_heads(model: Any, leak: float = 0.0) -> Any:
    """`MTPHeads` for an in-memory mlx-lm llama (every layer plain KV, so rows verify merged):
    one llama block as the MTP layer, made predictable as above (`model` changed in place)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models.llama import TransformerBlock

    from mlx_kvserve.models.mtp_heads import MTPBlock, MTPHeads

    args = model.args
    scaled = [(k, v * leak) for k, v in tree_flatten(model.parameters()) if k.endswith(_OUTPUTS)]
    model.load_weights(scaled, strict=False)
    block = MTPBlock([TransformerBlock(args)], args.hidden_size, args.rms_norm_eps)
    zeroed = [(k, mx.zeros_like(v)) for k, v in tree_flatten(block.parameters())]
    eye = mx.eye(args.hidden_size)
    fc = mx.concatenate([eye, mx.zeros_like(eye)], axis=1)
    block.load_weights(
        [(k, v) for k, v in zeroed if k.endswith(_OUTPUTS)] + [("fc.weight", fc)], strict=False
    )
    mx.eval(model.parameters(), block.parameters())
    return MTPHeads(model, block)


# zero-centred RMSNorm weights: Hugging Face's Qwen3.5 stores w - 1 (mlx-lm adds the 1 back)
_CENTRED = (
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
    "q_norm.weight",
    "k_norm.weight",
    "norm.weight",
    "pre_fc_norm_embedding.weight",
    "pre_fc_norm_hidden.weight",
)


def as_hugging_face(mlx_dir: Path, dest: Path) -> Path:
    """The Qwen3.5 checkpoint in `mlx_dir` in the layout Qwen ships it on the Hub: names under
    `model.language_model.`, convolutions (C, 1, K), zero-centred norms stored as w - 1 (the
    MTP block's too), as mlx-lm's `sanitize` expects to undo."""
    import shutil

    import mlx.core as mx

    shutil.copytree(mlx_dir, dest)
    weights = dict(mx.load(str(dest / "model.safetensors")))
    out = {}
    for key, value in weights.items():
        if key.startswith("language_model.model."):
            key = "model.language_model." + key[len("language_model.model.") :]
        elif key.startswith("language_model."):
            key = key[len("language_model.") :]
        if "conv1d.weight" in key:
            value = value.moveaxis(1, 2)
        if value.ndim == 1 and key.endswith(_CENTRED) and "linear_attn" not in key:
            value = value - 1.0
        out[key] = value
    mx.eval(out)
    mx.save_safetensors(str(dest / "model.safetensors"), out)
    return dest
