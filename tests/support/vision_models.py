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
