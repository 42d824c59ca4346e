"""Drafting from a checkpoint's own MTP heads (models/mtp_heads.py, engine/speculation/mtp.py):
the heads are kept at load from the model's safetensors; the decode batch's passes keep the
target's hidden states for them without changing its logits; with random heads (every draft a
guess) the tokens are plain decoding's, and with heads made to guess right (tests/support/
mtp_models.py) their drafts are kept, solo and merged, and their own cache holds exactly one
entry per committed position, as if fed afresh."""

from __future__ import annotations

import json
import threading
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mlx_lm.models.cache import CacheList
from mlx_lm.utils import load_model

from mlx_kvserve.cache.kinds import describe_model
from mlx_kvserve.engine.batch import DecodeBatch
from mlx_kvserve.engine.loading import Loaded
from mlx_kvserve.engine.room import Room
from mlx_kvserve.engine.speculation.depth import VerifyCost
from mlx_kvserve.engine.speculation.mtp import SOURCE, MTPDraft, Tap, prefill_source
from mlx_kvserve.engine.worker import Engine
from mlx_kvserve.models.mtp_heads import MTPHeads, heads_problem, load_heads
from tests.support.mtp_models import HEADS, loaded_qwens, mtp_model_dir, predictable_llama_heads
from tests.support.tiny_models import make_model_dir
from tests.unit.test_batching import Driver
from tests.unit.test_engine_units import StubTokenizer, reference, request, tokens_of
from tests.unit.test_speculation_step import FlatPriors

PROMPTS = [[5, 9, 2, 7, 11, 13, 17, 19], [3, 4, 8, 100, 200], [40, 41, 42, 43, 44, 45]]


@pytest.fixture(autouse=True)
def prior_cost(monkeypatch: pytest.MonkeyPatch) -> None:
    """Draft on the cost prior alone: a loaded machine's timings must not decide the test."""
    monkeypatch.setattr(VerifyCost, "observe", lambda self, batch, width, seconds: None)


@pytest.fixture(scope="module")
def qwen(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple]:
    return loaded_qwens(tmp_path_factory.mktemp)


def decode(model, heads: MTPHeads | None, prompts, n, speculation: str = "auto", **params):
    """Each request joins the batch a step after the one before, then all run out; `n`: the
    tokens each asks for (or a list, one per prompt)."""
    driver = Driver(model)
    driver.batch = DecodeBatch(model, driver._end, speculation=speculation, mtp=heads)
    driver.gen.model = driver.batch.model  # the prefill through the tap too, as the engine's
    reqs = []
    for i, prompt in enumerate(prompts):
        req = request(prompt, max_tokens=n[i] if isinstance(n, list) else n)
        req.params = replace(req.params, **params)
        reqs.append(req)
        driver.join(req)
        driver.step()
    driver.drain()
    return driver, reqs


def untied_llama():
    """A tiny llama with its own output head (tied, a zeroed llama predicts its input token)."""
    from tests.unit.test_cache_models import tiny_llama

    mx.random.seed(3)
    return tiny_llama(False, vocab=512, tied=False)


def mtp_counts(driver: Driver) -> list[list[int]]:
    """Each finished row's (drafted, kept, passes) from the MTP heads."""
    return [seq.timings.by_source.get(SOURCE, [0, 0, 0]) for seq in driver.ended]


def test_the_heads_are_kept_at_load_and_passes_return_the_models_logits(qwen):
    model, heads, path = qwen["random"]
    assert heads is not None and heads.depth == 1
    config = json.loads((path / "config.json").read_text())
    assert config["text_config"]["mtp_num_hidden_layers"] == 1
    tokens = mx.array([PROMPTS[0]])
    cache, cache2 = model.make_cache(), model.make_cache()
    tap = Tap(model, heads)
    for part in (tokens[:, :5], tokens[:, 5:]):  # a prefill, then more on the same caches
        assert mx.array_equal(tap(part, cache=cache), model(part, cache=cache2)).item()
    width = config["text_config"]["hidden_size"]
    assert tap.hidden is not None and tap.hidden.shape == (1, 3, width)


@pytest.mark.parametrize("family", ["qwen3_5_moe", "qwen3_next", "deepseek_v3", "glm4_moe"])
def test_other_families_heads_load_and_draft_exactly(tmp_path: Path, family):
    """Qwen3.5-MoE (experts in the MTP layer too), Qwen3-Next, DeepSeek-V3's nextn layer (MLA
    attention, experts) and GLM-4 MoE's: the heads load, and with heads that guess right every
    draft is kept and the tokens are plain decoding's (test_speculation_mtp_families.py: the
    families added since)."""
    path = mtp_model_dir(tmp_path / family, family=family, predictable=True)
    # mlx-lm drops Qwen3-Next's `mtp.*` only from a Hugging Face layout (per-expert weights, as
    # real checkpoints ship) and DeepSeek-V3's nextn layer only at index 61 (the real one's):
    # these tiny ones load unstrictly
    model, _ = load_model(path, strict=family in ("qwen3_5_moe", "glm4_moe"))
    heads = load_heads(path, model)
    assert heads is not None and heads.depth == 1
    assert mx.array_equal(
        Tap(model, heads)(mx.array([PROMPTS[1]])), model(mx.array([PROMPTS[1]]))
    ).item()
    _, plain = decode(model, None, PROMPTS[:1], 24, "off")
    driver, spec = decode(model, heads, PROMPTS[:1], 24)
    assert tokens_of(spec[0].text) == tokens_of(plain[0].text)
    ((drafted, kept, _),) = mtp_counts(driver)
    assert kept == drafted > 0


def test_a_checkpoint_without_heads_has_none_and_mtp_on_names_why(tmp_path: Path, qwen):
    plain = make_model_dir(tmp_path / "plain", "qwen3_5")
    model, _ = load_model(plain)
    assert load_heads(plain, model) is None  # no mtp_num_hidden_layers
    assert "states no MTP layers" in heads_problem(plain)
    stated = make_model_dir(tmp_path / "stated", "qwen3_5", mtp_num_hidden_layers=1)
    assert load_heads(stated, model) is None  # stated, but the conversion dropped the tensors
    assert "hold no mtp.* tensors" in heads_problem(stated)
    llama = make_model_dir(tmp_path / "llama", "llama")
    assert load_heads(llama, load_model(llama)[0]) is None  # a family without heads
    assert "model_type 'llama'" in heads_problem(llama)
    carrying = qwen["random"][2]
    assert heads_problem(carrying) is None
    assert "speculation is off" in heads_problem(carrying, "off")


def test_an_unknown_mtp_mode_is_refused_naming_it(tmp_path: Path, monkeypatch):
    from mlx_kvserve.config.file import ConfigError
    from mlx_kvserve.config.precedence import resolve_settings

    assert resolve_settings({}, tmp_path / "absent.toml").settings.mtp == "auto"
    assert resolve_settings({"mtp": "on"}, tmp_path / "absent.toml").settings.mtp == "on"
    with pytest.raises(ConfigError, match="mtp.*'yes' is not one of auto, on, off"):
        resolve_settings({"mtp": "yes"}, tmp_path / "absent.toml")
    monkeypatch.setenv("MLX_KVSERVE_MTP", "always")
    with pytest.raises(ConfigError, match="^MLX_KVSERVE_MTP: setting 'mtp'"):
        resolve_settings({}, tmp_path / "absent.toml")


@pytest.mark.parametrize("kind", list(HEADS))
def test_greedy_tokens_are_plain_decodings_and_right_heads_are_kept(qwen, kind):
    """A lone row (snapshot and replay of the hybrid's states when a draft is rejected)."""
    model, heads, _ = qwen[kind]
    _, plain = decode(model, None, PROMPTS[:1], 30, "off")
    driver, spec = decode(model, heads, PROMPTS[:1], 30)
    assert tokens_of(spec[0].text) == tokens_of(plain[0].text)
    assert spec[0].done.completion_tokens == 30
    ((drafted, kept, passes),) = mtp_counts(driver)
    assert drafted > 0 and passes > 0
    if kind == "random":
        assert kept < drafted
    elif kind == "right":
        assert kept == drafted
    else:
        assert 0 < kept < drafted


def test_merged_rows_hand_each_its_hidden_states(qwen):
    """A hybrid's merged rows (speculating too: snapshot and replay with per-row lengths) feed
    their MTP sources all the while: once alone again, the last row's source holds every
    position since its first decode pass, and it drafts at once."""
    model, heads, _ = qwen["right"]
    lengths = [40, 12, 12]  # the first decodes alone again after the others end
    _, plain = decode(model, None, PROMPTS, lengths, "off")
    driver = Driver(model)
    driver.batch = DecodeBatch(model, driver._end, speculation="auto", mtp=heads)
    driver.batch.speculator.priors = FlatPriors()  # each row learns its heads' worth afresh
    driver.gen.model = driver.batch.model
    reqs = [request(p, max_tokens=n) for p, n in zip(PROMPTS, lengths, strict=True)]
    for req in reqs:
        driver.join(req)
        driver.step()
    while len(driver.batch) > 1:
        driver.step()
    (seq,) = driver.batch.seqs  # whichever row is left: rows draft at their own pace
    assert max(driver.sizes) == 3
    drafted_before = seq.timings.by_source.get(SOURCE, [0])[0]
    assert_fed_afresh(heads, driver.batch.speculator.rows[id(seq)].mtp, 0)
    driver.step()
    assert seq.timings.by_source[SOURCE][0] > drafted_before  # drafted on its first step alone
    driver.drain()
    for a, b in zip(plain, reqs, strict=True):
        assert tokens_of(b.text) == tokens_of(a.text)


@pytest.mark.parametrize("leak", [0.0, 0.3])
def test_merged_plain_kv_rows_verify_mtp_drafts_together(leak):
    """Every layer plain KV (a llama with heads made for it): rows verify merged, each
    accepting and rolling back its own drafts (holes), and give plain decoding's tokens."""
    model = untied_llama()
    heads = predictable_llama_heads(model, leak)
    lengths = [64, 24, 24]  # the first still runs when the third joins, drafting as it does
    want = [reference(model, p, n) for p, n in zip(PROMPTS, lengths, strict=True)]
    driver, spec = decode(model, heads, PROMPTS, lengths)
    assert [tokens_of(r.text) for r in spec] == want
    assert max(driver.sizes) == 3
    counts = mtp_counts(driver)
    assert all(kept > 0 for _, kept, _ in counts), counts
    if leak:
        assert any(kept < drafted for drafted, kept, _ in counts), counts


def test_seeded_sampled_rows_give_the_same_tokens(qwen):
    model, heads, _ = qwen["leaky"]
    params = {"temperature": 0.8, "seed": 7}
    _, plain = decode(model, None, PROMPTS[:1], 30, "off", **params)
    driver, spec = decode(model, heads, PROMPTS[:1], 30, **params)
    assert tokens_of(spec[0].text) == tokens_of(plain[0].text)
    assert mtp_counts(driver)[0][0] > 0


def test_the_mtp_cache_holds_each_committed_pair_once(qwen):
    """Mid-answer, after drafts kept and rejected: the row's MTP source equals one fed afresh
    every pair (h_p, t_{p+1}) since its first decode pass, h from a full forward of its tokens
    (its drafting steps trimmed away, no rejected position in it)."""
    model, heads, _ = qwen["leaky"]
    driver = Driver(model)
    driver.batch = DecodeBatch(model, driver._end, speculation="auto", mtp=heads)
    driver.gen.model = driver.batch.model
    req = request(PROMPTS[0], max_tokens=60)
    driver.join(req)
    for _ in range(12):
        driver.step()
    (seq,) = driver.batch.seqs
    source = driver.batch.speculator.rows[id(seq)].mtp
    assert 0 < seq.timings.by_source[SOURCE][1] < seq.timings.by_source[SOURCE][0]
    assert_fed_afresh(heads, source, 0)  # from the prompt's first token: its prefill's pass
    driver.drain()
    assert tokens_of(req.text) == reference(model, PROMPTS[0], 60)


def assert_fed_afresh(heads: MTPHeads, source: MTPDraft, first: int) -> None:
    """`source` (a row's, mid-answer) equals an MTP source fed at once every pair since
    position `first` (where its prefill's last pass began), the hidden states from a full
    forward of the row's tokens."""
    source.propose(1)  # feeds what is pending
    assert source.fed == len(source.tokens) - 2
    kv = source.cache[0]
    kv = kv[0] if isinstance(kv, CacheList) else kv  # DeepSeek-V3.2's: KV and indexer keys
    assert kv.offset == source.fed - first + 1
    fresh = MTPDraft(heads)
    fresh.extend(source.tokens)
    hidden = heads.inner(mx.array([source.tokens[: source.fed + 1]]), None)[0]
    fresh.record(first, hidden[first:])
    assert fresh.propose(1) is not None and fresh.fed == source.fed
    assert mx.allclose(fresh.out, source.out, atol=1e-4).item()


def test_the_engine_drafts_with_the_heads_its_loader_kept(qwen):
    """A real engine thread whose loader returns the heads (as models/serving.py's does)."""
    model, heads, _ = qwen["right"]
    reqs = [request(p, max_tokens=20) for p in PROMPTS]
    seen: dict[str, list[int]] = {}
    ended = threading.Semaphore(0)

    def observe(req, timings) -> None:
        seen[req.request_id] = timings.by_source.get(SOURCE, [0, 0, 0])
        ended.release()

    mx.eval(model(mx.array([[0]])))  # lazy arrays made on this thread (test_batching's note)
    engine = Engine(
        lambda: Loaded(model, StubTokenizer(), mtp=heads), speculation="auto", cache_enabled=False
    )
    engine.add_observer(observe)
    engine.start()
    assert engine.ready.wait(60), engine.load_error
    try:
        for req in reqs:  # one after the other: each decodes alone, so each verifies
            engine.submit(req)
            assert ended.acquire(timeout=120)
    finally:
        engine.stop()
    for req, prompt in zip(reqs, PROMPTS, strict=True):
        assert tokens_of(req.text) == reference(model, prompt, 20)
        drafted, kept, _ = seen[req.request_id]
        assert kept == drafted > 0


@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    st.lists(
        st.tuples(st.integers(0, 5), st.integers(1, 6), st.booleans()), min_size=1, max_size=10
    )
)
def test_any_run_of_passes_keeps_one_cache_entry_per_committed_pair(qwen, rounds):
    """Rounds of (drafts kept, drafts asked, tokens known before or after the hidden states):
    every proposal has the length asked, and the MTP cache holds one entry per pair fed."""
    _, heads, _ = qwen["random"]
    width = heads.embed.weight.shape[1]
    source = MTPDraft(heads)
    prompt = 5
    source.extend(list(range(prompt + 1)))  # the prompt and the prefill's token (position 5)
    assert source.propose(3) is None  # no hidden state before the first pass
    cursor = prompt
    for kept, limit, tokens_first in rounds:
        fed = kept + 1  # the pending token and the drafts kept, positions cursor..
        hidden = mx.random.normal((fed, width))
        new = [7 + i for i in range(cursor + fed + 1 - len(source))]  # and the bonus token
        if tokens_first:
            source.extend(new)
            source.record(cursor, hidden)
        else:
            source.record(cursor, hidden)
            source.extend(new)
        cursor += fed
        draft = source.propose(limit)
        assert draft is not None and len(draft.tokens) == limit
        assert source.fed == len(source) - 2 == cursor - 1
        assert source.cache[0].offset == source.fed - prompt + 1


def test_a_row_that_opted_out_feeds_no_mtp_source_and_its_company_drafts():
    model = untied_llama()
    heads = predictable_llama_heads(model)
    want = [reference(model, p, 20) for p in PROMPTS[:2]]
    driver = Driver(model)
    driver.batch = DecodeBatch(model, driver._end, speculation="auto", mtp=heads)
    driver.gen.model = driver.batch.model
    reqs = [request(p, max_tokens=20) for p in PROMPTS[:2]]
    reqs[0].params = replace(reqs[0].params, speculative=False)
    for req in reqs:
        driver.join(req)
        driver.step()
    quiet = next(s for s in driver.batch.seqs if s.req is reqs[0])
    assert quiet.live.mtp is None  # its prefill fed none either
    driver.step()
    state = driver.batch.speculator.rows.get(id(quiet))
    assert state is None or (state.mtp is not None and not state.mtp.hidden)
    driver.drain()
    assert [tokens_of(r.text) for r in reqs] == want
    by_request = {s.req.request_id: s.timings.by_source for s in driver.ended}
    assert by_request[reqs[0].request_id] == {}
    assert by_request[reqs[1].request_id][SOURCE][1] > 0


def test_whether_to_read_first_is_asked_without_running_the_block(qwen, monkeypatch):
    """The pipelined step asks whether some source would draft (read the pending token first,
    or keep the overlap): MTP answers from what it was fed, running nothing."""
    from mlx_kvserve.engine.speculation.drafts import Drafter

    _, heads, _ = qwen["random"]
    source = MTPDraft(heads)
    drafter = Drafter([source])
    drafter.extend(list(range(7)))
    assert not drafter.would_propose()  # no hidden state yet
    source.record(5, mx.zeros((1, heads.embed.weight.shape[1])))
    steps = []
    monkeypatch.setattr(MTPHeads, "step", lambda *args: steps.append(args))
    assert drafter.would_propose() and not steps


def test_a_hugging_face_checkpoints_heads_equal_its_mlx_conversions(qwen, tmp_path: Path):
    """The layout Qwen ships (zero-centred norms stored as w - 1, the MTP block's too): the
    heads loaded from it draft exactly what those of the same weights in MLX's layout do."""
    from tests.support.mtp_models import as_hugging_face

    model, heads, path = qwen["random"]
    hub = as_hugging_face(path, tmp_path / "hub")
    hub_model, _ = load_model(hub)
    hub_heads = load_heads(hub, hub_model)
    assert hub_heads is not None
    tokens = mx.array([PROMPTS[0]])
    assert mx.allclose(hub_model(tokens), model(tokens), atol=1e-5).item()
    hidden = heads.inner(tokens, None)
    ours = heads.step(tokens[:, 1:], hidden[:, :-1], heads.make_cache())
    theirs = hub_heads.step(tokens[:, 1:], hidden[:, :-1], hub_heads.make_cache())
    assert mx.allclose(ours, theirs, atol=1e-5).item()


def test_the_heads_compute_in_the_targets_dtype(tmp_path: Path):
    """A bfloat16 checkpoint whose heads were saved in float32: they run in bfloat16, as the
    target does (so its hidden states meet weights of their own dtype)."""
    path = mtp_model_dir(tmp_path / "bf16", dtype="bfloat16")
    model, _ = load_model(path)
    heads = load_heads(path, model)
    assert heads is not None
    assert (
        heads.block.fc.weight.dtype == mx.bfloat16 == model.language_model.model.norm.weight.dtype
    )
    hidden, _ = heads.forward(mx.array([PROMPTS[0]]), None)
    assert (
        heads.step(mx.array([PROMPTS[0][1:]]), hidden[:, :-1], heads.make_cache()).dtype
        == mx.bfloat16
    )


def test_a_row_takes_only_its_own_prefills_hidden_states(qwen):
    """A joining row's MTP source is the one its own prefill fed (another row's pass in
    between changes nothing); a row whose prefill ran past the tap (a generator on the plain
    model) takes nothing from the last pass, which was another row's, and starts at its first
    decode pass."""
    model, heads, _ = qwen["random"]
    driver = Driver(model)
    driver.batch = DecodeBatch(model, driver._end, speculation="auto", mtp=heads)
    tap = driver.gen.model = driver.batch.model
    driver.join(request(PROMPTS[0], max_tokens=8))
    (first,) = driver.batch.seqs
    mine = driver.batch.speculator.rows[id(first)].mtp
    assert mine is first.live.mtp
    assert sorted(mine.hidden) == [len(PROMPTS[0]) - 1]  # the last waits for its next token
    assert mine.fed == len(PROMPTS[0]) - 2  # every other pair fed in its prefill
    _, second = driver.gen.start(request(PROMPTS[1], max_tokens=8))
    tap(mx.array([[3]]), cache=model.make_cache())  # some other pass runs in between
    driver.batch.add(second)
    assert_prompt_fed(heads, driver.batch.speculator.rows[id(second)].mtp, PROMPTS[1])
    driver.gen.model = model  # a prefill past the tap: its row's source is the batch's
    _, third = driver.gen.start(request(PROMPTS[2], max_tokens=8))
    assert third.live.mtp is None
    tap(mx.array([[3]]), cache=model.make_cache())
    driver.batch.add(third)
    theirs = driver.batch.speculator.rows.get(id(third))
    assert theirs is None or not (theirs.mtp and theirs.mtp.hidden)
    driver.drain()


LONG = [(7 * i + 3) % 240 + 5 for i in range(150)]  # chunks of 8, then a last pass of 64


def fed_pair_by_pair(heads: MTPHeads, tokens: list[int]) -> MTPDraft:
    """An MTP source fed every pair (h_p, t_{p+1}) of `tokens` one step at a time, h from
    one forward of them all."""
    fresh = MTPDraft(heads)
    fresh.extend(tokens)
    hidden = heads.inner(mx.array([tokens]), None)[0]
    for p in range(len(tokens) - 1):
        fresh.out = heads.step(mx.array([[tokens[p + 1]]]), hidden[p][None, None], fresh.cache)
        fresh.fed = p
    fresh.hidden[len(tokens) - 1] = hidden[-1]
    return fresh


def assert_prompt_fed(heads: MTPHeads, source: MTPDraft, prompt: list[int]) -> None:
    """`source`, a row's straight after its prefill, holds every pair of `prompt` in its
    cache (KV equal to a source fed pair by pair) and its last hidden state pending."""
    fresh = fed_pair_by_pair(heads, prompt)
    assert source.fed == fresh.fed == len(prompt) - 2
    assert sorted(source.hidden) == [len(prompt) - 1]
    assert mx.allclose(source.hidden[len(prompt) - 1], fresh.hidden[len(prompt) - 1], atol=1e-4)
    for mine, theirs in zip(source.cache, fresh.cache, strict=True):
        assert mine.offset == theirs.offset == len(prompt) - 1
        for a, b in ((mine.keys, theirs.keys), (mine.values, theirs.values)):
            a, b = a[..., : mine.offset, :], b[..., : theirs.offset, :]
            assert a.shape == b.shape
            assert mx.allclose(a, b, atol=1e-4).item()
    assert mx.allclose(source.out, fresh.out, atol=1e-4).item()


def test_a_cold_prefill_of_many_chunks_feeds_the_mtp_every_pair_of_the_prompt(qwen):
    """Each prefill chunk hands its hidden states to the row's MTP source, one block step a
    chunk: after a cold prefill its cache holds every pair (h_p, t_{p+1}) of the prompt, as
    a source fed them one by one (the pairs across chunk boundaries too)."""
    model, heads, _ = qwen["random"]
    driver = Driver(model)  # prefill_step 8: the prompt runs in many chunks
    driver.batch = DecodeBatch(model, driver._end, speculation="auto", mtp=heads)
    tap = driver.gen.model = driver.batch.model
    passes = []
    forward = heads.forward
    heads.forward = lambda inputs, cache: passes.append(inputs.shape[1]) or forward(inputs, cache)
    try:
        _, seq = driver.gen.start(request(LONG, max_tokens=4))
    finally:
        del heads.forward
    assert len(passes) > 5 and sum(passes) == len(LONG), passes
    assert isinstance(tap, Tap)
    assert_prompt_fed(heads, seq.live.mtp, LONG)
    driver.batch.add(seq)
    assert driver.batch.speculator.rows[id(seq)].mtp is seq.live.mtp
    assert seq.live.mtp.ready()  # drafts on its first step: the pending pair is the next
    driver.drain()


@pytest.mark.parametrize("kind", ["right", "leaky"])
def test_long_prompts_draft_from_their_whole_context_and_keep_plain_tokens(qwen, kind):
    """Greedy tokens after a prefill of many chunks are plain decoding's; heads that guess
    right have every draft kept from the first step."""
    model, heads, _ = qwen[kind]
    _, plain = decode(model, None, [LONG, LONG[40:]], 24, "off")
    driver, spec = decode(model, heads, [LONG, LONG[40:]], 24)
    assert [tokens_of(r.text) for r in spec] == [tokens_of(r.text) for r in plain]
    counts = mtp_counts(driver)
    assert all(drafted > 0 for drafted, _, _ in counts), counts
    if kind == "right":
        assert all(kept == drafted for drafted, kept, _ in counts), counts


def test_a_resumed_row_drafts_from_its_whole_context(qwen):
    """A row paused for memory (its KV freed, the MTP's too) and resumed by a prefill of its
    tokens (no prompt cache here: all of them) gets an MTP source fed every pair of them, and
    still answers as plain decoding."""
    model, heads, _ = qwen["random"]
    driver = Driver(model)
    driver.batch = DecodeBatch(model, driver._end, speculation="auto", mtp=heads)
    tap = driver.gen.model = driver.batch.model
    req = request(LONG, max_tokens=12)
    driver.join(req)
    driver.step()
    driver.step()
    (seq,) = driver.batch.seqs
    room = Room(describe_model(model).layers, 1 << 30, driver.gen.states, None, 16, True)
    room._pause(seq, driver.batch, 0)
    assert seq.live.mtp is None and not driver.batch.seqs
    task = room.next_resume(tap, 8, busy=False)
    assert task is not None
    while not task.advance():
        pass
    assert len(seq.live.tokens) > len(LONG)
    assert_prompt_fed(heads, seq.live.mtp, seq.live.tokens)
    driver.batch.add(seq)
    assert driver.batch.speculator.rows[id(seq)].mtp is seq.live.mtp
    driver.drain()
    assert tokens_of(req.text) == reference(model, LONG, 12)


def test_the_next_turn_on_a_resident_session_drafts_from_the_whole_conversation(qwen):
    """A finished row's session stays resident with its MTP source (cut to the tokens its
    caches hold); the next turn, which extends it, takes both: after its prefill the MTP
    cache holds every pair of the whole conversation, the previous answer's too."""
    model, heads, _ = qwen["leaky"]
    driver = Driver(model, live_budget=1 << 30)
    driver.batch = DecodeBatch(model, driver._end, speculation="auto", mtp=heads)
    driver.gen.model = driver.batch.model
    first = request(LONG, max_tokens=20)
    driver.join(first)
    driver.drain()
    turn = LONG + tokens_of(first.text) + [9, 8, 7, 6, 5, 4, 3, 2, 1, 33, 44]
    second = request(turn, max_tokens=12)
    timings, seq = driver.gen.start(second)
    assert timings.cache_source == "live" and timings.cached_tokens > len(LONG)
    assert_prompt_fed(heads, seq.live.mtp, turn)
    driver.batch.add(seq)
    driver.drain()
    assert tokens_of(second.text) == reference(model, turn, 12)


def test_a_resident_cut_back_keeps_only_the_pairs_of_the_common_prefix(qwen):
    """An edited last message: the resident's MTP source cut to the common prefix keeps the
    pairs whose next token is in it, as a source fed them; the pair across the edit goes, its
    hidden state waiting again for the edited token."""
    _, heads, _ = qwen["random"]
    source = MTPDraft(heads)
    mx.eval(source.chunk(0, LONG[:40], heads.inner(mx.array([LONG[:40]]), None)[0]))
    edited = LONG[:30] + [1, 2, 3]
    source.cut(edited[:31])  # the next prompt's first 31 tokens: 30 shared
    fresh = fed_pair_by_pair(heads, LONG[:30])
    assert source.fed == fresh.fed == 28 and sorted(source.hidden) == [29]
    assert mx.allclose(source.hidden[29], fresh.hidden[29], atol=1e-4).item()
    assert source.cache[0].offset == 29 and source.tokens == edited[:31]
    a, b = source.cache[0].keys[..., :29, :], fresh.cache[0].keys[..., :29, :]
    assert mx.allclose(a, b, atol=1e-4).item()


def test_a_chunk_without_hidden_states_leaves_a_gap_not_a_wrong_pair(qwen):
    """An image chunk runs past the tap: its pairs are lost, and the next chunk's first
    token is not paired with a hidden state from before the gap."""
    _, heads, _ = qwen["random"]
    tokens = LONG[:24]
    hidden = heads.inner(mx.array([tokens]), None)[0]
    source = MTPDraft(heads)
    mx.eval(source.chunk(0, tokens[:8], hidden[:8]))
    assert source.fed == 6 and sorted(source.hidden) == [7]
    assert source.chunk(8, tokens[8:16], None) == []
    assert not source.hidden and source.cache[0].offset == 7
    mx.eval(source.chunk(16, tokens[16:], hidden[16:]))
    assert source.fed == 22 and source.cache[0].offset == 7 + 7


def test_a_fork_drafts_from_its_own_copy_of_the_prompts_pairs(qwen):
    """Choices of one request (n > 1) each get a copy of the prompt's MTP source: one row's
    pairs never reach another's cache."""
    model, heads, _ = qwen["random"]
    driver = Driver(model)
    driver.batch = DecodeBatch(model, driver._end, speculation="auto", mtp=heads)
    driver.gen.model = driver.batch.model
    source = prefill_source(driver.gen.model, [], True)
    hidden = heads.inner(mx.array([LONG[:16]]), None)[0]
    mx.eval(source.chunk(0, LONG[:16], hidden))
    other = source.copy()
    assert other.tokens == source.tokens
    mx.eval(other.chunk(16, LONG[16:24], heads.inner(mx.array([LONG[:24]]), None)[0][16:]))
    assert source.cache[0].offset == 15 and other.cache[0].offset == 23
    assert len(source.tokens) == 16 and sorted(source.hidden) == [15]
