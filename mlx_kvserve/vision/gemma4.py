"""Gemma 4's vision: its tower and embedder from mlx-vlm's classes, mlx-vlm's own image
processor (`Gemma4ImageProcessor`: Pillow and numpy), and what its language model does
differently over an image's tokens (docs/images.md, "Gemma 4").

Beyond Gemma 3: an image keeps its aspect ratio and becomes a variable number of soft tokens
(up to `max_soft_tokens`, 280 in the released configs); positions stay 1D, one per token. Two
things the text model does over image tokens that mlx-lm's Gemma 4 does not do by itself, and
that a prefill chunk holding an image asks for here (text-only chunks and decode steps run the
model as they always do):

- per-layer inputs (E2B, E4B: `hidden_size_per_layer_input`): an image token's per-layer
  embedding is the pad id's (0), as mlx-vlm and transformers build it, not the image token's;
- with `use_bidirectional_attention: "vision"` (the larger checkpoints) an image's tokens see
  each other both ways: the chunk's causal masks get each image's block added. No chunk splits
  an image (engine/image_prefill.py), so the block is always whole in the chunk's keys.

The features are divided by sqrt(hidden size): the text model multiplies every input embedding
by it, and mlx-vlm feeds the embedder's output unscaled.
"""

from __future__ import annotations

import io
import json
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlx_kvserve.images.image import Image
from mlx_kvserve.vision.base import Family
from mlx_kvserve.vision.tower import install, under, vision_weights

MAX_SOFT_TOKENS = 280  # the processor's default, as Gemma 4's configs state it
_CLIPS = ("input_max", "input_min", "output_max", "output_min")


class Gemma4Vision(Family):
    """Images to the rows of their `<|image|>` tokens, the markup that holds them, and the
    prefill forward of a chunk that holds them."""

    def __init__(self, model_dir: Path, token_text: Callable[[int], str]) -> None:
        config = json.loads((Path(model_dir) / "config.json").read_text())
        text = config["text_config"]
        self.tower, self.embedder = vision_modules(config)
        weights = vision_weights(model_dir, ("vision_tower.", "embed_vision."))
        clipped = bool(config["vision_config"].get("use_clipped_linears", False))
        install(
            self.tower, under(weights, "vision_tower"), config, lambda w: tower_weights(w, clipped)
        )
        install(self.embedder, under(weights, "embed_vision"), config)
        self.scale = float(text["hidden_size"]) ** 0.5
        self.bidirectional = text.get("use_bidirectional_attention") == "vision"
        self._image_token = int(config.get("image_token_id", 258880))
        self._boi = token_text(int(config.get("boi_token_id", 255999)))
        self._eoi = token_text(int(config.get("eoi_token_id", 258882)))
        self._soft = token_text(self._image_token)
        self.processor = image_processor(Path(model_dir))
        self.tokens_per_image = int(self.processor.max_soft_tokens)  # at most

    @property
    def image_token(self) -> int:
        return self._image_token

    def soft_tokens(self, image: Image) -> int:
        """The image's soft-token count: its patches after the processor's aspect-preserving
        resize, pooled (what the tower gives for it)."""
        from mlx_vlm.models.gemma4.processing_gemma4 import get_aspect_ratio_preserving_size

        p, k = self.processor.patch_size, self.processor.pooling_kernel_size
        height, width = image.height, image.width
        if self.processor.do_resize:
            max_patches = self.processor.max_soft_tokens * k * k
            height, width = get_aspect_ratio_preserving_size(height, width, p, max_patches, k)
        return (height // p) * (width // p) // (k * k)

    def markup(self, image: Image) -> tuple[str, int]:
        """The chat template's image item (`\\n\\n<|image|>\\n\\n`) as the processor expands
        it: `<|image>`, the image's soft tokens, `<image|>`."""
        n = self.soft_tokens(image)
        return f"\n\n{self._boi}{self._soft * n}{self._eoi}\n\n", n

    def pixels(self, image: Image) -> np.ndarray:
        """The image as the tower reads it: (1, 3, H, W) in [0, 1], aspect kept."""
        from PIL import Image as PILImage

        with PILImage.open(io.BytesIO(image.data)) as opened:
            opened.seek(0)  # the first frame of an animation
            rgb = opened.convert("RGB")
        data, _ = self.processor.preprocess([rgb])
        return np.asarray(data["pixel_values"])

    def features(self, image: Image, dtype: mx.Dtype) -> mx.array:
        """(soft tokens, hidden size): the rows its placeholders get, as input embeddings
        before the text model's scaling."""
        rows = self.embedder(self.tower(mx.array(self.pixels(image))))
        return rows.astype(dtype)[0] / self.scale

    def forward(
        self,
        model: nn.Module,
        ids: mx.array,
        rows: mx.array,
        blocks: Sequence[tuple[int, int]],
        caches: list,
    ) -> mx.array:
        """The logits of a prefill chunk holding images: `rows` its input embeddings,
        `blocks` each image's [start, end) within the chunk."""
        inner = text_model(model)
        per_layer = None
        if getattr(inner, "hidden_size_per_layer_input", 0):
            plain = mx.where(ids == self._image_token, mx.zeros_like(ids), ids)
            per_layer = inner._get_per_layer_inputs(plain)
        with image_blocks(inner, blocks if self.bidirectional else ()):
            return model(ids, cache=caches, input_embeddings=rows, per_layer_inputs=per_layer)


def text_model(model: nn.Module) -> nn.Module:
    """mlx-lm's `Gemma4TextModel` inside its wrappers (layers, masks, per-layer inputs)."""
    inner = getattr(model, "language_model", model)
    return inner.model


@contextmanager
def image_blocks(inner: nn.Module, blocks: Sequence[tuple[int, int]]) -> Iterator[None]:
    """While it lasts, `inner`'s attention masks let each block's queries see the whole
    block (its causal masks, made as arrays, or'ed with the blocks): the text model's own
    `_make_masks`, shadowed on this one instance for one forward."""
    if not blocks:
        yield
        return
    made = inner._make_masks

    def masks(h: mx.array, cache: list) -> list:
        return blocked_masks(inner, h, cache, made(h, cache), blocks)

    inner._make_masks = masks
    try:
        yield
    finally:
        del inner._make_masks


def blocked_masks(
    inner: nn.Module,
    h: mx.array,
    cache: list,
    made: list,
    blocks: Sequence[tuple[int, int]],
) -> list:
    """The text model's masks `made`, one per layer type as it makes them (a KV-sharing layer
    takes its type's), each as an array (its `"causal"` shorthand made explicit, as the
    cache makes it with `return_array`) with the blocks added."""
    from mlx_lm.models.base import create_attention_mask

    by_type: dict[str, mx.array | None] = {}
    out = []
    for mask, layer, c in zip(made, inner.layers, cache, strict=True):
        kind = layer.layer_type
        if kind not in by_type:
            if isinstance(mask, str):
                window = inner.window_size if kind == "sliding_attention" else None
                mask = create_attention_mask(h, c, window_size=window, return_array=True)
            by_type[kind] = with_blocks(mask, h.shape[1], blocks)
        out.append(by_type[kind])
    return out


def with_blocks(mask: mx.array | None, n: int, blocks: Sequence[tuple[int, int]]) -> mx.array:
    """`mask` (queries x keys, the chunk's `n` tokens the last `n` keys) with each block's
    queries seeing all of that block's keys."""
    if mask is None:
        return mask
    block = np.full(n, -1)
    for i, (start, end) in enumerate(blocks):
        block[start:end] = i
    same = (block[:, None] == block[None, :]) & (block[:, None] >= 0)
    extra = np.zeros((n, mask.shape[-1]), dtype=bool)
    extra[:, mask.shape[-1] - n :] = same
    return mask | mx.array(extra)


def tower_weights(weights: dict[str, mx.array], clipped: bool) -> dict[str, mx.array]:
    """The tower's tensors as its module holds them: clipping bounds only where the config
    uses them, no rotary buffers (mlx-vlm's `Model.sanitize`, for the tower's part)."""
    return {
        k: v
        for k, v in weights.items()
        if "rotary_emb" not in k and (clipped or not any(c in k for c in _CLIPS))
    }


def vision_modules(config: dict) -> tuple[nn.Module, nn.Module]:
    """mlx-vlm's tower and embedder for a Gemma 4 `config.json` (weights not loaded)."""
    from mlx_vlm.models.gemma4.config import TextConfig, VisionConfig
    from mlx_vlm.models.gemma4.gemma4 import MultimodalEmbedder
    from mlx_vlm.models.gemma4.vision import VisionModel

    vision = VisionConfig.from_dict(config["vision_config"])
    text = TextConfig.from_dict(config["text_config"])
    embedder = MultimodalEmbedder(vision.hidden_size, text.hidden_size, eps=vision.rms_norm_eps)
    return VisionModel(vision), embedder


def processor_config(patch: int, pooling: int, max_soft_tokens: int) -> dict[str, object]:
    """Gemma 4's `processor_config.json` (its `image_processor` part; the released values:
    patch 16, pooling 3, 280 soft tokens, rescale to [0, 1], no normalization)."""
    return {
        "image_processor": {
            "image_processor_type": "Gemma4ImageProcessor",
            "do_convert_rgb": True,
            "do_normalize": False,
            "do_rescale": True,
            "do_resize": True,
            "image_mean": [0.0, 0.0, 0.0],
            "image_std": [1.0, 1.0, 1.0],
            "max_soft_tokens": max_soft_tokens,
            "patch_size": patch,
            "pooling_kernel_size": pooling,
            "resample": 3,
            "rescale_factor": 1 / 255,
        },
        "image_seq_length": max_soft_tokens,
        "processor_class": "Gemma4Processor",
    }


_PROCESSOR_KEYS = (
    "patch_size",
    "max_soft_tokens",
    "pooling_kernel_size",
    "do_resize",
    "do_rescale",
    "do_normalize",
    "rescale_factor",
    "image_mean",
    "image_std",
    "size",
)


def image_processor(model_dir: Path):  # noqa: ANN201  (mlx-vlm's class)
    """mlx-vlm's `Gemma4ImageProcessor` with the checkpoint's settings, read as mlx-vlm's
    `Gemma4Processor.from_pretrained` reads them: `processor_config.json`'s `image_processor`
    (or its flat form, or `preprocessor_config.json`)."""
    from mlx_vlm.models.gemma4.processing_gemma4 import Gemma4ImageProcessor

    settings: dict = {}
    for name in ("processor_config.json", "preprocessor_config.json"):
        path = model_dir / name
        if path.is_file():
            settings = json.loads(path.read_text())
            break
    nested = settings.get("image_processor")
    if isinstance(nested, dict):
        chosen = {k: v for k, v in nested.items() if k != "image_processor_type"}
    elif "image_processor_type" not in settings:
        chosen = {k: settings[k] for k in _PROCESSOR_KEYS if k in settings}
    else:
        chosen = {}
    return Gemma4ImageProcessor(**chosen)
