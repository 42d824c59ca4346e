"""Exceptions raised by the prompt cache, and which failures are not a stored state's fault.

The engine maps a `CacheRestoreError` to evicting the entry it names and going on from what is
left; `out_of_memory` tells it which errors say nothing about any state (DESIGN invariant 5).
"""

from __future__ import annotations

import errno


class CacheError(Exception):
    """Base class for prompt-cache errors."""


class CacheLockedError(CacheError):
    """Another process already owns this cache directory (one writer per directory)."""


class CacheRestoreError(CacheError):
    """A checkpoint could not be restored.

    `key` names the entry whose data is bad (a chain link may be the culprit rather than the entry
    the lookup named, so evicting `key` also removes everything built on it); `match_key` is the
    entry the caller asked for. The caller evicts `key` and goes on from what the cache still
    holds.
    """

    def __init__(self, key: str, problem: str, *, match_key: str | None = None) -> None:
        super().__init__(f"checkpoint {key[:16]}: {problem}")
        self.key = key
        self.problem = problem
        self.match_key = match_key or key


class EntryFormatError(CacheError):
    """A stored entry (file or header) is malformed, damaged, or belongs elsewhere."""


# How MLX words running out of memory: Metal's command-buffer failure ("[METAL] Command buffer
# execution failed: Insufficient Memory (00000008:kIOGPUCommandBufferCallbackErrorOutOfMemory)"),
# its allocators ("[metal::malloc] Attempting to allocate ... greater than the maximum allowed
# buffer size", "[metal::malloc] Resource limit (...) exceeded", "[malloc] Unable to allocate").
_MEMORY_WORDS = (
    "insufficient memory",
    "out of memory",
    "outofmemory",
    "[metal::malloc]",
    "[malloc",
    "unable to allocate",
    "resource limit",
)


def out_of_memory(exc: BaseException) -> bool:
    """Is `exc` the machine running out of memory? Such an error is nobody's state: it is
    retried once memory is freed, and nothing is evicted for it."""
    if isinstance(exc, MemoryError):
        return True
    if isinstance(exc, OSError) and exc.errno == errno.ENOMEM:
        return True
    if isinstance(exc, RuntimeError):
        text = str(exc).lower()
        return any(word in text for word in _MEMORY_WORDS)
    return False
