"""What the chat layer uses of a tokenizer: templating, encoding, decoding, the vocabulary."""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable
from typing import Protocol, TypeVar

from mlx_kvserve.json_value import JSON

K = TypeVar("K")
T = TypeVar("T")


class Tokenizer(Protocol):
    """mlx-lm's `TokenizerWrapper` (mlx_lm.tokenizer_utils), as the chat layer uses it.

    What mlx-lm reads from the template at load (`tool_parser`, `tool_call_start`,
    `has_thinking`, `think_start`, ...) and what only the wrapper has (`eos_token_ids`,
    `add_eos_token`) is looked up with `getattr` where it is used, so a plain Hugging Face
    tokenizer serves too."""

    @property
    def chat_template(self) -> str | None: ...

    def apply_chat_template(self, conversation: list[dict[str, JSON]], **kwargs: object) -> str:
        """The template's text for the messages (called with `tokenize=False`)."""
        ...

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, token_ids: list[int]) -> str: ...

    def get_vocab(self) -> dict[str, int]: ...


def per_tokenizer(find: Callable[[K], T]) -> Callable[[K], T]:
    """`find(tokenizer)` worked out once per tokenizer while it lives (probes render the
    template; a vocabulary is a map of 150k entries built anew by each `get_vocab()`); a
    tokenizer that cannot be weakly referenced is asked again each time."""
    known: weakref.WeakKeyDictionary[K, T] = weakref.WeakKeyDictionary()

    @functools.wraps(find)
    def once(tokenizer: K) -> T:
        try:
            return known[tokenizer]
        except (KeyError, TypeError):
            pass
        found = find(tokenizer)
        with contextlib.suppress(TypeError):
            known[tokenizer] = found
        return found

    return once
