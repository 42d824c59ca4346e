"""Budgets (invariant 8): score order, protections, oversize refusal, RAM tier."""

from __future__ import annotations

import threading

import pytest
from mlx_lm.models.cache import KVCache

from mlx_kvserve.cache import PromptCache, default_disk_budget
from mlx_kvserve.cache.disk import DiskTier
from mlx_kvserve.cache.entry import SCORE_HALF_LIFE_S, score
from tests.support.cache_testing import fill_kv, make_kv, make_ssm

KiB = 1 << 10
GiB = 1 << 30
ENTRY = 2 * 2 * 2 * 8 * 100 * 4  # payload bytes of a 100-token, 2-layer entry (12.5 KiB)


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def prompt(tag, n=100):
    return [tag * 1000 + i for i in range(n)]


def open_cache(path, budget, clock, ram=1 << 30):
    return PromptCache(path, "model-a", disk_budget=budget, ram_budget=ram, clock=clock)


def hit(pc, toks, layers=2):
    m = pc.lookup(toks + [0])
    assert m.hit
    pc.restore(m, [KVCache() for _ in range(layers)])


def test_score_formula():
    assert score(0, 0.0, 100, 100, 0.0) == 1.0
    assert score(3, 0.0, 100, 100, 0.0) == 4.0
    assert score(0, 0.0, 100, 100, SCORE_HALF_LIFE_S) == pytest.approx(0.5)
    assert score(0, 0.0, 200, 100, 0.0) == 2.0  # more tokens per byte is worth more


def test_default_budget():
    assert default_disk_budget(100 * GiB) == 20 * GiB
    assert default_disk_budget(8 * GiB, 4 * GiB) == 3 * GiB


def test_evicts_lowest_score_first(tmp_path):
    clock = Clock()
    pc = open_cache(tmp_path, budget=4 * ENTRY, clock=clock)
    a = pc.checkpoint(prompt(1), make_kv(100), "m")
    clock.now += 10
    b = pc.checkpoint(prompt(2), make_kv(100), "m")
    clock.now += 10
    c = pc.checkpoint(prompt(3), make_kv(100), "m")
    hit(pc, prompt(1))
    hit(pc, prompt(1))  # a: 2 hits
    clock.now += 2 * SCORE_HALF_LIFE_S
    hit(pc, prompt(3))  # c: 1 recent hit; b: old and never used
    d = pc.checkpoint(prompt(4), make_kv(100), "m")  # needs room
    assert {e.key for e in pc.entries()} == {a, c, d}
    assert pc.stats()["evictions"] == 1
    e = pc.checkpoint(prompt(5), make_kv(100), "m")
    # a (3 x 1/4 = 0.75) is now below c (2 x 1) and d (fresh, 1).
    assert {x.key for x in pc.entries()} == {c, d, e}
    assert b not in {x.key for x in pc.entries()}
    pc.flush()
    assert pc.stats()["disk_bytes"] <= 4 * ENTRY
    assert len(list((tmp_path / "model-a").glob("*.kvc"))) == 3
    pc.close()


def test_just_written_entry_is_protected(tmp_path):
    clock = Clock()
    pc = open_cache(tmp_path, budget=2 * ENTRY, clock=clock)
    a = pc.checkpoint(prompt(1), make_kv(100), "m")
    for _ in range(5):
        hit(pc, prompt(1))
    # The new entry has the lowest score, yet it is the one kept; a is evicted.
    b = pc.checkpoint(prompt(2), make_kv(100), "m")
    assert {e.key for e in pc.entries()} == {b}
    assert a is not None
    pc.close()


def test_pinned_entry_is_never_evicted(tmp_path):
    clock = Clock()
    pc = open_cache(tmp_path, budget=2 * ENTRY + ENTRY // 2, clock=clock)
    a = pc.checkpoint(prompt(1), make_kv(100), "m")
    clock.now += 10 * SCORE_HALF_LIFE_S  # a is old: the natural victim
    with pc.pinned(a):
        b = pc.checkpoint(prompt(2), make_kv(100), "m")
        c = pc.checkpoint(prompt(3), make_kv(100), "m")
        keys = {e.key for e in pc.entries()}
        assert a in keys and c in keys and b not in keys
    pc.close()


def test_chain_links_are_evicted_only_after_their_children(tmp_path):
    clock = Clock()
    pc = open_cache(tmp_path, budget=3 * ENTRY + ENTRY // 2, clock=clock)
    root = pc.checkpoint(prompt(1), make_kv(100), "m")
    caches = make_kv(100)
    fill_kv(caches, 100, 200)
    child = pc.checkpoint(prompt(1, 200), caches, "m")
    clock.now += 10 * SCORE_HALF_LIFE_S  # root and child are old: the natural victims
    pc.checkpoint(prompt(2), make_kv(100), "m")
    pc.checkpoint(prompt(3), make_kv(100), "m")
    keys = {e.key for e in pc.entries()}
    assert child not in keys and root in keys  # the leaf goes first, the link stays
    pc.checkpoint(prompt(4), make_kv(100), "m")
    assert root not in {e.key for e in pc.entries()}  # a leaf now, and the oldest
    pc.close()


def test_entry_larger_than_budget_refused(tmp_path, caplog):
    caplog.set_level("INFO", logger="mlx_kvserve.cache")
    clock = Clock()
    pc = open_cache(tmp_path, budget=ENTRY // 2, clock=clock)
    assert pc.checkpoint(prompt(1), make_kv(100), "m") is None
    assert pc.entries() == [] and pc.stats()["refused"] == 1
    assert "refused" in caplog.text
    assert pc.checkpoint(prompt(1, 20), make_kv(20), "m") is not None
    pc.close()


def test_budget_enforced_at_start_up(tmp_path):
    clock = Clock()
    pc = open_cache(tmp_path, budget=10 * ENTRY, clock=clock)
    for tag in range(1, 6):
        pc.checkpoint(prompt(tag), make_kv(100), "m")
    pc.close()
    pc = open_cache(tmp_path, budget=2 * ENTRY + ENTRY // 2, clock=clock)
    assert len(pc.entries()) == 2
    assert len(list((tmp_path / "model-a").glob("*.kvc"))) == 2
    pc.close()


# -- RAM tier ------------------------------------------------------------------------------
def test_ram_tier_lru_falls_back_to_disk(tmp_path):
    clock = Clock()
    pc = open_cache(tmp_path, budget=1 << 30, clock=clock, ram=2 * ENTRY + KiB)
    pc.checkpoint(prompt(1), make_kv(100), "m")
    pc.checkpoint(prompt(2), make_kv(100), "m")
    pc.checkpoint(prompt(3), make_kv(100), "m")
    pc.flush()
    s = pc.stats()
    assert s["ram_entries"] == 2 and s["ram_bytes"] <= 2 * ENTRY + KiB
    assert pc.lookup(prompt(1) + [0]).source == "disk"
    assert pc.lookup(prompt(3) + [0]).source == "ram"
    hit(pc, prompt(1))  # promoted back into RAM by the writer thread ...
    pc.flush()
    assert pc.lookup(prompt(1) + [0]).source == "ram"
    assert pc.lookup(prompt(2) + [0]).source == "disk"  # ... pushing out the LRU one
    pc.close()


def test_ram_tier_returns_within_budget_once_slow_writes_land(tmp_path, monkeypatch):
    """A busy disk: every copy is still queued when the third checkpoint comes, so none may
    be dropped then; once the writes land the tier must shrink back to its budget."""
    write_entry = DiskTier.write_entry
    gate = threading.Event()

    def slow_write_entry(self, *args, **kwargs):
        gate.wait(5)
        return write_entry(self, *args, **kwargs)

    monkeypatch.setattr(DiskTier, "write_entry", slow_write_entry)
    clock = Clock()
    pc = open_cache(tmp_path, budget=1 << 30, clock=clock, ram=2 * ENTRY + KiB)
    pc.checkpoint(prompt(1), make_kv(100), "m")
    pc.checkpoint(prompt(2), make_kv(100), "m")
    threading.Timer(0.3, gate.set).start()  # the backpressure wait is what lets them land
    pc.checkpoint(prompt(3), make_kv(100), "m")
    s = pc.stats()
    assert s["ram_entries"] == 2 and s["ram_bytes"] <= 2 * ENTRY + KiB
    pc.flush()
    assert pc.lookup(prompt(1) + [0]).source == "disk"
    assert pc.lookup(prompt(3) + [0]).source == "ram"
    pc.close()


def test_ram_only_mode_uses_scores_and_budget():
    clock = Clock()
    pc = PromptCache(None, "model-a", disk_budget=None, ram_budget=2 * ENTRY, clock=clock)
    a = pc.checkpoint(prompt(1), make_kv(100), "m")
    hit(pc, prompt(1))
    b = pc.checkpoint(prompt(2), make_kv(100), "m")
    c = pc.checkpoint(prompt(3), make_kv(100), "m")
    assert {e.key for e in pc.entries()} == {a, c}
    assert b is not None and pc.stats()["ram_bytes"] <= 2 * ENTRY
    assert pc.stats()["disk_bytes"] == 0
    pc.close()


def test_snapshot_budget(tmp_path):
    clock = Clock()
    pc = open_cache(tmp_path, budget=1 << 30, clock=clock)
    for n in range(1, 30):
        pc.checkpoint(prompt(1, n), make_ssm(n), "interval")
    # Nested snapshots of one prompt never pile up.
    assert len(pc.entries()) == 1
    pc.close()
