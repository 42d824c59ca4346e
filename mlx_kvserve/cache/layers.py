"""Live mlx-lm caches <-> the per-layer storage of `plan`. ENGINE THREAD ONLY (MLX calls).

`describe` says how each layer of live caches is stored (span, whole or list) without copying
anything; `extract` copies what one checkpoint stores to host memory; `assemble` sets fresh
caches from restored arrays.

Span layers are the classes below whose positions can be read in order: the table says, per
class, which arrays hold the positions (axis 2 of each), the first position they hold, the
first one the layer still needs at `n` tokens, and how to rebuild the class from positions
[lo, n). A `RotatingKVCache` is rebuilt in temporal order holding its last `max_size`
positions (as mlx-lm's own `BatchRotatingKVCache.extract` leaves one): its next update, in place
or concatenating, then attends to exactly the keys the live window held. A window that keeps
sink tokens (`keep` > 0), `ArraysCache` and unknown classes are stored whole.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

import mlx.core as mx
from mlx_lm.models import cache as mlx_cache

from mlx_kvserve.cache import plan
from mlx_kvserve.cache.codec import HostArray
from mlx_kvserve.cache.kinds import ArrayTree, LayerCache
from mlx_kvserve.cache.state import StateError, decode_tree, dtype_name, encode_tree, to_host
from mlx_kvserve.json_value import JSON

C = TypeVar("C")  # one of mlx-lm's position-indexed cache classes


@dataclass(frozen=True)
class _Positional(Generic[C]):
    arrays: Callable[[C], list[mx.array]]  # positions [held_from, offset) in order, axis 2
    lo: Callable[[C, int], int]  # first position still needed once the layer holds n
    params: Callable[[C], dict[str, JSON]]  # JSON, stored in the layer's doc
    build: Callable[[C, list[mx.array], int, int, Mapping[str, JSON]], None]
    padded: bool = False  # restored with free room after the positions (KVCache's growth step)


def _kv_arrays(c: mlx_cache.KVCache) -> list[mx.array]:
    return [c.keys[..., : c.offset, :], c.values[..., : c.offset, :]]


def _kv_build(
    c: mlx_cache.KVCache, a: list[mx.array], lo: int, n: int, p: Mapping[str, JSON]
) -> None:
    c.state = (a[0], a[1], n)


def _quantized_arrays(c: mlx_cache.QuantizedKVCache) -> list[mx.array]:
    return [x[..., : c.offset, :] for x in (*c.keys, *c.values)]


def _quantized_build(
    c: mlx_cache.QuantizedKVCache, a: list[mx.array], lo: int, n: int, p: Mapping[str, JSON]
) -> None:
    c.state = (tuple(a[:3]), tuple(a[3:]), n, int(p["group_size"]), int(p["bits"]))


def _rotating_arrays(c: mlx_cache.RotatingKVCache) -> list[mx.array]:
    return [c._temporal_order(c.keys), c._temporal_order(c.values)]


def _rotating_build(
    c: mlx_cache.RotatingKVCache, a: list[mx.array], lo: int, n: int, p: Mapping[str, JSON]
) -> None:
    c.state = (a[0], a[1], n, 0, int(p["max_size"]), int(a[0].shape[2]))


def _chunked_arrays(c: mlx_cache.ChunkedKVCache) -> list[mx.array]:
    held = c.offset - c.start_position
    return [c.keys[..., :held, :], c.values[..., :held, :]]


def _chunked_build(
    c: mlx_cache.ChunkedKVCache, a: list[mx.array], lo: int, n: int, p: Mapping[str, JSON]
) -> None:
    c.state = (a[0], a[1], n, int(p["chunk_size"]), lo)


_POSITIONAL: dict[type[LayerCache], _Positional] = {
    mlx_cache.KVCache: _Positional(
        _kv_arrays, lambda c, n: 0, lambda c: {}, _kv_build, padded=True
    ),
    mlx_cache.QuantizedKVCache: _Positional(
        _quantized_arrays,
        lambda c, n: 0,
        lambda c: {"group_size": int(c.group_size), "bits": int(c.bits)},
        _quantized_build,
    ),
    mlx_cache.RotatingKVCache: _Positional(
        _rotating_arrays,
        lambda c, n: max(0, n - int(c.max_size)),
        lambda c: {"max_size": int(c.max_size)},
        _rotating_build,
    ),
    mlx_cache.ChunkedKVCache: _Positional(
        _chunked_arrays,
        lambda c, n: int(c.start_position),
        lambda c: {"chunk_size": int(c.chunk_size)},
        _chunked_build,
    ),
}


def _positional(c: LayerCache) -> _Positional | None:
    adapter = _POSITIONAL.get(type(c))
    if adapter is None or getattr(c, "keys", None) is None:
        return None
    if type(c) is mlx_cache.RotatingKVCache and c.keep:
        return None  # sink tokens: the window is stored whole
    return adapter


def padded(class_name: str) -> bool:
    """Whether a span layer of this class is restored with KVCache's free room after it."""
    cls = getattr(mlx_cache, class_name, None)
    return cls is not None and cls in _POSITIONAL and _POSITIONAL[cls].padded


# -- describe and extract ----------------------------------------------------------------------
def describe(caches: Sequence[LayerCache], n: int) -> tuple[list[dict[str, JSON]], plan.Layout]:
    """Layer docs for a checkpoint of the first `n` positions (whole layers without their
    state yet) and the span arrays' layout (positions axis 0). Copies nothing."""
    layout: plan.Layout = {}
    docs = [_describe(c, str(i), n, layout) for i, c in enumerate(caches)]
    return docs, layout


def _describe(c: LayerCache, path: str, n: int, layout: plan.Layout) -> dict[str, JSON]:
    parts = getattr(c, "caches", None)
    if type(c) is mlx_cache.CacheList and isinstance(parts, (list, tuple)):
        subs = [_describe(sub, f"{path}.{j}", n, layout) for j, sub in enumerate(parts)]
        return {"class": "CacheList", "mode": plan.LIST, "parts": subs}
    adapter = _positional(c)
    if adapter is None:
        return {"class": type(c).__name__, "mode": plan.WHOLE}
    names = []
    for j, a in enumerate(adapter.arrays(c)):
        name = f"p.{path}.{j}"
        shape = tuple(int(d) for d in a.shape)
        layout[name] = (dtype_name(a.dtype), (*shape[:2], 0, *shape[3:]))
        names.append(name)
    return {
        "class": type(c).__name__,
        "mode": plan.SPAN,
        "lo": adapter.lo(c, n),
        "arrays": names,
        "params": adapter.params(c),
    }


def extract(
    caches: Sequence[LayerCache], docs: list[dict[str, JSON]], parent_len: int, n: int
) -> list[HostArray]:
    """Host copies of what the entry stores: each span layer's positions
    [max(parent_len, lo), n), each whole layer's state (its tree is put into its doc)."""
    arrays: list[HostArray] = []
    for i, (c, doc) in enumerate(zip(caches, docs, strict=True)):
        _extract(c, doc, parent_len, n, arrays, str(i))
    return arrays


def _extract(
    c: LayerCache, doc: dict[str, JSON], parent_len: int, n: int, out: list[HostArray], path: str
) -> None:
    if doc["mode"] == plan.LIST:
        for j, (sub, sub_doc) in enumerate(zip(c.caches, doc["parts"], strict=True)):
            _extract(sub, sub_doc, parent_len, n, out, f"{path}.{j}")
        return
    if doc["mode"] == plan.WHOLE:
        refs: dict[str, mx.array] = {}
        doc["state"] = encode_tree(_whole_state(c), refs, f"s.{path}")
        out.extend(to_host(name, a) for name, a in refs.items())
        return
    adapter = _positional(c)
    assert adapter is not None
    start = plan.span_start(doc, parent_len)
    for name, a in zip(doc["arrays"], adapter.arrays(c), strict=True):
        held_from = c.offset - a.shape[2]
        if start < held_from or n > c.offset:
            raise StateError(
                f"{name}: layer holds positions [{held_from}, {c.offset}), need [{start}, {n})"
            )
        out.append(to_host(name, a[..., start - held_from : n - held_from, :]))


def _whole_state(c: LayerCache) -> ArrayTree:
    """A whole layer's `state`, with the padding of a sink-keeping window cut off."""
    if type(c) is mlx_cache.RotatingKVCache and c.keys is not None and c.offset == c._idx:
        idx = c._idx
        return (c.keys[..., :idx, :], c.values[..., :idx, :], c.offset, c.keep, c.max_size, idx)
    return c.state


# -- restore -----------------------------------------------------------------------------------
def check_fits(caches: Sequence[LayerCache], docs: list[dict[str, JSON]]) -> None:
    """The stored layers have the model's layer count and classes."""
    if len(docs) != len(caches):
        raise StateError(f"stores {len(docs)} layers, model has {len(caches)}")
    for i, (c, doc) in enumerate(zip(caches, docs, strict=True)):
        _check_class(c, doc, str(i))


def _check_class(c: LayerCache, doc: dict[str, JSON], path: str) -> None:
    if doc.get("class") != type(c).__name__:
        raise StateError(f"layer {path}: stored {doc.get('class')}, model uses {type(c).__name__}")
    if doc.get("mode") == plan.LIST:
        parts = doc.get("parts") or []
        if len(parts) != len(c.caches):
            raise StateError(f"layer {path}: {len(parts)} parts, model has {len(c.caches)}")
        for j, (sub, sub_doc) in enumerate(zip(c.caches, parts, strict=True)):
            _check_class(sub, sub_doc, f"{path}.{j}")
    elif doc.get("mode") == plan.SPAN:
        cls = type(c)
        if cls not in _POSITIONAL or (cls is mlx_cache.RotatingKVCache and c.keep):
            raise StateError(f"layer {path}: {cls.__name__} cannot be restored from positions")
        if cls is mlx_cache.RotatingKVCache and doc["params"].get("max_size") != c.max_size:
            raise StateError(f"layer {path}: window {doc['params']} != model's {c.max_size}")


def assemble(
    caches: Sequence[LayerCache],
    docs: list[dict[str, JSON]],
    arrays: Mapping[str, mx.array],
    usable: int,
) -> None:
    """Set fresh caches from restored arrays: span layers hold positions [lo, usable)."""
    for i, (c, doc) in enumerate(zip(caches, docs, strict=True)):
        _assemble(c, doc, arrays, usable, str(i))


def _assemble(
    c: LayerCache, doc: dict[str, JSON], arrays: Mapping[str, mx.array], usable: int, path: str
) -> None:
    if doc["mode"] == plan.LIST:
        for j, (sub, sub_doc) in enumerate(zip(c.caches, doc["parts"], strict=True)):
            _assemble(sub, sub_doc, arrays, usable, f"{path}.{j}")
        return
    if doc["mode"] == plan.WHOLE:
        state = decode_tree(doc.get("state"), arrays)
        _check_geometry(c, state, path)
        c.state = state
        return
    adapter = _POSITIONAL[type(c)]
    adapter.build(
        c, [arrays[name] for name in doc["arrays"]], int(doc["lo"]), usable, doc.get("params") or {}
    )


def _check_geometry(c: LayerCache, state: ArrayTree, path: str) -> None:
    """A whole state has the shape of its layer's class (and a window the model's window)."""
    if type(c) is mlx_cache.RotatingKVCache:
        if not isinstance(state, tuple) or len(state) != 6:
            raise StateError(f"layer {path}: malformed RotatingKVCache state")
        if (state[3], state[4]) != (c.keep, c.max_size):
            raise StateError(f"layer {path}: window {state[3:5]} != {(c.keep, c.max_size)}")
    elif type(c) is mlx_cache.ArraysCache and (
        not isinstance(state, tuple) or len(state) != 3 or len(state[0]) != len(c.cache)
    ):
        raise StateError(f"layer {path}: malformed ArraysCache state")
