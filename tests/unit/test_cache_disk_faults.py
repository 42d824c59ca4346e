"""A failing disk under the prompt cache: ENOSPC, EIO and EACCES on every write step, every read
and every unlink (the `disk_<op>_<errno>` fault points of engine.faults), and a disk that fills
up (`SmallDisk`). Whatever fails, a failed write loses only its checkpoint, a failed read is a
miss of that entry, a file that cannot be deleted is never served again, nothing stays pending
or pinned, and what is restored equals what was stored. The same faults under a real engine, with
the answers compared to mlx-lm's: tests/unit/test_engine_disk_faults.py."""

from __future__ import annotations

import errno
import logging

import numpy as np
import pytest
from mlx_lm.models.cache import KVCache

from mlx_kvserve.cache import PromptCache, codec
from mlx_kvserve.engine import faults
from tests.support.cache_testing import (
    SmallDisk,
    assert_disk_consistent,
    entry_files,
    inject_faults,
    kv_arrays,
    make_kv,
    settle,
)

MiB = 1 << 20
FP = "model-a"
T = list(range(2000, 2400))
ERRNOS = {"enospc": errno.ENOSPC, "eio": errno.EIO, "eacces": errno.EACCES}
WRITE_OPS = ["write", "fsync", "rename", "dirsync"]
ENTRY = 2 * 2 * 2 * 8 * 100 * 4  # payload bytes of a 100-token, 2-layer entry (12.5 KiB)


def open_cache(path, **kw):
    kw.setdefault("disk_budget", 64 * MiB)
    kw.setdefault("ram_budget", 64 * MiB)
    return PromptCache(path, FP, **kw)


def restore(pc, prompt, layers=2):
    m = pc.lookup(prompt)
    fresh = [KVCache() for _ in range(layers)]
    if m.hit:
        pc.restore(m, fresh)
    return m, fresh


def same_kv(caches, n) -> bool:
    want = kv_arrays(make_kv(n))
    return all(np.array_equal(a, b) for a, b in zip(kv_arrays(caches), want, strict=True))


def slot_flags(root, key) -> int:
    raw = (root / FP / f"{key}.kvc").read_bytes()[: codec.PREFIX_SIZE]
    slot = codec.parse_prefix(raw)[2]
    return slot.flags if slot else 0


def warnings(caplog, needle):
    return [r for r in caplog.records if needle in r.getMessage()]


# -- writes: every step x every errno ---------------------------------------------------------
@pytest.mark.parametrize("name", list(ERRNOS))
@pytest.mark.parametrize("op", WRITE_OPS)
def test_a_failed_write_loses_only_that_checkpoint(tmp_path, monkeypatch, caplog, op, name):
    caplog.set_level(logging.INFO, logger="mlx_kvserve.cache")
    pc = open_cache(tmp_path)
    a = pc.checkpoint(T[:100], make_kv(100), "message")
    settle(pc)
    point = f"disk_{op}_{name}"
    inject_faults(monkeypatch, f"{point}@1")
    b = pc.checkpoint(T[:200], make_kv(200), "message")
    stats = assert_disk_consistent(pc)
    assert faults.reached(point) == 1
    # Only B is lost to the disk; it stays in RAM and serves.
    assert entry_files(pc) == {a}
    info = {e.key: e for e in pc.entries()}
    assert info[b].disk == "none" and info[b].in_ram and info[a].disk == "written"
    assert stats["write_errors"] == 1 and stats["disk_writes_failing"]
    assert stats["last_write_error"] == codec_strerror(name)
    m, caches = restore(pc, T[:201])
    assert m.usable == 200 and m.source == "ram" and same_kv(caches, 200)
    # The next checkpoint is written (chained to A, the last link on disk), and says so once.
    c = pc.checkpoint(T[:300], make_kv(300), "message")
    stats = assert_disk_consistent(pc)
    assert entry_files(pc) == {a, c} and not stats["disk_writes_failing"]
    assert {e.key: e for e in pc.entries()}[c].parent == a
    assert len(warnings(caplog, "disk write failed")) == 1
    assert len(warnings(caplog, "disk writes resumed")) == 1
    pc.close()
    caplog.clear()
    pc = open_cache(tmp_path)  # what is on disk is whole: nothing dropped at start-up
    assert {e.key for e in pc.entries()} == {a, c} and "dropped" not in caplog.text
    m, caches = restore(pc, T[:301])
    assert m.usable == 300 and m.source == "disk" and same_kv(caches, 300)
    pc.close()


def codec_strerror(name: str) -> str:
    import os

    return os.strerror(ERRNOS[name])


def test_a_disk_that_keeps_failing_does_not_grow_the_writers_memory(tmp_path, monkeypatch):
    """D11: the writer remembers a failed write's key only until the store has seen it."""
    pc = open_cache(tmp_path, ram_budget=0)  # no RAM copy: each failed entry leaves the cache
    inject_faults(monkeypatch, "disk_write_eio:1000")
    for n in range(20, 400, 20):  # a growing conversation: each delta chains to the last
        pc.checkpoint(T[:n], make_kv(n), "message")
        pc.flush()
        assert pc._writer.unwritten <= 2
    stats = assert_disk_consistent(pc)
    assert stats["write_errors"] >= 1 and stats["entries"] == 0 and entry_files(pc) == set()


# -- reads ------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(ERRNOS))
def test_a_failed_prefetch_is_only_a_lost_hint(tmp_path, monkeypatch, name):
    pc = open_cache(tmp_path)
    keys = [pc.checkpoint(T[:n], make_kv(n), "message") for n in (100, 200, 300)]
    pc.close()
    pc = open_cache(tmp_path, ram_budget=0)  # every link is read from disk
    inject_faults(monkeypatch, f"disk_prefetch_{name}:10")
    m, caches = restore(pc, T[:301])
    assert faults.reached(f"disk_prefetch_{name}") == 3  # one per small link
    assert m.usable == 300 and same_kv(caches, 300)
    stats = assert_disk_consistent(pc)
    assert stats["failure_evictions"] == 0 and entry_files(pc) == set(keys)
    pc.close()


@pytest.mark.parametrize("name", list(ERRNOS))
def test_an_unreadable_header_at_start_up_drops_only_that_file(tmp_path, monkeypatch, caplog, name):
    pc = open_cache(tmp_path)
    keys = {pc.checkpoint([t + k * 1000 for t in T[:100]], make_kv(100), "m") for k in (1, 2)}
    pc.close()
    inject_faults(monkeypatch, f"disk_header_{name}@1")
    pc = open_cache(tmp_path)  # one of the two files cannot be read: a miss, not a failed start
    assert faults.reached(f"disk_header_{name}") == 2
    (kept,) = {e.key for e in pc.entries()}
    (lost,) = keys - {kept}
    assert [r for r in caplog.records if lost[:16] in r.getMessage()]
    assert_disk_consistent(pc)
    assert entry_files(pc) == {kept}
    pc.close()


# -- unlink -----------------------------------------------------------------------------------
@pytest.mark.parametrize("then", ["retry", "restart"])
@pytest.mark.parametrize("route", ["budget", "failure"])
@pytest.mark.parametrize("name", list(ERRNOS))
def test_a_file_that_cannot_be_deleted_is_never_served_again(
    tmp_path, monkeypatch, caplog, name, route, then
):
    caplog.set_level(logging.INFO, logger="mlx_kvserve.cache")
    pc = open_cache(tmp_path, disk_budget=2 * ENTRY + ENTRY // 2)
    prompts = [[t + k * 1000 for t in T[:100]] for k in (1, 2, 3)]
    a = pc.checkpoint(prompts[0], make_kv(100), "m")
    b = pc.checkpoint(prompts[1], make_kv(100), "m")
    settle(pc)
    inject_faults(monkeypatch, f"disk_unlink_{name}:1000")
    if route == "budget":
        pc.checkpoint(prompts[2], make_kv(100), "m")  # over budget: evicts one of A, B
        (gone,) = {a, b} - {e.key for e in pc.entries()}
    else:
        assert pc.evict(a, "test") == [a]
        gone = a
    stats = assert_disk_consistent(pc)
    assert faults.reached(f"disk_unlink_{name}") == 1
    # Its file stays, marked evicted, and the entry is never offered again.
    assert set(pc.disk.undeleted) == {gone} and stats["undeleted_files"] == 1
    assert slot_flags(tmp_path, gone) & codec.FLAG_EVICTED
    pc.disk.write_slot(gone, codec.Slot(hits=5))  # e.g. a hit count queued before the eviction
    assert slot_flags(tmp_path, gone) & codec.FLAG_EVICTED
    assert not pc.lookup(prompts[[a, b].index(gone)] + [0]).hit
    assert len(warnings(caplog, "could not delete")) == 1
    if then == "retry":
        inject_faults(monkeypatch, "")
        assert pc.disk.retry_deletions() == 0
        assert gone not in entry_files(pc) and pc.stats()["undeleted_files"] == 0
        pc.close()
        pc = open_cache(tmp_path, disk_budget=2 * ENTRY + ENTRY // 2)
    else:
        pc.close()
        inject_faults(monkeypatch, "")
        caplog.clear()
        pc = open_cache(tmp_path, disk_budget=2 * ENTRY + ENTRY // 2)
        assert "deleted 1 files of entries evicted by an earlier run" in caplog.text
    assert gone not in {e.key for e in pc.entries()} and gone not in entry_files(pc)
    assert not pc.lookup(prompts[[a, b].index(gone)] + [0]).hit
    assert_disk_consistent(pc)
    pc.close()


def test_storing_the_same_tokens_again_replaces_a_file_marked_evicted(tmp_path, monkeypatch):
    pc = open_cache(tmp_path, disk_budget=ENTRY + ENTRY // 2)
    a = pc.checkpoint(T[:100], make_kv(100), "m")
    settle(pc)
    inject_faults(monkeypatch, "disk_unlink_eio:1")
    pc.checkpoint(conversation(1, 100), make_kv(100), "m")  # evicts A for the budget
    assert set(pc.disk.undeleted) == {a}
    assert pc.checkpoint(T[:100], make_kv(100), "m") == a  # a fresh file under the same name
    assert_disk_consistent(pc)
    assert pc.disk.undeleted == {} and not slot_flags(tmp_path, a) & codec.FLAG_EVICTED
    pc.close()
    pc = open_cache(tmp_path, disk_budget=ENTRY + ENTRY // 2)
    m, caches = restore(pc, T[:101])
    assert m.key == a and m.usable == 100 and same_kv(caches, 100)
    pc.close()


@pytest.mark.parametrize("name", list(ERRNOS))
def test_an_entry_evicted_before_its_file_was_written_leaves_no_undeleted_file(
    tmp_path, monkeypatch, name
):
    """Its queued write is cancelled, so there is no file: a failed unlink there is no file
    kept "undeleted" (which /health counted until a retry found nothing)."""
    disk = SmallDisk(tmp_path / FP, total=64 * MiB)
    disk.install(monkeypatch)
    pc = open_cache(tmp_path)
    disk.writes.clear()  # the write waits in the queue
    a = pc.checkpoint(T[:100], make_kv(100), "m")
    inject_faults(monkeypatch, f"disk_unlink_{name}:1000")
    assert pc.evict(a, "test") == [a]
    disk.writes.set()
    stats = assert_disk_consistent(pc)
    assert faults.reached(f"disk_unlink_{name}") == 1
    assert pc.disk.undeleted == {} and stats["undeleted_files"] == 0
    assert a not in entry_files(pc)
    pc.close()


@pytest.mark.parametrize("name", list(ERRNOS))
def test_a_write_that_fails_after_its_entry_was_evicted_is_forgotten(tmp_path, monkeypatch, name):
    """The writer had started the write when the entry was evicted; then the write failed. The
    writer remembers failed writes until the store has seen them (so that no child chains to
    one): a cancelled one must be forgotten too, or the writer keeps it for good."""
    disk = SmallDisk(tmp_path / FP, total=64 * MiB)
    disk.install(monkeypatch)
    pc = open_cache(tmp_path)
    inject_faults(monkeypatch, f"disk_write_{name}:1")
    disk.writes.clear()
    a = pc.checkpoint(T[:100], make_kv(100), "m")
    assert disk.waiting.wait(30)  # the writer is inside the write
    assert pc.evict(a, "test") == [a]
    disk.writes.set()
    stats = assert_disk_consistent(pc)  # the writer remembers no failed write
    assert faults.reached(f"disk_write_{name}") == 1 and stats["write_errors"] == 1
    b = pc.checkpoint(T[:120], make_kv(120), "m")  # the same tokens and more: written whole
    assert_disk_consistent(pc)
    assert {e.key for e in pc.entries() if e.disk == "written"} == {b}
    pc.close()


def test_deletions_are_retried_by_the_writer(tmp_path, monkeypatch):
    pc = open_cache(tmp_path)
    pc._writer.retry_seconds = 0.0
    a = pc.checkpoint(T[:100], make_kv(100), "m")
    settle(pc)
    inject_faults(monkeypatch, "disk_unlink_eacces@1")
    pc.evict(a, "test")
    assert a in pc.disk.undeleted
    pc.checkpoint([t + 1000 for t in T[:100]], make_kv(100), "m")  # the writer's next job
    settle(pc)
    assert pc.disk.undeleted == {} and a not in entry_files(pc)
    pc.close()


# -- a disk that fills up ---------------------------------------------------------------------
def conversation(k: int, n: int) -> list[int]:
    return [t + k * 1000 for t in T[:n]]


@pytest.mark.parametrize("budget", ["configured", "default"])
def test_a_full_disk_keeps_serving_from_ram_and_the_budget_follows_the_space(
    tmp_path, monkeypatch, caplog, budget
):
    caplog.set_level(logging.INFO, logger="mlx_kvserve.cache")
    disk = SmallDisk(tmp_path, total=80 * ENTRY)
    disk.install(monkeypatch)
    requested = 12 * ENTRY if budget == "configured" else None
    pc = open_cache(tmp_path, disk_budget=requested)
    configured = pc.stats()["disk_budget"]
    assert configured == pc.stats()["disk_budget_configured"] and not pc.stats()["disk_short"]
    old = [pc.checkpoint(conversation(k, 100), make_kv(100, seed=k), "m") for k in range(4)]
    settle(pc)
    assert entry_files(pc) == set(old)
    disk.fill(leave=ENTRY // 4)  # another program fills the disk
    # The next checkpoint's write fails for want of space: it stays in RAM and serves.
    full = pc.checkpoint(conversation(9, 100), make_kv(100, seed=9), "m")
    stats = assert_disk_consistent(pc)
    assert stats["disk_writes_failing"] and full not in entry_files(pc)
    # That failure has the free space read again: the budget shrinks to what the disk holds,
    # leaving a reserve free, and entries are evicted to fit it.
    more = pc.checkpoint(conversation(10, 100), make_kv(100, seed=10), "m")
    stats = assert_disk_consistent(pc)
    assert stats["disk_short"] and stats["disk_budget"] < 4 * ENTRY < configured
    assert stats["disk_bytes"] <= stats["disk_budget"] and len(entry_files(pc)) < len(old)
    assert stats["disk_free"] is not None and stats["disk_free"] < ENTRY
    for key, k in ((full, 9), (more, 10)):  # served from RAM, exactly
        m, caches = restore(pc, conversation(k, 101))
        assert m.key == key and m.source == "ram"
        assert all(
            np.array_equal(x, y)
            for x, y in zip(kv_arrays(caches), kv_arrays(make_kv(100, seed=k)), strict=True)
        )
    for _ in range(3):  # one line for the episode, not one per checkpoint
        pc.checkpoint(conversation(11 + _, 100), make_kv(100, seed=11 + _), "m")
    assert len(warnings(caplog, "disk write failed")) == 1
    assert len(warnings(caplog, "disk budget lowered")) == 1
    assert len([r for r in caplog.records if r.levelno >= logging.WARNING]) == 1
    # Space returns: the budget grows back and checkpoints are written again.
    settle(pc)
    disk.filler = 0
    pc.refresh_disk_space()
    stats = pc.stats()  # (the default budget: the fraction of what is free now)
    assert stats["disk_budget"] == pytest.approx(configured, rel=0.01) and not stats["disk_short"]
    back = pc.checkpoint(conversation(20, 100), make_kv(100, seed=20), "m")
    stats = assert_disk_consistent(pc)
    assert back in entry_files(pc) and not stats["disk_writes_failing"]
    assert "disk space is back" in caplog.text and "disk writes resumed" in caplog.text
    pc.close()


def test_while_the_disk_is_full_writes_without_room_are_skipped_not_tried(tmp_path, monkeypatch):
    disk = SmallDisk(tmp_path, total=80 * ENTRY)
    disk.install(monkeypatch)
    pc = open_cache(tmp_path, disk_budget=40 * ENTRY)
    pc.checkpoint(conversation(0, 100), make_kv(100), "m")
    settle(pc)
    disk.fill(leave=0)
    disk.writes.clear()  # three writes queue up before the first one fails
    for k in range(1, 4):
        pc.checkpoint(conversation(k, 100), make_kv(100, seed=k), "m")
    disk.writes.set()
    stats = assert_disk_consistent(pc)
    # The first write fails; the writer then asks the file system before each one instead.
    assert stats["write_errors"] == 1 and stats["write_skips"] == 2
    # The next checkpoint knows the disk is full: it is kept in RAM without a write, and the
    # entry on disk makes way for the reserve the budget leaves free.
    pc.checkpoint(conversation(4, 100), make_kv(100, seed=4), "m")
    stats = assert_disk_consistent(pc)
    assert stats["disk_skipped"] == 1 and stats["write_errors"] == 1 and stats["write_skips"] == 2
    assert entry_files(pc) == set() and len(pc.entries()) == 4
    assert all(e.in_ram and e.disk == "none" for e in pc.entries())
    pc.close()


def test_the_budget_shrinks_while_idle_when_another_program_fills_the_disk(tmp_path, monkeypatch):
    disk = SmallDisk(tmp_path, total=80 * ENTRY)
    disk.install(monkeypatch)
    pc = open_cache(tmp_path, disk_budget=20 * ENTRY)
    keys = [pc.checkpoint(conversation(k, 100), make_kv(100, seed=k), "m") for k in range(6)]
    settle(pc)
    disk.fill(leave=0)
    pc.refresh_disk_space()  # what the periodic check does
    stats = assert_disk_consistent(pc)
    assert stats["disk_short"] and stats["disk_bytes"] <= stats["disk_budget"]
    assert 0 < len(entry_files(pc)) < len(keys) and stats["write_errors"] == 0
    disk.filler = 0
    pc.refresh_disk_space()
    assert pc.stats()["disk_budget"] == 20 * ENTRY
    pc.close()


def test_a_lowered_budget_keeps_queued_checkpoints_in_ram(tmp_path, monkeypatch):
    """Checkpoints still queued for the writer when the disk fills (a slow writer: a busy
    machine) are not evicted by the lowered budget: their writes are cancelled and they serve
    from RAM, as a checkpoint made once the disk is known to be full does."""
    disk = SmallDisk(tmp_path, total=80 * ENTRY)
    disk.install(monkeypatch)
    pc = open_cache(tmp_path, disk_budget=40 * ENTRY)
    old = pc.checkpoint(conversation(0, 100), make_kv(100), "m")
    settle(pc)
    disk.writes.clear()  # the next writes wait in the queue
    queued = [pc.checkpoint(conversation(k, 100), make_kv(100, seed=k), "m") for k in (1, 2)]
    disk.fill(leave=0)
    pc.refresh_disk_space()
    disk.writes.set()
    stats = assert_disk_consistent(pc)
    assert stats["disk_short"] and stats["disk_bytes"] <= stats["disk_budget"]
    for key, k in zip(queued, (1, 2), strict=True):
        m, caches = restore(pc, conversation(k, 101))
        assert m.key == key and m.source == "ram" and same_kv_seed(caches, 100, k)
    assert {e.key for e in pc.entries() if e.disk == "none"} >= set(queued)
    assert set(queued).isdisjoint(entry_files(pc)) and old not in entry_files(pc)
    pc.close()


def same_kv_seed(caches, n, seed) -> bool:
    want = kv_arrays(make_kv(n, seed=seed))
    return all(np.array_equal(a, b) for a, b in zip(kv_arrays(caches), want, strict=True))
