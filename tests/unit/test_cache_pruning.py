"""Prefix dominance (invariant 4), with snapshots and with delta chains."""

from __future__ import annotations

import errno

import pytest
from mlx_lm.models.cache import KVCache

from mlx_kvserve.cache import PromptCache
from mlx_kvserve.cache.disk import DiskTier
from tests.support.cache_testing import fill_kv, make_kv, make_ssm

MiB = 1 << 20
T = list(range(300, 600))


@pytest.fixture(params=["disk", "ram"])
def cache(request, tmp_path):
    directory = tmp_path / "kv" if request.param == "disk" else None
    pc = PromptCache(directory, "model-a", disk_budget=64 * MiB, ram_budget=64 * MiB)
    yield pc
    pc.close()


def keys(pc):
    return {e.key for e in pc.entries()}


# -- snapshots: nested copies are real copies, so strict prefixes go --------------------------
def test_strict_prefix_snapshot_pruned(cache):
    a = cache.checkpoint(T[:10], make_ssm(10), "interval")
    b = cache.checkpoint(T[:20], make_ssm(20), "interval")
    c = cache.checkpoint(T[:30], make_ssm(30), "generation")
    assert keys(cache) == {c}
    assert a and b and cache.stats()["pruned"] == 2


def test_unrelated_entry_kept(cache):
    other = cache.checkpoint([9] * 15, make_ssm(15), "message")
    new = cache.checkpoint(T[:30], make_ssm(30), "message")
    assert keys(cache) == {other, new}


def test_diverging_sibling_kept(cache):
    """Shares a prefix but is not a prefix of the new entry: still serves its own branch."""
    sib = cache.checkpoint(T[:10] + [1, 2, 3], make_ssm(13), "message")
    new = cache.checkpoint(T[:30], make_ssm(30), "message")
    assert keys(cache) == {sib, new}


def test_new_entry_itself_kept(cache):
    new = cache.checkpoint(T[:30], make_ssm(30), "message")
    assert keys(cache) == {new}
    assert cache.lookup(T[:31]).key == new


def test_shared_anchor_kept(cache):
    anchor = cache.checkpoint(T[:10], make_ssm(10), "system", anchor=True)
    a = cache.checkpoint(T[:30], make_ssm(30), "message")
    b = cache.checkpoint(T[:10] + [7] * 20, make_ssm(30), "message")
    assert keys(cache) == {anchor, a, b}
    # A third conversation with the same system prompt restores the anchor.
    m = cache.lookup(T[:10] + [8] * 5)
    assert m.key == anchor and m.usable == 10


# -- deltas: prefix entries are chain links; nothing is stored twice ---------------------------
def test_chain_links_kept_and_no_duplicate_bytes(cache):
    a = cache.checkpoint(T[:100], make_kv(100), "interval")
    b = cache.checkpoint(T[:200], make_kv(200), "interval")
    c = cache.checkpoint(T[:300], make_kv(300), "message")
    infos = {e.key: e for e in cache.entries()}
    assert set(infos) == {a, b, c}
    assert infos[b].parent == a and infos[c].parent == b
    assert cache.stats()["tokens"] == 300  # each position stored once
    assert cache.stats()["pruned"] == 0


def test_anchor_inside_existing_chain_is_stored(cache):
    cache.checkpoint(T[:300], make_kv(300), "message")
    anchor = cache.checkpoint(T[:50], make_kv(50), "system", anchor=True)
    assert anchor is not None
    # The second conversation branches from the anchor rather than copying the system prompt.
    conv = T[:50] + [1] * 40
    m = cache.lookup(conv)
    assert m.usable == 50
    caches = [KVCache(), KVCache()]
    cache.restore(m, caches)
    fill_kv(caches, 50, 90)
    key = cache.checkpoint(conv, caches, "message")
    info = {e.key: e for e in cache.entries()}[key]
    assert info.parent == anchor and info.parent_len == 50


def test_delta_leaf_off_the_chain_is_pruned(tmp_path, monkeypatch):
    """A prefix entry that is not part of the new entry's chain (here: its write failed, so it
    lives only in RAM and cannot parent a durable delta) is redundant and pruned."""
    pc = PromptCache(tmp_path, "model-a", disk_budget=64 * MiB, ram_budget=64 * MiB)
    real = DiskTier.write_entry
    fail = {"on": True}

    def flaky(self, *args, **kw):
        if fail["on"]:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, *args, **kw)

    monkeypatch.setattr(DiskTier, "write_entry", flaky)
    ram_only = pc.checkpoint(T[:100], make_kv(100), "message")
    pc.flush()
    assert {e.key: e.disk for e in pc.entries()} == {ram_only: "none"}
    fail["on"] = False
    new = pc.checkpoint(T[:200], make_kv(200), "message")
    pc.flush()
    infos = {e.key: e for e in pc.entries()}
    assert set(infos) == {new}
    assert infos[new].parent is None and infos[new].disk == "written"
    pc.close()


def test_pinned_prefix_not_pruned(cache):
    a = cache.checkpoint(T[:10], make_ssm(10), "interval")
    with cache.pinned(a):
        cache.checkpoint(T[:30], make_ssm(30), "generation")
        assert a in keys(cache)
    cache.checkpoint(T[:40], make_ssm(40), "generation")
    assert a not in keys(cache)


def test_departure_snapshots_outlive_their_own_request(cache):
    """A snapshot cannot be cut back: the conversation before a message (a retry, an edit or a
    rewind to that message departs there) and one token before a prompt's end (a retried
    request, or a next turn that re-renders the answer differently, departs there) are kept;
    other snapshots of the same request are pruned by longer ones."""
    message = cache.checkpoint(T[:10], make_ssm(10), "message")
    cache.checkpoint(T[:25], make_ssm(25), "interval")
    prompt = cache.checkpoint(T[:45], make_ssm(45), "prompt")
    answer = cache.checkpoint(T[:70], make_ssm(70), "generation")
    assert keys(cache) == {message, prompt, answer}
    assert cache.stats()["pruned"] == 1  # the interval snapshot
    # The next turn re-renders a different answer: its message point is far from every entry
    # (a snapshot of its own), and the answer nothing extends stays a leaf.
    other_message = cache.checkpoint(T[:45] + [7] * 40, make_ssm(85), "message")
    assert keys(cache) == {message, prompt, answer, other_message}
    # A next turn that extends the answer: its message point, 3 tokens (the template's end of
    # the answer) after it, is folded into the answer instead of storing another whole state.
    assert cache.checkpoint(T[:73], make_ssm(73), "message") is None
    assert cache.stats()["folded"] == 1 and cache.stats()["checkpoints"] == 5
    next_answer = cache.checkpoint(T[:120], make_ssm(120), "generation")
    # The answer is now that message's departure point: a longer snapshot does not prune it.
    assert keys(cache) == {message, prompt, answer, other_message, next_answer}
    assert cache.lookup(T[:74]).key == answer


def test_a_folded_departure_point_survives_a_restart(tmp_path):
    """The fold is a flag in the entry's slot, so a restarted server keeps the entry too."""
    with PromptCache(tmp_path, "model-a", disk_budget=64 * MiB, ram_budget=64 * MiB) as pc:
        answer = pc.checkpoint(T[:70], make_ssm(70), "generation")
        assert pc.checkpoint(T[:75], make_ssm(75), "message") is None
    with PromptCache(tmp_path, "model-a", disk_budget=64 * MiB, ram_budget=64 * MiB) as pc:
        later = pc.checkpoint(T[:120], make_ssm(120), "generation")
        assert keys(pc) == {answer, later}
    with PromptCache(tmp_path, "model-b", disk_budget=64 * MiB, ram_budget=64 * MiB) as pc:
        pc.checkpoint(T[:70], make_ssm(70), "generation")
        assert pc.checkpoint(T[:87], make_ssm(87), "message") is not None  # 17 > FOLD_TOKENS
        pc.checkpoint(T[:120], make_ssm(120), "generation")
        assert len(keys(pc)) == 2  # the unfolded answer was pruned by the longer snapshot
