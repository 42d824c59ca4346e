"""Entry file format: host arrays <-> bytes, with checksums. No MLX here (writer-thread safe).

Layout of `<key>.kvc` (all integers little-endian)::

    offset  size  field
    0       8     magic b"MLXKVC\\r\\n" (the CR/LF catches text-mode mangling)
    8       4     format version (uint32)
    12      4     header length H (uint32)
    16      32    sha256 of the header bytes
    48      32    mutable slot: hits u64, last_used f64, flags u32, reserved u32, crc32 u32, pad
    80      H     header: UTF-8 JSON (see below)
    ...           zero padding to a 64-byte boundary
    P       N     payload: the arrays' raw bytes, each at header["arrays"][i]["offset"] from P

The header holds everything that identifies the entry: format, fingerprint, key, token ids
(base64 of uint32 LE), n_tokens, kind (delta|snapshot), parent key and length, reason, anchor,
created, run_id, per-array name/dtype/shape/offset/nbytes, payload size and sha256, and the
optional behaviour probe. The header is covered by its own sha256 in the fixed prefix; the
payload by the sha256 in the header (sha256 runs at ~1.5-1.8 GB/s with SHA-NI / ARMv8 crypto,
about as fast as a cold read from a fast disk: restores hash in a helper thread while they read,
see `pipeline`).

The 32-byte slot is the only part ever rewritten in place: counters (hits, last use) and flags
(suspect, anchor, departure, evicted: a file whose entry was evicted but that could not be
deleted, which start-up deletes instead of indexing). It is outside both checksums and carries
its own crc32; a torn or garbled slot reads as "no hits, suspect", the conservative answer.
Updates are not fsync'd: losing a hit count to a power cut is harmless; the suspect and evicted
flags are fsync'd when set.
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
import struct
import sys
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np

from mlx_kvserve.cache.exceptions import EntryFormatError
from mlx_kvserve.json_value import JSON

MAGIC = b"MLXKVC\r\n"
FORMAT_VERSION = 2  # 2: per-layer chains (see `plan`); 1: whole-model deltas or snapshots
PREFIX_SIZE = 80
SLOT_OFFSET = 48
SLOT_SIZE = 32
ALIGN = 64
MAX_HEADER = 64 * 1024 * 1024

FLAG_SUSPECT = 1
FLAG_ANCHOR = 2
FLAG_DEPARTURE = 4  # a later request departs at its end: never pruned (see policy)
FLAG_EVICTED = 8  # evicted, but the unlink failed: never indexed again (see disk.DiskTier.delete)

_PREFIX = struct.Struct("<8sII32s")
_SLOT = struct.Struct("<QdII")  # hits, last_used, flags, reserved (then crc32, pad)

if sys.byteorder != "little":  # pragma: no cover - every MLX platform is little-endian
    raise ImportError("the prompt-cache file format assumes a little-endian host")

# name -> numpy storage dtype. bfloat16 has no numpy dtype: its bits travel as uint16.
DTYPES: dict[str, np.dtype] = {
    "bool": np.dtype("?"),
    "uint8": np.dtype("<u1"),
    "uint16": np.dtype("<u2"),
    "uint32": np.dtype("<u4"),
    "uint64": np.dtype("<u8"),
    "int8": np.dtype("<i1"),
    "int16": np.dtype("<i2"),
    "int32": np.dtype("<i4"),
    "int64": np.dtype("<i8"),
    "float16": np.dtype("<f2"),
    "bfloat16": np.dtype("<u2"),
    "float32": np.dtype("<f4"),
    "float64": np.dtype("<f8"),
}
FLOAT_DTYPES = {"float16", "bfloat16", "float32", "float64"}
_EXPONENT_MASKS = {"float16": 0x7C00, "bfloat16": 0x7F80}  # as uint16 bit patterns


@dataclass(frozen=True)
class HostArray:
    """One array as plain bytes: `data` has the storage dtype of `dtype` (see DTYPES)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    data: np.ndarray

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)


@dataclass
class Slot:
    hits: int = 0
    last_used: float = 0.0
    flags: int = 0

    def pack(self) -> bytes:
        body = _SLOT.pack(self.hits, self.last_used, self.flags, 0)
        return body + struct.pack("<I", zlib.crc32(body)) + b"\0" * 4

    @classmethod
    def unpack(cls, raw: bytes) -> Slot | None:
        """None if the slot is torn or garbled."""
        if len(raw) != SLOT_SIZE:
            return None
        body = raw[: _SLOT.size]
        (crc,) = struct.unpack("<I", raw[_SLOT.size : _SLOT.size + 4])
        if zlib.crc32(body) != crc:
            return None
        hits, last_used, flags, _ = _SLOT.unpack(body)
        if not (0 <= hits < 2**48) or last_used != last_used or abs(last_used) > 1e11:
            return None
        return cls(hits, last_used, flags)


def host_finite(a: HostArray) -> bool:
    """False if a float array holds NaN or Inf."""
    if a.dtype not in FLOAT_DTYPES or a.nbytes == 0:
        return True
    return _finite(np.asarray(a.data), a.dtype)


def finite_check(name: str, dtype: str) -> Callable[[memoryview], None] | None:
    """A check that raises if raw bytes of float array `name` hold NaN/Inf (None: not float).

    Restores run it on every piece they read (hundreds per restore), so it is kept lean.
    """
    if dtype not in FLOAT_DTYPES:
        return None
    storage = DTYPES[dtype]

    def check(raw: memoryview) -> None:
        if raw.nbytes and not _finite(np.frombuffer(raw, dtype=storage), dtype):
            raise EntryFormatError(f"{name} contains NaN or Inf")

    return check


def _finite(data: np.ndarray, dtype: str) -> bool:
    """No NaN/Inf in a non-empty float array. 16-bit floats are checked on their bit pattern
    (NaN/Inf: every exponent bit set): bfloat16 has no NumPy dtype, and for float16 it is ~10x
    faster than `np.isfinite`."""
    mask = _EXPONENT_MASKS.get(dtype)
    if mask is not None:
        return int((data.view(np.uint16) & mask).max()) != mask
    return bool(np.isfinite(data).all())


def encode_tokens(tokens: np.ndarray) -> str:
    return base64.b64encode(np.ascontiguousarray(tokens, dtype="<u4").tobytes()).decode()


def decode_tokens(text: str) -> np.ndarray:
    raw = base64.b64decode(text.encode(), validate=True)
    if len(raw) % 4:
        raise EntryFormatError("token bytes are not a multiple of 4")
    return np.frombuffer(raw, dtype="<u4").copy()


def array_specs(arrays: Iterable[HostArray]) -> tuple[list[dict[str, JSON]], int]:
    """Per-array header records with payload offsets; returns (specs, payload size)."""
    specs = []
    offset = 0
    for arr in arrays:
        expected = math.prod(arr.shape) * DTYPES[arr.dtype].itemsize
        if expected != arr.nbytes:
            raise ValueError(f"array {arr.name}: {arr.nbytes} bytes for {arr.dtype}{arr.shape}")
        specs.append(
            {
                "name": arr.name,
                "dtype": arr.dtype,
                "shape": list(arr.shape),
                "offset": offset,
                "nbytes": arr.nbytes,
            }
        )
        offset += arr.nbytes
    return specs, offset


def byte_view(data: np.ndarray) -> memoryview:
    """Flat byte view of an array (zero-copy when contiguous; works for empty arrays)."""
    return memoryview(np.ascontiguousarray(data).reshape(-1).view(np.uint8))


def payload_digest(arrays: Iterable[HostArray]) -> str:
    h = hashlib.sha256()
    for arr in arrays:
        h.update(byte_view(arr.data))
    return h.hexdigest()


def payload_start(header_len: int) -> int:
    end = PREFIX_SIZE + header_len
    return (end + ALIGN - 1) // ALIGN * ALIGN


def pack_head(header: dict[str, JSON], slot: Slot) -> bytes:
    """Fixed prefix + JSON header + padding: everything before the payload."""
    body = json.dumps(header, separators=(",", ":"), sort_keys=True).encode()
    if len(body) > MAX_HEADER:
        raise ValueError("entry header too large")
    prefix = _PREFIX.pack(MAGIC, FORMAT_VERSION, len(body), hashlib.sha256(body).digest())
    head = prefix + slot.pack() + body
    return head + b"\0" * (payload_start(len(body)) - len(head))


@dataclass
class ParsedHead:
    header: dict[str, JSON]
    slot: Slot | None
    payload_offset: int


def parse_prefix(raw: bytes) -> tuple[int, bytes, Slot | None]:
    """Validate magic/version; returns (header length, header digest, slot)."""
    if len(raw) < PREFIX_SIZE:
        raise EntryFormatError("file shorter than its fixed prefix")
    magic, version, header_len, digest = _PREFIX.unpack(raw[: _PREFIX.size])
    if magic != MAGIC:
        raise EntryFormatError("bad magic")
    if version != FORMAT_VERSION:
        raise EntryFormatError(f"format version {version}, expected {FORMAT_VERSION}")
    if not 0 < header_len <= MAX_HEADER:
        raise EntryFormatError(f"implausible header length {header_len}")
    slot = Slot.unpack(raw[SLOT_OFFSET : SLOT_OFFSET + SLOT_SIZE])
    return header_len, digest, slot


def parse_header(body: bytes, digest: bytes) -> dict[str, JSON]:
    if hashlib.sha256(body).digest() != digest:
        raise EntryFormatError("header checksum mismatch")
    try:
        header = json.loads(body.decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise EntryFormatError(f"header is not JSON: {exc}") from None
    if not isinstance(header, dict):
        raise EntryFormatError("header is not an object")
    return header


def check_array_specs(header: dict[str, JSON]) -> list[dict[str, JSON]]:
    """Array records must tile the payload exactly, with sizes that match dtype x shape."""
    specs = header.get("arrays")
    payload_bytes = header.get("payload_bytes")
    if not isinstance(specs, list) or not isinstance(payload_bytes, int):
        raise EntryFormatError("header lacks array specs")
    offset = 0
    for spec in specs:
        try:
            dtype = DTYPES[spec["dtype"]]
            shape = [int(d) for d in spec["shape"]]
            nbytes = int(spec["nbytes"])
            start = int(spec["offset"])
            str(spec["name"])
        except (KeyError, TypeError, ValueError):
            raise EntryFormatError(f"bad array spec {spec!r}") from None
        if any(d < 0 for d in shape) or start != offset:
            raise EntryFormatError(f"bad array spec {spec!r}")
        if math.prod(shape) * dtype.itemsize != nbytes:
            raise EntryFormatError(f"array {spec['name']}: size does not match dtype x shape")
        offset += nbytes
    if offset != payload_bytes:
        raise EntryFormatError("array specs do not tile the payload")
    return specs


def first_nonfinite(buf: bytes | memoryview, specs: list[dict[str, JSON]]) -> str | None:
    """The name of the first float array of a payload holding NaN/Inf, or None. A payload of
    one float dtype (a KV model's) is scanned in one pass: a chain of short links has many
    small arrays, and a call per array cost more than the scan."""
    dtypes = {str(s["dtype"]) for s in specs}
    one = dtypes.pop() if len(dtypes) == 1 else None
    if one in FLOAT_DTYPES and len(buf) and _finite(np.frombuffer(buf, DTYPES[one]), one):
        return None
    for spec in specs:
        dtype = str(spec["dtype"])
        if dtype in FLOAT_DTYPES and spec["nbytes"]:
            start = spec["offset"]
            data = np.frombuffer(
                buf, DTYPES[dtype], spec["nbytes"] // DTYPES[dtype].itemsize, start
            )
            if not _finite(data, dtype):
                return str(spec["name"])
    return None


def decode_payload(
    buf: bytes | memoryview, header: dict[str, JSON], *, specs_checked: bool = False
) -> list[HostArray]:
    """Verify the payload checksum and slice it into host arrays (zero-copy views of `buf`).

    `specs_checked`: the header's array specs passed `check_array_specs` already."""
    specs = header["arrays"] if specs_checked else check_array_specs(header)
    if len(buf) != header["payload_bytes"]:
        claimed = header["payload_bytes"]
        raise EntryFormatError(f"payload is {len(buf)} bytes, header says {claimed}")
    if hashlib.sha256(buf).hexdigest() != header.get("payload_sha256"):
        raise EntryFormatError("payload checksum mismatch")
    arrays = []
    for spec in specs:
        dtype = DTYPES[spec["dtype"]]
        count = spec["nbytes"] // dtype.itemsize
        data = np.frombuffer(buf, dtype=dtype, count=count, offset=spec["offset"])
        arrays.append(HostArray(spec["name"], spec["dtype"], tuple(spec["shape"]), data))
    return arrays
