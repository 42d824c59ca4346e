"""Restore a chain of links into fresh caches, straight into their final buffers. ENGINE THREAD.

The entry being restored (the leaf) says per layer what it needs (see `plan`): each span layer
positions [lo, usable), each whole layer its own state. Every span array gets one buffer of
those positions (KVCache layers: plus its usual free room after `usable`, without which the
first prefill step would copy everything again to grow the buffer). Links are copied from RAM,
or read from their file, directly into it through a NumPy view of the MLX buffer (MLX documents
such views as shared and writable): one allocation and one copy per restore, because on small
machines page faults on fresh memory, not arithmetic, dominate restore time. Positions a link
holds below `lo` (a window's positions that slid out) are read into scratch memory, only to
verify the file's checksum; links that hold nothing the leaf needs are not read at all.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from mlx_kvserve.cache import layers, plan
from mlx_kvserve.cache.codec import DTYPES, FLOAT_DTYPES, HostArray
from mlx_kvserve.cache.entry import Entry
from mlx_kvserve.cache.kinds import LayerCache
from mlx_kvserve.cache.mtp_part import is_mtp
from mlx_kvserve.cache.state import StateError, to_mx
from mlx_kvserve.json_value import JSON

KV_STEP = 256  # KVCache grows its buffers in multiples of this


@dataclass
class _Span:
    """One span array's buffer: positions [lo, end), filled up to `filled`."""

    lo: int
    end: int
    dtype: str
    geometry: tuple[int, ...]  # shape without the positions axis
    host: np.ndarray
    mx_buf: mx.array | None  # None: the view was refused, converted from `host` at the end
    filled: int


class ChainBuilder:
    """Fresh caches filled link by link (root first) with `usable` tokens of the leaf's state."""

    def __init__(
        self,
        caches: Sequence[LayerCache],
        links: list[Entry],
        usable: int,
        dtype: str | None = None,
    ) -> None:
        """`dtype`: the model's KV dtype, which every floating KV array must have."""
        leaf = links[-1]
        self.dtype = dtype
        self.caches = caches
        self.leaf = leaf
        self.usable = usable
        self.docs: list[dict[str, JSON]] = leaf.meta.get("layers") or []
        layers.check_fits(caches, self.docs)
        if not 0 < usable <= leaf.n_tokens:
            raise StateError(f"chain holds {leaf.n_tokens} positions, need {usable}")
        self._spans: dict[str, _Span] = {}
        self._whole: dict[str, np.ndarray] = {}
        buffers: list[tuple[str, int, int, str, mx.array]] = []
        for _, doc in plan.leaves(self.docs):
            if doc["mode"] == plan.SPAN:
                buffers += self._span_buffers(doc)
            else:
                for name in plan.tree_refs(doc.get("state")):
                    self._whole[name] = np.empty(0)  # filled from the leaf
        if buffers:
            mx.eval([buf for *_, buf in buffers])  # one evaluation for every layer's buffer
        for name, lo, end, dtype, buf in buffers:
            view = _writable_view(buf)
            host = view if view is not None else np.zeros(buf.shape, DTYPES[dtype])
            shape = self.leaf.layout[name][1]
            geometry = (*shape[:2], *shape[3:])
            self._spans[name] = _Span(
                lo, end, dtype, geometry, host, buf if view is not None else None, lo
            )
        self.links = [link for link in links if self._needs(link)]
        # link key -> its MTP part's arrays, kept as they are read, for the links named here
        # (the restore's MTP run: cache/mtp_part.py); any other link's are read and dropped
        self.mtp: dict[str, dict[str, HostArray]] = {}

    def _span_buffers(self, doc: dict[str, JSON]) -> list[tuple[str, int, int, str, mx.array]]:
        """(name, lo, end, dtype, zeroed buffer, not yet evaluated) per array of a span layer."""
        lo = int(doc["lo"])
        if lo >= self.usable:
            raise StateError(f"a layer needs positions from {lo}, restoring {self.usable}")
        end = self.usable
        if layers.padded(doc["class"]):
            end = max(self.leaf.n_tokens, (self.usable // KV_STEP + 1) * KV_STEP)
        out = []
        for name in doc["arrays"]:
            dtype, shape = self.leaf.layout[name]
            if self.dtype is not None and dtype in FLOAT_DTYPES and dtype != self.dtype:
                raise StateError(f"{name}: dtype {dtype}, model uses {self.dtype}")
            storage = mx.uint16 if dtype == "bfloat16" else getattr(mx, dtype)
            out.append(
                (
                    name,
                    lo,
                    end,
                    dtype,
                    mx.zeros((shape[0], shape[1], end - lo, *shape[3:]), storage),
                )
            )
        return out

    def _needs(self, link: Entry) -> bool:
        if link is self.leaf and self._whole:
            return True
        for name, span in self._spans.items():
            start, stop = _link_span(link, name)
            if max(start, span.lo) < min(stop, self.usable):
                return True
        return False

    # -- one link ---------------------------------------------------------------------------
    def _region(
        self, link: Entry, name: str, dtype: str, shape: Sequence[int]
    ) -> tuple[_Span, int, int, int] | None:
        """For a span array of `link`: (span, first stored position, region start, end)."""
        span = self._spans.get(name)
        if span is None:
            return None
        shape = tuple(int(d) for d in shape)
        if dtype != span.dtype or (*shape[:2], *shape[3:]) != span.geometry or len(shape) != 4:
            raise StateError(f"{name}: {dtype}{list(shape)} differs from the chain's")
        start, stop = _link_span(link, name)
        if stop - start != shape[2]:
            raise StateError(f"{name}: shape {list(shape)} does not hold {stop - start} positions")
        r0, r1 = max(start, span.lo), min(stop, span.end)
        if r0 >= r1:
            return span, start, start, start  # nothing needed: all of it is scratch
        if r0 != span.filled:
            raise StateError(f"{name}: the chain lacks positions [{span.filled}, {r0})")
        span.filled = r1
        return span, start, r0, r1

    def put(self, link: Entry, arrays: Sequence[HostArray]) -> None:
        """Copy one link's host arrays (from the RAM tier) into place."""
        if {a.name for a in arrays} != set(link.layout):
            raise StateError("stored arrays differ from the entry's layout")
        for a in arrays:
            if is_mtp(a.name):
                if link.key in self.mtp:
                    self.mtp[link.key][a.name] = a
                continue
            region = self._region(link, a.name, a.dtype, a.shape)
            data = np.asarray(a.data).reshape(a.shape)
            if region is not None:
                span, start, r0, r1 = region
                if r1 > r0:
                    dest = span.host[:, :, r0 - span.lo : r1 - span.lo]
                    dest[...] = data[:, :, r0 - start : r1 - start]
            elif link is self.leaf and a.name in self._whole:
                self._whole[a.name] = data

    def read_targets(self, link: Entry) -> Callable[[dict[str, JSON]], list[memoryview]]:
        """For `DiskTier.read_entry_into`: per array spec, the byte views to read it into."""

        def target(spec: dict[str, JSON]) -> list[memoryview]:
            name, dtype = str(spec["name"]), str(spec["dtype"])
            shape = tuple(int(d) for d in spec["shape"])
            if is_mtp(name) and link.key in self.mtp:
                buf = np.empty(shape, DTYPES[dtype])
                self.mtp[link.key][name] = HostArray(name, dtype, shape, buf)
                return [memoryview(buf.reshape(-1).view(np.uint8))]
            region = self._region(link, name, dtype, shape)
            if region is None:
                if link is self.leaf and name in self._whole:
                    buf = np.empty(shape, DTYPES[dtype])
                    self._whole[name] = buf
                    return [memoryview(buf.reshape(-1).view(np.uint8))]
                return [_scratch(int(spec["nbytes"]))]
            span, start, r0, r1 = region
            # Per (batch, head) the positions x rest block is contiguous, as in the file.
            row = math.prod(shape[3:]) * DTYPES[dtype].itemsize
            head, tail = (r0 - start) * row, (start + shape[2] - r1) * row
            views: list[memoryview] = []
            for b in range(shape[0]):
                for h in range(shape[1]):
                    if head:
                        views.append(_scratch(head))
                    if r1 > r0:
                        body = span.host[b, h, r0 - span.lo : r1 - span.lo]
                        views.append(memoryview(body).cast("B"))
                    if tail:
                        views.append(_scratch(tail))
            return views

        return target

    # -- the end ----------------------------------------------------------------------------
    def finish(self) -> None:
        """Hand the buffers to the caches."""
        arrays: dict[str, mx.array] = {}
        for name, span in self._spans.items():
            if span.filled < self.usable:
                raise StateError(
                    f"{name}: chain holds positions up to {span.filled}, need {self.usable}"
                )
            buf = span.mx_buf if span.mx_buf is not None else mx.array(span.host)
            arrays[name] = buf.view(mx.bfloat16) if span.dtype == "bfloat16" else buf
        for name, data in self._whole.items():
            dtype, shape = self.leaf.layout[name]
            if data.size * data.itemsize != DTYPES[dtype].itemsize * math.prod(shape):
                raise StateError(f"{name}: not read")
            arrays[name] = to_mx(HostArray(name, dtype, tuple(shape), data))
        self._spans.clear()  # no NumPy view may outlive the hand-over
        mx.eval(list(arrays.values()))
        layers.assemble(self.caches, self.docs, arrays, self.usable)


def _link_span(link: Entry, name: str) -> tuple[int, int]:
    """Positions [start, stop) array `name` of `link` holds (its stored count ends at n)."""
    stored = link.layout.get(name)
    if stored is None:
        raise StateError(f"link {link.key[:16]} lacks array {name}")
    return link.n_tokens - int(stored[1][2]), link.n_tokens


def _scratch(nbytes: int) -> memoryview:
    """Fresh memory for bytes read only to be checksummed (never reused: a helper thread may
    still be hashing an earlier piece)."""
    return memoryview(np.empty(nbytes, np.uint8))


def _writable_view(arr: mx.array) -> np.ndarray | None:
    """A NumPy view sharing `arr`'s memory, or None if MLX did not hand out a plain buffer."""
    try:
        view = np.array(arr, copy=False)
    except (TypeError, ValueError):
        return None
    if view.flags.writeable and view.flags.c_contiguous and view.shape == tuple(arr.shape):
        return view
    return None
