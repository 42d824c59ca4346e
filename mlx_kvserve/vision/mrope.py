"""Qwen's M-RoPE on mlx-lm's text model: the positions an image prompt's tokens get, and a
rope in each attention layer that applies them (docs/images.md, "Qwen's M-RoPE").

An image's tokens get 3D positions (t, h, w of its merged-patch grid, from where the text
before it ended), and the text after it continues from one past the largest of them: an
image of N tokens advances positions by max(t, h, w), not N. For text tokens the three
positions are equal, where M-RoPE is mlx-lm's 1D rope; so the KV of a prompt's text before
its first image is the same with or without images after it.

`Positions` is the shared context the engine sets around a forward pass
(engine/positions.py): a prefill chunk that holds an image gives its explicit 3 x L
positions (the request prefills alone, one row); any other pass gives each row's `delta`
(its position minus its token index: 0 for a text-only row), added to mlx-lm's offset.
With no context, or every delta 0, the original rope runs untouched.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlx_kvserve.images.spans import ImageSpan

Grid = tuple[int, int, int]


def prompt_positions(length: int, spans: Sequence[ImageSpan], grids: Sequence[Grid]) -> np.ndarray:
    """(3, length) positions of a prompt whose images sit at `spans` with merged grids
    `grids` (mlx-vlm's and transformers' `get_rope_index` for one row)."""
    out = np.empty((3, length), dtype=np.int64)
    at = p = 0
    for span, (t, h, w) in zip(spans, grids, strict=True):
        if t * h * w != span.length:
            raise ValueError(f"an image of grid {(t, h, w)} in a span of {span.length} tokens")
        n = span.start - at
        out[:, at : span.start] = p + np.arange(n)
        p += n
        tt, hh, ww = np.meshgrid(np.arange(t), np.arange(h), np.arange(w), indexing="ij")
        out[:, span.start : span.end] = p + np.stack([tt.ravel(), hh.ravel(), ww.ravel()])
        p += max(t, h, w)
        at = span.end
    out[:, at:] = p + np.arange(length - at)
    return out


def rope_delta(spans: Sequence[ImageSpan], grids: Sequence[Grid]) -> int:
    """Position minus token index of the text after every image (mlx-vlm's `rope_deltas`)."""
    return sum(max(g) - span.length for span, g in zip(spans, grids, strict=True))


class Positions:
    """What the next forward pass rotates by: explicit (3, L) positions of a one-row chunk,
    or a per-row delta on mlx-lm's offsets, or nothing (the original rope)."""

    def __init__(self) -> None:
        self.ids: mx.array | None = None  # (3, 1, L)
        self.delta: int | mx.array | None = None
        self.deepstack: list[mx.array] | None = None  # (1, L, hidden) per first layer
        self._cos_sin: tuple[mx.array, mx.array] | None = None

    @contextmanager
    def chunk(
        self, ids: np.ndarray, lo: int, deepstack: list[mx.array] | None = None
    ) -> Iterator[None]:
        """One row's prefill chunk from token `lo` at explicit positions (3, L), with what
        the first layers add to its image tokens (Qwen3-VL's deepstack) if any."""
        self.deepstack = deepstack
        try:
            if (ids[0] == ids[1]).all() and (ids[0] == ids[2]).all():
                with self.rows([int(ids[0, 0]) - lo]):  # text only: the 1D rope, shifted
                    yield
                return
            self.ids, self._cos_sin = mx.array(ids)[:, None, :], None
            try:
                yield
            finally:
                self.ids = self._cos_sin = None
        finally:
            self.deepstack = None

    @contextmanager
    def rows(self, deltas: Sequence[int]) -> Iterator[None]:
        """Each row's delta on its offset."""
        if any(deltas):
            self.delta = deltas[0] if len(deltas) == 1 else mx.array(deltas)
        try:
            yield
        finally:
            self.delta = None

    def cos_sin(self, rope: MRoPE, x: mx.array) -> tuple[mx.array, mx.array]:
        """The chunk's cos and sin, once per pass (every layer rotates by the same)."""
        if self._cos_sin is None:
            assert self.ids is not None
            self._cos_sin = rope.rotary(x, self.ids)
        return self._cos_sin


class MRoPE(nn.Module):
    """mlx-lm's rope of one attention layer, with the positions of `Positions` applied."""

    def __init__(
        self,
        original: nn.Module,
        positions: Positions,
        rotary: nn.Module,
        apply: Callable[..., tuple[mx.array, mx.array]],
    ) -> None:
        super().__init__()
        self.original = original
        self.rotary = rotary  # mlx-vlm's rotary embedding of the family (its M-RoPE math)
        self._apply = apply  # ... and how it rotates by cos and sin (chunked, interleaved)
        self._positions = positions

    def __call__(self, x: mx.array, offset: int | mx.array = 0) -> mx.array:
        positions = self._positions
        if positions.ids is not None:
            cos, sin = positions.cos_sin(self, x)
            return self._apply(x, x, cos, sin)[0]
        delta = positions.delta
        if delta is None:
            return self.original(x, offset=offset)
        return self.original(x, offset=offset + delta)


def install_mrope(model: nn.Module, family: str, text_config: dict) -> Positions:
    """Put an `MRoPE` in every attention layer of mlx-lm's text model of a Qwen vision
    `family` (mlx-lm's `qwen2_vl`, `qwen3_vl` or `qwen3_5`, or their MoE models); the
    `Positions` they share, also kept as `model.mrope_positions` (engine/positions.py)."""
    heads = int(text_config["num_attention_heads"])
    head_dim = int(text_config.get("head_dim") or int(text_config["hidden_size"]) // heads)
    longest = int(text_config.get("max_position_embeddings", 128000))
    rotary: nn.Module
    if family == "qwen3_5":  # a quarter of each head rotated, on its full-attention layers
        from mlx_vlm.models.qwen3_5.language import Qwen3_5RotaryEmbedding
        from mlx_vlm.models.qwen3_5.language import apply_multimodal_rotary_pos_emb as apply

        rope = text_config.get("rope_parameters") or {}
        rotary = Qwen3_5RotaryEmbedding(
            int(head_dim * float(rope.get("partial_rotary_factor", 0.25))),
            max_position_embeddings=longest,
            base=float(rope.get("rope_theta", 10000000.0)),
            mrope_section=list(rope.get("mrope_section", [11, 11, 10])),
        )
    else:
        if family == "qwen3_vl":
            from mlx_vlm.models.qwen3_vl.language import Qwen3VLRotaryEmbedding as Rotary
            from mlx_vlm.models.qwen3_vl.language import apply_multimodal_rotary_pos_emb as apply
        else:
            from mlx_vlm.models.qwen2_5_vl.language import Qwen2RotaryEmbedding as Rotary
            from mlx_vlm.models.qwen2_5_vl.language import apply_multimodal_rotary_pos_emb as apply
        rotary = Rotary(
            head_dim,
            max_position_embeddings=longest,
            base=float(text_config.get("rope_theta", 1000000.0)),
            rope_scaling=text_config.get("rope_scaling"),
        )
    positions = Positions()
    for layer in model.layers:
        attention = getattr(layer, "self_attn", None)  # (Qwen3.5's linear layers have none)
        if attention is not None:
            attention.rope = MRoPE(attention.rope, positions, rotary, apply)
    model.mrope_positions = positions
    return positions


class _Deepstack:
    """A text layer that adds its deepstack rows (Qwen3-VL: set per prefill chunk by
    `Positions`, zero outside the images) to its output, as mlx-vlm's text model does after
    each of its first layers. Mixed into the layer's own class, so the layer keeps its
    parameters' names and every attribute mlx-lm and the engine read."""

    _deepstack_at: tuple[Positions, int]

    def __call__(self, *args: object, **kwargs: object) -> mx.array:
        out = super().__call__(*args, **kwargs)  # type: ignore[misc]
        positions, index = self._deepstack_at
        rows = positions.deepstack
        if rows is None or index >= len(rows):
            return out
        return out + rows[index]


def install_deepstack(model: nn.Module, positions: Positions, layers: int) -> None:
    """Make the first `layers` text layers add the chunk's deepstack rows."""
    made: dict[type, type] = {}
    for index, layer in enumerate(model.layers[:layers]):
        cls = type(layer)
        if cls not in made:
            made[cls] = type(f"Deepstack{cls.__name__}", (_Deepstack, cls), {})
        layer.__class__ = made[cls]
        object.__setattr__(layer, "_deepstack_at", (positions, index))
