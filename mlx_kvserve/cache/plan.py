"""What an entry stores per layer, as written in its header. No MLX here (writer-thread safe).

Every entry is one link of a chain: it names its parent (the longest stored prefix it was cut
against, or none) and stores, per layer, only what the parent's chain does not already hold:

* **span** (KV indexed by position: `KVCache`, MLA's latent KV, `QuantizedKVCache`, a
  `RotatingKVCache` window, `ChunkedKVCache`): positions [max(parent_len, lo), n) of the
  layer, where `lo` is the first position the layer still needs at `n` (0 for KV that keeps
  every position; n - window for a full window; a chunked layer's `start_position`). A restore
  joins the links' spans into positions [lo, n): a growing conversation writes each position of
  each layer once, O(N) bytes.
* **whole** (a fixed-size state: `ArraysCache` of SSM / linear-attention layers, a window that
  keeps sink tokens, classes this project does not know): the layer's current state, a fixed
  size per checkpoint, read only from the entry being restored.
* **list** (`CacheList`): its parts, each described as above.

A layer doc in `header["meta"]["layers"]` is one of::

    {"class": "KVCache", "mode": "span", "lo": 0, "arrays": ["p.3.0", "p.3.1"], "params": {}}
    {"class": "ArraysCache", "mode": "whole", "state": <tree; arrays as {"a": "s.3.0"}>}
    {"class": "CacheList", "mode": "list", "parts": [<doc>, ...]}

An entry whose layers are all spans from position 0 serves any prefix of its tokens (kind
`delta`, trimmable); any other serves exactly its tokens (kind `snapshot`). A child chains to a
parent only if both describe the same layers the same way (`signature`) and no span layer of the
parent starts later than the child's (`parent_fits`), so the chain holds every position a
restore needs.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping

from mlx_kvserve.json_value import JSON

SPAN, WHOLE, LIST = "span", "whole", "list"

Layout = dict[str, tuple[str, tuple[int, ...]]]  # array name -> (dtype name, shape)
# Arrays of an entry's optional MTP part (cache/mtp_part.py): beside the layers, never named by
# them, and checked where they are restored (a part that does not fit is dropped, not the entry)
MTP_PREFIX = "mtp."


class PlanError(ValueError):
    """A header's per-layer description is malformed or does not match its arrays."""


def leaves(docs: list[dict[str, JSON]], path: str = "") -> Iterator[tuple[str, dict[str, JSON]]]:
    """(path, doc) of every span or whole layer, CacheList parts flattened ("3", "3.1")."""
    for i, doc in enumerate(docs):
        here = f"{path}.{i}" if path else str(i)
        if doc.get("mode") == LIST:
            yield from leaves(doc.get("parts") or [], here)
        else:
            yield here, doc


def span_start(doc: Mapping[str, JSON], parent_len: int) -> int:
    """First position a span layer's arrays hold in an entry with this parent length."""
    return max(int(parent_len), int(doc["lo"]))


def trimmable(docs: list[dict[str, JSON]]) -> bool:
    """Every layer a span from position 0: any prefix of the entry can be restored."""
    return bool(docs) and all(d.get("mode") == SPAN and d.get("lo") == 0 for _, d in leaves(docs))


def tree_refs(tree: JSON) -> Iterator[str]:
    """Array names a whole layer's state tree refers to."""
    if isinstance(tree, dict):
        if "a" in tree:
            yield tree["a"]
        for key in ("t", "l"):
            for item in tree.get(key, ()):
                yield from tree_refs(item)


def signature(docs: list[dict[str, JSON]], layout: Layout) -> str:
    """What two links of one chain must share: the layers' classes, modes and parameters, and
    the span arrays' names, dtypes and geometry (all axes but the positions)."""
    out = []
    for path, doc in leaves(docs):
        item: list[JSON] = [path, doc.get("class"), doc.get("mode")]
        if doc.get("mode") == SPAN:
            item.append(doc.get("params") or {})
            for name in doc.get("arrays") or []:
                dtype, shape = layout.get(name, ("?", ()))
                item.append([name, dtype, [*shape[:2], *shape[3:]]])
        out.append(item)
    return json.dumps(out, sort_keys=True, separators=(",", ":"))


def span_starts(docs: list[dict[str, JSON]]) -> dict[str, int]:
    """path -> lo of every span layer."""
    return {path: int(doc["lo"]) for path, doc in leaves(docs) if doc.get("mode") == SPAN}


def parent_fits(parent_docs: list[dict[str, JSON]], child_los: Mapping[str, int]) -> bool:
    """No span layer of the parent starts after the child's: the child's restore finds every
    position below the parent's length in the parent's chain."""
    parent_los = span_starts(parent_docs)
    return all(parent_los.get(path, 1 << 62) <= lo for path, lo in child_los.items())


def check_meta(meta: JSON, layout: Layout, n_tokens: int, parent_len: int) -> None:
    """Raise PlanError unless the layer docs are well formed and the arrays are exactly the
    ones they name, each span holding positions [max(parent_len, lo), n_tokens)."""
    if not isinstance(meta, dict) or not isinstance(meta.get("layers"), list):
        raise PlanError("header meta lacks per-layer docs")
    named: set[str] = set()
    for path, doc in _checked_leaves(meta["layers"]):
        if doc["mode"] == SPAN:
            lo, arrays = doc.get("lo"), doc.get("arrays")
            if not isinstance(lo, int) or not 0 <= lo < n_tokens or not isinstance(arrays, list):
                raise PlanError(f"layer {path}: bad span lo/arrays")
            if not isinstance(doc.get("params", {}), dict):
                raise PlanError(f"layer {path}: bad params")
            if arrays != [f"p.{path}.{j}" for j in range(len(arrays))]:
                raise PlanError(f"layer {path}: arrays {arrays!r} are not its own, in order")
            held = n_tokens - span_start(doc, parent_len)
            for name in arrays:
                if name not in layout:
                    raise PlanError(f"layer {path}: array {name!r} is not stored")
                shape = layout[name][1]
                if len(shape) != 4 or shape[2] != held:
                    raise PlanError(f"{name}: shape {list(shape)} does not hold {held} positions")
                named.add(name)
        else:
            for name in tree_refs(doc.get("state")):
                if (
                    not isinstance(name, str)
                    or name not in layout
                    or not name.startswith(f"s.{path}.")
                ):
                    raise PlanError(f"layer {path}: bad array reference {name!r}")
                named.add(name)
    if named != {name for name in layout if not name.startswith(MTP_PREFIX)}:
        raise PlanError("stored arrays differ from the ones the layers name")


def _checked_leaves(docs: JSON, path: str = "") -> Iterator[tuple[str, dict[str, JSON]]]:
    if not isinstance(docs, list) or not docs:
        raise PlanError(f"layer {path or 'list'}: no layers")
    for i, doc in enumerate(docs):
        here = f"{path}.{i}" if path else str(i)
        if not isinstance(doc, dict) or not isinstance(doc.get("class"), str):
            raise PlanError(f"layer {here}: malformed")
        mode = doc.get("mode")
        if mode == LIST:
            yield from _checked_leaves(doc.get("parts"), here)
        elif mode in (SPAN, WHOLE):
            yield here, doc
        else:
            raise PlanError(f"layer {here}: unknown mode {mode!r}")
