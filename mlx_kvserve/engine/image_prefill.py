"""ENGINE THREAD. A prompt with images, prefilled: the chunks that hold an image are fed as
input embeddings (the text's rows, and the vision features in each image's span). No chunk
ends inside an image (`ImageSpan`, images/spans.py; the prefill's `Checkpoints` move every
cut and checkpoint to an image's start, engine/chunks.py), so every chunk boundary, and the
checkpoints taken there, are places the prompt cache may key and reuse."""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Protocol

import mlx.core as mx
import mlx.nn as nn

from mlx_kvserve.images.image import Image
from mlx_kvserve.images.spans import ImageSpan


class ImageRows(Protocol):
    """A prompt's images as input embeddings (vision/encoder.py: `PromptImages`)."""

    @property
    def spans(self) -> tuple[ImageSpan, ...]: ...

    def embeddings(self, tokens: Sequence[int], lo: int, hi: int) -> mx.array | None: ...

    def forward(
        self, model: nn.Module, ids: mx.array, rows: mx.array, lo: int, caches: list
    ) -> mx.array: ...

    def positions(self, lo: int, hi: int) -> AbstractContextManager[None]:
        """Set the rope positions of prompt positions [lo, hi) for the pass that feeds them
        (Qwen's M-RoPE, vision/mrope.py; nothing for a family with 1D positions)."""
        ...


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

    def rope_delta(self, spans: Sequence[ImageSpan], images: Sequence[Image]) -> int:
        """What a row's decode passes add to its offsets (0 but for M-RoPE)."""
        ...


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
    if images is None:
        return model(ids, cache=caches)
    rows = images.embeddings(prompt, lo, hi)
    with images.positions(lo, hi):
        if rows is None:
            return model(ids, cache=caches)
        return images.forward(model, ids, rows, lo, caches)
