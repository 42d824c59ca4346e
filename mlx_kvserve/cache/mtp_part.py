"""An entry's optional MTP part: the state of a checkpoint's own MTP layers beside the target's.

A row's MTP source (engine/speculation/mtp.py) holds, per MTP layer, the KV of the pairs
(h_p, t_{p+1}) it was fed and the target's pending hidden state h_{n-1}, which pairs with
whatever token comes next. A prefix the prompt cache serves would start its MTP attention from
nothing without them, so an entry stores them too: not as more layers (the signature, which
decides which entries chain and fit this model, stays the target's, and entries written without
them keep loading), but as arrays `mtp.{i}.keys`, `mtp.{i}.values` (B, heads, positions, D) and
`mtp.hidden` (H,), named in `meta["mtp"]` and covered by the payload checksum like the rest.

Like the target's KV, a link stores only what its parent's chain lacks: the parent's pending
pair (at parent_len - 1) completes in the child, so a link holds pairs [fed_from, n - 1), with
fed_from = parent_len - 1 where the row's source held those pairs (later where it did not: a
prefix restored without them, an image chunk). A restore joins the longest run of links, ending
at the newest, that all carry their part and follow each other; restored to a prefix shorter
than the newest link, the pair at usable - 1 and its hidden state are not stored (a lost guess,
never a wrong token: the target verifies every draft). An MTP part that does not fit (a
malformed doc, arrays of another shape, a run that does not join) is dropped and the entry kept:
the target's state is still right, and so is a part that fails to be written (the entry is
stored without it). MLX only at the hand-overs: `stored_part` copies to host memory,
`restored_state` builds the arrays (engine thread).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from mlx_kvserve.cache.codec import HostArray
from mlx_kvserve.cache.entry import Entry
from mlx_kvserve.cache.exceptions import out_of_memory
from mlx_kvserve.cache.plan import MTP_PREFIX
from mlx_kvserve.cache.state import to_host, to_mx
from mlx_kvserve.json_value import JSON

HIDDEN = "mtp.hidden"

log = logging.getLogger("mlx_kvserve.cache")


@dataclass
class MTPState:
    """A row's MTP layers over a token prefix: per layer the keys and values (B, heads, P, D)
    of pairs [fed_from, fed_from + P), and the hidden state h_{n-1} (H,) that pairs with the
    prompt's next token (None: not known, its pair is lost)."""

    fed_from: int
    keys: list[mx.array]
    values: list[mx.array]
    hidden: mx.array | None

    @property
    def n_tokens(self) -> int:
        """The prefix it covers: its pairs end at n - 2, its hidden state is h_{n-1}."""
        return self.fed_from + int(self.keys[0].shape[2]) + 1


@dataclass
class MTPRestored:
    """Where a restore puts the MTP state the entry's chain carried (None: none, or dropped)."""

    state: MTPState | None = None


def is_mtp(name: str) -> bool:
    return name.startswith(MTP_PREFIX)


def names(layers: int) -> list[str]:
    """The arrays of an MTP part of `layers` layers, in file order."""
    return [f"mtp.{i}.{kind}" for i in range(layers) for kind in ("keys", "values")] + [HIDDEN]


def stored_part(
    state: MTPState | None, parent_len: int, n: int
) -> tuple[list[HostArray], dict[str, JSON]] | None:
    """The host arrays and doc a link of `n` tokens over a parent of `parent_len` stores:
    pairs [max(parent_len - 1, fed_from), n - 1) and h_{n-1}; None when `state` is not exactly
    that prefix's, would add no pair, or fails to be copied (logged: the layers are stored)."""
    if state is None or state.hidden is None or not state.keys or state.n_tokens != n:
        return None
    try:
        return _part(state, parent_len, n)
    except Exception as exc:
        if out_of_memory(exc):
            raise
        log.warning("prompt-cache checkpoint of %d tokens stored without its MTP state: %r", n, exc)
        return None


def _part(
    state: MTPState, parent_len: int, n: int
) -> tuple[list[HostArray], dict[str, JSON]] | None:
    lo = max(parent_len - 1, state.fed_from)
    if lo >= n - 1:
        return None
    cut = slice(lo - state.fed_from, n - 1 - state.fed_from)
    arrays: list[HostArray] = []
    for i, (k, v) in enumerate(zip(state.keys, state.values, strict=True)):
        arrays.append(to_host(f"mtp.{i}.keys", k[:, :, cut]))
        arrays.append(to_host(f"mtp.{i}.values", v[:, :, cut]))
    arrays.append(to_host(HIDDEN, state.hidden))
    doc: dict[str, JSON] = {
        "layers": len(state.keys),
        "fed_from": lo,
        "hidden_size": int(state.hidden.shape[0]),
    }
    return arrays, doc


def run(links: Sequence[Entry], usable: int, read: set[str]) -> list[Entry]:
    """The links, root first, whose MTP parts a restore of `usable` tokens joins: the longest
    run ending at the newest link that all carry one and follow each other, among those the
    restore reads (`read`: keys) and that hold a pair below usable - 1."""
    out: list[Entry] = []
    follows = -1  # the first pair of the link after, which must be this link's pending one
    for link in reversed(links):
        doc = _doc(link)
        if doc is None or link.key not in read or follows not in (-1, link.n_tokens - 1):
            break
        if doc["fed_from"] < usable - 1:
            out.append(link)
        follows = doc["fed_from"]
    return out[::-1]


def restored_state(
    links: Sequence[Entry], usable: int, arrays: Mapping[str, Mapping[str, HostArray]]
) -> MTPState | None:
    """The MTP state of the first `usable` tokens from the run `links` (see `run`) and their
    MTP arrays by link key; None if the run is empty or does not fit together (logged)."""
    if not links:
        return None
    try:
        return _joined(links, usable, arrays)
    except Exception as exc:  # the MTP part's problem only: the target's state is restored
        if out_of_memory(exc):
            raise
        log.info("prompt-cache MTP state of %s dropped: %s", links[-1].key[:16], exc)
        return None


def _joined(
    links: Sequence[Entry], usable: int, arrays: Mapping[str, Mapping[str, HostArray]]
) -> MTPState:
    first = _doc(links[0])
    assert first is not None
    layers, size = first["layers"], first["hidden_size"]
    keys: list[list[np.ndarray]] = [[] for _ in range(layers)]
    values: list[list[np.ndarray]] = [[] for _ in range(layers)]
    geometry: dict[str, tuple[str, tuple[int, ...]]] = {}
    for link in links:
        doc = _doc(link)
        assert doc is not None
        if (doc["layers"], doc["hidden_size"]) != (layers, size):
            raise ValueError("links' MTP layers differ")
        mine = arrays[link.key]
        if sorted(mine) != sorted(names(layers)):
            raise ValueError("arrays differ from the ones its doc names")
        held = link.n_tokens - 1 - doc["fed_from"]
        take = min(link.n_tokens, usable) - 1 - doc["fed_from"]
        for i in range(layers):
            for kind, out in (("keys", keys), ("values", values)):
                a = mine[f"mtp.{i}.{kind}"]
                shape = tuple(a.shape)
                if len(shape) != 4 or shape[2] != held:
                    raise ValueError(f"mtp.{i}.{kind}: shape {list(shape)}, holds {held}")
                form = (a.dtype, (*shape[:2], *shape[3:]))
                if geometry.setdefault(f"{i}.{kind}", form) != form:
                    raise ValueError(f"mtp.{i}.{kind}: {form} differs from the run's")
                out[i].append(np.asarray(a.data).reshape(shape)[:, :, :take])
    leaf = arrays[links[-1].key][HIDDEN]
    if tuple(leaf.shape) != (size,):
        raise ValueError(f"mtp.hidden: shape {list(leaf.shape)}, hidden size {size}")
    hidden = to_mx(leaf) if links[-1].n_tokens == usable else None

    def joined(parts: list[np.ndarray], i: int, kind: str) -> mx.array:
        dtype = geometry[f"{i}.{kind}"][0]
        data = np.concatenate(parts, axis=2)
        return to_mx(HostArray(f"mtp.{i}.{kind}", dtype, tuple(data.shape), data))

    state = MTPState(
        first["fed_from"],
        [joined(keys[i], i, "keys") for i in range(layers)],
        [joined(values[i], i, "values") for i in range(layers)],
        hidden,
    )
    mx.eval(state.keys, state.values, *([hidden] if hidden is not None else []))
    return state


def _doc(link: Entry) -> dict[str, int] | None:
    """A link's well-formed MTP doc, or None."""
    doc = link.meta.get("mtp")
    if not isinstance(doc, dict):
        return None
    fields = ("layers", "fed_from", "hidden_size")
    if not all(isinstance(doc.get(f), int) and doc[f] >= 0 for f in fields):
        return None
    if doc["layers"] == 0 or not 0 <= doc["fed_from"] < link.n_tokens - 1:
        return None
    return {f: int(doc[f]) for f in fields}
