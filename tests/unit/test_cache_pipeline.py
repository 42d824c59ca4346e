"""Pipelined disk reads: the checksum is computed by a helper thread while the file is read, and
the NaN/Inf scan runs piece by piece. Damage anywhere, in any piece, must still be refused, and
the helper never outlives a read. Pieces are made tiny here so that tiny entries span many."""

from __future__ import annotations

import hashlib
import io
import threading

import numpy as np
import pytest
from mlx_lm.models.cache import KVCache

from mlx_kvserve.cache import CacheRestoreError, codec, pipeline
from mlx_kvserve.cache.codec import HostArray
from mlx_kvserve.cache.exceptions import EntryFormatError
from tests.support.cache_testing import kv_arrays, make_kv
from tests.unit.test_cache_disk import T, build_chain, entry_path, open_cache, rewrite

CHUNK = 256


@pytest.fixture(autouse=True, params=[CHUNK, 1 << 20], ids=["tiny-pieces", "whole-blocks"])
def pipelined(request, monkeypatch):
    """Every read goes through the helper thread, in pieces of CHUNK bytes (or, with the real
    1 MiB, one piece per (batch, head) block)."""
    monkeypatch.setattr(pipeline, "CHUNK", request.param)
    monkeypatch.setattr(pipeline, "PIPELINE_FROM", 0)


def hash_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "kvcache-hash"]


def restore_leaf(root):
    pc = open_cache(root, ram_budget=0)  # nothing in RAM: every link is read from its file
    m = pc.lookup(T[:350])
    assert m.usable == 300 and m.source == "disk"
    caches = [KVCache(), KVCache()]
    try:
        pc.restore(m, caches, tokens=T[:350])
    finally:
        pc.close()
    return caches


def payload_offset(path) -> tuple[int, int]:
    """(payload start, payload size) of an entry file."""
    raw = path.read_bytes()
    header_len, digest, _ = codec.parse_prefix(raw[: codec.PREFIX_SIZE])
    header = codec.parse_header(raw[codec.PREFIX_SIZE : codec.PREFIX_SIZE + header_len], digest)
    return codec.payload_start(header_len), header["payload_bytes"]


def test_pipelined_restore_is_bit_exact(tmp_path):
    build_chain(tmp_path)
    caches = restore_leaf(tmp_path)
    for a, b in zip(kv_arrays(caches), kv_arrays(make_kv(300)), strict=True):
        assert np.array_equal(a, b)
    assert hash_threads() == []


@pytest.mark.parametrize("where", ["first", "second-piece", "middle", "last"])
@pytest.mark.parametrize("link", [0, 2])
def test_a_flipped_byte_in_any_piece_is_refused(tmp_path, where, link):
    keys = build_chain(tmp_path)
    path = entry_path(tmp_path, keys[link])
    start, size = payload_offset(path)
    assert size > 8 * CHUNK  # many pieces (blocks), so "second" and "middle" are inner ones
    at = {"first": 0, "second-piece": CHUNK + 7, "middle": size // 2, "last": size - 1}[where]
    raw = bytearray(path.read_bytes())
    raw[start + at] ^= 0x01  # the low mantissa bit: still a finite float
    path.write_bytes(bytes(raw))
    with pytest.raises(CacheRestoreError) as info:
        restore_leaf(tmp_path)
    assert info.value.key == keys[link]
    assert "checksum" in info.value.problem
    assert hash_threads() == []


@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_nan_in_the_last_piece_is_refused(tmp_path, value):
    keys = build_chain(tmp_path)

    def poison_last(arrays):
        a = arrays[-1]
        data = a.data.view("<f4").copy()
        data[-1] = value
        return [*arrays[:-1], HostArray(a.name, a.dtype, a.shape, data)]

    rewrite(entry_path(tmp_path, keys[2]), mutate_arrays=poison_last)  # valid checksums
    with pytest.raises(CacheRestoreError) as info:
        restore_leaf(tmp_path)
    assert info.value.key == keys[2]
    assert "NaN or Inf" in info.value.problem and "p.1.1" in info.value.problem  # layer 1's values
    assert hash_threads() == []


def test_read_verified_stops_its_helper_on_every_failure():
    data = np.arange(4096, dtype=np.float32)
    raw = data.tobytes()
    digest = hashlib.sha256(raw).hexdigest()
    out = np.zeros_like(data)
    view = memoryview(out).cast("B")
    check = codec.finite_check("x", "float32")

    pipeline.read_verified(io.BytesIO(raw), [(view, check)], len(raw), digest)
    assert np.array_equal(out, data)

    failures = {
        "truncated": (raw[:-10], [(view, check)], "truncated"),
        "wrong digest": (raw, [(view, check)], "checksum"),
        "nan": (raw[:-4] + np.float32(np.nan).tobytes(), [(view, check)], "NaN"),
    }
    for name, (content, targets, message) in failures.items():
        wanted = digest if name != "wrong digest" else "0" * 64
        with pytest.raises(EntryFormatError, match=message):
            pipeline.read_verified(io.BytesIO(content), targets, len(raw), wanted)
        assert hash_threads() == [], name

    def raising_targets():
        yield view[:CHUNK], check
        raise EntryFormatError("layout problem")

    with pytest.raises(EntryFormatError, match="layout problem"):
        pipeline.read_verified(io.BytesIO(raw), raising_targets(), len(raw), digest)
    assert hash_threads() == []


def test_pieces_never_split_an_element():
    view = memoryview(bytearray(1000))
    got = list(pipeline.pieces(view, 100))
    assert [p.nbytes for p in got] == [96] * 10 + [40]
    assert b"".join(bytes(p) for p in got) == bytes(view)
