"""Lookup: the best restorable prefix of a prompt.

A delta serves any prefix of its tokens (it is trimmed back to the common prefix with the
prompt); a snapshot serves only when its tokens are an exact prefix of the prompt. At least one
prompt token is always left to prefill, so an exact hit still produces logits.
"""

from __future__ import annotations

from collections.abc import Sequence

from mlx_kvserve.cache.catalog import Catalog
from mlx_kvserve.cache.entry import DELTA, MISS, SNAPSHOT, Entry, Match, as_token_array


def find_match(catalog: Catalog, tokens: Sequence[int], at_most: int | None = None) -> Match:
    """Best restorable prefix of `tokens`; `usable <= len(tokens) - 1` always, and at most
    `at_most` if given."""
    try:
        arr = as_token_array(tokens)
    except ValueError:
        return MISS
    counters = catalog.counters
    n = arr.shape[0]
    counters["lookup_tokens"] += n
    limit = n - 1 if at_most is None else min(n - 1, at_most)
    best: tuple[int, str] | None = None
    if limit >= 1 and catalog.entries:
        walk = catalog.index.walk(arr, limit)
        if walk.trim_key is not None:
            best = (min(walk.trim_lcp, limit), walk.trim_key)
        for length, key in reversed(walk.prefixes):
            if length <= limit and catalog.entries[key].kind == SNAPSHOT:
                if best is None or length > best[0]:
                    best = (length, key)
                break
    if best is None or best[0] <= 0:
        counters["misses"] += 1
        return MISS
    usable, key = best
    entry = catalog.entries[key]
    links = catalog.links(entry, usable)
    if any(link.suspect for link in links) and not reaches_probe(entry, usable):
        # An unverified state is never used unchecked: when the prompt stops before
        # the entry's probe (e.g. the same prompt sent again), fall back to the
        # deepest link of its chain that ends inside the prompt, whose own probe the
        # restore does reach; the positions after it are prefilled instead.
        inside = [link for link in links[:-1] if link.n_tokens <= usable]
        if not inside:
            counters["misses"] += 1
            return MISS
        entry, usable = inside[-1], inside[-1].n_tokens
        key, links = entry.key, links[: len(inside)]
    in_ram = all(link.key in catalog.ram or link.key in catalog.pending for link in links)
    counters["hits"] += 1
    counters["cached_tokens"] += usable
    return Match(
        key=key,
        usable=usable,
        source="ram" if in_ram else "disk",
        kind=entry.kind,
        entry_tokens=entry.n_tokens,
        suspect=any(link.suspect for link in links),
        probe=entry.probe,
    )


def reaches_probe(entry: Entry, usable: int) -> bool:
    """Does restoring `usable` tokens of `entry` reach its probe (or is there none to reach)?

    Only a delta can be cut back to re-prefill its probe position; for a snapshot or an entry
    without a probe, the payload checksum verified on load is the check.
    """
    if entry.probe is None or entry.kind != DELTA:
        return True
    position = int(entry.probe.get("position", -1))
    return position <= 0 or position < usable
