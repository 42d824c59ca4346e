"""Per-layer chains (cache/plan.py): windows and recurrent states next to growing KV.

A checkpoint stores, per layer, only what its parent's chain lacks: the new positions of KV and
window layers, the current state of recurrent ones. These tests build synthetic mlx-lm caches
(tests/support/cache_testing.py: KV of position p depends on p only) and check that a chain
restores what the live caches held, that it writes each position once, and that a damaged link
in the middle is a clean miss that takes only itself and what depends on it.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache

from mlx_kvserve.cache import CacheRestoreError, PromptCache
from tests.support.cache_testing import fill_kv, state_arrays

MiB = 1 << 20
FP = "model-chains"
T = list(range(500, 1100))
WINDOW = 16
STOPS = [10, 30, 31, 70, 100, 101, 140, 200]  # inside, at and far past the window; 1-token links


def open_cache(path, **kw):
    return PromptCache(path, FP, disk_budget=64 * MiB, ram_budget=kw.get("ram", 64 * MiB))


def hybrid() -> list:
    """A window layer, a growing KV layer and a recurrent state, as in Gemma 3 / Qwen3.5."""
    return [RotatingKVCache(max_size=WINDOW), KVCache(), ArraysCache(size=1)]


def advance(caches: list, start: int, end: int, chunk: int) -> None:
    fill_kv(caches[:2], start, end, chunk=chunk)
    caches[2][0] = mx.full((1, 4), float(end))  # the state after `end` tokens


def conversation(pc: PromptCache, chunk: int) -> list:
    live = hybrid()
    start = 0
    for n in STOPS:
        advance(live, start, n, chunk)
        start = n
        assert pc.checkpoint(T[:n], live, "generation") is not None
    return live


@pytest.mark.parametrize("chunk", [1, 7, 64], ids=["decode", "chunks", "long-chunks"])
def test_chain_restores_the_window_the_kv_and_the_state(tmp_path, chunk):
    pc = open_cache(tmp_path)
    live = conversation(pc, chunk)
    pc.close()
    pc = open_cache(tmp_path, ram=0)  # every link from disk
    n = STOPS[-1]
    m = pc.lookup(T[: n + 1])
    assert (m.usable, m.kind, m.source) == (n, "snapshot", "disk")
    fresh = hybrid()
    pc.restore(m, fresh, tokens=T[: n + 1])
    window, kv = state_arrays(fresh[:1]), state_arrays(live[:1])
    for got, want in zip(window, kv, strict=True):
        assert got.shape[2] == WINDOW and np.array_equal(got, want[..., -WINDOW:, :])
    assert np.array_equal(np.array(fresh[1].keys[..., :n, :]), np.array(live[1].keys[..., :n, :]))
    assert fresh[2][0].tolist() == [[float(n)] * 4]
    assert (fresh[0].offset, fresh[1].offset) == (n, n)
    # Prefill and decode on from there attend to the same keys as the live caches do.
    for step in (5, 1, 1):
        fill_kv(fresh[:2], fresh[1].offset, fresh[1].offset + step, chunk=step)
        fill_kv(live[:2], live[1].offset, live[1].offset + step, chunk=step)
        for a, b in zip(fresh[0].keys_and_values(), live[0].keys_and_values(), strict=True):
            assert mx.array_equal(a, b).item()
    pc.close()


def test_each_position_is_written_once(tmp_path):
    """KV and window positions once per chain, plus one recurrent state per checkpoint."""
    pc = open_cache(tmp_path)
    conversation(pc, 7)
    entries = sorted(pc.entries(), key=lambda e: e.n_tokens)
    assert [e.parent_len for e in entries] == [0, *STOPS[:-1]]
    per_position = 2 * 2 * 8 * 4  # keys + values, 2 heads x 8 dims of float32
    state = 4 * 4
    n = STOPS[-1]
    # The KV layer stores every position once, the window layer at most the window per link.
    payload = sum(e.payload_bytes for e in entries)
    windows = sum(min(e.n_tokens - e.parent_len, WINDOW) for e in entries)
    assert payload == per_position * (n + windows) + state * len(entries)
    whole_snapshots = sum(per_position * (k + min(k, WINDOW)) + state for k in STOPS)
    assert payload < whole_snapshots / 2
    pc.close()


def test_a_damaged_link_in_the_middle_is_a_clean_miss_and_evicted(tmp_path):
    pc = open_cache(tmp_path)
    conversation(pc, 7)
    pc.close()
    with open_cache(tmp_path, ram=0) as pc:
        chain = sorted(pc.entries(), key=lambda e: e.n_tokens)
    middle = chain[3]  # 70 tokens: the window and KV of the links after it pass through it
    path = tmp_path / FP / f"{middle.key}.kvc"
    raw = bytearray(path.read_bytes())
    raw[-9] ^= 0x40  # a payload byte: the header still parses, the checksum does not match
    path.write_bytes(bytes(raw))
    pc = open_cache(tmp_path, ram=0)
    n = STOPS[-1]
    m = pc.lookup(T[: n + 1])
    with pytest.raises(CacheRestoreError) as info:
        pc.restore(m, hybrid(), tokens=T[: n + 1])
    assert info.value.key == middle.key and "checksum" in info.value.problem
    removed = pc.evict(info.value.key, info.value.problem)
    assert set(removed) == {e.key for e in chain[3:]}
    assert not path.exists()
    # What is left serves its own prefix: the link before the damaged one.
    m = pc.lookup(T[: n + 1])
    assert m.usable == chain[2].n_tokens
    fresh = hybrid()
    pc.restore(m, fresh, tokens=T[: n + 1])
    assert fresh[1].offset == chain[2].n_tokens
    assert pc.verify() == []
    pc.close()


def test_states_alone_need_no_parent(tmp_path):
    """A model of recurrent states only (Mamba): each checkpoint stands alone, and a longer
    one makes the shorter ones redundant (prefix dominance), as whole snapshots did."""
    pc = open_cache(tmp_path)
    for n in (10, 20, 30):
        c = ArraysCache(size=1)
        c[0] = mx.full((1, 4), float(n))
        pc.checkpoint(T[:n], [c], "interval")
    (entry,) = pc.entries()
    assert (entry.n_tokens, entry.parent, entry.kind) == (30, None, "snapshot")
    pc.close()


def test_a_window_not_yet_full_is_a_delta(tmp_path):
    """Below its length a window holds every position from 0: its entries serve any prefix."""
    pc = open_cache(tmp_path)
    live = [RotatingKVCache(max_size=WINDOW), KVCache()]
    fill_kv(live, 0, 12, chunk=5)
    pc.checkpoint(T[:12], live, "message")
    m = pc.lookup(T[:8] + [1])
    assert (m.kind, m.usable) == ("delta", 8)
    fresh = [RotatingKVCache(max_size=WINDOW), KVCache()]
    pc.restore(m, fresh, tokens=T[:8] + [1])
    want = [RotatingKVCache(max_size=WINDOW), KVCache()]
    fill_kv(want, 0, 8, chunk=5)
    for got, ref in zip(state_arrays(fresh), state_arrays(want), strict=True):
        assert np.array_equal(got, ref)
    pc.close()
