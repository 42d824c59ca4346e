"""Where a prefill's chunks end, and where it checkpoints.

A prefill is cut at multiples of the prefill step and at every checkpoint position, never inside
an image; its last few tokens run as one pass (`plan_chunks`). engine/generate.py runs the plan.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from mlx_kvserve.images.spans import ImageSpan, whole_spans


@dataclass
class Checkpoints:
    """When to checkpoint during prefill, and the callback that stores one."""

    boundaries: dict[int, str]
    interval: int
    store: Callable[..., None]  # store(live, last_logits, reason=..., length=None)
    keep_end: bool = False  # a chat prompt: checkpoint near its end where caches cannot be cut
    # False when some rank of a job holds caches that cannot be cut: every rank then plans its
    # chunks alike, as if its own could not (the ranks' passes must match one for one)
    sliceable: bool = True
    # The prompt's images: no chunk and no checkpoint ends inside one (each moves to its start)
    spans: tuple[ImageSpan, ...] = ()

    def for_prompt(self, start: int, end: int, foldable: bool) -> Checkpoints:
        """These checkpoints with the "prompt" point one token before `end` added where the
        caches cannot be cut back (`keep_end`) and the chat layer placed none; every point
        inside an image moved to the image's start."""
        planned = self._with_end(start, end, foldable)
        return planned._outside_images(end) if self.spans else planned

    def _with_end(self, start: int, end: int, foldable: bool) -> Checkpoints:
        if not self.keep_end or foldable or "prompt" in self.boundaries.values():
            return self
        if not start < end - 1 or end - 1 in self.boundaries:
            return self
        return replace(self, boundaries={**self.boundaries, end - 1: "prompt"}, keep_end=False)

    def _outside_images(self, end: int) -> Checkpoints:
        """Every checkpoint position (interval ones spelled out) that falls inside an image
        moved to its start; where several land on one position, the earliest's reason wins."""
        points = dict(self.boundaries)
        if self.interval:
            for position in range(self.interval, end, self.interval):
                points.setdefault(position, "interval")
        moved: dict[int, str] = {}
        for position, reason in sorted(points.items()):
            moved.setdefault(whole_spans(position, self.spans), reason)
        moved.pop(0, None)
        return replace(self, boundaries=moved, interval=0)

    def reason_at(self, position: int) -> str | None:
        if position in self.boundaries:
            return self.boundaries[position]
        if self.interval and position % self.interval == 0:
            return "interval"
        return None

    def cuts(self, start: int, end: int, step: int) -> list[int]:
        """Chunk ends in (start, end]: multiples of step, and every checkpoint position.

        Aligning chunks to absolute multiples of `step` makes a prefill that resumes from a
        cached prefix compute the same chunks as a cold one after its first, shorter chunk.
        """
        points = set(range((start // step + 1) * step, end, step)) | {end}
        points |= {p for p in self.boundaries if start < p < end}
        if self.interval:
            first = (start // self.interval + 1) * self.interval
            points |= set(range(first, end, self.interval))
        if self.spans:  # a chunk never ends inside an image: its end moves to the image's start
            points = {whole_spans(p, self.spans) for p in points} - set(range(start + 1))
        return sorted(points)


# A prompt's last few tokens (usually the newest message of a conversation whose earlier turns
# came from a cache) run as one forward pass, even where a checkpoint boundary lies among them:
# each pass streams all the weights, so on a memory-bound machine splitting 14 tokens at a
# message boundary and again before the last token costs three passes instead of one. Their
# checkpoints are cut from the longer KV afterwards (positions never see later tokens) with the
# probe taken from their own logits row. Computing logits for every row is what limits the fold
# to small tails: the vocabulary projection of TAIL_FOLD rows costs less than one extra pass.
TAIL_FOLD = 64


def plan_chunks(
    start: int, end: int, step: int, checkpoints: Checkpoints, *, foldable: bool
) -> tuple[list[tuple[int, int]], int]:
    """Prefill of prompt positions [start, end): (early chunks, first position of the last pass).

    Early chunks end at multiples of `step` and at checkpoint positions. The last pass covers
    the final token, and folds in the chunks before it while it stays within TAIL_FOLD tokens;
    checkpoint positions are folded only if the caches can be cut to a prefix (`foldable`).
    """
    bounds = [start, *(checkpoints.cuts(start, end - 1, step) if end - 1 > start else [])]
    while len(bounds) > 1 and end - bounds[-2] <= TAIL_FOLD:
        if not foldable and checkpoints.reason_at(bounds[-1]) is not None:
            break
        bounds.pop()
    return list(zip(bounds[:-1], bounds[1:], strict=True)), bounds[-1]
