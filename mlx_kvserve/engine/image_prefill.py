"""ENGINE THREAD. A prompt with images, prefilled: the chunks that hold an image are fed as
input embeddings (the text's rows, and the vision features in each image's span), and no chunk
ends inside an image (`ImageSpan`, images/spans.py), so every chunk boundary, and the
checkpoints taken there, are places the prompt cache may key and reuse."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import mlx.core as mx
import mlx.nn as nn

from mlx_kvserve.images.image import Image
from mlx_kvserve.images.spans import ImageSpan, whole_spans


class ImageRows(Protocol):
    """A prompt's images as input embeddings (vision/encoder.py: `PromptImages`)."""

    @property
    def spans(self) -> tuple[ImageSpan, ...]: ...

    def embeddings(self, tokens: Sequence[int], lo: int, hi: int) -> mx.array | None: ...

    def forward(
        self, model: nn.Module, ids: mx.array, rows: mx.array, lo: int, caches: list
    ) -> mx.array: ...


class Markup(Protocol):
    """What a vision model's prompt needs (chat/image_markup.py): the placeholder id, and an
    image's markup text and placeholder count."""

    @property
    def image_token(self) -> int: ...

    def markup(self, image: Image) -> tuple[str, int]: ...


class VisionRows(Markup, Protocol):
    """A vision model (vision/encoder.py: `Vision`): its prompts' markup, and a prompt's
    images as rows for its prefill."""

    def rows(
        self, model: nn.Module, spans: tuple[ImageSpan, ...], images: tuple[Image, ...]
    ) -> ImageRows: ...


def request_rows(
    vision: VisionRows | None,
    model: nn.Module,
    spans: tuple[ImageSpan, ...],
    images: tuple[Image, ...],
) -> ImageRows | None:
    """What prefills a request's images (None: it has none, or the model sees none)."""
    if vision is None or not spans:
        return None
    return vision.rows(model, spans, images)


def whole_chunks(
    chunks: list[tuple[int, int]], last_from: int, spans: Sequence[ImageSpan]
) -> tuple[list[tuple[int, int]], int]:
    """`plan_chunks`' plan with each boundary inside an image moved back to the image's start
    (a chunk left empty goes)."""
    if not spans:
        return chunks, last_from
    start = chunks[0][0] if chunks else last_from
    bounds = [start]
    for cut in [hi for _, hi in chunks]:
        moved = whole_spans(cut, spans)
        if moved > bounds[-1]:
            bounds.append(moved)
    moved = whole_spans(last_from, spans)
    if moved < bounds[-1]:  # the last pass may not start before a chunk that already ended
        moved = bounds[-1]
    if moved > bounds[-1]:
        bounds.append(moved)
    return list(zip(bounds[:-1], bounds[1:], strict=True)), bounds[-1]


def inside_image(position: int, images: ImageRows | None) -> bool:
    """Whether a checkpoint at `position` would end inside an image (none is taken there)."""
    return images is not None and whole_spans(position, images.spans) != position


def forward(
    model: nn.Module,
    prompt: Sequence[int],
    lo: int,
    hi: int,
    caches: list,
    images: ImageRows | None,
) -> mx.array:
    """The model's logits for prompt[lo:hi] (embedded with its images where it holds any)."""
    ids = mx.array(prompt[lo:hi])[None]
    rows = images.embeddings(prompt, lo, hi) if images is not None else None
    if rows is None:
        return model(ids, cache=caches)
    return images.forward(model, ids, rows, lo, caches)
