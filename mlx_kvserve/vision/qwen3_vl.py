"""Qwen3-VL's vision: Qwen2.5-VL's way (vision/qwen2_5_vl.py: the processor, the markup, the
grid and M-RoPE positions, here with the three sections interleaved across the frequencies),
with mlx-vlm's Qwen3-VL tower (16 px patches, learned position embeddings) and its deepstack:
the tower also gives, from some of its middle layers, one more set of rows per image that is
added to the image tokens' hidden states after each of the first text layers
(vision/mrope.py: `install_deepstack`). An image's features are kept as one array, the
merger's rows and then each deepstack set side by side, so the features cache and its disk
copies hold them all.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from mlx_kvserve.images.image import Image
from mlx_kvserve.vision.qwen2_5_vl import Qwen25VLVision, _processor, processor_config


class Qwen3VLVision(Qwen25VLVision):
    """Images to the rows of their `<|image_pad|>`s (and their deepstack rows)."""

    def __init__(self, model_dir: Path, token_text) -> None:  # noqa: ANN001  (as the base's)
        super().__init__(model_dir, token_text)
        config = json.loads((Path(model_dir) / "config.json").read_text())
        self.deepstack = len(config["vision_config"].get("deepstack_visual_indexes") or ())

    def features(self, image: Image, dtype: mx.Dtype) -> mx.array:
        """(tokens, (1 + deepstack) x text hidden size): the merger's rows, then each
        deepstack merger's, side by side."""
        patches, grid = self.pixels(image)
        x = mx.array(patches).astype(self.tower.patch_embed.proj.weight.dtype)
        hidden, deepstack = self.tower(x, mx.array(grid))
        return mx.concatenate([hidden, *deepstack], axis=-1).astype(dtype)

    @staticmethod
    def vision_module(config: dict) -> nn.Module:
        """mlx-vlm's Qwen3-VL tower for a `config.json` (weights not loaded). Qwen3-VL-MoE's
        (its `vision_config` names `qwen3_vl_moe`) is the same tower in transformers; mlx-vlm's
        copy of it swaps the merger's and the MLP's GELUs, so Qwen3-VL's runs it."""
        from mlx_vlm.models.qwen3_vl.config import VisionConfig
        from mlx_vlm.models.qwen3_vl.vision import VisionModel

        vision = {**config["vision_config"], "model_type": "qwen3_vl"}
        return VisionModel(VisionConfig.from_dict(vision))

    @staticmethod
    def image_processor(model_dir: Path, vision: dict):  # noqa: ANN205  (transformers')
        """The checkpoint's, or Qwen3-VL's defaults (16 px patches, mean and std 0.5)."""
        patch = int(vision.get("patch_size", 16))
        defaults = processor_config(patch, 65536, 16777216)
        defaults |= {"image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}
        return _processor(model_dir, vision, defaults)


class Qwen35Vision(Qwen3VLVision):
    """Qwen3.5's vision: Qwen3-VL's tower without deepstack (mlx-vlm's `qwen3_5`), and the
    same processor and markup."""

    @staticmethod
    def vision_module(config: dict) -> nn.Module:
        from mlx_vlm.models.qwen3_5.config import VisionConfig
        from mlx_vlm.models.qwen3_5.vision import VisionModel

        return VisionModel(VisionConfig.from_dict(config["vision_config"]))
