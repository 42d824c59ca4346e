"""mlx-lm cache objects <-> host arrays. ENGINE THREAD ONLY: every function here touches MLX.

Two shapes of stored state:

* **delta** (every layer plain position-indexed KV, `kinds.is_sliceable`): arrays `k.<layer>` /
  `v.<layer>` holding positions [start, end) of each layer's keys/values, sliced out of the
  padded buffer (KVCache grows in steps of 256, and `state` returns the padding too). Restore
  copies a chain into one buffer.
* **snapshot** (anything else: RotatingKVCache, ArraysCache/SSM, QuantizedKVCache,
  ChunkedKVCache, CacheList, mixed, and classes this project does not know): each layer's class
  name plus its `state` tree, with arrays replaced by references into the payload. Padded KV
  buffers are sliced to their real length first; everything else is stored as is.

Dtypes are kept exactly; bfloat16 travels as its uint16 bit pattern.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models import cache as mlx_cache

from mlx_kvserve.cache.codec import DTYPES, FLOAT_DTYPES, HostArray
from mlx_kvserve.cache.kinds import is_sliceable

__all__ = ["is_sliceable"]  # re-exported: the engine and admission ask it here

_MX_DTYPES: dict[str, Any] = {
    name: (mx.bool_ if name == "bool" else getattr(mx, name)) for name in DTYPES
}
_MX_NAMES = {v: k for k, v in _MX_DTYPES.items()}


class StateError(ValueError):
    """Stored state does not fit the caches it is being restored into."""


def dtype_name(dtype: Any) -> str:
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


def cache_offsets(caches: Sequence[Any]) -> list[int]:
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


# -- deltas ---------------------------------------------------------------------------------
def extract_delta(caches: Sequence[Any], start: int, end: int) -> list[HostArray]:
    """Positions [start, end) of every layer, as host arrays `k.<i>` / `v.<i>`."""
    arrays = []
    for i, c in enumerate(caches):
        if c.keys is None or c.offset < end:
            raise StateError(f"layer {i} holds {c.offset} tokens, need {end}")
        arrays.append(to_host(f"k.{i}", c.keys[..., start:end, :]))
        arrays.append(to_host(f"v.{i}", c.values[..., start:end, :]))
    return arrays


def compatible_delta(
    a: dict[str, tuple[str, tuple[int, ...]]], b: dict[str, tuple[str, tuple[int, ...]]]
) -> bool:
    """Same arrays, dtypes, and shapes apart from the sequence axis."""
    if a.keys() != b.keys():
        return False
    for name, (dt, shape) in a.items():
        dt2, shape2 = b[name]
        if dt != dt2 or len(shape) != 4 or len(shape2) != 4:
            return False
        if shape[:2] != shape2[:2] or shape[3] != shape2[3]:
            return False
    return True


class DeltaBuilder:
    """Empty KVCaches filled link by link, straight into their final buffers.

    Each layer's keys and values get one buffer of `capacity` positions: the chain's positions
    plus KVCache's usual free room after `usable` (without it, the first prefill step would copy
    everything again to grow the buffer). Links are copied, or read from their file, directly
    into it through a NumPy view of the MLX buffer (MLX documents such views as shared and
    writable). One allocation and one copy per restore: on small machines page faults on fresh
    memory, not arithmetic, dominate restore time. Positions past `usable` are unused capacity,
    as after a trim.
    """

    def __init__(
        self,
        caches: Sequence[Any],
        layout: dict[str, tuple[str, tuple[int, ...]]],
        positions: int,
        usable: int,
        *,
        dtype: str | None = None,
    ) -> None:
        if not is_sliceable(caches):
            raise StateError("delta entries restore only into plain KVCache layers")
        names = {f"{kv}.{i}" for i in range(len(caches)) for kv in "kv"}
        if set(layout) != names:
            raise StateError(f"stored layers do not match the model's {len(caches)} layers")
        if not 0 < usable <= positions:
            raise StateError(f"chain holds {positions} positions, need {usable}")
        self.caches = caches
        self.layout = layout
        self.usable = usable
        self.capacity = max(positions, _padded_length(usable, getattr(caches[0], "step", 256)))
        self._filled = dict.fromkeys(layout, 0)
        buffers: dict[str, mx.array] = {}
        for name, (dt, shape) in layout.items():
            if len(shape) != 4:
                raise StateError(f"{name}: shape {shape} is not (batch, heads, positions, dim)")
            if dtype is not None and dt != dtype:
                raise StateError(f"{name}: dtype {dt}, model uses {dtype}")
            storage = mx.uint16 if dt == "bfloat16" else _MX_DTYPES[dt]
            buffers[name] = mx.zeros((shape[0], shape[1], self.capacity, shape[3]), storage)
        mx.eval(list(buffers.values()))
        # The NumPy array each link is written into, and the MLX array it becomes (None: the
        # view was refused, not seen with MLX 0.32, so a host copy is converted at the end).
        self._host: dict[str, np.ndarray] = {}
        self._mx: dict[str, mx.array | None] = {}
        for name, buf in buffers.items():
            view = _writable_view(buf)
            self._host[name] = (
                view if view is not None else np.zeros(buf.shape, DTYPES[layout[name][0]])
            )
            self._mx[name] = buf if view is not None else None

    def slot(self, name: str, dtype: str, shape: Sequence[int], start: int) -> np.ndarray:
        """The buffer region for array `name` (dtype, shape) of a link starting at `start`."""
        want = self.layout.get(name)
        if want is None:
            raise StateError(f"unexpected array {name}")
        if dtype != want[0]:
            raise StateError(f"{name}: dtype {dtype}, the chain uses {want[0]}")
        shape = tuple(int(d) for d in shape)
        if len(shape) != 4 or shape[:2] != tuple(want[1][:2]) or shape[3] != want[1][3]:
            raise StateError(f"{name}: shape {shape} differs from the chain's {want[1]}")
        end = start + shape[2]
        if start != self._filled[name] or end > self.capacity:
            raise StateError(f"{name}: link at {start} does not continue the chain")
        self._filled[name] = end
        return self._host[name][:, :, start:end, :]

    def put(self, start: int, end: int, arrays: Sequence[HostArray]) -> None:
        """Copy one link's host arrays (positions [start, end)) into place."""
        if {a.name for a in arrays} != set(self.layout):
            raise StateError(f"stored layers do not match the model's {len(self.caches)} layers")
        for a in arrays:
            _check_span(a.name, a.shape, start, end)
            region = self.slot(a.name, a.dtype, a.shape, start)
            region[...] = np.asarray(a.data).reshape(a.shape)

    def read_targets(self, start: int, end: int) -> Callable[[dict[str, Any]], list[memoryview]]:
        """For `DiskTier.read_entry_into`: per array spec, the byte views to read it into."""

        def target(spec: dict[str, Any]) -> list[memoryview]:
            shape = tuple(int(d) for d in spec["shape"])
            _check_span(str(spec["name"]), shape, start, end)
            region = self.slot(str(spec["name"]), str(spec["dtype"]), shape, start)
            # Per (batch, head), the positions x dim block is contiguous, as in the file.
            return [
                memoryview(region[b, h]).cast("B") for b in range(shape[0]) for h in range(shape[1])
            ]

        return target

    def finish(self) -> None:
        """Hand the buffers to the caches, each holding `usable` positions."""
        for name, filled in self._filled.items():
            if filled < self.usable:
                raise StateError(f"{name}: chain holds {filled} positions, need {self.usable}")
        out: dict[str, mx.array] = {}
        for name, (dt, _) in self.layout.items():
            buf = self._mx[name]
            if buf is None:
                buf = mx.array(self._host[name])
            out[name] = buf.view(mx.bfloat16) if dt == "bfloat16" else buf
        self._host.clear()  # no NumPy view may outlive the hand-over
        mx.eval(list(out.values()))
        for i, c in enumerate(self.caches):
            c.state = (out[f"k.{i}"], out[f"v.{i}"], self.usable)


def _check_span(name: str, shape: Sequence[int], start: int, end: int) -> None:
    if len(shape) != 4 or shape[2] != end - start:
        raise StateError(f"{name}: shape {tuple(shape)} does not hold {end - start} positions")


def _writable_view(arr: mx.array) -> np.ndarray | None:
    """A NumPy view sharing `arr`'s memory, or None if MLX did not hand out a plain buffer."""
    try:
        view = np.array(arr, copy=False)
    except (TypeError, ValueError):
        return None
    if view.flags.writeable and view.flags.c_contiguous and view.shape == tuple(arr.shape):
        return view
    return None


def _padded_length(usable: int, step: int) -> int:
    """KVCache grows its buffers in multiples of `step`; leave at least one free position."""
    return (usable // step + 1) * step


# -- snapshots ------------------------------------------------------------------------------
# A layer's `state` with its KV buffers cut to the positions in use (KVCache and ChunkedKVCache
# allocate 256 positions ahead; a RotatingKVCache that has not wrapped yet, up to its window).
# Per class, because `state` returns the padding too; any other class is stored as its `state`.
def _cut_kv(c: Any) -> Any:
    off = c.offset
    return (c.keys[..., :off, :], c.values[..., :off, :], off)


def _cut_quantized(c: Any) -> Any:
    off = c.offset
    cut = tuple(x[..., :off, :] for x in c.keys), tuple(x[..., :off, :] for x in c.values)
    return (*cut, off, c.group_size, c.bits)


def _cut_rotating(c: Any) -> Any:
    if c.offset != c._idx:  # wrapped: the whole window is in use, in rotated order
        return c.state
    idx = c._idx
    return (c.keys[..., :idx, :], c.values[..., :idx, :], c.offset, c.keep, c.max_size, idx)


def _cut_chunked(c: Any) -> Any:
    held = c.offset - c.start_position
    return (c.keys[..., :held, :], c.values[..., :held, :], *c.state[2:])


_CUT: dict[type, Callable[[Any], Any]] = {
    mlx_cache.KVCache: _cut_kv,
    mlx_cache.QuantizedKVCache: _cut_quantized,
    mlx_cache.RotatingKVCache: _cut_rotating,
    mlx_cache.ChunkedKVCache: _cut_chunked,
}


def _layer_state(c: Any) -> Any:
    """A layer's `state` with padded KV buffers cut to their real length."""
    parts = getattr(c, "caches", None)
    if isinstance(parts, (list, tuple)):  # CacheList: its state setter takes (state, class)
        return [(_layer_state(sub), type(sub).__name__) for sub in parts]
    cut = _CUT.get(type(c))
    if cut is not None and getattr(c, "keys", None) is not None:
        return cut(c)
    return c.state


def _encode_tree(obj: Any, arrays: list[HostArray], layer: int) -> Any:
    if isinstance(obj, mx.array):
        arrays.append(to_host(f"s.{layer}.{len(arrays)}", obj))
        return {"a": len(arrays) - 1}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, tuple):
        return {"t": [_encode_tree(x, arrays, layer) for x in obj]}
    if isinstance(obj, list):
        return {"l": [_encode_tree(x, arrays, layer) for x in obj]}
    raise StateError(f"cannot serialise cache state element of type {type(obj).__name__}")


def _decode_tree(obj: Any, arrays: Sequence[mx.array]) -> Any:
    if isinstance(obj, dict):
        if "a" in obj:
            idx = obj["a"]
            if not isinstance(idx, int) or not 0 <= idx < len(arrays):
                raise StateError(f"bad array reference {idx!r}")
            return arrays[idx]
        if "t" in obj:
            return tuple(_decode_tree(x, arrays) for x in obj["t"])
        if "l" in obj:
            return [_decode_tree(x, arrays) for x in obj["l"]]
        raise StateError("bad state tree node")
    return obj


def extract_snapshot(caches: Sequence[Any]) -> tuple[dict[str, Any], list[HostArray]]:
    """Whole state of every layer: (meta for the header, arrays)."""
    arrays: list[HostArray] = []
    layers = []
    for i, c in enumerate(caches):
        layers.append(
            {"class": type(c).__name__, "state": _encode_tree(_layer_state(c), arrays, i)}
        )
    return {"layers": layers}, arrays


def restore_snapshot(
    caches: Sequence[Any],
    meta: dict[str, Any],
    arrays: Sequence[HostArray],
    n_tokens: int,
    *,
    check_finite: bool = True,
) -> None:
    """Set each fresh layer's state from a snapshot; classes and geometry must match."""
    layers = meta.get("layers")
    if not isinstance(layers, list) or len(layers) != len(caches):
        raise StateError(f"snapshot has {len(layers or [])} layers, model has {len(caches)}")
    mx_arrays = [to_mx(a) for a in arrays]
    if mx_arrays:
        mx.eval(*mx_arrays)
    if check_finite:
        pairs = zip(mx_arrays, arrays, strict=True)
        _assert_finite([a for a, h in pairs if h.dtype in FLOAT_DTYPES])
    states = []
    for i, (c, layer) in enumerate(zip(caches, layers, strict=True)):
        cls = type(c).__name__
        if layer.get("class") != cls:
            raise StateError(f"layer {i}: stored {layer.get('class')}, model uses {cls}")
        state = _decode_tree(layer.get("state"), mx_arrays)
        _check_geometry(c, state, i)
        states.append(state)
    for c, state in zip(caches, states, strict=True):
        c.state = state
    offsets = cache_offsets(caches)
    if any(off != n_tokens for off in offsets):
        raise StateError(f"restored offsets {sorted(set(offsets))} != {n_tokens} tokens")


def _check_rotating(c: Any, state: Any, i: int) -> None:
    if not isinstance(state, tuple) or len(state) != 6:
        raise StateError(f"layer {i}: malformed RotatingKVCache state")
    if (state[3], state[4]) != (c.keep, c.max_size):
        raise StateError(f"layer {i}: window {state[3:5]} != model's {(c.keep, c.max_size)}")


def _check_arrays(c: Any, state: Any, i: int) -> None:
    if not isinstance(state, tuple) or len(state) != 3 or len(state[0]) != len(c.cache):
        raise StateError(f"layer {i}: malformed ArraysCache state")


def _check_tuple(length: int) -> Callable[[Any, Any, int], None]:
    def check(c: Any, state: Any, i: int) -> None:
        if not isinstance(state, tuple) or len(state) != length:
            raise StateError(f"layer {i}: malformed {type(c).__name__} state")

    return check


def _check_list(c: Any, state: Any, i: int) -> None:
    parts = c.caches
    if not isinstance(state, list) or len(state) != len(parts):
        raise StateError(f"layer {i}: malformed CacheList state")
    for sub, item in zip(parts, state, strict=True):
        if not isinstance(item, (list, tuple)) or len(item) != 2 or item[1] != type(sub).__name__:
            raise StateError(
                f"layer {i}: stored part {item[1:]!r}, model uses {type(sub).__name__}"
            )
        _check_geometry(sub, item[0], i)


_CHECKS: dict[type, Callable[[Any, Any, int], None]] = {
    mlx_cache.KVCache: _check_tuple(3),
    mlx_cache.QuantizedKVCache: _check_tuple(5),
    mlx_cache.ChunkedKVCache: _check_tuple(5),
    mlx_cache.RotatingKVCache: _check_rotating,
    mlx_cache.ArraysCache: _check_arrays,
    mlx_cache.CacheList: _check_list,
}


def _check_geometry(c: Any, state: Any, i: int) -> None:
    """The stored state has the shape of the layer's class (and a window its window)."""
    check = _CHECKS.get(type(c))
    if check is not None:
        check(c, state, i)


def _assert_finite(arrays: Sequence[mx.array]) -> None:
    floats = [a for a in arrays if mx.issubdtype(a.dtype, mx.floating)]
    if not floats:
        return
    flags = mx.stack([mx.all(mx.isfinite(a)) for a in floats])
    if not bool(mx.all(flags).item()):
        raise StateError("stored state contains NaN or Inf")


# -- behaviour probe ------------------------------------------------------------------------
def make_probe(logits: Any, position: int, k: int = 8) -> dict[str, Any]:
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


def probe_matches(probe: dict[str, Any], logits: Any, *, atol: float = 0.5) -> bool:
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
