"""Checkpoint admission: decide whether live caches become an entry, and store it.

Every entry names its parent, the longest stored entry whose tokens are a prefix of its own and
whose layers are stored the same way, and stores per layer only what that chain lacks (see
`plan`): the new positions of KV layers and windows, the current state of recurrent layers. A
growing conversation therefore writes each position once (O(N) bytes, not O(N^2)) plus a fixed
size per checkpoint for recurrent states, and a shared system prompt is stored once and reused
by every conversation that branches from it. Entries whose layers all hold positions from 0 are
deltas (they serve any prefix); the others are snapshots (they serve exactly their tokens).
A model drafting with its own MTP heads adds the MTP layers' pairs the chain lacks beside the
layers (cache/mtp_part.py), counted in the same payload.

With a disk, a parent must itself be on disk (written or queued), so every file on disk has its
whole chain on disk. Positions below `parent_len` come from the parent chain, not from the live
cache: identical when the live cache was restored from that chain (the normal case); after a
cold prefill they may differ in the last float bits, as any prefix cache does.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import mlx.core as mx
import numpy as np

from mlx_kvserve.cache import codec, kinds, layers, plan, state
from mlx_kvserve.cache.catalog import Catalog
from mlx_kvserve.cache.codec import Slot
from mlx_kvserve.cache.entry import (
    DELTA,
    DEPARTURE_REASONS,
    DISK_NONE,
    SNAPSHOT,
    Entry,
    as_token_array,
    entry_key,
)
from mlx_kvserve.cache.fingerprint import layout_versions
from mlx_kvserve.cache.kinds import LayerCache
from mlx_kvserve.cache.mtp_part import MTPState, stored_part
from mlx_kvserve.cache.persistence import queue_write
from mlx_kvserve.cache.policy import Policy
from mlx_kvserve.json_value import JSON

_DIGEST_PLACEHOLDER = "0" * 64  # the writer thread fills in the payload's sha256

# A "message" point of caches that cannot be cut back is folded into a stored entry ending at
# most this many tokens before it, instead of storing another whole state: the next turn's
# "message" point usually lies a few tokens (the template's end of the answer) after the
# previous answer's checkpoint. A request departing there (an edited or retried message)
# restores that entry and prefills these few tokens again. A "prompt" point is never folded:
# the next turn departs there whenever its template re-renders the answer differently.
FOLD_TOKENS = 16
DTYPE_SIZES = {name: dt.itemsize for name, dt in codec.DTYPES.items()}


def admit_checkpoint(
    catalog: Catalog,
    policy: Policy,
    tokens: Sequence[int],
    caches: list[LayerCache],
    reason: str,
    *,
    anchor: bool,
    probe: mx.array | None,
    run_id: str,
    mtp: MTPState | None = None,
) -> str | None:
    """Store the live caches' state for `tokens` (see `PromptCache.checkpoint`)."""
    counters = catalog.counters
    try:
        arr = as_token_array(tokens)
    except ValueError as exc:
        catalog.log.warning("prompt-cache checkpoint refused: %s", exc)
        return None
    n = arr.shape[0]
    if n == 0 or not caches:
        return None
    offsets = state.cache_offsets(caches)
    # Sliceable caches can be checkpointed at any prefix of what they hold (a delta is
    # cut from them); other states only as the whole.
    prefix_ok = state.is_sliceable(caches)
    if any(off != n and not (prefix_ok and off > n) for off in offsets):
        counters["refused"] += 1
        catalog.log.warning(
            "prompt-cache checkpoint refused: caches hold %s tokens, key has %d",
            sorted(set(offsets)),
            n,
        )
        return None
    key = entry_key(catalog.fingerprint, arr)
    departure = reason in DEPARTURE_REASONS
    existing = catalog.entries.get(key)
    if existing is None and reason == "message" and not prefix_ok:
        existing = _fold_target(catalog, arr)
    if existing is not None:
        counters["duplicates" if existing.key == key else "folded"] += 1
        existing.last_used = catalog.clock()
        existing.anchor |= anchor and existing.key == key
        existing.departure |= departure
        catalog.persist_slot(existing)
        return None
    if not anchor and state.is_sliceable(caches) and policy.is_dominated(arr):
        # A longer trimmable entry already serves these tokens: storing them again
        # would be a nested copy (invariant 4).
        counters["dominated"] += 1
        return None
    try:
        return _store(catalog, policy, arr, key, caches, reason, anchor, probe, run_id, mtp)
    except Exception as exc:  # a checkpoint must never fail the request
        counters["refused"] += 1
        catalog.log.warning("prompt-cache checkpoint of %d tokens failed: %r", n, exc)
        if key in catalog.entries:
            catalog.remove_tree(key)
        return None


def _fold_target(catalog: Catalog, arr: np.ndarray) -> Entry | None:
    """The deepest stored entry at most FOLD_TOKENS before the end of `arr`, on its path."""
    n = arr.shape[0]
    found = catalog.index.longest_prefix(arr, lambda key: True)
    if found is None or n - found[0] > FOLD_TOKENS:
        return None
    return catalog.entries[found[1]]


def _store(
    catalog: Catalog,
    policy: Policy,
    arr: np.ndarray,
    key: str,
    caches: list[LayerCache],
    reason: str,
    anchor: bool,
    probe: mx.array | None,
    run_id: str,
    mtp: MTPState | None = None,
) -> str | None:
    """Build the entry (cut against the longest fitting stored prefix), queue its write, then
    prune what it dominates and enforce the budgets, protecting it."""
    n = arr.shape[0]
    docs, live = layers.describe(caches, n)
    signature = plan.signature(docs, live)
    catalog.live_signature = signature
    parent = _parent(catalog, arr, signature, plan.span_starts(docs))
    start = parent.n_tokens if parent else 0
    per_token = sum(
        DTYPE_SIZES[dt] * math.prod([*shape[:2], *shape[3:]]) for dt, shape in live.values()
    )
    if not policy.fits(per_token * (n - start), parent, n):
        return None
    kind = DELTA if plan.trimmable(docs) else SNAPSHOT
    arrays = layers.extract(caches, docs, start, n)
    meta: dict[str, JSON] = {"layers": docs}
    stored = kinds.kv_dtype(caches)  # the rule PromptStates.kv_dtype uses
    if stored is not None:
        meta["kv_dtype"] = state.dtype_name(stored)
    part = stored_part(mtp, start, n)  # the MTP layers' pairs the chain lacks, if known
    if part is not None:
        arrays += part[0]
        meta["mtp"] = part[1]
    payload_bytes = sum(a.nbytes for a in arrays)
    probe_doc = state.make_probe(probe, n - 1) if probe is not None else None
    now = catalog.clock()
    specs, _ = codec.array_specs(arrays)
    header = {
        "format": codec.FORMAT_VERSION,
        "fingerprint": catalog.fingerprint,
        "key": key,
        "tokens": codec.encode_tokens(arr),
        "n_tokens": n,
        "kind": kind,
        "parent": parent.key if parent else None,
        "parent_len": parent.n_tokens if parent else 0,
        "reason": str(reason),
        "anchor": bool(anchor),
        "created": now,
        "run_id": run_id,
        "meta": meta,
        "arrays": specs,
        "payload_bytes": payload_bytes,
        "payload_sha256": _DIGEST_PLACEHOLDER,
        "probe": probe_doc,
        "versions": layout_versions(),
    }
    head_bytes = len(codec.pack_head(header, Slot()))
    file_bytes = head_bytes + payload_bytes
    if not policy.fits(file_bytes if catalog.disk else payload_bytes, parent, n):
        return None
    to_disk = catalog.disk is not None and policy.fits_disk_now(file_bytes, parent)
    if catalog.disk is not None and not to_disk:
        catalog.counters["disk_skipped"] += 1  # the disk is short of space: RAM only, if it fits
        if payload_bytes > catalog.ram.budget:
            return None
    entry = Entry(
        key=key,
        tokens=arr,
        kind=kind,
        parent=parent.key if parent else None,
        parent_len=parent.n_tokens if parent else 0,
        reason=str(reason),
        anchor=bool(anchor),
        created=now,
        run_id=run_id,
        layout={a.name: (a.dtype, a.shape) for a in arrays},
        meta=meta,
        signature=signature,
        payload_bytes=payload_bytes,
        probe=probe_doc,
        last_used=now,
        departure=reason in DEPARTURE_REASONS,
    )
    catalog.add(entry)
    if payload_bytes <= catalog.ram.budget:
        catalog.ram.put(key, arrays)
    if to_disk:
        queue_write(catalog, entry, header, arrays, file_bytes)
    catalog.counters["checkpoints"] += 1
    policy.prune_dominated(entry)
    protect = {key}
    policy.enforce_disk_budget(protect)
    policy.enforce_ram_budget(protect)
    return key if key in catalog.entries else None


def _parent(catalog: Catalog, arr: np.ndarray, signature: str, los: dict[str, int]) -> Entry | None:
    """The longest stored strict prefix a new entry of `arr` can chain to: one holding
    positions the new entry needs, its layers stored the same way, none of its spans starting
    later than the new entry's, and (with a disk) on disk or queued, so every file's chain is
    on disk too. None: the entry stands alone (a recurrent state needs no history)."""

    def accept(k: str) -> bool:
        e = catalog.entries[k]
        return (
            any(lo < e.n_tokens for lo in los.values())  # else nothing is needed from it
            and e.signature == signature
            and (catalog.disk is None or e.disk != DISK_NONE)
            and plan.parent_fits(e.meta.get("layers") or [], los)
        )

    found = catalog.index.longest_prefix(arr, accept, strict=True)
    return catalog.entries[found[1]] if found else None
