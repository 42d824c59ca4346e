"""Where an image sits in a prompt, and how the prompt cache keys it.

A vision model reads an image as a run of placeholder tokens (Qwen's `<|image_pad|>`, Gemma's
`<image_soft_token>`) whose embeddings the vision encoder replaces. Those ids are the same for
every image, so a cache keyed by token ids alone would give one picture's KV to another
(vllm-mlx #718). The prompt cache therefore keys a prompt by `key_tokens`: the text's own ids,
and in each image's span ids derived from the hash of its decoded pixels (`Image.digest`) and
the span's length, in a range no tokenizer uses (at or above 2**31). A prefix is then reused
exactly up to the first image that differs, a text-only prompt shares its prefix with an image
prompt, and the key survives a restart because it is made of the pixels, not of a path or a URL.
The engine feeds the model the real ids; key ids are never fed to it nor drafted (`is_image_key`).

A span is never split: the KV of half an image is not what any prompt computes (an encoder's
features are fed whole, and some models attend within an image both ways), so a reused length
that ends inside a span is cut back to the span's start (`whole_spans`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

# Ids at or above this are image keys; every tokenizer's ids are far below it.
IMAGE_KEY_BASE = 1 << 31
_KEY_MASK = IMAGE_KEY_BASE - 1
_WORDS = 8  # a 256-bit digest read as 8 words of 31 bits, repeated along the span


@dataclass(frozen=True)
class ImageSpan:
    """One image's placeholder tokens: `length` tokens from prompt position `start`."""

    start: int
    length: int
    digest: str  # Image.digest: sha-256 hex of the decoded pixels

    def __post_init__(self) -> None:
        if self.start < 0 or self.length < 1:
            raise ValueError(f"an image span needs start >= 0 and length >= 1, got {self}")

    @property
    def end(self) -> int:
        return self.start + self.length

    def key_ids(self) -> np.ndarray:
        """The span's ids as the cache keys them: the words of a hash of the digest and the
        span's length in turn, each mixed with its position so that no two positions of a span
        share an id. Any span of 8 or more tokens carries the whole hash (248 of its bits). The
        length is in the hash because the same pixels read as another number of tokens (another
        resize setting) are other features: a shorter span must not match a longer one's
        first positions."""
        raw = hashlib.sha256(f"{self.digest}:{self.length}".encode()).digest()
        words = np.frombuffer(raw[: 4 * _WORDS], dtype="<u4")
        i = np.arange(self.length, dtype=np.uint64)
        mixed = (words[i % _WORDS].astype(np.uint64) ^ (i * np.uint64(0x9E3779B1))) & _KEY_MASK
        return (mixed | IMAGE_KEY_BASE).astype(np.uint32)


def key_tokens(tokens: Sequence[int], spans: Sequence[ImageSpan]) -> list[int]:
    """The prompt as the prompt cache keys it: `tokens` with each span's ids replaced by the
    span's key ids. Without spans, the tokens themselves."""
    if not spans:
        return list(tokens)
    keyed = np.asarray(tokens, dtype=np.uint32).copy()
    for span in spans:
        if span.start < 0 or span.end > len(keyed):
            raise ValueError(f"image span {span.start}..{span.end} outside {len(keyed)} tokens")
        keyed[span.start : span.end] = span.key_ids()
    return keyed.tolist()


def find_spans(
    tokens: Sequence[int], placeholder: int, digests: Sequence[str]
) -> tuple[ImageSpan, ...]:
    """The spans of a rendered prompt whose images a processor expanded into runs of the
    `placeholder` id (Qwen's `<|image_pad|>`, Gemma's `<image_soft_token>`; each run between
    the family's start and end markers), paired in order with the images' `digests`. Raises
    ValueError when the runs and the images do not pair up."""
    arr = np.asarray(tokens, dtype=np.int64) == placeholder
    edges = np.flatnonzero(np.diff(np.concatenate(([False], arr, [False])).astype(np.int8)))
    starts, ends = edges[0::2], edges[1::2]
    if len(starts) != len(digests):
        raise ValueError(f"{len(starts)} runs of image tokens for {len(digests)} images")
    return tuple(
        ImageSpan(int(s), int(e - s), d) for s, e, d in zip(starts, ends, digests, strict=True)
    )


def check_spans(length: int, spans: Sequence[ImageSpan]) -> None:
    """Raise ValueError unless `spans` lie within a prompt of `length` tokens, in order and
    apart: where the engine relies on it (a span cut, or two over one position, is a bug of
    whoever placed them, not a prompt)."""
    end = 0
    for span in spans:
        if span.start < end or span.end > length:
            raise ValueError(f"image spans {list(spans)} do not fit a {length}-token prompt")
        end = span.end


def whole_spans(length: int, spans: Sequence[ImageSpan]) -> int:
    """`length` cut back to the start of the span it would split, if any: a reused prefix or a
    checkpoint never ends inside an image."""
    for span in spans:
        if span.start < length < span.end:
            return span.start
    return length


def is_image_key(token: int) -> bool:
    """Whether a key id stands for part of an image (never fed to a model, never drafted)."""
    return token >= IMAGE_KEY_BASE
