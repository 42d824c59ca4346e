"""File format pieces, host conversion of every dtype, keys, fingerprints, probes."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlx_kvserve.cache import codec, entry_key, make_probe, model_fingerprint, probe_matches
from mlx_kvserve.cache.codec import HostArray, Slot
from mlx_kvserve.cache.entry import as_token_array, check_fingerprint
from mlx_kvserve.cache.exceptions import EntryFormatError
from mlx_kvserve.cache.state import to_host, to_mx


@pytest.mark.parametrize(
    "dtype", [mx.float32, mx.float16, mx.bfloat16, mx.int32, mx.uint32, mx.bool_]
)
def test_host_roundtrip_keeps_dtype_and_bits(dtype):
    src = mx.random.normal((1, 2, 5, 8)) * 100
    arr = src > 0 if dtype == mx.bool_ else src.astype(dtype)
    host = to_host("x", arr)
    back = to_mx(host)
    assert back.dtype == arr.dtype and back.shape == arr.shape
    assert mx.array_equal(back, arr).item()
    # The host copy owns its memory: it is not a view of an MLX buffer.
    assert host.data.flags.owndata or host.data.base is None


def test_payload_roundtrip_and_checksum():
    arrays = [
        to_host("a", mx.arange(12, dtype=mx.float32).reshape(3, 4)),
        to_host("b", mx.ones((2, 2), dtype=mx.bfloat16)),
        to_host("c", mx.zeros((0, 4), dtype=mx.float16)),
    ]
    specs, size = codec.array_specs(arrays)
    header = {
        "arrays": specs,
        "payload_bytes": size,
        "payload_sha256": codec.payload_digest(arrays),
    }
    buf = b"".join(a.data.tobytes() for a in arrays)
    out = codec.decode_payload(buf, header)
    assert [(a.name, a.dtype, a.shape) for a in out] == [(a.name, a.dtype, a.shape) for a in arrays]
    for x, y in zip(out, arrays, strict=True):
        assert np.array_equal(x.data.reshape(x.shape), y.data)
    bad = bytearray(buf)
    bad[3] ^= 1
    with pytest.raises(EntryFormatError, match="checksum"):
        codec.decode_payload(bytes(bad), header)
    with pytest.raises(EntryFormatError):
        codec.decode_payload(buf[:-1], header)


def test_specs_must_tile_the_payload():
    arrays = [HostArray("a", "float32", (2, 2), np.zeros(4, dtype="<f4"))]
    specs, size = codec.array_specs(arrays)
    header = {"arrays": specs, "payload_bytes": size}
    codec.check_array_specs(header)
    for broken in (
        {"payload_bytes": size + 4},
        {"arrays": [dict(specs[0], shape=[2, 3])]},
        {"arrays": [dict(specs[0], dtype="float64")]},
        {"arrays": [dict(specs[0], offset=4)]},
        {"arrays": [dict(specs[0], dtype="complex64")]},
    ):
        with pytest.raises(EntryFormatError):
            codec.check_array_specs({**header, **broken})


def test_head_layout_and_prefix_checks():
    head = codec.pack_head({"hello": "world"}, Slot(3, 12.5, codec.FLAG_ANCHOR))
    assert len(head) % codec.ALIGN == 0
    header_len, digest, slot = codec.parse_prefix(head[: codec.PREFIX_SIZE])
    assert codec.parse_header(head[codec.PREFIX_SIZE : codec.PREFIX_SIZE + header_len], digest) == {
        "hello": "world"
    }
    assert (slot.hits, slot.last_used, slot.flags) == (3, 12.5, codec.FLAG_ANCHOR)
    with pytest.raises(EntryFormatError, match="magic"):
        codec.parse_prefix(b"X" * codec.PREFIX_SIZE)
    future = bytearray(head)
    future[8] = 99
    with pytest.raises(EntryFormatError, match="version"):
        codec.parse_prefix(bytes(future[: codec.PREFIX_SIZE]))
    with pytest.raises(EntryFormatError, match="shorter"):
        codec.parse_prefix(head[:10])


def test_garbled_slot_reads_as_none():
    raw = bytearray(Slot(5, 1.0, 0).pack())
    assert Slot.unpack(bytes(raw)) is not None
    raw[2] ^= 0xFF
    assert Slot.unpack(bytes(raw)) is None
    assert Slot.unpack(b"\0" * 5) is None


def test_token_encoding():
    toks = as_token_array([0, 1, 2**32 - 1, 151_000])
    assert list(codec.decode_tokens(codec.encode_tokens(toks))) == [0, 1, 2**32 - 1, 151_000]
    with pytest.raises(ValueError):
        as_token_array([-1])
    with pytest.raises(ValueError):
        as_token_array([2**32])


def test_keys_are_content_addresses():
    k = entry_key("fp", [1, 2, 3])
    assert len(k) == 64 and k == entry_key("fp", np.array([1, 2, 3], dtype=np.int64))
    assert k != entry_key("fp", [1, 2, 3, 4])
    assert k != entry_key("fp2", [1, 2, 3])
    assert k != entry_key("fp", [3, 2, 1])


def test_fingerprints():
    a = model_fingerprint(weights="w1", config={"b": 1, "a": [1, 2]}, tokenizer="t", name="Smol/M2")
    b = model_fingerprint(weights="w1", config={"a": [1, 2], "b": 1}, tokenizer="t", name="Smol/M2")
    assert a == b and a.startswith("smol-m2-")
    assert a != model_fingerprint(weights="w2", config={"b": 1, "a": [1, 2]}, tokenizer="t")
    check_fingerprint(a)
    for bad in ("", "../x", "a/b", ".hidden", "x" * 200):
        with pytest.raises(ValueError):
            check_fingerprint(bad)


def test_probe():
    logits = mx.array(np.linspace(-3, 3, 100, dtype=np.float32)) + mx.random.normal((100,)) * 0.01
    probe = make_probe(logits[None, None, :], position=41, k=5)
    assert probe["position"] == 41 and len(probe["ids"]) == 5
    assert probe["ids"][0] == int(mx.argmax(logits).item())
    assert probe_matches(probe, logits)
    assert probe_matches(probe, logits + 0.01)  # chunking noise is tolerated
    assert not probe_matches(probe, logits[::-1])
    assert not probe_matches(probe, mx.zeros(100))
    assert not probe_matches(probe, mx.full((100,), float("nan")))
    assert probe_matches(probe, np.array(logits))


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16], ids=str)
def test_host_finite_on_every_float_dtype(dtype):
    top = {mx.float32: 3.0e38, mx.float16: 65504.0, mx.bfloat16: 3.0e38}[dtype]
    finite = mx.array([0.0, -0.0, 1e-40, -1.5, top, -top, 1e-7]).astype(dtype)
    assert codec.host_finite(to_host("x", finite))
    for bad in (float("nan"), float("inf"), -float("inf")):
        values = mx.concatenate([finite, mx.array([bad]).astype(dtype)])
        host = to_host("x", values)
        assert not codec.host_finite(host)
        check = codec.finite_check("x", host.dtype)
        with pytest.raises(EntryFormatError, match="x contains NaN or Inf"):
            check(memoryview(host.data).cast("B"))
    assert codec.finite_check("x", "int32") is None
