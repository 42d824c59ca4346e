"""Gemma 3's vision: SigLIP tower and projector from mlx-vlm's classes, the image processor
of transformers (`Gemma3ImageProcessorPil`: Pillow and numpy, no torch), and its markup.

mlx-vlm runs Gemma 3's language model causally over image tokens too, with 1D positions: the
text model of mlx-lm, fed the features as input embeddings, computes the very same thing.
(transformers lets an image's tokens see each other both ways in the prefill; no chunk splits
an image, so a mask could do that here too.) The features are divided by sqrt(hidden size)
because the text model multiplies every input embedding by it (its text embeddings are stored
unscaled).
"""

from __future__ import annotations

import io
import json
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlx_kvserve.images.image import Image
from mlx_kvserve.vision.base import Family
from mlx_kvserve.vision.tower import install, under, vision_weights


class Gemma3Vision(Family):
    """Images to the rows of their `<image_soft_token>`s, and the markup that holds them."""

    def __init__(self, model_dir: Path, token_text: Callable[[int], str]) -> None:
        config = json.loads((Path(model_dir) / "config.json").read_text())
        text = config["text_config"]
        self.tokens_per_image = tokens_per_image(config)
        self.tower, self.projector = vision_modules(config)
        weights = vision_weights(model_dir, ("vision_tower.", "multi_modal_projector."))
        install(self.tower, under(weights, "vision_tower"), config, self.tower.sanitize)
        install(self.projector, under(weights, "multi_modal_projector"), config)
        self.scale = float(text["hidden_size"]) ** 0.5
        self._image_token = int(config.get("image_token_index", 262144))
        boi = token_text(int(config.get("boi_token_index", 255999)))
        eoi = token_text(int(config.get("eoi_token_index", 256000)))
        soft = token_text(self._image_token)
        self._markup = f"\n\n{boi}{soft * self.tokens_per_image}{eoi}\n\n"
        self.processor = _processor(Path(model_dir), int(config["vision_config"]["image_size"]))

    @property
    def image_token(self) -> int:
        return self._image_token

    def markup(self, image: Image) -> tuple[str, int]:
        """What the processor puts where the template placed the image, and its placeholder
        count (the same for every image: Gemma 3 resizes each to one square)."""
        return self._markup, self.tokens_per_image

    def pixels(self, image: Image) -> np.ndarray:
        """The image as the tower reads it: (1, 3, size, size), resized and normalized."""
        from PIL import Image as PILImage

        with PILImage.open(io.BytesIO(image.data)) as opened:
            opened.seek(0)  # the first frame of an animation
            rgb = opened.convert("RGB")
        return self.processor(rgb, return_tensors="np", do_pan_and_scan=False)["pixel_values"]

    def features(self, image: Image, dtype: mx.Dtype) -> mx.array:
        """(tokens_per_image, hidden size): the rows its placeholders get, as input embeddings
        before the text model's scaling."""
        x = mx.array(self.pixels(image)).transpose(0, 2, 3, 1).astype(dtype)
        hidden, _, _ = self.tower(x, output_hidden_states=True)
        return (self.projector(hidden) / self.scale)[0].astype(dtype)


def tokens_per_image(config: dict) -> int:
    """`mm_tokens_per_image`: top-level in Gemma 3's configs, in `text_config` in some
    conversions, 256 when neither says."""
    text = config.get("text_config") or {}
    return int(config.get("mm_tokens_per_image", text.get("mm_tokens_per_image", 256)))


def vision_modules(config: dict) -> tuple[nn.Module, nn.Module]:
    """mlx-vlm's tower and projector for a Gemma 3 `config.json` (weights not loaded)."""
    from mlx_vlm.models.gemma3.config import ModelConfig, TextConfig, VisionConfig
    from mlx_vlm.models.gemma3.gemma3 import Gemma3MultiModalProjector
    from mlx_vlm.models.gemma3.vision import VisionModel

    cfg = ModelConfig.from_dict(config)
    text = {**config["text_config"], "mm_tokens_per_image": tokens_per_image(config)}
    cfg.text_config = TextConfig.from_dict(text)
    cfg.vision_config = VisionConfig.from_dict(config["vision_config"])
    return VisionModel(cfg.vision_config), Gemma3MultiModalProjector(cfg)


def processor_config(size: int) -> dict[str, object]:
    """Gemma 3's `preprocessor_config.json` at a tower of `size` pixels (its checkpoints'
    values: 896, bilinear, [-1, 1], no pan-and-scan)."""
    return {
        "image_processor_type": "Gemma3ImageProcessor",
        "do_convert_rgb": True,
        "do_normalize": True,
        "do_pan_and_scan": False,
        "do_rescale": True,
        "do_resize": True,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "resample": 2,
        "rescale_factor": 1 / 255,
        "size": {"height": size, "width": size},
    }


def _processor(model_dir: Path, size: int):  # noqa: ANN202  (transformers' class)
    """The checkpoint's processor (preprocessor_config.json), or Gemma 3's at the tower's
    size."""
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    if (model_dir / "preprocessor_config.json").is_file():
        return Gemma3ImageProcessorPil.from_pretrained(str(model_dir))
    settings = processor_config(size)
    settings.pop("image_processor_type")
    return Gemma3ImageProcessorPil(**settings)
