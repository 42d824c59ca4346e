"""Qwen2.5-VL's vision: the windowed ViT and patch merger from mlx-vlm's `VisionModel`, the
image processor of transformers (`Qwen2VLImageProcessorPil`: Pillow and numpy, no torch), its
markup, and each image's merged-patch grid, which gives its tokens their M-RoPE positions
(vision/mrope.py).

Each image is resized to a multiple of `patch_size * merge_size` pixels within the processor's
pixel range, keeping its aspect ratio; it becomes `(h / patch) * (w / patch) / merge_size**2`
`<|image_pad|>` tokens between `<|vision_start|>` and `<|vision_end|>`, as Qwen's processor
inserts them.
"""

from __future__ import annotations

import io
import json
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlx_kvserve.chat.invalid_request import InvalidRequest
from mlx_kvserve.images.image import Image
from mlx_kvserve.vision.base import Family
from mlx_kvserve.vision.tower import install, under, vision_weights

Grid = tuple[int, int, int]  # (t, h, w) of an image's merged patches: one token each


class Qwen25VLVision(Family):
    """Images to the rows of their `<|image_pad|>`s, their markup and their grids."""

    deepstack = 0  # the tower's extra feature sets, added after the first text layers

    def __init__(self, model_dir: Path, token_text: Callable[[int], str]) -> None:
        config = json.loads((Path(model_dir) / "config.json").read_text())
        self.tower = self.vision_module(config)
        weights = vision_weights(model_dir, ("visual.", "vision_tower."))
        tower = {**under(weights, "visual"), **under(weights, "vision_tower")}
        install(self.tower, tower, config, self.tower.sanitize)
        self._image_token = int(config.get("image_token_id", 151655))
        self._start = token_text(int(config.get("vision_start_token_id", 151652)))
        self._end = token_text(int(config.get("vision_end_token_id", 151653)))
        self._pad = token_text(self._image_token)
        self.processor = self.image_processor(Path(model_dir), config["vision_config"])
        self.merge = int(self.processor.merge_size)

    @property
    def image_token(self) -> int:
        return self._image_token

    def grid(self, image: Image) -> Grid:
        """The image's merged-patch grid: where the processor's resize puts it."""
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

        p = self.processor
        try:
            height, width = smart_resize(
                image.height,
                image.width,
                factor=p.patch_size * self.merge,
                min_pixels=_edge(p.size, "shortest_edge"),
                max_pixels=_edge(p.size, "longest_edge"),
            )
        except ValueError as e:  # an aspect ratio beyond 200:1
            raise InvalidRequest(
                f"Invalid image in '{image.origin}': {e}", param=image.origin or None
            ) from e
        step = p.patch_size * self.merge
        return 1, height // step, width // step

    def markup(self, image: Image) -> tuple[str, int]:
        """What the processor puts where the template placed the image, and its
        placeholder count (one per merged patch)."""
        t, h, w = self.grid(image)
        count = t * h * w
        return f"{self._start}{self._pad * count}{self._end}", count

    def pixels(self, image: Image) -> tuple[np.ndarray, np.ndarray]:
        """(patches, grid_thw) as the tower reads them, the processor's own output."""
        from PIL import Image as PILImage

        with PILImage.open(io.BytesIO(image.data)) as opened:
            opened.seek(0)  # the first frame of an animation
            rgb = opened.convert("RGB")
        out = self.processor(rgb, return_tensors="np")
        return np.asarray(out["pixel_values"]), np.asarray(out["image_grid_thw"])

    def features(self, image: Image, dtype: mx.Dtype) -> mx.array:
        """(tokens, text hidden size): the merger's rows, in the placeholders' order."""
        patches, grid = self.pixels(image)
        x = mx.array(patches).astype(self.tower.patch_embed.proj.weight.dtype)
        return self.tower(x, mx.array(grid), output_hidden_states=False).astype(dtype)

    @staticmethod
    def vision_module(config: dict) -> nn.Module:
        return vision_module(config)

    @staticmethod
    def image_processor(model_dir: Path, vision: dict):  # noqa: ANN205  (transformers')
        return _processor(model_dir, vision)


def _edge(size: object, name: str) -> int:
    return int(size[name] if isinstance(size, dict) else getattr(size, name))


def vision_module(config: dict) -> nn.Module:
    """mlx-vlm's Qwen2.5-VL tower (with its merger) for a `config.json` (weights not
    loaded)."""
    from mlx_vlm.models.qwen2_5_vl.config import VisionConfig
    from mlx_vlm.models.qwen2_5_vl.vision import VisionModel

    return VisionModel(VisionConfig.from_dict(config["vision_config"]))


def processor_config(patch: int, min_pixels: int, max_pixels: int) -> dict[str, object]:
    """A Qwen2.5-VL `preprocessor_config.json` (its checkpoints' values but the pixel range
    and patch size: 14 px patches, 3136 to 12845056 pixels, CLIP's mean and std)."""
    return {
        "image_processor_type": "Qwen2VLImageProcessor",
        "do_convert_rgb": True,
        "do_normalize": True,
        "do_rescale": True,
        "do_resize": True,
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711],
        "resample": 3,
        "rescale_factor": 1 / 255,
        "min_pixels": min_pixels,
        "max_pixels": max_pixels,
        "patch_size": patch,
        "temporal_patch_size": 2,
        "merge_size": 2,
    }


def _processor(model_dir: Path, vision: dict, defaults: dict | None = None):  # noqa: ANN202  (transformers' class)
    """The checkpoint's processor (preprocessor_config.json), or `defaults` (Qwen2.5-VL's at
    the tower's patch size)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    path = model_dir / "preprocessor_config.json"
    if path.is_file():
        settings = json.loads(path.read_text())
    else:
        patch = int(vision.get("patch_size", 14))
        settings = defaults or processor_config(patch, 56 * 56, 28 * 28 * 16384)
    settings = {k: v for k, v in settings.items() if k not in _NOT_KWARGS}
    return Qwen2VLImageProcessorPil(**settings)


_NOT_KWARGS = {"image_processor_type", "processor_class", "auto_map"}
