"""Exceptions raised by the prompt cache; the engine maps them to evict-and-retry-cold."""

from __future__ import annotations


class CacheError(Exception):
    """Base class for prompt-cache errors."""


class CacheLockedError(CacheError):
    """Another process already owns this cache directory (one writer per directory)."""


class CacheRestoreError(CacheError):
    """A checkpoint could not be restored.

    `key` names the entry whose data is bad (a chain link may be the culprit rather than the entry
    the lookup named, so evicting `key` also removes everything built on it); `match_key` is the
    entry the caller asked for. The caller evicts `key` and retries the request cold.
    """

    def __init__(self, key: str, problem: str, *, match_key: str | None = None) -> None:
        super().__init__(f"checkpoint {key[:16]}: {problem}")
        self.key = key
        self.problem = problem
        self.match_key = match_key or key


class EntryFormatError(CacheError):
    """A stored entry (file or header) is malformed, damaged, or belongs elsewhere."""
