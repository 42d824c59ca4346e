"""MLX arrays <-> host arrays, cache state trees, behaviour probes. ENGINE THREAD ONLY.

What a checkpoint stores per layer is `plan`'s and `layers`' business; this module holds the
pieces they share: exact dtype conversion (bfloat16 travels as its uint16 bit pattern), the
encoding of a layer's `state` tree with arrays replaced by named references, and the probe that
re-checks a restored state's behaviour after an unclean shutdown.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import mlx.core as mx
import numpy as np

from mlx_kvserve.cache.codec import DTYPES, HostArray
from mlx_kvserve.cache.kinds import ArrayTree, LayerCache, is_sliceable
from mlx_kvserve.json_value import JSON

__all__ = ["is_sliceable"]  # re-exported: the engine and admission ask it here

_MX_DTYPES: dict[str, mx.Dtype] = {
    name: (mx.bool_ if name == "bool" else getattr(mx, name)) for name in DTYPES
}
_MX_NAMES = {v: k for k, v in _MX_DTYPES.items()}


class StateError(ValueError):
    """Stored state does not fit the caches it is being restored into."""


def dtype_name(dtype: mx.Dtype) -> str:
    try:
        return _MX_NAMES[dtype]
    except KeyError:
        raise StateError(f"unsupported dtype {dtype}") from None


def to_host(name: str, arr: mx.array) -> HostArray:
    """Copy an MLX array into host memory (owned by numpy, independent of MLX buffers)."""
    dname = dtype_name(arr.dtype)
    src = arr.view(mx.uint16) if dname == "bfloat16" else arr
    data = np.array(src, copy=True)
    if data.dtype != DTYPES[dname]:
        data = data.astype(DTYPES[dname])
    return HostArray(name, dname, tuple(int(d) for d in arr.shape), data)


def to_mx(h: HostArray) -> mx.array:
    data = np.asarray(h.data).reshape(h.shape)
    arr = mx.array(data)
    if h.dtype == "bfloat16":
        arr = arr.view(mx.bfloat16)
    elif arr.dtype != _MX_DTYPES[h.dtype]:
        raise StateError(f"{h.name}: decoded as {arr.dtype}, expected {h.dtype}")
    return arr


def cache_offsets(caches: Sequence[LayerCache]) -> list[int]:
    """Integer `offset`s the layers report (sub-caches of CacheList included)."""
    out: list[int] = []
    for c in caches:
        subs = getattr(c, "caches", None)
        if isinstance(subs, (list, tuple)):
            out.extend(cache_offsets(subs))
            continue
        off = getattr(c, "offset", None)
        if isinstance(off, int) and not isinstance(off, bool):
            out.append(off)
    return out


# -- state trees ---------------------------------------------------------------------------
def encode_tree(obj: ArrayTree, refs: dict[str, mx.array], prefix: str) -> JSON:
    """A `state` tree as JSON (the result), each array replaced by {"a": name}, collected in
    `refs`."""
    if isinstance(obj, mx.array):
        name = f"{prefix}.{len(refs)}"
        refs[name] = obj
        return {"a": name}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, tuple):
        return {"t": [encode_tree(x, refs, prefix) for x in obj]}
    if isinstance(obj, list):
        return {"l": [encode_tree(x, refs, prefix) for x in obj]}
    raise StateError(f"cannot serialise cache state element of type {type(obj).__name__}")


def decode_tree(obj: JSON, arrays: Mapping[str, mx.array]) -> ArrayTree:
    """The inverse of `encode_tree` (`obj` is its JSON)."""
    if isinstance(obj, dict):
        if "a" in obj:
            name = obj["a"]
            if not isinstance(name, str) or name not in arrays:
                raise StateError(f"bad array reference {name!r}")
            return arrays[name]
        if "t" in obj:
            return tuple(decode_tree(x, arrays) for x in obj["t"])
        if "l" in obj:
            return [decode_tree(x, arrays) for x in obj["l"]]
        raise StateError("bad state tree node")
    return obj


# -- behaviour probe ------------------------------------------------------------------------
def make_probe(logits: mx.array | np.ndarray, position: int, k: int = 8) -> dict[str, JSON]:
    """Top-k log-probabilities of one logits row, stored to re-check behaviour after restore."""
    row = mx.array(logits) if not isinstance(logits, mx.array) else logits
    row = row.reshape(-1, row.shape[-1])[-1].astype(mx.float32)
    logprobs = row - mx.logsumexp(row)
    k = min(k, row.shape[0])
    ids = mx.argpartition(-logprobs, kth=k - 1)[:k]
    vals = logprobs[ids]
    order = mx.argsort(-vals)
    ids, vals = ids[order], vals[order]
    return {"position": int(position), "ids": ids.tolist(), "logprobs": vals.tolist()}


def probe_matches(
    probe: dict[str, JSON], logits: mx.array | np.ndarray, *, atol: float = 0.5
) -> bool:
    """True if `logits` (the row for probe["position"]) behaves like the stored probe.

    Cache-on and cache-off prefills chunk differently, so bit equality is not expected: the
    check is that the output is finite, its top token is among the stored top-k, and every stored
    top-k log-probability agrees within `atol` nats. Garbage state fails all three.
    """
    row = np.asarray(
        (logits if isinstance(logits, mx.array) else mx.array(logits)).astype(mx.float32)
    ).reshape(-1, np.shape(logits)[-1])[-1]
    if not np.all(np.isfinite(row)):
        return False
    shifted = row - row.max()
    logprobs = shifted - np.log(np.exp(shifted).sum())
    ids = [int(i) for i in probe.get("ids", [])]
    if not ids or max(ids) >= row.shape[0]:
        return False
    if int(np.argmax(row)) not in ids:
        return False
    stored = np.asarray(probe.get("logprobs", []), dtype=np.float64)
    return bool(np.all(np.abs(logprobs[ids] - stored) <= atol))
