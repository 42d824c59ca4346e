"""The ids a tokenizer writes, which a checkpoint's logits may outnumber.

Qwen2.5/3/3.5 ship 151,669 tokens in an embedding of 151,936 rows; Gemma 3 and DeepSeek-V3 pad
theirs too. The logits past the tokenizer's ids belong to no token: the engine never draws them
(engine/sampling.py), a grammar never allows them (chat/grammar.py), a prompt of token ids may
not name them (chat/render.py). A tokenizer with more ids than the embedding has rows is refused
before a model is served (models/preflight.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from mlx_kvserve.chat.tokenizer import per_tokenizer


@dataclass(frozen=True)
class _Vocabulary:
    ids: Mapping[str, int]  # token -> id
    size: int | None  # the highest id + 1


@per_tokenizer
def _vocabulary(tokenizer: object) -> _Vocabulary:
    """Read once per tokenizer: `get_vocab()` builds the whole map on every call (60 ms for
    SmolLM2's 49k tokens; gpt-oss has 200k), and tokens are looked up on every request."""
    get_vocab = getattr(tokenizer, "get_vocab", None)
    vocab = get_vocab() if callable(get_vocab) else None
    if not vocab:
        return _Vocabulary(MappingProxyType({}), None)
    return _Vocabulary(MappingProxyType(dict(vocab)), max(vocab.values()) + 1)


def token_ids(tokenizer: object) -> Mapping[str, int]:
    """The tokenizer's token -> id map, added tokens included (empty for one without a
    vocabulary, a test's stub)."""
    return _vocabulary(tokenizer).ids


def vocabulary_size(tokenizer: object) -> int | None:
    """How many ids the tokenizer writes (its highest id + 1, added tokens included), or None
    for one without a vocabulary (a test's stub)."""
    return _vocabulary(tokenizer).size


def unknown_token_id(tokenizer: object, ids: list[int]) -> tuple[int, int] | None:
    """The first of `ids` that no token has, with the vocabulary's size; None if all are known.
    A prompt or an embedding input of token ids may name no other: the model would read past
    its embedding table, or a padded row no token has."""
    size = vocabulary_size(tokenizer) or len(getattr(tokenizer, "_tokenizer", tokenizer))
    bad = next((t for t in ids if not 0 <= t < size), None)
    return None if bad is None else (bad, size)
