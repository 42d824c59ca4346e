"""The prompt cache keeps the MTP layers' state (cache/mtp_part.py): a prefix restored from RAM
or from disk after a restart is in the row's MTP attention as after a cold prefill (its KV equal
to a source fed the whole prefix pair by pair), greedy tokens stay plain decoding's, a mid-prompt
checkpoint restores exactly its tokens' pairs, a delta served to a shorter prefix all its
pairs but the one at the cut, a suspect entry after a crash its part once the target's probe
passed; the ledgers count the MTP bytes, and entries without an MTP part (`--mtp off`, older
servers) or with one that does not fit the heads still restore and serve, the heads starting
where the restored part ends."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from mlx_kvserve.cache import MTPRestored, MTPState, PromptCache
from mlx_kvserve.cache import restore as restore_module
from mlx_kvserve.cache.mtp_part import HIDDEN, names
from mlx_kvserve.engine.batch import DecodeBatch
from mlx_kvserve.engine.prompt_state import PromptStates
from mlx_kvserve.engine.speculation.depth import VerifyCost
from mlx_kvserve.engine.speculation.mtp import MTPDraft, Tap
from tests.support.mtp_models import loaded_qwens, predictable_llama_heads
from tests.unit.test_batching import Driver
from tests.unit.test_engine_units import reference, request, tokens_of
from tests.unit.test_speculation_mtp import (
    LONG,
    assert_prompt_fed,
    fed_pair_by_pair,
    untied_llama,
)

MiB = 1 << 20
TAIL = [9, 8, 7, 6, 5, 4, 3, 2, 1, 33, 44]  # the next turn's new message


@pytest.fixture(autouse=True)
def prior_cost(monkeypatch: pytest.MonkeyPatch) -> None:
    """Draft on the cost prior alone, as test_speculation_mtp.py does: rows draft and verify."""
    monkeypatch.setattr(VerifyCost, "observe", lambda self, batch, width, seconds: None)


@pytest.fixture(scope="module")
def qwen(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple]:
    return loaded_qwens(tmp_path_factory.mktemp, ("random", "leaky"))


def open_cache(directory: Path | None) -> PromptCache:
    return PromptCache(directory, "tiny-qwen35-mtp", disk_budget=64 * MiB, ram_budget=64 * MiB)


def driver_for(model, heads, cache: PromptCache, *, mtp: bool = True) -> Driver:
    """The engine's prefill and decode batch over `cache`, checkpoints every 40 tokens; with
    `mtp` False the server of `--mtp off`: no tap, no heads."""
    driver = Driver(model)
    driver.states = driver.gen.states = PromptStates(model, cache)
    driver.gen.checkpoint_interval = 40
    if mtp:
        driver.batch = DecodeBatch(model, driver._end, speculation="auto", mtp=heads)
        driver.gen.model = driver.batch.model
    return driver


def first_turn(driver: Driver) -> list[int]:
    """LONG answered; the next turn's prompt (the resident session dropped: the cache serves)."""
    req = request(LONG, max_tokens=12)
    driver.join(req)
    driver.drain()
    driver.states.reset()
    return LONG + tokens_of(req.text) + TAIL


def next_turn(driver: Driver, model, turn: list[int]):
    req = request(turn, max_tokens=12)
    timings, seq = driver.gen.start(req)
    return req, timings, seq


def mtp_docs(cache: PromptCache) -> list[dict]:
    entries = cache._catalog.entries.values()
    return [e.meta.get("mtp") for e in sorted(entries, key=lambda e: e.n_tokens)]


@pytest.mark.parametrize("tier", ["ram", "disk", "disk_into"])
def test_a_restored_prefix_is_in_the_mtp_attention_as_after_a_cold_prefill(
    qwen, tmp_path, monkeypatch, tier
):
    """Turn one stores its checkpoints with their MTP parts; turn two, restored from RAM or
    (a restarted engine) from disk, whole files or read straight into the buffers, has an MTP
    cache equal to a source fed the whole turn pair by pair, and answers as plain decoding."""
    model, heads, _ = qwen["leaky"]
    directory = None if tier == "ram" else tmp_path
    cache = open_cache(directory)
    turn = first_turn(driver_for(model, heads, cache))
    assert all(doc is not None for doc in mtp_docs(cache))
    if tier != "ram":
        cache.close()
        cache = open_cache(directory)  # a restart: only the files
        if tier == "disk_into":
            monkeypatch.setattr(restore_module, "SMALL_LINK_BYTES", 0)
    driver = driver_for(model, heads, cache)
    req, timings, seq = next_turn(driver, model, turn)
    assert timings.cache_source == tier.split("_")[0]
    assert timings.cached_tokens > len(LONG)
    assert_prompt_fed(heads, seq.live.mtp, turn)
    driver.batch.add(seq)
    driver.drain()
    assert tokens_of(req.text) == reference(model, turn, 12)
    cache.close()


def test_an_entry_without_an_mtp_part_restores_and_serves_with_heads_on(qwen, tmp_path):
    """Entries written by `--mtp off` (or an older server) carry no MTP part: restored with
    heads on they serve, the MTP cache holding the pairs from the restored position on, and
    the next checkpoints carry their part from there (a chain of links with and without)."""
    model, heads, _ = qwen["leaky"]
    cache = open_cache(tmp_path)
    turn = first_turn(driver_for(model, heads, cache, mtp=False))
    assert mtp_docs(cache) and not any(mtp_docs(cache))
    cache.close()
    cache = open_cache(tmp_path)
    driver = driver_for(model, heads, cache)
    req, timings, seq = next_turn(driver, model, turn)
    usable = timings.cached_tokens
    assert timings.cache_source == "disk" and usable > len(LONG)
    assert seq.live.mtp.tail == usable and seq.live.mtp.fed == len(turn) - 2
    driver.batch.add(seq)
    driver.drain()
    assert tokens_of(req.text) == reference(model, turn, 12)
    newest = mtp_docs(cache)[-1]
    assert newest is not None and newest["fed_from"] == usable
    cache.close()


def test_a_mid_prompt_checkpoint_restores_an_mtp_state_of_exactly_its_tokens(qwen):
    """The interval checkpoint at 120 tokens (a chunk end, before the prompt's end) keeps the
    pairs of its 120 tokens and h_119: a prompt that departs there restores exactly them."""
    model, heads, _ = qwen["random"]
    cache = open_cache(None)
    first_turn(driver_for(model, heads, cache))
    states = PromptStates(model, cache)
    start = states.acquire(LONG[:120] + [1, 2, 3])
    assert start.source == "ram" and start.usable == 120
    state = start.restored_mtp
    assert state is not None and state.fed_from == 0 and state.n_tokens == 120
    fresh = fed_pair_by_pair(heads, LONG[:120])
    for mine, theirs in zip(state.keys, [c.keys for c in fresh.cache], strict=True):
        assert mine.shape[2] == 119 and mx.allclose(mine, theirs[..., :119, :], atol=1e-4).item()
    assert mx.allclose(state.hidden, fresh.hidden[119], atol=1e-4).item()


def test_the_ram_and_disk_ledgers_count_the_mtp_bytes(qwen, tmp_path):
    """Every entry's payload (what the RAM tier and the disk budget count) is its arrays,
    the MTP part's too, and its file holds exactly them."""
    model, heads, _ = qwen["random"]
    cache = open_cache(tmp_path)
    first_turn(driver_for(model, heads, cache))
    cache.flush()
    catalog = cache._catalog
    assert catalog.entries
    for entry in catalog.entries.values():
        doc = entry.meta["mtp"]
        mtp = [n for n in entry.layout if n.startswith("mtp.")]
        assert sorted(mtp) == sorted(names(doc["layers"]))
        header, arrays = cache.disk.read_entry(entry.key)
        assert {a.name for a in arrays} == set(entry.layout)
        assert entry.payload_bytes == sum(a.nbytes for a in arrays) == header["payload_bytes"]
        held = entry.n_tokens - 1 - doc["fed_from"]
        assert entry.layout["mtp.0.keys"][1][2] == held
        assert entry.layout[HIDDEN][1] == (doc["hidden_size"],)
    in_ram = sum(e.payload_bytes for e in catalog.entries.values() if catalog.ram.get(e.key))
    assert cache.memory()["ram_tier"] == in_ram
    assert sum(e.file_bytes for e in catalog.entries.values()) == sum(
        p.stat().st_size for p in cache.disk.entry_files()
    )
    cache.close()


def test_an_mtp_part_that_does_not_fit_the_heads_is_dropped_and_the_entry_kept(qwen):
    """An entry whose MTP part has another geometry (another model's heads): the target's
    state restores and serves, the MTP starts where the restore ends, the entry stays."""
    model, heads, _ = qwen["random"]
    cache = open_cache(None)
    tap = Tap(model, heads)
    states = PromptStates(model, cache)
    live = states.cold().caches
    hidden, _ = heads.forward(mx.array([LONG[:40]]), live)
    mx.eval(hidden)
    fresh = fed_pair_by_pair(heads, LONG[:40])
    wide = [mx.concatenate([c.keys[..., :39, :]] * 2, axis=1) for c in fresh.cache]
    state = MTPState(0, wide, wide, hidden[0, -1])
    key = cache.checkpoint(LONG[:40], live, "message", mtp=state)
    assert key is not None and cache._catalog.entries[key].meta["mtp"]["fed_from"] == 0
    assert not tap.fits(state)
    driver = driver_for(model, heads, cache)
    req, timings, seq = next_turn(driver, model, LONG[:40] + TAIL)
    assert timings.cache_source == "ram" and timings.cached_tokens == 40
    assert seq.live.mtp.tail == 40  # the restored part was dropped: pairs from 40 on
    driver.batch.add(seq)
    driver.drain()
    assert tokens_of(req.text) == reference(model, LONG[:40] + TAIL, 12)
    assert key in cache._catalog.entries


@pytest.fixture(scope="module")
def llama():
    """A plain-KV llama with predictable heads: its entries are deltas, served to any prefix."""
    model = untied_llama()
    return model, predictable_llama_heads(model, 0.05)


def test_a_delta_served_to_a_shorter_prefix_restores_its_pairs_but_the_one_at_the_cut(llama):
    """A prompt departing inside the newest link (an edited answer): the MTP state of the
    prefix restores, but the pair at the cut, whose next token was the entry's, and its hidden
    state, which was not stored: one pair short, tokens still plain decoding's."""
    model, heads = llama
    cache = open_cache(None)
    turn = first_turn(driver_for(model, heads, cache))
    assert {e.kind for e in cache._catalog.entries.values()} == {"delta"}
    prompt = turn[:155] + [1, 2, 3]
    driver = driver_for(model, heads, cache)
    req, timings, seq = next_turn(driver, model, prompt)
    assert timings.cache_source == "ram" and timings.cached_tokens == 155
    source = seq.live.mtp
    assert source.fed == len(prompt) - 2 and source.tail == 155
    assert source.cache[0].offset == len(prompt) - 2  # pair 154 lost
    fresh = fed_pair_by_pair(heads, prompt)
    a, b = source.cache[0].keys[..., :154, :], fresh.cache[0].keys[..., :154, :]
    assert mx.allclose(a, b, atol=1e-4).item()
    driver.batch.add(seq)
    driver.drain()
    assert tokens_of(req.text) == reference(model, prompt, 12)


def test_a_suspect_entry_with_an_mtp_part_is_checked_and_served_after_a_crash(llama, tmp_path):
    """After an unclean shutdown the entries are suspect: the restore stops before the probe,
    re-prefills it and compares (the target's logits), keeps the entry, and the row's MTP
    starts from the restored part (the probe's pairs lost); tokens plain decoding's."""
    model, heads = llama
    cache = open_cache(tmp_path)
    turn = first_turn(driver_for(model, heads, cache))
    cache.flush()
    cache._writer.stop()  # a crash: no clean close
    cache.disk.release_lock()
    cache = open_cache(tmp_path)
    assert cache.unclean_start and all(e.suspect for e in cache.entries())
    driver = driver_for(model, heads, cache)
    req, timings, seq = next_turn(driver, model, turn)
    usable = timings.cached_tokens
    assert timings.cache_source == "disk" and usable > len(LONG)
    source = seq.live.mtp
    assert source.tail == usable and source.fed == len(turn) - 2
    assert source.cache[0].offset == len(turn) - 1 - 2  # the probe's pair and the one before it
    fresh = fed_pair_by_pair(heads, turn)
    a, b = source.cache[0].keys[..., : usable - 2, :], fresh.cache[0].keys[..., : usable - 2, :]
    assert mx.allclose(a, b, atol=1e-4).item()
    driver.batch.add(seq)
    driver.drain()
    assert tokens_of(req.text) == reference(model, turn, 12)
    assert len(cache.entries()) >= 4
    cache.close()


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    st.lists(st.tuples(st.integers(1, 9), st.booleans()), min_size=1, max_size=8),
    st.integers(0, 8),
)
def test_any_run_of_chunks_gives_checkpoints_exactly_their_pairs(qwen, chunks, fold):
    """Chunks of any length, some without hidden states (image chunks: gaps), a checkpoint
    at each chunk's end and one folded inside the last: a state is None or holds exactly the
    pairs of its tokens from the first after the last gap (`tail`), equal to a source fed
    them pair by pair where no gap came before, and h at its last position."""
    _, heads, _ = qwen["random"]
    tokens = LONG[: sum(n for n, _ in chunks)]
    hidden = heads.inner(mx.array([tokens]), None)[0]
    fresh = fed_pair_by_pair(heads, tokens)
    source, start, gap = MTPDraft(heads), 0, -1
    for i, (n, seen) in enumerate(chunks):
        seen = seen or i == 0  # a prompt starts with text
        mx.eval(
            source.chunk(
                start, tokens[start : start + n], hidden[start : start + n] if seen else None
            )
        )
        if not seen:
            gap = start + n  # its pairs, and the one before it, lost
        start += n
        last = i == len(chunks) - 1
        ends = {start, start - fold} if last and start - fold > start - n else {start}
        for length in sorted(ends):
            state = source.state(length)
            if state is None:  # a lone token, or nothing after the gap
                assert length < 2 or gap >= length - 1
                continue
            assert state.n_tokens == length and state.fed_from == max(gap, 0)
            assert state.fed_from == source.tail
            assert mx.allclose(state.hidden, hidden[length - 1], atol=1e-4).item()
            if gap < 0:
                for mine, theirs in zip(state.keys, fresh.cache, strict=True):
                    want = theirs.keys[..., : length - 1, :]
                    assert mx.allclose(mine, want, atol=1e-4).item()


JSONISH = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 200) | st.text(max_size=4),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=8,
)
KEEP = "keep"  # the doc as written
DOCS = st.fixed_dictionaries(
    {},
    optional={
        "layers": st.integers(-1, 3) | JSONISH,
        "fed_from": st.integers(-2, 70) | JSONISH,
        "hidden_size": st.integers(-1, 20) | JSONISH,
    },
)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.just(KEEP) | DOCS | JSONISH, min_size=3, max_size=3), st.integers(41, 60))
@example([KEEP] * 3, 50)
@example([KEEP] * 3, 60)
@example([KEEP, {"layers": 1, "fed_from": 19, "hidden_size": 9}, KEEP], 60)
def test_any_mtp_doc_restores_the_target_and_a_fitting_part_or_none(docs, usable):
    """Whatever an entry's MTP doc says (a damaged or foreign header that still parses), a
    restore fills the target's caches and hands over a part whose arrays agree with it, or
    none: it never raises and never blames the entry for it."""
    from tests.support.cache_testing import make_kv

    cache = open_cache(None)
    keys = []
    for n in (20, 40, 60):
        caches = make_kv(n)
        kv = [mx.ones((1, 2, n - 1, 4)) * n]
        state = MTPState(0, kv, kv, mx.ones((8,)))
        keys.append(cache.checkpoint(LONG[:n], caches, "message", anchor=True, mtp=state))
    for key, doc in zip(keys, docs, strict=True):
        if doc != KEEP:
            cache._catalog.entries[key].meta["mtp"] = doc
    got = MTPRestored()
    match = cache.lookup(LONG[: usable + 1])
    assert match.usable == usable
    caches = cache.restore(match, make_kv(0), tokens=LONG[: usable + 1], mtp=got)
    assert {c.offset for c in caches} == {usable}
    if docs == [KEEP] * 3:  # each link's pairs, the hidden state where usable is its end
        want = [20] * 19 + [40] * 20 + [60] * (usable - 40)
        assert got.state.keys[0][0, 0, :, 0].tolist() == want[: usable - 1]
        assert (got.state.hidden is not None) == (usable == 60)
    if got.state is not None:
        assert got.state.n_tokens == usable
        assert got.state.keys[0].shape[1:2] == (2,)
    assert len(cache._catalog.entries) == 3


def test_an_mtp_state_that_cannot_be_stored_costs_only_itself():
    """An MTP state the format cannot hold (a dtype it has no name for): the checkpoint is
    stored without its MTP part, never refused."""
    from tests.support.cache_testing import make_kv

    cache = open_cache(None)
    kv = [mx.ones((1, 2, 19, 4), dtype=mx.complex64)]
    key = cache.checkpoint(
        LONG[:20], make_kv(20), "message", mtp=MTPState(0, kv, kv, mx.ones((8,)))
    )
    assert key is not None and "mtp" not in cache._catalog.entries[key].meta
