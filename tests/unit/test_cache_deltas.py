"""Delta chains: O(N) bytes for a growing conversation, bit-exact restores, restart."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache

from mlx_kvserve.cache import PromptCache
from tests.support.cache_testing import fill_kv, kv_arrays, make_kv

MiB = 1 << 20
DTYPES = [mx.float32, mx.float16, mx.bfloat16]
TOKENS = list(range(5000, 7000))


def open_cache(path, **kw):
    kw.setdefault("disk_budget", 256 * MiB)
    kw.setdefault("ram_budget", 256 * MiB)
    return PromptCache(path, "model-a", **kw)


def restore(pc, prompt, layers=2):
    m = pc.lookup(prompt)
    fresh = [KVCache() for _ in range(layers)]
    if m.hit:
        pc.restore(m, fresh, tokens=prompt)
    return m, fresh


def assert_same(got, want):
    for a, b in zip(kv_arrays(got), kv_arrays(want), strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert np.array_equal(a, b)


def run_conversation(pc, turns, *, dtype=mx.float32, user=150, reply=50, chunk=64):
    """Emulate the engine: lookup, restore, prefill the rest, checkpoint at the message
    boundary, 'generate', checkpoint after generation."""
    n = 0
    for _ in range(turns):
        prompt_len = n + user
        m, caches = restore(pc, TOKENS[:prompt_len])
        start = m.usable
        assert start == max(0, n)  # turn k prefills only what it added
        fill_kv(caches, start, prompt_len, dtype=dtype, chunk=chunk)
        assert pc.checkpoint(TOKENS[:prompt_len], caches, "message") is not None
        fill_kv(caches, prompt_len, prompt_len + reply, dtype=dtype, chunk=1)
        n = prompt_len + reply
        assert pc.checkpoint(TOKENS[:n], caches, "generation") is not None
    return n


def kv_bytes(n, layers=2, heads=2, head_dim=8, itemsize=4):
    return 2 * layers * heads * head_dim * n * itemsize


def test_growing_chain_writes_linear_bytes(tmp_path):
    pc = open_cache(tmp_path)
    n = run_conversation(pc, turns=5)
    pc.flush()
    s = pc.stats()
    final = kv_bytes(n)
    # Each position is written once; headers (token ids, specs) are the only overhead.
    assert final <= s["bytes_written"] <= 2 * final
    # Whole snapshots would have written the sum of every checkpoint's length.
    lengths = [150, 200, 350, 400, 550, 600, 750, 800, 950, 1000]
    assert s["bytes_written"] < sum(kv_bytes(x) for x in lengths) / 3
    assert s["disk_bytes"] == s["bytes_written"]
    # Every checkpoint is still reachable and the final one restores bit-exactly.
    m, caches = restore(pc, TOKENS[: n + 1])
    assert m.usable == n
    assert_same(caches, make_kv(n))
    pc.close()


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_chain_restore_is_bit_exact(tmp_path, dtype):
    pc = open_cache(tmp_path)
    n = run_conversation(pc, turns=4, dtype=dtype)
    want = make_kv(n, dtype=dtype)
    for usable in (1, 149, 150, 151, 399, 400, n):
        m, caches = restore(pc, TOKENS[: usable + 1])
        assert m.usable == usable
        assert caches[0].keys.dtype == dtype
        assert_same(caches, [fill_kv([KVCache(), KVCache()], 0, usable, dtype=dtype)][0])
    pc.close()
    # After a restart the chain is rebuilt from file headers and restores identically.
    pc = open_cache(tmp_path)
    m, caches = restore(pc, TOKENS[: n + 10])
    assert m.usable == n and m.source == "disk"
    assert_same(caches, want)
    # ... and, once the writer thread has read it back, a second hit is served from RAM.
    pc.flush()
    assert pc.lookup(TOKENS[: n + 10]).source == "ram"
    pc.close()


def test_restored_cache_keeps_working(tmp_path):
    """A restored KVCache must accept further updates exactly like a never-cached one."""
    pc = open_cache(tmp_path)
    pc.checkpoint(TOKENS[:300], make_kv(300), "message")
    pc.close()
    pc = open_cache(tmp_path)
    _, caches = restore(pc, TOKENS[:500])
    fill_kv(caches, 300, 500, chunk=7)
    assert_same(caches, make_kv(500))
    pc.close()


def test_shared_system_prompt_stored_once(tmp_path):
    pc = open_cache(tmp_path)
    system = TOKENS[:400]
    anchor = pc.checkpoint(system, make_kv(400), "system", anchor=True)
    conv_a = system + list(range(10, 60))
    conv_b = system + list(range(100, 180))
    for conv in (conv_a, conv_b):
        m, caches = restore(pc, conv)
        assert m.usable == 400
        fill_kv(caches, 400, len(conv), seed=0)
        pc.checkpoint(conv, caches, "message")
    pc.flush()
    infos = {e.key: e for e in pc.entries()}
    assert infos[anchor].children == 2
    children = [e for e in infos.values() if e.parent == anchor]
    assert sorted(e.n_tokens - e.parent_len for e in children) == [50, 80]
    assert pc.stats()["tokens"] == 400 + 50 + 80
    pc.close()


def test_history_edit_reuses_the_common_prefix(tmp_path):
    pc = open_cache(tmp_path)
    run_conversation(pc, turns=3)
    # The agent summarises: keep 320 tokens, then new content.
    edited = TOKENS[:320] + list(range(9, 99))
    m, caches = restore(pc, edited)
    assert m.usable == 320
    assert_same(caches, make_kv(320))
    pc.close()


def test_checkpoint_of_a_prefix_cut_from_longer_kv(tmp_path):
    """The engine folds a prompt's tail into one pass and checkpoints boundaries inside it
    afterwards: a prefix checkpoint of longer KV must equal one taken at that length."""
    live = make_kv(300)
    with open_cache(tmp_path) as pc:
        assert pc.checkpoint(TOKENS[:120], live, "anchor", anchor=True)
        assert pc.checkpoint(TOKENS[:250], live, "message")
        assert pc.checkpoint(TOKENS[:300], live, "generation")
        pc.flush()
    with open_cache(tmp_path) as pc:
        for n in (120, 250, 300):
            m, got = restore(pc, TOKENS[: n + 1])
            assert m.usable == n and m.key is not None
            assert_same(got, make_kv(n))
        # The chain stores each position once: parent 0..120, then 120..250, then 250..300.
        assert sum(e.n_tokens - e.parent_len for e in pc.entries()) == 300


def test_prefix_checkpoint_refused_for_longer_or_shorter_snapshot_state(tmp_path):
    from tests.support.cache_testing import make_rotating

    caches = make_rotating(40, max_size=16)
    with open_cache(tmp_path) as pc:
        assert pc.checkpoint(TOKENS[:30], caches, "message") is None
        assert pc.stats()["refused"] == 1
        assert pc.checkpoint(TOKENS[:40], caches, "message") is not None


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_restore_without_a_writable_mlx_view_falls_back_to_concatenate(
    tmp_path, dtype, monkeypatch
):
    from mlx_kvserve.cache import chain

    with open_cache(tmp_path) as pc:
        run_conversation(pc, 3, dtype=dtype)
        n = max(e.n_tokens for e in pc.entries())
        _, want = restore(pc, TOKENS[: n + 1])
        monkeypatch.setattr(chain, "_writable_view", lambda arr: None)
        _, got = restore(pc, TOKENS[: n + 1])
    assert_same(got, want)
    assert got[0].keys.shape[2] > n  # free room after the restored positions either way
