"""Disk tier: format checks, corruption matrix, crash recovery, locking, permissions, ENOSPC."""

from __future__ import annotations

import errno
import logging
import os
import signal
import stat
import subprocess
import sys
import textwrap
import threading

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache

from mlx_kvserve.cache import CacheLockedError, CacheRestoreError, PromptCache, codec, probe_matches
from mlx_kvserve.cache import header as header_module
from mlx_kvserve.cache import restore as restore_module
from mlx_kvserve.cache.codec import HostArray
from mlx_kvserve.cache.disk import DiskTier
from tests.support.cache_testing import kv_arrays, make_kv, rebuild_benchmark

MiB = 1 << 20
FP = "model-a"
T = list(range(2000, 2400))


def open_cache(path, fp=FP, **kw):
    kw.setdefault("disk_budget", 64 * MiB)
    kw.setdefault("ram_budget", 64 * MiB)
    return PromptCache(path, fp, **kw)


def entry_path(root, key, fp=FP):
    return root / fp / f"{key}.kvc"


def build_chain(root):
    """root (100 tokens) <- child (200) <- grandchild (300); returns their keys."""
    pc = open_cache(root)
    keys = [pc.checkpoint(T[:n], make_kv(n), "message") for n in (100, 200, 300)]
    pc.close()
    return keys


def rewrite(path, mutate_header=None, mutate_arrays=None):
    """Rewrite an entry with edited header/arrays and *valid* checksums (a lying file)."""
    raw = path.read_bytes()
    header_len, digest, slot = codec.parse_prefix(raw[: codec.PREFIX_SIZE])
    header = codec.parse_header(raw[codec.PREFIX_SIZE : codec.PREFIX_SIZE + header_len], digest)
    arrays = codec.decode_payload(memoryview(raw)[codec.payload_start(header_len) :], header)
    arrays = [HostArray(a.name, a.dtype, a.shape, np.array(a.data)) for a in arrays]
    if mutate_arrays:
        arrays = mutate_arrays(arrays)
    specs, size = codec.array_specs(arrays)
    header.update(arrays=specs, payload_bytes=size, payload_sha256=codec.payload_digest(arrays))
    if mutate_header:
        mutate_header(header)
    head = codec.pack_head(header, slot or codec.Slot())
    path.write_bytes(head + b"".join(a.data.tobytes() for a in arrays))


def restore(pc, prompt, layers=2, **kw):
    m = pc.lookup(prompt)
    fresh = [KVCache() for _ in range(layers)]
    if m.hit:
        pc.restore(m, fresh, **kw)
    return m, fresh


# -- layout, permissions --------------------------------------------------------------------
def test_file_format_and_permissions(tmp_path):
    old = os.umask(0)
    try:
        pc = open_cache(tmp_path / "kv")
        key = pc.checkpoint(T[:100], make_kv(100), "message")
        pc.close()
    finally:
        os.umask(old)
    d = tmp_path / "kv" / FP
    assert stat.S_IMODE((tmp_path / "kv").stat().st_mode) == 0o700
    assert stat.S_IMODE(d.stat().st_mode) == 0o700
    for f in d.iterdir():
        assert stat.S_IMODE(f.stat().st_mode) == 0o600, f.name
    raw = entry_path(tmp_path / "kv", key).read_bytes()
    assert raw[:8] == codec.MAGIC
    header_len, digest, slot = codec.parse_prefix(raw[: codec.PREFIX_SIZE])
    header = codec.parse_header(raw[codec.PREFIX_SIZE : codec.PREFIX_SIZE + header_len], digest)
    assert header["n_tokens"] == 100 and header["kind"] == "delta"
    assert header["fingerprint"] == FP and header["key"] == key
    assert list(codec.decode_tokens(header["tokens"])) == T[:100]
    assert header["payload_bytes"] == 2 * 2 * 2 * 8 * 100 * 4  # sliced to 100, not 256
    assert len(raw) == codec.payload_start(header_len) + header["payload_bytes"]
    assert not (d / "RUNNING").exists()  # clean close removes the run marker


# -- corruption matrix ----------------------------------------------------------------------
def _truncate(p):
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])


def _zero(p):
    p.write_bytes(b"\0" * p.stat().st_size)


def _random(p):
    p.write_bytes(np.random.default_rng(1).bytes(p.stat().st_size))


def _flip_payload_bit(p):
    raw = bytearray(p.read_bytes())
    raw[-100] ^= 0x10
    p.write_bytes(bytes(raw))


def _more_tokens(p):
    rewrite(p, mutate_header=lambda h: h.update(n_tokens=h["n_tokens"] + 50))


def _foreign_fingerprint(p):
    rewrite(p, mutate_header=lambda h: h.update(fingerprint="model-b"))


def _header_garbage(p):
    raw = bytearray(p.read_bytes())
    raw[codec.PREFIX_SIZE + 5] ^= 0xFF
    p.write_bytes(bytes(raw))


CORRUPTIONS = {
    "truncated": _truncate,
    "zero-filled": _zero,
    "random-bytes": _random,
    "flipped-payload-bit": _flip_payload_bit,
    "header-claims-more-tokens": _more_tokens,
    "wrong-fingerprint": _foreign_fingerprint,
    "header-bit-flip": _header_garbage,
}


@pytest.mark.parametrize("corrupt", list(CORRUPTIONS), ids=list(CORRUPTIONS))
def test_corruption_while_running_evicts_entry_and_dependents(tmp_path, corrupt):
    keys = build_chain(tmp_path)
    pc = open_cache(tmp_path, ram_budget=0)  # nothing in RAM: restores read the files
    CORRUPTIONS[corrupt](entry_path(tmp_path, keys[0]))
    m = pc.lookup(T[:350])
    assert m.key == keys[2] and m.usable == 300 and m.source == "disk"
    with pytest.raises(CacheRestoreError) as info:
        pc.restore(m, [KVCache(), KVCache()])
    assert info.value.key == keys[0]  # the damaged link is blamed, not the leaf
    removed = pc.evict(info.value.key, info.value.problem)
    assert sorted(removed) == sorted(keys)
    assert pc.lookup(T[:350]).usable == 0
    assert not any(entry_path(tmp_path, k).exists() for k in keys)
    # Nothing is barred: a sound state for the same tokens is stored again, under its key.
    assert pc.checkpoint(T[:100], make_kv(100), "message") == keys[0]
    assert pc.checkpoint(T[:150], make_kv(150), "message") is not None
    pc.close()


@pytest.mark.parametrize("corrupt", list(CORRUPTIONS), ids=list(CORRUPTIONS))
def test_corruption_at_rest_never_served(tmp_path, corrupt, caplog):
    keys = build_chain(tmp_path)
    CORRUPTIONS[corrupt](entry_path(tmp_path, keys[1]))
    pc = open_cache(tmp_path, ram_budget=0)
    m = pc.lookup(T[:350])
    if m.usable > 100:
        # Damage the header checks cannot see (payload bits) is caught by the checksum.
        with pytest.raises(CacheRestoreError) as info:
            pc.restore(m, [KVCache(), KVCache()])
        assert info.value.key == keys[1]
        pc.evict(info.value.key, info.value.problem)
        m = pc.lookup(T[:350])
    # Damaged entries and their dependents are gone; the intact root still serves.
    assert m.key == keys[0] and m.usable == 100
    _, caches = restore(pc, T[:350])
    for a, b in zip(kv_arrays(caches), kv_arrays(make_kv(100)), strict=True):
        assert np.array_equal(a, b)
    assert {e.key for e in pc.entries()} == {keys[0]}
    assert not entry_path(tmp_path, keys[1]).exists()
    assert not entry_path(tmp_path, keys[2]).exists()
    pc.close()


def test_wrong_dtype_refused(tmp_path):
    (key,) = build_chain(tmp_path)[:1]

    def to_f16(arrays):
        return [
            HostArray(a.name, "float16", a.shape, a.data.view("<f4").astype("<f2")) for a in arrays
        ]

    rewrite(entry_path(tmp_path, key), mutate_arrays=to_f16)
    pc = open_cache(tmp_path)
    m = pc.lookup(T[:101])
    assert m.key == key  # a self-consistent file: only the dtype is wrong
    with pytest.raises(CacheRestoreError) as info:
        pc.restore(m, [KVCache(), KVCache()], dtype=mx.float32)
    assert info.value.key == key
    pc.evict(key, info.value.problem)
    # Without a dtype hint, the layout learned from live checkpoints catches it too.
    pc.close()
    build_chain(tmp_path)
    rewrite(entry_path(tmp_path, key), mutate_arrays=to_f16)
    pc = open_cache(tmp_path)
    pc.checkpoint([1, 2, 3], make_kv(3), "message")  # live float32 KV
    with pytest.raises(CacheRestoreError):
        pc.restore(pc.lookup(T[:101]), [KVCache(), KVCache()])
    pc.close()


def test_nan_in_kv_refused(tmp_path):
    keys = build_chain(tmp_path)

    def poison(arrays):
        a = arrays[0]
        data = a.data.view("<f4").copy()
        data[3] = np.nan
        return [HostArray(a.name, a.dtype, a.shape, data), *arrays[1:]]

    rewrite(entry_path(tmp_path, keys[1]), mutate_arrays=poison)
    pc = open_cache(tmp_path)
    with pytest.raises(CacheRestoreError) as info:
        pc.restore(pc.lookup(T[:350]), [KVCache(), KVCache()])
    assert info.value.key == keys[1]
    assert "NaN" in info.value.problem
    assert sorted(pc.evict(keys[1], "nan")) == sorted(keys[1:])
    assert pc.verify() == []
    pc.close()


def test_verify_reports_bad_files(tmp_path):
    keys = build_chain(tmp_path)
    pc = open_cache(tmp_path)
    assert pc.verify() == []
    _flip_payload_bit(entry_path(tmp_path, keys[2]))
    problems = pc.verify()
    assert [k for k, _ in problems] == [keys[2]]
    assert "checksum" in problems[0][1]
    pc.close()


# -- start-up: temp files, orphans, rebuild -------------------------------------------------
def test_temp_leftovers_swept_and_orphans_dropped(tmp_path):
    keys = build_chain(tmp_path)
    d = tmp_path / FP
    (d / f".tmp.{keys[0]}.123.0").write_bytes(b"partial write")
    (d / ".tmp.RUNNING.1").write_bytes(b"{}")
    entry_path(tmp_path, keys[1]).unlink()  # the middle link vanished
    pc = open_cache(tmp_path)
    assert {e.key for e in pc.entries()} == {keys[0]}
    assert not entry_path(tmp_path, keys[2]).exists()  # orphan deleted
    assert not [p for p in d.iterdir() if p.name.startswith(".tmp.")]
    pc.close()


def test_restart_rebuilds_index_and_counters(tmp_path):
    keys = build_chain(tmp_path)
    pc = open_cache(tmp_path)
    restore(pc, T[:350])
    restore(pc, T[:350])
    pc.close()
    pc = open_cache(tmp_path)
    infos = {e.key: e for e in pc.entries()}
    assert set(infos) == set(keys)
    assert infos[keys[2]].hits == 2 and infos[keys[0]].hits == 2  # slots persisted
    assert infos[keys[1]].parent == keys[0] and infos[keys[2]].parent == keys[1]
    assert not any(e.suspect for e in infos.values())
    m, caches = restore(pc, T[:350])
    assert m.usable == 300
    for a, b in zip(kv_arrays(caches), kv_arrays(make_kv(300)), strict=True):
        assert np.array_equal(a, b)
    pc.close()


def test_fingerprints_are_separate(tmp_path):
    build_chain(tmp_path)
    other = open_cache(tmp_path, fp="model-b")
    assert other.lookup(T[:350]).usable == 0
    other.close()


def test_rebuild_with_1000_entries(tmp_path):
    result = rebuild_benchmark(tmp_path, n_entries=1000, tokens=16)
    assert result["entries"] == 1000
    print(f"\nrebuild of 1000 entries: {result['rebuild_seconds'] * 1000:.1f} ms")


# -- locking -------------------------------------------------------------------------------
def test_second_instance_is_refused(tmp_path):
    pc = open_cache(tmp_path)
    with pytest.raises(CacheLockedError, match="in use by another process"):
        open_cache(tmp_path)
    pc.close()
    open_cache(tmp_path).close()  # free again after a clean close


def test_lock_held_by_another_process(tmp_path):
    code = textwrap.dedent(
        f"""
        import sys, time
        from mlx_kvserve.cache import PromptCache
        pc = PromptCache({str(tmp_path)!r}, {FP!r}, disk_budget=1 << 26, ram_budget=0)
        print("ready", flush=True)
        sys.stdin.readline()
        """
    )
    child = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout.readline().strip() == "ready"
        with pytest.raises(CacheLockedError, match=f"pid {child.pid}"):
            open_cache(tmp_path)
    finally:
        child.kill()
        child.wait()
    open_cache(tmp_path).close()  # the kernel released the flock with the process


# -- unclean shutdown -----------------------------------------------------------------------
CRASHER = textwrap.dedent(
    """
    import os, signal, sys
    import mlx.core as mx
    from mlx_kvserve.cache import PromptCache
    from tests.support.cache_testing import make_kv
    root, n, flush = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1"
    pc = PromptCache(root, "model-a", disk_budget=1 << 30, ram_budget=1 << 30)
    toks = list(range(2000, 2400))
    for i in range(1, n + 1):
        caches = make_kv(20 * i)
        logits = mx.arange(50, dtype=mx.float32) * 0.1 * i
        pc.checkpoint(toks[: 20 * i], caches, "message", probe=logits)
    if flush:
        pc.flush()
    os.kill(os.getpid(), signal.SIGKILL)
    """
)


def crash_child(root, n, *, flush=True):
    proc = subprocess.run([sys.executable, "-c", CRASHER, str(root), str(n), "1" if flush else "0"])
    assert proc.returncode == -signal.SIGKILL


def test_unclean_shutdown_marks_entries_suspect(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="mlx_kvserve.cache")
    crash_child(tmp_path, 3)
    pc = open_cache(tmp_path)
    assert pc.unclean_start
    assert "did not shut down cleanly" in caplog.text
    infos = pc.entries()
    assert len(infos) == 3 and all(e.suspect for e in infos)
    m = pc.lookup(T[:61])
    assert m.suspect and m.usable == 60
    # The stored probe describes the output at the entry's last position.
    assert m.probe["position"] == 59
    good = mx.arange(50, dtype=mx.float32) * 0.1 * 3
    assert probe_matches(m.probe, good)
    assert not probe_matches(m.probe, mx.zeros(50))
    assert not probe_matches(m.probe, mx.full((50,), float("nan")))
    _, caches = restore(pc, T[:61])
    pc.mark_verified(m.key)
    assert not pc.lookup(T[:61]).suspect
    # New entries of this run are not suspect.
    pc.checkpoint(T[:200], make_kv(200), "message")
    pc.close()
    pc = open_cache(tmp_path)
    assert not pc.unclean_start
    assert not any(e.suspect for e in pc.entries())  # verification was persisted
    pc.close()


def test_suspicion_survives_a_second_crash(tmp_path):
    crash_child(tmp_path, 2)
    pc = open_cache(tmp_path)  # suspect stamped, then this run "crashes" too:
    pc._writer.stop()
    pc.disk.release_lock()
    pc = open_cache(tmp_path)
    assert all(e.suspect for e in pc.entries())
    pc.close()


@pytest.mark.parametrize("n", [1, 3, 6, 10, 15])
def test_kill_with_writes_in_flight_leaves_only_complete_entries(tmp_path, n):
    crash_child(tmp_path, n, flush=False)
    pc = open_cache(tmp_path)
    assert pc.verify() == []
    for info in pc.entries():
        m, caches = restore(pc, T[: info.n_tokens + 1])
        assert m.usable == info.n_tokens
        for a, b in zip(kv_arrays(caches), kv_arrays(make_kv(info.n_tokens)), strict=True):
            assert np.array_equal(a, b)
    assert not [p for p in (tmp_path / FP).iterdir() if p.name.startswith(".tmp.")]
    pc.close()


# -- full disk -----------------------------------------------------------------------------
def test_enospc_logs_once_keeps_serving_and_recovers(tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="mlx_kvserve.cache")
    real = DiskTier.write_entry
    full = {"on": False}

    def maybe_full(self, *args, **kw):
        if full["on"]:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, *args, **kw)

    monkeypatch.setattr(DiskTier, "write_entry", maybe_full)
    pc = open_cache(tmp_path)
    base = pc.checkpoint(T[:50], make_kv(50), "message")
    pc.flush()
    full["on"] = True
    for n in (100, 150, 200):
        assert pc.checkpoint(T[:n], make_kv(n), "message") is not None
    pc.flush()
    warnings = [r for r in caplog.records if "disk write failed" in r.message]
    assert len(warnings) == 1
    # each failed write counts (a checkpoint the writer reached only after a longer one made it
    # redundant is dropped unwritten, so under load fewer than three may be tried)
    assert 1 <= pc.stats()["write_errors"] <= 3 and pc.stats()["disk_writes_failing"]
    # Still served, from RAM.
    m, caches = restore(pc, T[:250])
    assert m.usable == 200 and m.source == "ram"
    # Space returns: the next checkpoint is written (chained to what is on disk).
    full["on"] = False
    key = pc.checkpoint(T[:250], make_kv(250), "message")
    pc.flush()
    assert entry_path(tmp_path, key).exists()
    assert "disk writes resumed" in caplog.text
    info = {e.key: e for e in pc.entries()}[key]
    assert info.parent == base and info.disk == "written"
    pc.close()
    pc = open_cache(tmp_path)
    m, caches = restore(pc, T[:300])
    assert m.usable == 250
    for a, b in zip(kv_arrays(caches), kv_arrays(make_kv(250)), strict=True):
        assert np.array_equal(a, b)
    pc.close()


def test_evicted_pending_write_never_lands(tmp_path, monkeypatch):
    """Evicting an entry whose write is still queued cancels it: the file never appears."""
    import threading

    gate = threading.Event()
    real = DiskTier.write_entry

    def slow(self, *args, **kw):
        gate.wait(10)
        return real(self, *args, **kw)

    monkeypatch.setattr(DiskTier, "write_entry", slow)
    pc = open_cache(tmp_path)
    key = pc.checkpoint(T[:50], make_kv(50), "message")
    assert pc.evict(key, "test") == [key]
    gate.set()
    pc.flush()
    assert not entry_path(tmp_path, key).exists()
    assert pc.entries() == []
    pc.close()


def test_hot_hit_never_reads_disk(tmp_path, monkeypatch):
    pc = open_cache(tmp_path)
    pc.checkpoint(T[:100], make_kv(100), "message")
    pc.flush()

    def boom(*a, **k):
        raise AssertionError("disk read on a RAM hit")

    monkeypatch.setattr(DiskTier, "read_entry", boom)
    monkeypatch.setattr(DiskTier, "read_entry_into", boom)
    m, _ = restore(pc, T[:101])
    assert m.source == "ram" and m.usable == 100
    pc.close()


def test_clear(tmp_path):
    build_chain(tmp_path)
    pc = open_cache(tmp_path)
    assert pc.clear() == 3
    assert pc.entries() == [] and not list((tmp_path / FP).glob("*.kvc"))
    pc.close()


def test_read_only_view_and_model_directories(tmp_path):
    from mlx_kvserve.cache import model_directories

    keys = build_chain(tmp_path)
    server = open_cache(tmp_path)  # holds the lock
    view = open_cache(tmp_path, read_only=True)  # `cache ls` next to a running server
    assert {e.key for e in view.entries()} == set(keys)
    assert view.verify() == []
    assert view.checkpoint(T[:10], make_kv(10), "m") is None
    view.close()
    dirs = model_directories(tmp_path)
    assert [(d["fingerprint"], d["entries"], d["run_marker"]) for d in dirs] == [(FP, 3, True)]
    server.close()
    assert not model_directories(tmp_path)[0]["run_marker"]


def test_probe_check_after_restore(tmp_path):
    pc = open_cache(tmp_path)
    logits = mx.arange(50, dtype=mx.float32) * 0.1
    key = pc.checkpoint(T[:100], make_kv(100), "message", probe=logits)
    m = pc.lookup(T[:150])
    assert m.key == key and m.usable == 100
    p = m.for_probe()
    assert p.usable == 99 and p.probe["position"] == 99
    _, caches = restore(pc, T[:150])
    assert caches[0].offset == 100
    assert pc.lookup(T[:60]).for_probe().usable == 59  # probe position not restored anyway
    pc.close()


# -- fuzzing: damage anywhere never crashes and never yields wrong state ----------------------
def _check_never_wrong(root, keys):
    pc = open_cache(root, ram_budget=0)
    for _ in range(4):
        m = pc.lookup(T[:350])
        if not m.hit:
            break
        fresh = [KVCache(), KVCache()]
        try:
            pc.restore(m, fresh)
        except CacheRestoreError as err:
            assert pc.evict(err.key, err.problem)
            continue
        for a, b in zip(kv_arrays(fresh), kv_arrays(make_kv(m.usable)), strict=True):
            assert np.array_equal(a, b)
        break
    assert pc.verify() == []
    pc.close()


@pytest.mark.parametrize("seed", range(40))
def test_random_damage(tmp_path, seed):
    rng = np.random.default_rng(seed)
    keys = build_chain(tmp_path)
    path = entry_path(tmp_path, keys[rng.integers(3)])
    raw = bytearray(path.read_bytes())
    where = int(rng.integers(len(raw)))
    span = int(rng.integers(1, 64))
    raw[where : where + span] = rng.bytes(len(raw[where : where + span]))
    if seed % 5 == 0:
        raw = raw[: int(rng.integers(len(raw)))]
    path.write_bytes(bytes(raw))
    _check_never_wrong(tmp_path, keys)


HEADER_LIES = {
    "kind": lambda h: h.update(kind="snapshot"),
    "parent_len": lambda h: h.update(parent_len=max(1, h["parent_len"] - 1)),
    "parent": lambda h: h.update(parent="0" * 64),
    "meta": lambda h: h.update(meta=[1, 2]),
    "probe": lambda h: h.update(probe={"position": "x"}),
    "created": lambda h: h.update(created="yesterday"),
    "arrays-shape": lambda h: h["arrays"][0].update(shape=[1, 2, 50, 16]),
    "arrays-name": lambda h: h["arrays"][0].update(name="k.9"),
    "payload-digest": lambda h: h.update(payload_sha256="f" * 64),
    "format": lambda h: h.update(format=1),  # the layout before per-layer chains
    "layer-lo": lambda h: h["meta"]["layers"][0].update(lo=5),
    "layer-mode": lambda h: h["meta"]["layers"][0].update(mode="whole"),
    "layer-class": lambda h: h["meta"]["layers"][1].update({"class": "RotatingKVCache"}),
    "layer-missing": lambda h: h["meta"]["layers"].pop(),
    "layer-arrays": lambda h: h["meta"]["layers"][0]["arrays"].reverse(),
    "tokens": lambda h: h.update(tokens=codec.encode_tokens(np.arange(h["n_tokens"]))),
}


@pytest.mark.parametrize("lie", list(HEADER_LIES), ids=list(HEADER_LIES))
@pytest.mark.parametrize("victim", [0, 1])
def test_self_consistent_lying_headers(tmp_path, lie, victim):
    keys = build_chain(tmp_path)
    rewrite(entry_path(tmp_path, keys[victim]), mutate_header=HEADER_LIES[lie])
    _check_never_wrong(tmp_path, keys)


def test_evict_takes_a_link_and_its_dependents_never_its_parent(tmp_path):
    keys = build_chain(tmp_path)
    pc = open_cache(tmp_path)
    other = pc.checkpoint([1] * 30, make_kv(30), "message")
    m = pc.lookup(T[:350])
    links = pc.links(m.key, m.usable)
    assert links == [(keys[0], 0), (keys[1], 100), (keys[2], 200)]  # root first
    assert pc.links(m.key, 150) == links[:2]  # a restore of 150 tokens reads two links
    assert sorted(pc.evict(keys[1], "nan logits")) == sorted(keys[1:])
    assert {e.key for e in pc.entries()} == {keys[0], other}
    assert entry_path(tmp_path, keys[0]).exists()
    assert pc.lookup(T[:350]).usable == 100  # the parent serves what it holds
    assert pc.links(keys[2], 300) == []  # gone
    assert pc.evict("f" * 64, "unknown") == []
    pc.close()


def test_disk_restore_reads_into_the_caches_and_promotes_off_the_hot_path(tmp_path, monkeypatch):
    """A chain of large links read from disk lands in the model's buffers directly (no
    whole-file read on the restore path); the writer thread then reads it back into RAM for the
    next hit."""
    build_chain(tmp_path)
    monkeypatch.setattr(restore_module, "SMALL_LINK_BYTES", 0)  # every link counts as large
    pc = open_cache(tmp_path)
    calls = []
    real = DiskTier.read_entry

    def counted(self, key, **kw):
        calls.append(threading.current_thread().name)
        return real(self, key, **kw)

    monkeypatch.setattr(DiskTier, "read_entry", counted)
    n = max(e.n_tokens for e in pc.entries())
    m = pc.lookup(T[: n + 1])
    caches = [KVCache(), KVCache()]
    pc.restore(m, caches, tokens=T[: n + 1])
    assert m.source == "disk" and m.usable == n
    assert all(name == "kvcache-writer" for name in calls)  # never on the restore path
    for a, b in zip(kv_arrays(caches), kv_arrays(make_kv(n)), strict=True):
        assert np.array_equal(a, b)
    assert caches[0].keys.shape[2] > n  # room to grow without another copy
    pc.flush()
    assert pc.lookup(T[: n + 1]).source == "ram"
    assert len(calls) == len(pc.entries())  # each link read back once
    pc.close()


def test_small_links_are_read_whole_and_their_headers_checked_once(tmp_path, monkeypatch):
    """A chain of short links (an agent's turns) is read one file at a time in one call each,
    and a header validated at the scan is not parsed again unless its bytes changed."""
    keys = build_chain(tmp_path)
    pc = open_cache(tmp_path, ram_budget=0)
    reads, validations = [], []
    real_read, real_validate = DiskTier.read_entry, header_module.validate_header

    def counted_read(self, key, **kw):
        reads.append((threading.current_thread().name, key))
        return real_read(self, key, **kw)

    def counted_validate(header, key, *args):
        validations.append(key)
        return real_validate(header, key, *args)

    monkeypatch.setattr(DiskTier, "read_entry", counted_read)
    monkeypatch.setattr(header_module, "validate_header", counted_validate)
    m, caches = restore(pc, T[:301], tokens=T[:301])
    assert m.source == "disk" and m.usable == 300
    for a, b in zip(kv_arrays(caches), kv_arrays(make_kv(300)), strict=True):
        assert np.array_equal(a, b)
    here = threading.current_thread().name
    assert [key for name, key in reads if name == here] == keys  # root first, once each
    assert validations == []  # all three were validated by the scan
    # A header rewritten since (valid checksums, one more token claimed) is parsed and refused.
    rewrite(entry_path(tmp_path, keys[1]), mutate_header=lambda h: h.update(n_tokens=250))
    with pytest.raises(CacheRestoreError) as info:
        restore(pc, T[:301], tokens=T[:301])
    assert info.value.key == keys[1] and validations == [keys[1]]
    pc.close()


def test_failed_behaviour_check_evicts_from_the_first_suspect_link(tmp_path):
    """Only what the dead run wrote can be blamed: a verified shared anchor and the other
    conversations chained on it survive."""
    pc = open_cache(tmp_path)
    anchor = pc.checkpoint(T[:20], make_kv(20), "anchor", anchor=True)
    other = T[:20] + list(range(9000, 9020))
    sibling = pc.checkpoint(other, make_kv(40), "message")
    pc.close()
    crash_child(tmp_path, 3)  # writes T[:20] (already stored), T[:40], T[:60], then dies
    pc = open_cache(tmp_path)
    infos = {e.n_tokens if e.key != sibling else -1: e for e in pc.entries()}
    assert not infos[20].suspect and infos[40].suspect and infos[60].suspect
    removed = pc.evict(infos[60].key, "behaviour check failed", first_suspect=True)
    assert set(removed) == {infos[40].key, infos[60].key}
    assert {e.key for e in pc.entries()} == {anchor, sibling}
    assert pc.lookup(other + [1]).usable == 40  # the other conversation still hits
    pc.close()


def test_suspect_entry_short_of_its_probe_falls_back_to_a_checkable_link(tmp_path):
    """Resending the same prompt restores all but its last token, which cannot reach a
    suspect entry's probe: lookup offers the longest chain link whose probe it reaches, and
    counts the request once."""
    crash_child(tmp_path, 3)  # T[:20] <- T[:40] <- T[:60], all suspect
    pc = open_cache(tmp_path)
    m = pc.lookup(T[:60])
    assert m.suspect and m.usable == 40 and m.entry_tokens == 40
    assert m.probe["position"] == 39 and m.for_probe().usable == 39
    stats = pc.stats()
    assert (stats["hits"], stats["misses"], stats["cached_tokens"]) == (1, 0, 40)
    # A longer prompt reaches the deepest entry's probe and uses it.
    assert pc.lookup(T[:61]).usable == 60
    pc.close()
