"""Tiny random-weight vision checkpoints, as a conversion of the real ones lays them out.

`gemma3_vision_dir(dest)`: the tiny Gemma 3 text model of tiny_models.py (mlx-lm's classes,
padded vocabulary, tied output), plus a SigLIP tower and projector built from mlx-vlm's config
classes in a second safetensors file under `vision_tower.` and `multi_modal_projector.`, a
`vision_config`, Gemma 3's image token ids and chat template (tests/fixtures/templates), the
image tokens added to the tokenizer and named in its config as Gemma's are, a
`preprocessor_config.json` (transformers' Gemma3ImageProcessor at the tower's size) and a
`processor_config.json`: mlx-vlm's own processor loads from it.
"""

from __future__ import annotations

import json
from pathlib import Path

from tests.support.tiny_models import make_model_dir

TEMPLATES = Path(__file__).parents[1] / "fixtures" / "templates"
GEMMA_TOKENS = ("<start_of_turn>", "<end_of_turn>", "<start_of_image>", "<end_of_image>")
IMAGE_TOKEN = "<image_soft_token>"
IMAGE_SIZE, PATCH, TOKENS_PER_IMAGE = 32, 8, 4  # a 4 x 4 patch grid pooled to 2 x 2


def _add_tokens(
    model_dir: Path, tokens: tuple[str, ...], extra: dict[str, str], plain: tuple[str, ...] = ()
) -> dict[str, int]:
    """Add `tokens` as special tokens to the tokenizer files, `plain` as added tokens that are
    not special (Qwen's `<think>`, as its real tokenizer has it), `extra` the tokenizer's named
    ones (Gemma 3's `boi_token`...); {token: id}."""
    from tokenizers import AddedToken, Tokenizer

    path = model_dir / "tokenizer.json"
    tokenizer = Tokenizer.from_file(str(path))
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in tokens])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in plain])
    tokenizer.save(str(path))
    config_path = model_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.pop("chat_template", None)
    config["extra_special_tokens"] = extra
    config_path.write_text(json.dumps(config, indent=2))
    return {t: tokenizer.token_to_id(t) for t in tokens + plain}


def _qwen_vl_tokenizer(dest: Path) -> dict[str, int]:
    """The default model's tokenizer files in `dest` with Qwen's vision tokens added, and the
    real Qwen2/2.5-VL chat template; {token: id}."""
    from tests.support.tiny_models import TOKENIZER_FILES, default_tokenizer_dir

    dest.mkdir(parents=True, exist_ok=True)
    source = default_tokenizer_dir()
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            (dest / name).write_bytes((source / name).read_bytes())
    ids = _add_tokens(dest, QWEN_TOKENS, {})
    (dest / "chat_template.jinja").write_text((TEMPLATES / "qwen2.5-vl.jinja").read_text())
    return ids


def gemma3_vision_dir(dest: Path, seed: int = 0, *, quantized: bool = False) -> Path:
    """`quantized`: the tower's linear layers stored 4-bit (group 32), as mlx-vlm's
    conversions quantize them, the text model left in float32."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    from mlx_kvserve.vision.gemma3 import processor_config, vision_modules

    dest = make_model_dir(dest, "gemma3", seed=seed, mm_tokens_per_image=TOKENS_PER_IMAGE)
    named = {
        "boi_token": "<start_of_image>",
        "eoi_token": "<end_of_image>",
        "image_token": IMAGE_TOKEN,
    }
    ids = _add_tokens(dest, (*GEMMA_TOKENS, IMAGE_TOKEN), named)
    (dest / "chat_template.jinja").write_text((TEMPLATES / "gemma3.jinja").read_text())
    config = json.loads((dest / "config.json").read_text())
    config.update(
        {
            "vision_config": {
                "model_type": "siglip_vision_model",
                "hidden_size": 32,
                "intermediate_size": 64,
                "num_hidden_layers": 2,
                "num_attention_heads": 2,
                "patch_size": PATCH,
                "image_size": IMAGE_SIZE,
                "layer_norm_eps": 1e-6,
            },
            "mm_tokens_per_image": TOKENS_PER_IMAGE,
            "boi_token_index": ids["<start_of_image>"],
            "eoi_token_index": ids["<end_of_image>"],
            "image_token_index": ids[IMAGE_TOKEN],
            # mlx-vlm scales image features by the top-level hidden size (2048 when absent)
            "hidden_size": config["text_config"]["hidden_size"],
        }
    )
    (dest / "config.json").write_text(json.dumps(config, indent=2))
    mx.random.seed(seed + 1)
    tower, projector = vision_modules(config)
    projector.mm_input_projection_weight = mx.random.normal(
        projector.mm_input_projection_weight.shape
    ) * (32**-0.5)
    if quantized:
        config["quantization"] = {"group_size": 32, "bits": 4}
        (dest / "config.json").write_text(json.dumps(config, indent=2))
        nn.quantize(
            tower, group_size=32, bits=4, class_predicate=lambda _p, m: isinstance(m, nn.Linear)
        )
    weights = {
        **{f"vision_tower.{k}": v for k, v in tree_flatten(tower.parameters())},
        **{f"multi_modal_projector.{k}": v for k, v in tree_flatten(projector.parameters())},
    }
    mx.save_safetensors(str(dest / "vision.safetensors"), weights, metadata={"format": "mlx"})
    processor = processor_config(IMAGE_SIZE)
    (dest / "preprocessor_config.json").write_text(json.dumps(processor, indent=2))
    whole = {"processor_class": "Gemma3Processor", "image_seq_length": TOKENS_PER_IMAGE}
    (dest / "processor_config.json").write_text(json.dumps(whole, indent=2))
    return dest


QWEN_TOKENS = (
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
SHARPEN = 6.0
QWEN_PATCH, QWEN_MIN_PIXELS, QWEN_MAX_PIXELS = 8, 16 * 16, 64 * 64  # 2 to 16 tokens an image


def qwen2_5_vl_dir(dest: Path, seed: int = 0) -> Path:
    """A tiny Qwen2.5-VL checkpoint as Hugging Face ships it: one flat `config.json` (the text
    model's fields at the top, `rope_scaling` of type `mrope`, a `vision_config`), the text
    model under `model.` and `lm_head.` (mlx-lm's `qwen2_vl` classes), the windowed ViT and
    merger under `visual.` (mlx-vlm's), the default tokenizer with Qwen's vision tokens added,
    the real Qwen2.5-VL chat template and a `preprocessor_config.json` (14 px patches there,
    8 here, and a small pixel range: a few tokens an image)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import qwen2_vl

    from mlx_kvserve.vision.qwen2_5_vl import processor_config, vision_module
    from tests.support.tiny_models import ROWS

    dest = Path(dest)
    ids = _qwen_vl_tokenizer(dest)
    config = {
        "architectures": ["Qwen2_5_VLForConditionalGeneration"],
        "model_type": "qwen2_5_vl",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-6,
        "vocab_size": ROWS,
        "max_position_embeddings": 32768,
        "rope_theta": 1000000.0,
        # head_dim 16: 8 frequencies, 2 for time, 3 for rows, 3 for columns (Qwen's 16/24/24)
        "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
        "tie_word_embeddings": False,
        "bos_token_id": 1,  # the default tokenizer's (Qwen's are 151643 and 151645)
        "eos_token_id": 2,
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
        "vision_token_id": ids["<|vision_pad|>"],
        "vision_config": {
            "model_type": "qwen2_5_vl",
            "depth": 2,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 2,
            "out_hidden_size": 64,
            "patch_size": QWEN_PATCH,
            "spatial_patch_size": QWEN_PATCH,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "window_size": 4 * QWEN_PATCH,  # 2 x 2 merged patches a window
            "fullatt_block_indexes": [1],
            "in_channels": 3,
        },
    }
    mx.random.seed(seed)
    text = qwen2_vl.Model(qwen2_vl.ModelArgs.from_dict(dict(config)))
    # Sharper attention than mlx-lm's initialisation gives (nearly uniform there, where a
    # token's position hardly matters): positions rotated wrongly must change the answers, as
    # they would with real weights.
    for layer in text.layers:
        for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj):
            proj.weight = proj.weight * SHARPEN
    tower = vision_module(config)
    weights = {
        **{k.removeprefix("language_model."): v for k, v in tree_flatten(text.parameters())},
        **{f"visual.{k}": v for k, v in tree_flatten(tower.parameters())},
    }
    mx.save_safetensors(str(dest / "model.safetensors"), weights, metadata={"format": "mlx"})
    (dest / "config.json").write_text(json.dumps(config, indent=2))
    generation = {"bos_token_id": 1, "eos_token_id": [2, 0]}
    (dest / "generation_config.json").write_text(json.dumps(generation, indent=2))
    processor = processor_config(QWEN_PATCH, QWEN_MIN_PIXELS, QWEN_MAX_PIXELS)
    (dest / "preprocessor_config.json").write_text(json.dumps(processor, indent=2))
    return dest


def qwen3_vl_dir(dest: Path, seed: int = 0, *, moe: bool = False) -> Path:
    """A tiny Qwen3-VL checkpoint in Hugging Face's layout: `text_config` and `vision_config`
    nested, M-RoPE interleaved (`mrope_interleaved`), the text model under
    `model.language_model.` (mlx-lm's `qwen3_vl`), the tower with its learned position
    embeddings and two deepstack mergers under `model.visual.` (mlx-vlm's), Qwen3-VL's
    vision tokens, template and processor as `qwen2_5_vl_dir` writes them (mean and std 0.5).
    `moe`: Qwen3-VL-MoE's (`qwen3_vl_moe`: every MLP routed over 4 experts, float32 as the
    CPU's gather_mm needs)."""
    import importlib

    import mlx.core as mx
    from mlx.utils import tree_flatten

    from mlx_kvserve.vision.qwen2_5_vl import processor_config
    from mlx_kvserve.vision.qwen3_vl import Qwen3VLVision
    from tests.support.tiny_models import ROWS

    dest = Path(dest)
    ids = _qwen_vl_tokenizer(dest)
    text = {
        "model_type": "qwen3_vl_moe_text" if moe else "qwen3_vl_text",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rms_norm_eps": 1e-6,
        "vocab_size": ROWS,
        "max_position_embeddings": 32768,
        "rope_theta": 5000000.0,
        "rope_scaling": {
            "mrope_interleaved": True,
            "mrope_section": [2, 3, 3],
            "rope_type": "default",
        },
        "tie_word_embeddings": False,
        "attention_bias": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    if moe:
        text |= {
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "moe_intermediate_size": 32,
            "norm_topk_prob": True,
        }
    kind = "qwen3_vl_moe" if moe else "qwen3_vl"
    config = {
        "architectures": [f"Qwen3VL{'Moe' if moe else ''}ForConditionalGeneration"],
        "model_type": kind,
        "tie_word_embeddings": False,
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
        "text_config": text,
        "vision_config": {
            "model_type": kind,
            "depth": 3,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 2,
            "out_hidden_size": 64,
            "patch_size": QWEN_PATCH,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "num_position_embeddings": 64,  # an 8 x 8 grid, interpolated to each image's
            "deepstack_visual_indexes": [0, 1],
            "in_channels": 3,
        },
    }
    mx.random.seed(seed)
    module = importlib.import_module(f"mlx_lm.models.{kind}")
    model = module.Model(module.ModelArgs.from_dict(dict(config)))
    for layer in model.layers:  # sharper attention: positions matter (qwen2_5_vl_dir)
        for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj):
            proj.weight = proj.weight * SHARPEN
    tower = Qwen3VLVision.vision_module(config)
    weights = {}
    for k, v in tree_flatten(model.parameters()):
        inner = k.removeprefix("language_model.")
        name = (
            inner
            if inner.startswith("lm_head")
            else "model.language_model." + inner.removeprefix("model.")
        )
        weights[name] = v
    weights |= {f"model.visual.{k}": v for k, v in tree_flatten(tower.parameters())}
    mx.save_safetensors(str(dest / "model.safetensors"), weights, metadata={"format": "mlx"})
    (dest / "config.json").write_text(json.dumps(config, indent=2))
    generation = {"bos_token_id": 1, "eos_token_id": [2, 0]}
    (dest / "generation_config.json").write_text(json.dumps(generation, indent=2))
    processor = processor_config(QWEN_PATCH, QWEN_MIN_PIXELS, QWEN_MAX_PIXELS)
    processor |= {"image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}
    (dest / "preprocessor_config.json").write_text(json.dumps(processor, indent=2))
    return dest


def qwen3_5_vision_dir(dest: Path, seed: int = 0, *, moe: bool = False) -> Path:
    """A tiny Qwen3.5 checkpoint with its vision, as mlx-vlm's conversions lay it out: the
    tiny `qwen3_5` text model of tiny_models.py (linear-attention layers and one full-attention
    layer, mlx-lm's classes and names) with three quarters of each head rotated here (a quarter
    in Qwen3.5's: 6 frequencies, 2 per section), Qwen3-VL's tower without deepstack under
    `vision_tower.` (mlx-vlm's `qwen3_5`) in a second file, Qwen's vision tokens, the real
    Qwen3.5 chat template (tests/fixtures/templates) and a processor config. `moe`: the tiny
    `qwen3_5_moe` text model (Qwen3.6-35B-A3B's layout: experts and a shared one)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from mlx_kvserve.vision.qwen2_5_vl import processor_config
    from mlx_kvserve.vision.qwen3_vl import Qwen35Vision
    from tests.support.tiny_models import make_model_dir

    rope = {
        "rope_type": "default",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.75,
        "mrope_section": [2, 2, 2],
        "mrope_interleaved": True,
    }
    kind = "qwen3_5_moe" if moe else "qwen3_5"
    dest = make_model_dir(dest, kind, seed=seed, rope_parameters=rope)
    ids = _add_tokens(dest, QWEN_TOKENS, {}, plain=("<think>", "</think>"))
    (dest / "chat_template.jinja").write_text((TEMPLATES / "qwen3.5.jinja").read_text())
    config = json.loads((dest / "config.json").read_text())
    config.update(
        {
            "image_token_id": ids["<|image_pad|>"],
            "video_token_id": ids["<|video_pad|>"],
            "vision_start_token_id": ids["<|vision_start|>"],
            "vision_end_token_id": ids["<|vision_end|>"],
            "vision_config": {
                "model_type": kind,
                "depth": 2,
                "hidden_size": 32,
                "intermediate_size": 64,
                "num_heads": 2,
                "out_hidden_size": config["text_config"]["hidden_size"],
                "patch_size": QWEN_PATCH,
                "spatial_merge_size": 2,
                "temporal_patch_size": 2,
                "num_position_embeddings": 64,
                "deepstack_visual_indexes": [],
                "in_channels": 3,
            },
        }
    )
    (dest / "config.json").write_text(json.dumps(config, indent=2))
    mx.random.seed(seed + 1)
    tower = Qwen35Vision.vision_module(config)
    weights = {f"vision_tower.{k}": v for k, v in tree_flatten(tower.parameters())}
    mx.save_safetensors(str(dest / "vision.safetensors"), weights, metadata={"format": "mlx"})
    processor = processor_config(QWEN_PATCH, QWEN_MIN_PIXELS, QWEN_MAX_PIXELS)
    processor |= {"image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}
    (dest / "preprocessor_config.json").write_text(json.dumps(processor, indent=2))
    return dest


# Gemma 4: its turn and tool tokens, its image markers, and the audio and video placeholders
# its tokenizer has (mlx-vlm's processor adds `<|video|>` when a tokenizer lacks it).
GEMMA4_IMAGE_TOKENS = ("<|image>", "<image|>", "<|image|>", "<|audio|>", "<|video|>")
GEMMA4_PATCH, GEMMA4_POOLING, GEMMA4_MAX_SOFT_TOKENS = 8, 2, 16  # at most 64 patches a picture


def gemma4_config(*, bidirectional: bool = True, per_layer: bool = True) -> dict:
    """A tiny Gemma 4 `config.json` in the released layout: `text_config` (sliding and full
    layers, KV-sharing last layers, per-layer inputs as E2B/E4B have them when `per_layer`,
    `use_bidirectional_attention: "vision"` as the larger checkpoints when `bidirectional`)
    and `vision_config` (the token ids are filled in by `gemma4_vision_dir`)."""
    from tests.support.tiny_models import ROWS

    text = {
        "model_type": "gemma4_text",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 16,
        "global_head_dim": 16,
        "num_kv_shared_layers": 2,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
        "sliding_window": 16,  # small, so an image prompt already slides
        "vocab_size": ROWS,
        "vocab_size_per_layer_input": ROWS,
        "hidden_size_per_layer_input": 8 if per_layer else 0,
        "rope_parameters": {
            "full_attention": {
                "partial_rotary_factor": 0.25,
                "rope_theta": 1000000.0,
                "rope_type": "proportional",
            },
            "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"},
        },
        "use_bidirectional_attention": "vision" if bidirectional else None,
        "max_position_embeddings": 32768,
        "final_logit_softcapping": 30.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
    }
    vision = {
        "model_type": "gemma4_vision",
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "global_head_dim": 16,
        "patch_size": GEMMA4_PATCH,
        "pooling_kernel_size": GEMMA4_POOLING,
        "default_output_length": GEMMA4_MAX_SOFT_TOKENS,
        "position_embedding_size": 64,
        "rms_norm_eps": 1e-6,
    }
    return {
        "model_type": "gemma4",
        "architectures": ["Gemma4ForConditionalGeneration"],
        "text_config": text,
        "vision_config": vision,
        "vocab_size": ROWS,
        "vision_soft_tokens_per_image": GEMMA4_MAX_SOFT_TOKENS,
        "tie_word_embeddings": True,
    }


def gemma4_vision_dir(
    dest: Path,
    seed: int = 0,
    *,
    bidirectional: bool = True,
    per_layer: bool = True,
    hf_layout: bool = False,
    dtype: str = "float32",
) -> Path:
    """A tiny random-weight Gemma 4 vision checkpoint as mlx-vlm converts one: one
    safetensors file of mlx-vlm's `gemma4.Model` (`language_model.model.*`, `vision_tower.*`,
    `embed_vision.*`; mlx-lm's `gemma4` loads the text part and drops the rest), the default
    model's tokenizer with Gemma 4's tokens added and named, the real Gemma 4 chat template
    (tests/fixtures/templates/gemma4.jinja) and a `processor_config.json` mlx-vlm's processor
    loads from. `hf_layout`: the tensors named as transformers saves them (`model.` first, the
    text model's without its inner `model.`), and the tower's linear layers clipped
    (`use_clipped_linears`, with bounds that bite). `dtype`: the floating tensors' type
    (`bfloat16` as the released checkpoints)."""
    import shutil

    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_vlm.models.gemma4.config import ModelConfig, TextConfig, VisionConfig
    from mlx_vlm.models.gemma4.gemma4 import Model

    from mlx_kvserve.vision.gemma4 import processor_config
    from tests.support.thinking_models import GEMMA4_TOOL_TOKENS
    from tests.support.tiny_models import EOS_IDS, TOKENIZER_FILES, default_tokenizer_dir

    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if (default_tokenizer_dir() / name).is_file():
            shutil.copyfile(default_tokenizer_dir() / name, dest / name)
    named = {"boi_token": "<|image>", "eoi_token": "<image|>", "image_token": "<|image|>"}
    ids = _add_tokens(dest, (*GEMMA4_TOOL_TOKENS, *GEMMA4_IMAGE_TOKENS), named)
    (dest / "chat_template.jinja").write_text((TEMPLATES / "gemma4.jinja").read_text())
    config = gemma4_config(bidirectional=bidirectional, per_layer=per_layer)
    config["vision_config"]["use_clipped_linears"] = hf_layout
    config |= {
        "image_token_id": ids["<|image|>"],
        "boi_token_id": ids["<|image>"],
        "eoi_token_id": ids["<image|>"],
        "audio_token_id": ids["<|audio|>"],
        "video_token_id": ids["<|video|>"],
        "eos_token_id": [*EOS_IDS, ids["<turn|>"]],
    }
    (dest / "config.json").write_text(json.dumps(config, indent=2))
    cfg = ModelConfig.from_dict(config)
    cfg.text_config = TextConfig.from_dict(config["text_config"])
    cfg.vision_config = VisionConfig.from_dict(config["vision_config"])
    mx.random.seed(seed)
    model = Model(cfg)
    weights = dict(tree_flatten(model.parameters()))
    if hf_layout:
        weights = {_hf_name(k): _clip_bound(k, v) for k, v in weights.items()}
    target = getattr(mx, dtype)
    weights = {
        k: v.astype(target) if mx.issubdtype(v.dtype, mx.floating) else v
        for k, v in weights.items()
    }
    mx.save_safetensors(str(dest / "model.safetensors"), weights, metadata={"format": "mlx"})
    processor = processor_config(GEMMA4_PATCH, GEMMA4_POOLING, GEMMA4_MAX_SOFT_TOKENS)
    (dest / "processor_config.json").write_text(json.dumps(processor, indent=2))
    return dest


def _hf_name(name: str) -> str:
    """A tensor's name as transformers saves Gemma 4 (`model.language_model.layers...`)."""
    return "model." + name.replace("language_model.model.", "language_model.", 1)


def _clip_bound(name: str, value):  # noqa: ANN001, ANN202  (mx.array)
    """A clipped linear layer's bounds, tight enough to change what the tower computes."""
    import mlx.core as mx

    for bound, at in (("input_min", -0.5), ("input_max", 0.5), ("output_min", -1.0)):
        if name.endswith(bound):
            return mx.array(at, dtype=value.dtype)
    if name.endswith("output_max"):
        return mx.array(1.0, dtype=value.dtype)
    return value
