"""ENGINE THREAD. Images to input embeddings: each image's features computed once per pixel
hash (`Image.digest`) and kept in RAM, and a prefill chunk's embeddings with its image rows
replaced by them."""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol

import mlx.core as mx
import mlx.nn as nn

from mlx_kvserve.engine.image_prefill import Markup
from mlx_kvserve.engine.protocols import ImageFeatures
from mlx_kvserve.images.image import Image
from mlx_kvserve.images.spans import ImageSpan
from mlx_kvserve.vision.family import vision_family

log = logging.getLogger("mlx_kvserve.vision")

FEATURES_BYTES = 256 << 20  # the features kept in RAM (a Gemma 3 27B image: 2.7 MB)


class Family(Markup, Protocol):
    """A family's vision (vision/gemma3.py, gemma4.py): its markup, an image's features, and
    the forward of a prefill chunk that holds images (`blocks`: each one's [start, end) in
    the chunk)."""

    def features(self, image: Image, dtype: mx.Dtype) -> mx.array: ...

    def forward(
        self,
        model: nn.Module,
        ids: mx.array,
        rows: mx.array,
        blocks: Sequence[tuple[int, int]],
        caches: list,
    ) -> mx.array: ...


class Vision:
    """A loaded model's vision: its family, and the features of the images seen lately (here,
    and in the model's prompt cache, which keeps them on disk across restarts)."""

    def __init__(self, family: Family, capacity: int = FEATURES_BYTES) -> None:
        self.family = family
        self.capacity = capacity
        self._features: OrderedDict[str, mx.array] = OrderedDict()
        self._bytes = 0
        self._store: ImageFeatures | None = None
        self.encoded = 0  # images run through the tower (a repeat image is not)

    def keep_in(self, store: ImageFeatures | None) -> None:
        """Where features outlive this process (cache/features.py, beside the KV entries;
        None with `--no-cache`): a restarted server does not run the tower on an image again."""
        self._store = store

    @property
    def image_token(self) -> int:
        return self.family.image_token

    def markup(self, image: Image) -> tuple[str, int]:
        return self.family.markup(image)

    def features(self, image: Image, dtype: mx.Dtype) -> mx.array:
        """The image's rows, from the cache when its pixels were seen before."""
        kept = self._features.get(image.digest)
        if kept is not None and kept.dtype == dtype:
            self._features.move_to_end(image.digest)
            return kept
        stored = self._store.get(image.digest) if self._store is not None else None
        if stored is not None and stored.dtype == dtype:
            self._keep(image.digest, stored)
            return stored
        rows = self.family.features(image, dtype)
        mx.eval(rows)
        self.encoded += 1
        self._keep(image.digest, rows)
        if self._store is not None:
            self._store.put(image.digest, rows)
        return rows

    def rows(
        self, model: nn.Module, spans: tuple[ImageSpan, ...], images: tuple[Image, ...]
    ) -> PromptImages:
        """A prompt's images for its prefill."""
        return PromptImages(self, model, spans, images)

    def _keep(self, digest: str, rows: mx.array) -> None:
        old = self._features.pop(digest, None)
        if old is not None:
            self._bytes -= old.nbytes
        self._features[digest] = rows
        self._bytes += rows.nbytes
        while self._bytes > self.capacity and len(self._features) > 1:
            _, dropped = self._features.popitem(last=False)
            self._bytes -= dropped.nbytes

    def embeddings(
        self,
        model: nn.Module,
        tokens: Sequence[int],
        lo: int,
        hi: int,
        spans: Sequence[ImageSpan],
        images: Sequence[Image],
    ) -> mx.array | None:
        """The input embeddings of prompt positions [lo, hi), (1, hi - lo, hidden), with each
        image's rows in its span; None when no image lies there (the model embeds the ids)."""
        inside = [
            (span, image)
            for span, image in zip(spans, images, strict=True)
            if span.start < hi and lo < span.end
        ]
        if not inside:
            return None
        table = text_embeddings(model)
        pieces: list[mx.array] = []
        at = lo
        for span, image in inside:
            start, end = max(span.start, lo), min(span.end, hi)
            if at < start:
                pieces.append(table(mx.array(tokens[at:start])))
            rows = self.features(image, embedding_dtype(table))
            pieces.append(rows[start - span.start : end - span.start])
            at = end
        if at < hi:
            pieces.append(table(mx.array(tokens[at:hi])))
        return mx.concatenate(pieces, axis=0)[None]


class PromptImages:
    """One prompt's images for its prefill (engine/image_prefill.py: `ImageRows`)."""

    def __init__(
        self,
        vision: Vision,
        model: nn.Module,
        spans: tuple[ImageSpan, ...],
        images: tuple[Image, ...],
    ) -> None:
        self.vision, self.model, self.spans, self.images = vision, model, spans, images

    def embeddings(self, tokens: Sequence[int], lo: int, hi: int) -> mx.array | None:
        return self.vision.embeddings(self.model, tokens, lo, hi, self.spans, self.images)

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
    """The class of a family module (vision/family.py's FAMILIES values)."""
    if family == "gemma4":
        from mlx_kvserve.vision.gemma4 import Gemma4Vision

        return Gemma4Vision
    from mlx_kvserve.vision.gemma3 import Gemma3Vision

    return Gemma3Vision


def load_vision(model_dir: Path | None, token_text: Callable[[int], str]) -> Vision | None:
    """The vision of `model_dir`'s checkpoint (None: a text model, vision/family.py);
    `token_text(id)`: a special token's text, as the tokenizer spells it."""
    family = vision_family(model_dir)
    if family is None or model_dir is None:
        return None
    loaded = family_class(family)(model_dir, token_text)
    log.info("vision tower loaded (%s): %d tokens per image", family, loaded.tokens_per_image)
    return Vision(loaded)
