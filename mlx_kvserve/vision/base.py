"""What a family's vision module is (vision/gemma3.py, gemma4.py, qwen2_5_vl.py, qwen3_vl.py):
the protocol vision/encoder.py calls, with the prefill forward most families share."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import mlx.core as mx
import mlx.nn as nn

from mlx_kvserve.engine.image_prefill import Markup
from mlx_kvserve.images.image import Image


class Family(Markup, Protocol):
    """A family's vision: its markup, an image's features, and the forward of a prefill chunk
    that holds images (`blocks`: each one's [start, end) in the chunk)."""

    def features(self, image: Image, dtype: mx.Dtype) -> mx.array: ...

    def forward(
        self,
        model: nn.Module,
        ids: mx.array,
        rows: mx.array,
        blocks: Sequence[tuple[int, int]],
        caches: list,
    ) -> mx.array:
        """A chunk with images: the text model fed their rows, causal as mlx-vlm runs Gemma 3
        and the Qwen families (Qwen's at the positions `Positions` holds for the chunk,
        vision/mrope.py); Gemma 4 overrides it."""
        return model(ids, cache=caches, input_embeddings=rows)
