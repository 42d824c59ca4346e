"""Restore: fill a model's empty caches from a matched entry, checking everything it reads.

Every problem, whatever its symptom (a missing payload, a changed file, a shape, dtype or class
that does not fit, NaN or Inf, or an error nobody expected from the disk tier), is raised as
`CacheRestoreError` naming the entry to blame: the link whose data failed a check, else the
newest link of the chain. The engine then evicts it and goes on from what is left (its parent),
so a bad state cannot be served twice. Only running out of memory passes through as it is:
it is nobody's state (`exceptions.out_of_memory`). The caches may be half filled by then: the
caller discards them.
"""

from __future__ import annotations

import array
import time
from collections.abc import Sequence
from typing import NoReturn

import mlx.core as mx
import numpy as np

from mlx_kvserve.cache import codec, state
from mlx_kvserve.cache.catalog import Catalog
from mlx_kvserve.cache.chain import ChainBuilder
from mlx_kvserve.cache.codec import HostArray
from mlx_kvserve.cache.disk import fault_point
from mlx_kvserve.cache.entry import DISK_WRITTEN, SNAPSHOT, Entry, Match, as_token_array
from mlx_kvserve.cache.exceptions import CacheRestoreError, EntryFormatError, out_of_memory
from mlx_kvserve.cache.kinds import LayerCache
from mlx_kvserve.cache.mtp_part import MTPRestored, restored_state, run
from mlx_kvserve.cache.persistence import request_readback
from mlx_kvserve.json_value import JSON

# Links up to this size are read whole with one call and then copied into place: for a long
# chain of short links the per-piece reads and checks of `ChainBuilder.read_targets` cost
# more than a second copy of bytes that are still in the CPU cache.
SMALL_LINK_BYTES = 256 * 1024


def restore_match(
    catalog: Catalog,
    match: Match,
    fresh_caches: list[LayerCache],
    *,
    tokens: Sequence[int] | None,
    dtype: mx.Dtype | str | None,
    mtp: MTPRestored | None = None,
) -> list[LayerCache]:
    """Fill `fresh_caches` with `match.usable` tokens of state (see `PromptCache.restore`)."""
    if not match.hit:
        return fresh_caches
    key = match.key
    assert key is not None
    entry = catalog.entries.get(key)
    if entry is None:
        raise CacheRestoreError(key, "entry no longer exists")
    usable = match.usable
    if not 0 < usable <= entry.n_tokens or (entry.kind == SNAPSHOT and usable != entry.n_tokens):
        raise CacheRestoreError(key, f"cannot restore {usable} of {entry.n_tokens} tokens")
    if tokens is not None:
        _check_prompt(entry, tokens, usable)
    dtype_str = None
    if dtype is not None:
        dtype_str = dtype if isinstance(dtype, str) else state.dtype_name(dtype)
    links = catalog.links(entry, usable)
    # Pinned links are neither pruned nor evicted while they are being read.
    for link in links:
        catalog.pin(link.key)
    started = time.perf_counter()
    try:
        stored = entry.meta.get("kv_dtype")
        if dtype_str is not None and stored is not None and stored != dtype_str:
            problem = f"stored KV is {stored}, the model uses {dtype_str}"
            _fail(catalog, key, state.StateError(problem), key)
        from_disk = _restore_chain(catalog, links, fresh_caches, usable, dtype_str, key, mtp)
    except CacheRestoreError:
        raise
    except Exception as exc:
        # Unexpected (a call the platform lacks, a bug in a tier): blamed on the newest link,
        # as a failure after a restore is (engine/blame.py), never on the request.
        _fail(catalog, links[-1].key, exc, key)
    finally:
        for link in links:
            catalog.unpin(link.key)
    now = catalog.clock()
    for link in links:
        link.hits += 1
        link.last_used = now
        catalog.persist_slot(link)
    catalog.counters["restores"] += 1
    catalog.log.debug(
        "restored %d tokens from %d link(s), %d read from disk, in %.3f s",
        usable,
        len(links),
        len(from_disk),
        time.perf_counter() - started,
    )
    request_readback(catalog, from_disk)
    return fresh_caches


def _check_prompt(entry: Entry, tokens: Sequence[int], usable: int) -> None:
    """The prompt begins with the entry's first `usable` tokens and has one more to prefill."""
    if len(tokens) < usable + 1:
        raise ValueError("at least one prompt token must be left to prefill")
    if isinstance(tokens, list):  # the engine's case: one C loop, no NumPy conversion
        try:
            if array.array("I", tokens[:usable]).tobytes() == entry.tokens[:usable].tobytes():
                return  # ids equal to stored ones are valid
        except (OverflowError, TypeError):
            pass  # not uint32 ids: as_token_array says why
    try:
        arr = as_token_array(tokens)
    except ValueError as exc:
        raise ValueError(f"bad prompt tokens: {exc}") from None
    if not np.array_equal(arr[:usable], entry.tokens[:usable]):
        raise CacheRestoreError(entry.key, "entry tokens do not match the prompt")


def _restore_chain(
    catalog: Catalog,
    links: list[Entry],
    caches: list[LayerCache],
    usable: int,
    dtype: str | None,
    match_key: str,
    mtp: MTPRestored | None = None,
) -> list[Entry]:
    """Links root..leaf into `caches`; returns the links that were read from disk.

    RAM copies are copied into place; disk links are read straight into the caches'
    buffers (see `chain.ChainBuilder`) and verified there, then promoted to RAM by the
    writer thread, off the hot path. `mtp` receives the MTP state of the run of links that
    carry it, read with them (cache/mtp_part.py); a part that does not fit is dropped there.
    """
    leaf = links[-1]
    try:
        if catalog.live_signature is not None and catalog.live_signature != leaf.signature:
            raise state.StateError("layers, dtype or geometry differ from this model's live KV")
        builder = ChainBuilder(caches, links, usable, dtype)
    except Exception as exc:
        # The leaf's layout is every link's (a parent stores its layers the same way): the
        # whole chain does not fit, so its root is the link to blame.
        _fail(catalog, links[0].key, exc, match_key)
    mtp_run = run(links, usable, {link.key for link in builder.links}) if mtp is not None else []
    builder.mtp = {link.key: {} for link in mtp_run}
    from_disk = []
    fault_point("restore")  # test seam (engine.faults): an error nobody expected, or memory
    if catalog.disk is not None:
        small = [
            link.key
            for link in builder.links
            if link.disk == DISK_WRITTEN
            and link.payload_bytes <= SMALL_LINK_BYTES
            and catalog.payload_in_ram(link) is None
        ]
        if len(small) > 1:
            catalog.disk.prefetch(small)
    for link in builder.links:
        arrays = catalog.payload_in_ram(link)
        try:
            if arrays is not None:
                builder.put(link, arrays)  # checks names, spans, dtypes, geometry
                continue
            if catalog.disk is None or link.disk != DISK_WRITTEN:
                raise EntryFormatError("payload is neither in RAM nor on disk")
            if link.payload_bytes <= SMALL_LINK_BYTES:
                header, arrays = catalog.disk.read_entry(link.key, vetted=True, finite=True)
                check_header(link, header)
                builder.put(link, arrays)
            else:
                header = catalog.disk.read_entry_into(link.key, builder.read_targets(link))
                check_header(link, header)
        except Exception as exc:  # a bad stored entry, whatever the symptom
            _fail(catalog, link.key, exc, match_key)
        from_disk.append(link)
        catalog.counters["bytes_read"] += link.file_bytes
    try:
        builder.finish()
    except Exception as exc:
        # Not attributable to one link: the newest is blamed first (DESIGN invariant 5).
        _fail(catalog, links[-1].key, exc, match_key)
    catalog.counters["restores_from_disk"] += len(from_disk)
    if mtp is not None:
        mtp.state = restored_state(mtp_run, usable, builder.mtp)
    return from_disk


def _fail(catalog: Catalog, key: str, exc: Exception, match_key: str) -> NoReturn:
    """Raise what `exc` means for a restore: a `CacheRestoreError` blaming `key`, or `exc`
    itself when memory ran out (nobody's state: nothing is to be evicted for it)."""
    if out_of_memory(exc):
        raise exc
    catalog.counters["restore_errors"] += 1
    problem = str(exc) if isinstance(exc, (EntryFormatError, state.StateError)) else repr(exc)
    raise CacheRestoreError(key, problem, match_key=match_key) from None


def check_loaded(entry: Entry, header: dict[str, JSON], arrays: Sequence[HostArray]) -> None:
    """A file read from disk must still be the indexed entry, with finite values."""
    check_header(entry, header)
    for a in arrays:
        if not codec.host_finite(a):
            raise EntryFormatError(f"{a.name} contains NaN or Inf")


def check_header(entry: Entry, header: dict[str, JSON]) -> None:
    """A file read from disk must still be the entry the index knows."""
    if entry.digest and header.get("payload_sha256") != entry.digest:
        raise EntryFormatError("file content changed since it was indexed")
    if (
        header.get("kind") != entry.kind
        or header.get("parent") != entry.parent
        or header.get("parent_len") != entry.parent_len
    ):
        raise EntryFormatError("header no longer matches the indexed entry")
