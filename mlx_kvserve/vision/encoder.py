"""ENGINE THREAD. Images to input embeddings: each image's features computed once per pixel
hash (`Image.digest`) and kept where the prompt cache keeps them, and a prefill chunk's
embeddings with its image rows replaced by them."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from mlx_kvserve.cache.features import FeatureCache
from mlx_kvserve.engine.protocols import ImageFeatures
from mlx_kvserve.images.image import Image
from mlx_kvserve.images.spans import ImageSpan
from mlx_kvserve.vision.base import Family
from mlx_kvserve.vision.family import vision_family
from mlx_kvserve.vision.mrope import Grid, Positions, prompt_positions, rope_delta

log = logging.getLogger("mlx_kvserve.vision")

FEATURES_BYTES = 256 << 20  # RAM for features no prompt cache keeps (a Gemma 3 27B image: 2.7 MB)


class Vision:
    """A loaded model's vision: its family, and where the features of the images it has seen
    are kept (`store`). `positions`: the M-RoPE context of the text model's attention layers,
    for a family with grids."""

    def __init__(self, family: Family, positions: Positions | None = None) -> None:
        self.family = family
        self.positions = positions
        self.store: ImageFeatures = ram_features()
        self.encoded = 0  # images run through the tower (a repeat image is not)

    def keep_in(self, store: ImageFeatures | None) -> None:
        """Keep features in the prompt cache's features tier (cache/features.py: counted in
        /v1/cache, /metrics and the memory ledger, and on disk, so a restarted server does not
        run the tower on an image again); None (`--no-cache`, per-key caches): in RAM of its
        own."""
        self.store = store if store is not None else ram_features()

    @property
    def image_token(self) -> int:
        return self.family.image_token

    def markup(self, image: Image) -> tuple[str, int]:
        return self.family.markup(image)

    def features(self, image: Image, dtype: mx.Dtype) -> mx.array:
        """The image's rows, from the store when its pixels were seen before."""
        kept = self.store.get(image.digest)
        if kept is not None and kept.dtype == dtype:
            return kept
        rows = self.family.features(image, dtype)
        mx.eval(rows)
        self.encoded += 1
        self.store.put(image.digest, rows)
        return rows

    @property
    def deepstack_layers(self) -> int:
        """The text layers that add an image's deepstack rows (Qwen3-VL's; else 0)."""
        return int(getattr(self.family, "deepstack", 0))

    def main(self, rows: mx.array) -> mx.array:
        """An image's features as input embeddings (without its deepstack sets)."""
        return rows[:, : rows.shape[-1] // (1 + self.deepstack_layers)]

    def grids(self, images: Sequence[Image]) -> list[Grid]:
        """Each image's merged-patch grid (a family with M-RoPE: vision/qwen2_5_vl.py)."""
        grid = self.family.grid  # type: ignore[attr-defined]
        return [grid(image) for image in images]

    def rope_delta(self, spans: Sequence[ImageSpan], images: Sequence[Image]) -> int:
        """Position minus token index of a row's tokens after its images (0 without
        M-RoPE): what its decode steps add to their offsets (engine/positions.py)."""
        if self.positions is None or not spans:
            return 0
        return rope_delta(spans, self.grids(images))

    def rows(
        self, model: nn.Module, spans: tuple[ImageSpan, ...], images: tuple[Image, ...]
    ) -> PromptImages:
        """A prompt's images for its prefill."""
        return PromptImages(self, model, spans, images)


class PromptImages:
    """One prompt's images for its prefill (engine/image_prefill.py: `ImageRows`). Each
    image's features are looked up once and held while the prefill runs, whatever the store
    drops meanwhile."""

    def __init__(
        self,
        vision: Vision,
        model: nn.Module,
        spans: tuple[ImageSpan, ...],
        images: tuple[Image, ...],
    ) -> None:
        self.vision, self.model, self.spans, self.images = vision, model, spans, images
        self._rows: dict[str, mx.array] = {}

    def features(self, image: Image) -> mx.array:
        """The image's features, in the text embeddings' dtype."""
        rows = self._rows.get(image.digest)
        if rows is None:
            dtype = embedding_dtype(text_embeddings(self.model))
            rows = self._rows[image.digest] = self.vision.features(image, dtype)
        return rows

    def inside(self, lo: int, hi: int) -> list[tuple[ImageSpan, Image]]:
        """The images that lie in prompt positions [lo, hi), with their spans."""
        pairs = zip(self.spans, self.images, strict=True)
        return [(span, image) for span, image in pairs if span.start < hi and lo < span.end]

    def embeddings(self, tokens: Sequence[int], lo: int, hi: int) -> mx.array | None:
        """The input embeddings of prompt positions [lo, hi), (1, hi - lo, hidden), with each
        image's rows in its span; None when no image lies there (the model embeds the ids)."""
        inside = self.inside(lo, hi)
        if not inside:
            return None
        table = text_embeddings(self.model)
        pieces: list[mx.array] = []
        at = lo
        for span, image in inside:
            start, end = max(span.start, lo), min(span.end, hi)
            if at < start:
                pieces.append(table(mx.array(tokens[at:start])))
            rows = self.vision.main(self.features(image))
            pieces.append(rows[start - span.start : end - span.start])
            at = end
        if at < hi:
            pieces.append(table(mx.array(tokens[at:hi])))
        return mx.concatenate(pieces, axis=0)[None]

    def deepstack(self, lo: int, hi: int) -> list[mx.array] | None:
        """What each of the first text layers adds to prompt positions [lo, hi): (1, L,
        hidden) each, an image's deepstack rows in its span, zero elsewhere; None without
        deepstack or an image there."""
        layers = self.vision.deepstack_layers
        inside = self.inside(lo, hi)
        if not layers or not inside:
            return None
        dtype = embedding_dtype(text_embeddings(self.model))
        out = []
        for k in range(1, layers + 1):
            pieces: list[mx.array] = []
            at = lo
            for span, image in inside:
                rows = self.features(image)
                width = rows.shape[-1] // (1 + layers)
                start, end = max(span.start, lo), min(span.end, hi)
                if at < start:
                    pieces.append(mx.zeros((start - at, width), dtype))
                part = rows[start - span.start : end - span.start, k * width : (k + 1) * width]
                pieces.append(part)
                at = end
            if at < hi:
                pieces.append(mx.zeros((hi - at, width), dtype))
            out.append(mx.concatenate(pieces, axis=0)[None])
        return out

    def forward(
        self, model: nn.Module, ids: mx.array, rows: mx.array, lo: int, caches: list
    ) -> mx.array:
        """The logits of the chunk from `lo` whose input embeddings are `rows`."""
        hi = lo + ids.shape[1]
        blocks = [
            (max(s.start, lo) - lo, min(s.end, hi) - lo)
            for s in self.spans
            if s.start < hi and lo < s.end
        ]
        return self.vision.family.forward(model, ids, rows, blocks, caches)

    def positions(self, lo: int, hi: int) -> AbstractContextManager[None]:
        """The rope positions of prompt positions [lo, hi) for the pass that feeds them
        (M-RoPE: an image's 3D grid, the text after it shifted; else nothing to set)."""
        positions = self.vision.positions
        if positions is None:
            return nullcontext()
        length = max(hi, self.spans[-1].end)  # every image placed, though the chunk ends first
        ids = prompt_positions(length, self.spans, self.vision.grids(self.images))
        deepstack = self.deepstack(lo, hi)
        return positions.chunk(ids[:, lo:hi], lo, deepstack)


def text_embeddings(model: nn.Module) -> nn.Module:
    """The text model's token embedding (mlx-lm's wrappers keep it at
    `language_model.model.embed_tokens`)."""
    inner = getattr(model, "language_model", model)
    return inner.model.embed_tokens


def embedding_dtype(table: nn.Module) -> mx.Dtype:
    """The dtype its rows come out in (a quantized table's scales' dtype)."""
    scales = getattr(table, "scales", None)
    return (scales if scales is not None else table.weight).dtype


def family_class(family: str) -> Callable[[Path, Callable[[int], str]], Family]:
    """The class of a Gemma family module (vision/family.py's FAMILIES values; the Qwen
    families load with their text model, `_load_qwen`)."""
    if family == "gemma4":
        from mlx_kvserve.vision.gemma4 import Gemma4Vision

        return Gemma4Vision
    from mlx_kvserve.vision.gemma3 import Gemma3Vision

    return Gemma3Vision


def ram_features() -> FeatureCache:
    """Where features are kept while no prompt cache keeps them: RAM only, FEATURES_BYTES at
    most, the least recently used out first."""
    return FeatureCache(None, "", ram_budget=FEATURES_BYTES, disk_budget=lambda: 0)


def load_vision(
    model_dir: Path | None, token_text: Callable[[int], str], model: nn.Module | None = None
) -> Vision | None:
    """The vision of `model_dir`'s checkpoint (None: a text model, vision/family.py);
    `token_text(id)`: a special token's text, as the tokenizer spells it; `model`: mlx-lm's
    text model of the same checkpoint (a Qwen family's gets its M-RoPE layers here)."""
    family = vision_family(model_dir)
    if family is None or model_dir is None:
        return None
    if family in ("qwen2_5_vl", "qwen3_vl", "qwen3_5"):
        return _load_qwen(model_dir, token_text, model, family)
    loaded = family_class(family)(model_dir, token_text)
    log.info("vision tower loaded (%s): %d tokens per image", family, loaded.tokens_per_image)
    return Vision(loaded)


def _load_qwen(
    model_dir: Path, token_text: Callable[[int], str], model: nn.Module | None, family: str
) -> Vision:
    """A Qwen family's vision, and M-RoPE (and Qwen3-VL's deepstack) installed in `model`."""
    import json

    from mlx_kvserve.vision.mrope import install_deepstack, install_mrope
    from mlx_kvserve.vision.qwen2_5_vl import Qwen25VLVision
    from mlx_kvserve.vision.qwen3_vl import Qwen3VLVision, Qwen35Vision

    if model is None:
        raise ValueError(f"{family}'s vision needs its text model (for M-RoPE)")
    config = json.loads((model_dir / "config.json").read_text())
    positions = install_mrope(model, family, config.get("text_config") or config)
    kind = {"qwen3_vl": Qwen3VLVision, "qwen3_5": Qwen35Vision}.get(family, Qwen25VLVision)
    loaded = kind(model_dir, token_text)
    if loaded.deepstack:
        install_deepstack(model, positions, loaded.deepstack)
    log.info("vision tower loaded (%s): M-RoPE positions", family)
    return Vision(loaded, positions=positions)
