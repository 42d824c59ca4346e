"""The ids a tokenizer writes, which a checkpoint's logits may outnumber.

Qwen2.5/3/3.5 ship 151,669 tokens in an embedding of 151,936 rows; Gemma 3 and DeepSeek-V3 pad
theirs too. The logits past the tokenizer's ids belong to no token: the engine never draws them
(engine/sampling.py), a grammar never allows them (chat/grammar.py), a prompt of token ids may
not name them (chat/render.py). A tokenizer with more ids than the embedding has rows is refused
before a model is served (models/preflight.py).
"""

from __future__ import annotations

import threading
import weakref

_sizes: weakref.WeakKeyDictionary[object, int | None] = weakref.WeakKeyDictionary()
_sizes_lock = threading.Lock()


def vocabulary_size(tokenizer: object) -> int | None:
    """How many ids the tokenizer writes (its highest id + 1, added tokens included), or None
    for one without a vocabulary (a test's stub). Counted once per tokenizer: reading a
    vocabulary of 150k entries takes tens of milliseconds."""
    try:
        with _sizes_lock:
            return _sizes[tokenizer]
    except KeyError:
        pass
    except TypeError:  # not weakly referable: counted each time
        return _count(tokenizer)
    size = _count(tokenizer)
    with _sizes_lock:
        _sizes[tokenizer] = size
    return size


def _count(tokenizer: object) -> int | None:
    get_vocab = getattr(tokenizer, "get_vocab", None)
    vocab = get_vocab() if callable(get_vocab) else None
    return max(vocab.values()) + 1 if vocab else None
