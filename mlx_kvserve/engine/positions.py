"""ENGINE THREAD. Each row's rope shift in a pass that decodes or verifies: a row that saw
images under Qwen's M-RoPE sits `rope_delta` positions away from its token count
(vision/mrope.py), which every pass over its KV adds to mlx-lm's offset. Text-only rows shift
by 0, and a model without M-RoPE, or a batch with no image row, runs its rope untouched."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Protocol

import mlx.nn as nn

Shift = Callable[[int], int]  # a prompt's rope shift at a position (0 before any image)


class RowPositions(Protocol):
    """The M-RoPE context a vision model's attention layers read (vision/mrope.py)."""

    def rows(self, deltas: Sequence[int]) -> AbstractContextManager[None]: ...


class Shifted(Protocol):
    rope_delta: int


def shifted(model: nn.Module, rows: Sequence[Shifted]) -> AbstractContextManager[None]:
    """The context of one pass over `rows` (the batch's order) on `model`."""
    return shifted_by(model, [row.rope_delta for row in rows])


def shifted_by(model: nn.Module, deltas: Sequence[int]) -> AbstractContextManager[None]:
    """The context of one pass whose rows sit `deltas` away from their offsets."""
    positions: RowPositions | None = getattr(model, "mrope_positions", None)
    if positions is None or not any(deltas):
        return nullcontext()
    return positions.rows(deltas)
