"""What each layer's cache holds, asked of the mlx-lm cache objects themselves. ENGINE THREAD.

mlx-lm builds one cache object per layer (`make_prompt_cache`), and the kinds differ in what
they keep as the conversation grows:

* **tokens**: KV that grows by one position per token (`KVCache`, MLA's latent KV, which mlx-lm
  keeps in a `KVCache` too, `QuantizedKVCache`);
* **window**: a bounded window of the last N positions (`RotatingKVCache` of sliding-window
  layers, `ChunkedKVCache` of chunked attention);
* **state**: a fixed-size recurrent state (`ArraysCache` of SSM and linear-attention layers).

`CacheList` (Falcon-H1, DeepSeek-V3.2) groups several of these in one layer; its description
adds theirs up. Everything is read from the objects after a one-token pass: `size()` (positions
held), `is_trimmable()`, `nbytes`, the arrays of `state`, and whether the class can `merge`
into a batch cache (which then has `extract`, `filter` and `extend`: what `BatchGenerator`
decodes rows together with; mlx_lm.server tests `hasattr(c, "merge")`). Two facts no method
states are kept in small per-class tables here: a window's length, and which classes hold
plain position-indexed KV whose live caches can be cut back to any prefix (`is_sliceable`: a
prefill may fold checkpoints into its last pass and cut them out afterwards). What a checkpoint
stores per layer (new positions, or the whole state) is `cache/plan.py`'s and
`cache/layers.py`'s. A class mlx-lm does not define is *unknown*: its layer is stored whole
(its `state`), never batched, and the server says so at start-up.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, TypeAlias

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models import cache as mlx_cache
from mlx_lm.models.cache import KVCache, make_prompt_cache

TOKENS, WINDOW, STATE = "tokens", "window", "state"

# A cache's `state`: arrays, nested in lists, tuples or dicts (a CacheList's, an SSM's).
ArrayTree: TypeAlias = (
    "mx.array | list[ArrayTree] | tuple[ArrayTree, ...] | dict[str, ArrayTree] | None"
)


class LayerCache(Protocol):
    """One layer's cache object as mlx-lm makes it (`make_prompt_cache`: its `_BaseCache`
    subclasses). A class mlx-lm does not define may lack part of this: the functions here ask
    such a one carefully."""

    state: ArrayTree

    def is_trimmable(self) -> bool: ...

    def trim(self, n: int) -> int: ...

    def size(self) -> int: ...

    @property
    def nbytes(self) -> int: ...


# Classes whose `state` is (keys, values, offset) with positions [0, offset) on axis 2: live
# caches of these can be cut to any prefix of what they hold.
_POSITION_SLICEABLE: tuple[type, ...] = (KVCache,)

# A window's length, which no method reports (`size()` is min(offset, length) only once full).
_WINDOW_LENGTH = {
    mlx_cache.RotatingKVCache: lambda c: int(c.max_size),
    mlx_cache.ChunkedKVCache: lambda c: int(c.chunk_size),
}


@dataclass(frozen=True)
class LayerKind:
    """One layer's cache: how it grows, what one more token costs, what it can do."""

    kind: str  # TOKENS, WINDOW or STATE (for a CacheList: the kind of its largest part)
    bytes_per_token: int  # per position held (0 for a state)
    fixed_bytes: int  # a state's size; a window's size once full (0 for growing KV)
    window: int | None  # positions a window keeps
    mergeable: bool  # rows can decode together (type(c).merge)
    sliceable: bool  # plain position-indexed KV: can be cut to any prefix
    known: bool  # one of mlx-lm's classes (cache/layers.py stores the others whole)
    name: str
    restorable: bool = True  # its state can be set back (a checkpoint can be restored)

    def bytes_for(self, tokens: int) -> int:
        """Bytes this layer holds after `tokens` tokens."""
        if self.kind == TOKENS:
            return self.bytes_per_token * tokens + self.fixed_bytes
        return self.fixed_bytes


def describe(cache: LayerCache) -> LayerKind:
    """The description of one layer's cache object, after at least one token went through it."""
    parts = getattr(cache, "caches", None)
    if isinstance(parts, (list, tuple)) and parts:
        return _combine(cache, [describe(c) for c in parts])
    name = type(cache).__name__
    known = _is_mlx_lm_class(cache)
    per_token = _bytes_per_position(cache) if _holds_positions(cache) else 0
    window = _WINDOW_LENGTH[type(cache)](cache) if type(cache) in _WINDOW_LENGTH else None
    if per_token and window is None:
        kind, fixed = TOKENS, 0
    elif per_token:
        kind, fixed = WINDOW, per_token * window
    else:
        kind, fixed = STATE, _nbytes(cache)
    return LayerKind(
        kind=kind,
        bytes_per_token=per_token,
        fixed_bytes=fixed,
        window=window,
        mergeable=_mergeable(cache),
        sliceable=type(cache) in _POSITION_SLICEABLE,
        known=known,
        name=name,
        restorable=known or _state_settable(cache),
    )


def is_sliceable(caches: Sequence[LayerCache]) -> bool:
    """Whether every layer holds plain position-indexed KV (cut to any prefix)."""
    return bool(caches) and all(type(c) in _POSITION_SLICEABLE for c in caches)


def can_cut_back(caches: Sequence[LayerCache], keep: int) -> bool:
    """Whether every layer can be trimmed back to its first `keep` positions and still hold
    exactly their state. `is_trimmable()` says whether a layer can be trimmed at all; a
    `ChunkedKVCache` says True even after it dropped its oldest positions (`start_position`),
    when a cut below them would leave the attention of the next tokens without their keys."""
    for c in leaves(caches):
        if not c.is_trimmable():
            return False
        if type(c) is mlx_cache.ChunkedKVCache and c.start_position > 0:
            return False
    return keep >= 0


def can_merge(caches: Sequence[LayerCache]) -> bool:
    """Whether rows with these per-layer caches can decode together as mlx-lm batches them."""
    return bool(caches) and all(_mergeable(c) for c in caches)


@dataclass(frozen=True)
class KVLayout:
    """The model's layers, described from a one-token pass; see `describe_model`."""

    layers: tuple[LayerKind, ...]
    activation_dtype: mx.Dtype  # of the pass's logits
    kv_dtype: mx.Dtype | None  # of what the caches hold (see `kv_dtype`)

    @property
    def bytes_per_token(self) -> int:
        """What one more token adds, summed over the layers whose KV grows per token."""
        return sum(layer.bytes_per_token for layer in self.layers if layer.kind == TOKENS)

    @property
    def fixed_bytes(self) -> int:
        """What a sequence holds whatever its length: full windows and recurrent states."""
        return sum(layer.fixed_bytes for layer in self.layers)

    def bytes_for(self, tokens: int) -> int:
        return sum(layer.bytes_for(tokens) for layer in self.layers)

    @property
    def mergeable(self) -> bool:
        return bool(self.layers) and all(layer.mergeable for layer in self.layers)

    @property
    def sliceable(self) -> bool:
        return bool(self.layers) and all(layer.sliceable for layer in self.layers)

    @property
    def unknown(self) -> list[str]:
        return sorted({layer.name for layer in self.layers if not layer.known})

    @property
    def unrestorable(self) -> list[str]:
        """Classes whose state cannot be set back: no checkpoint of them could be restored."""
        return sorted({layer.name for layer in self.layers if not layer.restorable})

    def summary(self) -> str:
        """E.g. '2 window of 32 + 1 tokens' for the start-up log."""
        counts: dict[str, int] = {}
        for layer in self.layers:
            label = f"window of {layer.window}" if layer.kind == WINDOW else layer.kind
            if layer.name == "CacheList":
                label = f"list ({label})"
            counts[label] = counts.get(label, 0) + 1
        return " + ".join(f"{n} {label}" for label, n in counts.items())


def describe_model(model: nn.Module) -> KVLayout:
    """Run one token through fresh caches and describe every layer."""
    caches = make_prompt_cache(model)
    logits = model(mx.array([[0]]), cache=caches)
    mx.eval(logits, [c.state for c in caches])
    layers = tuple(describe(c) for c in caches)
    return KVLayout(layers, logits.dtype, kv_dtype(caches))


def kv_dtype(caches: Sequence[LayerCache]) -> mx.Dtype | None:
    """The dtype of the first layer that holds positions (keys), else of the first floating
    array of any state (an SSM model's); None if nothing holds an array yet.

    The same rule serves the model (after a one-token pass) and a checkpoint (its live caches),
    so a stored snapshot's dtype can be compared with the model's.
    """
    for c in leaves(caches):
        if _holds_positions(c):
            arrays = _arrays(c.state)
            if arrays:
                return arrays[0].dtype
    for c in leaves(caches):
        for a in _arrays(c.state):
            if mx.issubdtype(a.dtype, mx.floating):
                return a.dtype
    return None


# ----------------------------------------------------------------------------------------------
def _combine(cache: LayerCache, parts: list[LayerKind]) -> LayerKind:
    main = max(parts, key=lambda p: (p.kind == TOKENS, p.kind == WINDOW, p.fixed_bytes))
    windows = [p.window for p in parts if p.window is not None]
    return LayerKind(
        kind=main.kind,
        bytes_per_token=sum(p.bytes_per_token for p in parts if p.kind == TOKENS),
        fixed_bytes=sum(p.fixed_bytes for p in parts),
        window=max(windows) if windows else None,
        mergeable=_mergeable(cache),
        sliceable=False,  # cache/layers.py stores each part as its own kind
        known=_is_mlx_lm_class(cache) and all(p.known for p in parts),
        name=type(cache).__name__,
        restorable=all(p.restorable for p in parts),
    )


def _mergeable(cache: LayerCache) -> bool:
    """`merge` is what mlx-lm batches with; an unknown class is not trusted with it."""
    if not callable(getattr(cache, "merge", None)):
        return False
    parts = getattr(cache, "caches", None)
    if isinstance(parts, (list, tuple)):
        return all(_mergeable(c) for c in parts)
    return _is_mlx_lm_class(cache)


def _state_settable(cache: LayerCache) -> bool:
    """Whether `cache.state = ...` can work: a read-only `state` property (DeepSeek-V4's
    `LayerCache` in mlx-lm 0.32) cannot take a restored state back."""
    prop = getattr(type(cache), "state", None)
    return not isinstance(prop, property) or prop.fset is not None


def _is_mlx_lm_class(cache: LayerCache) -> bool:
    """mlx-lm's own cache classes (their `state` layouts are what cache/layers.py stores)."""
    cls = type(cache)
    return getattr(mlx_cache, cls.__name__, None) is cls


def _holds_positions(cache: LayerCache) -> bool:
    """Whether the layer keeps entries per position (KV) rather than a state: it reports a
    `size()` or, after a token went through it, can be trimmed back (not every KV class
    implements `size()`; no recurrent state can be trimmed)."""
    try:
        return int(cache.size()) > 0 or bool(cache.is_trimmable())
    except Exception:  # an unknown class without these: count it as a state
        return False


def _bytes_per_position(cache: LayerCache) -> int:
    """Bytes one position takes: each KV array of the state is (batch, heads, positions, dim)
    and may be allocated ahead (KVCache grows in steps of 256)."""
    total = 0
    for a in _arrays(cache.state):
        if a.ndim == 4 and a.shape[2] > 0:
            total += a.nbytes // a.shape[2]
    return total


def _nbytes(cache: LayerCache) -> int:
    try:
        return int(cache.nbytes)
    except Exception:  # mlx-lm's base class raises NotImplementedError
        return sum(a.nbytes for a in _arrays(cache.state))


def _arrays(tree: ArrayTree) -> list[mx.array]:
    if isinstance(tree, mx.array):
        return [tree]
    if isinstance(tree, (list, tuple, dict)):
        return [v for _, v in tree_flatten(tree) if isinstance(v, mx.array)]
    return []


def leaves(caches: Sequence[LayerCache]) -> list[LayerCache]:
    """The caches, a `CacheList`'s parts in its place (recursively)."""
    out: list[LayerCache] = []
    for c in caches:
        parts = getattr(c, "caches", None)
        out.extend(leaves(parts) if isinstance(parts, (list, tuple)) else [c])
    return out
