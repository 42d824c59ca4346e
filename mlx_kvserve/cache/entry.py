"""Entry metadata, content-addressed keys, and the eviction score.

A key is sha256 over a domain tag, the model fingerprint and the token ids as little-endian
uint32. A file named K can therefore only ever hold the token stream that hashes to K: an index
entry cannot silently point at storage reused for another prompt.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

import numpy as np

from mlx_kvserve.json_value import JSON

_KEY_TAG = b"mlx-kvserve/entry/v1\0"
KEY_RE = re.compile(r"^[0-9a-f]{64}$")
FINGERPRINT_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")

# Entry kinds (see `plan`): both are links of a chain that store only what their parent's chain
# lacks; a delta (every layer positions from 0) serves any prefix of its tokens, a snapshot
# (a recurrent state, a full window) only exactly its tokens.
DELTA = "delta"
SNAPSHOT = "snapshot"
Kind = Literal["delta", "snapshot"]

# Disk states of an entry's payload.
DISK_NONE = "none"  # RAM only (no directory, or the write failed)
DISK_PENDING = "pending"  # queued for the writer thread
DISK_WRITTEN = "written"  # durable file

# Eviction score half-life. Agent sessions pause for minutes to hours and are resumed within a
# working day; 6 h keeps yesterday's hot conversation above a fresh one-off prompt for a few hours
# but lets it fade overnight.
SCORE_HALF_LIFE_S = 6 * 3600.0

_MAX_TOKEN = 2**32 - 1

# Checkpoint reasons whose end a later request departs from exactly: an edited or retried
# message ("message"), a retried request or a next turn that re-renders the answer differently
# ("prompt"). A snapshot there is never pruned by a longer one (see `policy`).
DEPARTURE_REASONS = frozenset({"message", "prompt"})

# Array name -> (dtype name, shape); a delta's shapes have 0 on the sequence axis.
Layout = dict[str, tuple[str, tuple[int, ...]]]


def as_token_array(tokens: Sequence[int] | np.ndarray) -> np.ndarray:
    """Token ids as a uint32 array; raises ValueError for ids outside [0, 2**32)."""
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        arr = arr.reshape(-1)
    if arr.size == 0:
        return np.zeros(0, dtype=np.uint32)
    if arr.dtype.kind not in "iu":
        if arr.dtype.kind == "f" and np.all(np.floor(arr) == arr):
            arr = arr.astype(np.int64)
        else:
            raise ValueError(f"token ids must be integers, got dtype {arr.dtype}")
    if int(arr.min()) < 0 or int(arr.max()) > _MAX_TOKEN:
        raise ValueError("token id out of range for uint32")
    return np.ascontiguousarray(arr, dtype="<u4")


def tokens_bytes(tokens: np.ndarray) -> bytes:
    return np.ascontiguousarray(tokens, dtype="<u4").tobytes()


def entry_key(fingerprint: str, tokens: Sequence[int] | np.ndarray) -> str:
    """Content address of `tokens` under `fingerprint` (64 hex chars)."""
    h = hashlib.sha256(_KEY_TAG)
    h.update(fingerprint.encode())
    h.update(b"\0")
    h.update(tokens_bytes(as_token_array(tokens)))
    return h.hexdigest()


def check_fingerprint(fingerprint: str) -> str:
    """Fingerprints name a directory: keep them to a safe, portable alphabet."""
    if not isinstance(fingerprint, str) or not FINGERPRINT_RE.match(fingerprint):
        raise ValueError(f"invalid fingerprint {fingerprint!r}: use [A-Za-z0-9._-], <= 128 chars")
    return fingerprint


def score(hits: int, last_used: float, n_tokens: int, nbytes: int, now: float) -> float:
    """Eviction score: (1 + hits) * 2**(-age / half-life) * tokens / bytes. Lowest goes first.

    `tokens` counts the positions the entry itself stores (a delta's own span), `bytes` its own
    payload, so the score is "expected reuse per byte freed".
    """
    age = max(0.0, now - last_used)
    decay = math.pow(2.0, -age / SCORE_HALF_LIFE_S)
    return (1.0 + hits) * decay * max(1, n_tokens) / max(1, nbytes)


@dataclass
class Entry:
    """In-memory record of one checkpoint; the durable truth is the file header."""

    key: str
    tokens: np.ndarray  # uint32, the full token stream this entry's state covers
    kind: str
    parent: str | None
    parent_len: int
    reason: str
    anchor: bool
    created: float
    run_id: str
    layout: Layout
    meta: dict[str, JSON]  # per-layer docs (see `plan`) and the KV dtype
    payload_bytes: int
    probe: dict[str, JSON] | None = None
    digest: str | None = None  # payload sha256 once known (scanned, or written)
    file_bytes: int = 0
    disk: str = DISK_NONE
    hits: int = 0
    last_used: float = 0.0
    suspect: bool = False
    departure: bool = False  # a later request is expected to depart at its end (see policy)
    children: set[str] = field(default_factory=set)
    signature: str = ""  # what a chain's links share (`plan.signature`), set by the catalog

    @property
    def n_tokens(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def own_tokens(self) -> int:
        """Positions whose state this entry itself stores."""
        return self.n_tokens - self.parent_len

    @property
    def trimmable(self) -> bool:
        return self.kind == DELTA

    def score(self, now: float) -> float:
        return score(self.hits, self.last_used, self.own_tokens, self.payload_bytes, now)


@dataclass(frozen=True)
class Match:
    """Result of a lookup: restore `usable` tokens from entry `key`, prefill the rest.

    `usable <= len(prompt) - 1` always. `suspect` entries were written by a run that ended
    uncleanly: verify behaviour after restoring (see `probe` / `probe_matches`) and call
    `PromptCache.mark_verified(key)`, or evict on mismatch. `probe`, when present, describes the
    model output at absolute position `probe["position"]` (the entry's last token).
    """

    key: str | None
    usable: int
    source: Literal["ram", "disk"] | None
    kind: str | None = None
    entry_tokens: int = 0
    suspect: bool = False
    probe: dict[str, JSON] | None = None

    @property
    def hit(self) -> bool:
        return self.key is not None and self.usable > 0

    def for_probe(self) -> Match:
        """This match, trimmed so the probe's position is prefilled again (deltas only).

        After restoring it, the first prefilled position is `probe["position"]`: compare its
        logits with `probe_matches(self.probe, row)`. Costs one extra prefilled token.
        """
        if self.probe is None or self.kind != DELTA:
            return self
        pos = int(self.probe.get("position", -1))
        if not 0 < pos < self.usable:
            return self
        return replace(self, usable=pos)


MISS = Match(None, 0, None)


@dataclass(frozen=True)
class EntryInfo:
    """Public, read-only view of an entry (for `cache ls`, /v1/cache, tests)."""

    key: str
    n_tokens: int
    kind: str
    parent: str | None
    parent_len: int
    reason: str
    anchor: bool
    created: float
    last_used: float
    hits: int
    payload_bytes: int
    file_bytes: int
    disk: str
    in_ram: bool
    suspect: bool
    children: int
    score: float

    def as_dict(self) -> dict[str, JSON]:
        return dict(self.__dict__)
