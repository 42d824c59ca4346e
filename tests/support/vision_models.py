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


def _add_tokens(model_dir: Path, tokens: tuple[str, ...], extra: dict[str, str]) -> dict[str, int]:
    """Add `tokens` as special tokens to the tokenizer files, `extra` the tokenizer's named
    ones (Gemma 3's `boi_token`...); {token: id}."""
    from tokenizers import AddedToken, Tokenizer

    path = model_dir / "tokenizer.json"
    tokenizer = Tokenizer.from_file(str(path))
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in tokens])
    tokenizer.save(str(path))
    config_path = model_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.pop("chat_template", None)
    config["extra_special_tokens"] = extra
    config_path.write_text(json.dumps(config, indent=2))
    return {t: tokenizer.token_to_id(t) for t in tokens}


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
