"""Persistent prompt (KV) cache: token-trie index, RAM tier, crash-safe disk tier of deltas.

The engine thread creates one `PromptCache` per loaded model and calls it from that thread only;
see `store` for the rules (deltas, prefix dominance, budgets, crash recovery).
"""

from mlx_kvserve.cache.entry import MISS, EntryInfo, Match, entry_key
from mlx_kvserve.cache.exceptions import (
    CacheError,
    CacheLockedError,
    CacheRestoreError,
    EntryFormatError,
)
from mlx_kvserve.cache.fingerprint import hash_files, layout_versions, model_fingerprint
from mlx_kvserve.cache.mtp_part import MTPRestored, MTPState
from mlx_kvserve.cache.policy import default_disk_budget
from mlx_kvserve.cache.scan import model_directories
from mlx_kvserve.cache.state import make_probe, probe_matches
from mlx_kvserve.cache.store import PromptCache

__all__ = [
    "CacheError",
    "CacheLockedError",
    "CacheRestoreError",
    "EntryFormatError",
    "EntryInfo",
    "MISS",
    "MTPRestored",
    "MTPState",
    "Match",
    "PromptCache",
    "default_disk_budget",
    "entry_key",
    "hash_files",
    "layout_versions",
    "make_probe",
    "model_directories",
    "model_fingerprint",
    "probe_matches",
]
