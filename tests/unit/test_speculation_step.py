"""Greedy prompt-lookup speculation in the decode batch (engine/speculation/step.py): the same
tokens as without it, solo and merged, with drafts really kept, and caches that hold exactly
each sequence's tokens afterwards."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import replace

import pytest

from mlx_kvserve.engine.batch import DecodeBatch
from mlx_kvserve.engine.requests import TextChunk
from mlx_kvserve.engine.speculation.depth import DepthController, SourcePriors, VerifyCost
from mlx_kvserve.engine.speculation.drafts import LONG
from mlx_kvserve.engine.speculation.rewind import roll_back
from mlx_kvserve.engine.speculation.step import Speculator
from tests.unit.test_batching import PROMPTS, Driver, check_caches
from tests.unit.test_engine_units import StubTokenizer, request, tiny_model, tokens_of

# A prompt that repeats itself: the tiny model's greedy output soon loops too, so lookup hits.
LOOPY = [5, 9, 2, 7, 5, 9, 2, 7, 5, 9, 2, 7, 11, 5, 9, 2, 7]
# ... and prompts where lookup also guesses wrong: "95 95" is followed by other tokens here than
# in the model's answer (95 on and on), and PROMPTS[3]'s answer changes token after six.
MISLED = LOOPY + [95, 95, 3, 95, 95, 4, 95, 95, 95, 6, 95, 95, 95, 7]


class PriorCost(VerifyCost):
    """The cost prior alone: how long passes take on a loaded CI machine must not decide whether
    a test drafts (a measured wide pass 3x a plain one turns drafting off, rightly)."""

    def observe(self, batch: int, width: int, seconds: float) -> None:
        pass

    def read_first(self, batch: int) -> float:
        return 1.0


class FlatPriors(SourcePriors):
    """Every source at the flat prior, reads assumed to draft: what other rows of a test kept
    must not decide whether this one drafts (test_speculation_depth.py tests the learning)."""

    def record(self, key: Hashable, drafted: int, accepted: int) -> None:
        pass

    def read(self, key: Hashable, hit: bool) -> None:
        pass

    def rates(self, key: Hashable) -> None:
        return None

    def hit_rate(self, key: Hashable) -> float:
        return 1.0


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def driver_for(model, speculation: str, eos: tuple[int, ...] = ()) -> Driver:
    """A batch driver with `speculation` as given, drafting on the cost prior alone."""
    driver = Driver(model)
    if eos:
        driver.gen.tokenizer = StubTokenizer(eos=eos)
    driver.batch = DecodeBatch(model, driver._end, speculation=speculation)
    if driver.batch.speculator is not None:
        driver.batch.speculator.cost = PriorCost()
        driver.batch.speculator.priors = FlatPriors()
    return driver


def serve(driver: Driver, reqs: list) -> Driver:
    """Each request joins the running batch a step after the one before; then all run out."""
    for req in reqs:
        driver.join(req)
        driver.step()
    driver.drain()
    return driver


def run(model, prompts, lengths, speculation: str, temperature: float = 0.0, seeds=None):
    reqs = []
    for i, (p, n) in enumerate(zip(prompts, lengths, strict=True)):
        req = request(p, max_tokens=n)
        seed = None if seeds is None else seeds[i]
        req.params = replace(req.params, temperature=temperature, seed=seed)
        reqs.append(req)
    return serve(driver_for(model, speculation), reqs), reqs


@pytest.mark.parametrize("rows", [1, 4], ids=["solo", "merged"])
def test_greedy_tokens_are_the_same_with_and_without_speculation(model, rows):
    prompts = [MISLED, PROMPTS[3], LOOPY, PROMPTS[1]][:rows]
    lengths = [40, 31, 24, 37][:rows]
    _, plain = run(model, prompts, lengths, "off")
    driver, spec = run(model, prompts, lengths, "auto")
    for a, b in zip(plain, spec, strict=True):
        assert tokens_of(b.text) == tokens_of(a.text), b.request_id
        assert (b.done.finish_reason, b.done.completion_tokens) == (
            a.done.finish_reason,
            a.done.completion_tokens,
        )
    speculator = driver.batch.speculator
    # it really drafted, kept and rejected drafts
    assert speculator.drafted > speculator.accepted > 0
    assert driver.batch.steps < sum(lengths)  # ... and saved passes
    assert sum(seq.timings.drafted for seq in driver.ended) == speculator.drafted
    assert sum(seq.timings.accepted for seq in driver.ended) == speculator.accepted
    line = driver.ended[0].timings.log_line(driver.ended[0].req)
    assert f"drafted={driver.ended[0].timings.drafted} accepted=" in line
    check_caches(driver.ended)


def test_eos_and_stop_strings_inside_a_kept_run_end_it_there(model):
    _, plain = run(model, [LOOPY], [40], "off")
    want = tokens_of(plain[0].text)
    eos = want[25]  # a token the loop repeats: it ends the answer at its first occurrence
    stop = f"<{want[18]}>"
    for kind in ("eos", "stop"):
        driver = Driver(model)
        driver.batch = DecodeBatch(model, driver._end, speculation="auto")
        if kind == "eos":
            driver.gen.tokenizer = StubTokenizer(eos=(eos,))
            req = request(LOOPY, max_tokens=40)
            end = want.index(eos)
        else:
            req = request(LOOPY, max_tokens=40, stop=(stop,))
            end = want.index(want[18])
        driver.join(req)
        driver.drain()
        assert tokens_of(req.text) == want[:end], kind
        assert req.done.finish_reason == "stop"
        check_caches(driver.ended)


@pytest.mark.parametrize("rows", [1, 3], ids=["solo", "merged"])
def test_seeded_rows_give_the_same_tokens_with_and_without_speculation(model, rows):
    """Each position is drawn from the seed of the token it would be without speculation, so
    a seeded request's answer does not depend on it."""
    prompts, lengths, seeds = [MISLED, LOOPY, PROMPTS[3]][:rows], [40, 30, 24][:rows], [7, 8, 9]
    _, plain = run(model, prompts, lengths, "off", 0.5, seeds)
    driver, spec = run(model, prompts, lengths, "auto", 0.5, seeds)
    for a, b in zip(plain, spec, strict=True):
        assert tokens_of(b.text) == tokens_of(a.text), b.request_id
    speculator = driver.batch.speculator
    assert speculator.drafted > speculator.accepted > 0  # drafts kept, and drafts rejected
    check_caches(driver.ended)


def test_unseeded_sampled_rows_speculate_and_finish(model):
    driver, reqs = run(model, [LOOPY, PROMPTS[0]], [30, 30], "auto", 0.5)
    assert driver.batch.speculator.passes > 0
    assert all(r.done.completion_tokens == 30 for r in reqs)
    check_caches(driver.ended)


def test_rollback_gives_back_each_rows_own_positions(model):
    """roll_back on a merged cache: each row keeps exactly its own tokens."""
    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache, make_prompt_cache

    rows = []
    for n in (6, 9, 4):
        cache = make_prompt_cache(model)
        model(mx.array([list(range(1, n + 1))]), cache=cache)
        rows.append(cache)
    merged = [BatchKVCache.merge(list(layer)) for layer in zip(*rows, strict=True)]
    model(mx.array([[1, 2, 3, 4]] * 3), cache=merged)
    roll_back(merged, [3, 0, 2])
    sizes = [merged[0].extract(i).offset for i in range(3)]
    assert sizes == [6 + 1, 9 + 4, 4 + 2]


def kinds_of_model(kind: str):
    import mlx.core as mx

    from tests.unit.test_cache_models import tiny_llama, tiny_mamba2

    if kind in FAMILIES:  # the served families' tiny configs (tests/support/tiny_models.py)
        from mlx.utils import tree_flatten, tree_unflatten

        from tests.support.every_architecture import build

        m = build(kind)
        weights = dict(tree_flatten(m.parameters()))
        name = max(weights, key=lambda k: (k.endswith("lm_head.weight"), "embed_tokens" in k))
        head = weights[name]
        for row in LIKELY:  # written often, in runs lookup half predicts
            head = mx.concatenate([head[:row], head[row : row + 1] * 8.0, head[row + 1 :]])
        m.update(tree_unflatten([(name, head)]))
    else:
        mx.random.seed(28 if kind == "mamba2" else 1)  # a mamba2 whose answers loop: lookup hits
        m = tiny_mamba2() if kind == "mamba2" else tiny_llama(kind == "rotating")
    mx.eval(m.parameters())
    return m


KINDS = ["kv", "rotating", "mamba2"]  # plain KV, a sliding window of 8, recurrent state
# Qwen3-Next and Qwen3.5 (GatedDeltaNet and attention), Gemma 3 (windows of 32 and global
# attention), their output rows of LIKELY scaled up
FAMILIES = ["qwen3_next", "qwen3_5", "gemma3"]
LIKELY = (95, 9, 7)
# For that mamba2: its answer runs 91 91 91 with other tokens between, so drafts are kept and
# rejected.
RECURRENT = LOOPY + [91, 91, 3, 91, 91, 4, 7, 91, 91, 91, 6]


@pytest.mark.parametrize("kind", KINDS + FAMILIES)
def test_the_engine_speculates_where_it_can_and_answers_the_same(kind, monkeypatch):
    """Through the engine with `speculation="auto"`: every model drafts, merged rows too; a
    sliding-window model's rejected keys cut off or rolled into each row's padding
    (engine/speculation/rewind.py), a recurrent model's states by snapshot and replay
    (engine/speculation/snapshot.py), its merged rows each replaying its own length."""
    from tests.unit.test_batching import serve_together
    from tests.unit.test_engine_units import reference

    m = kinds_of_model(kind)
    widths: list[int] = []  # rows of each verify pass
    verify = Speculator._verify

    def counted(self, seqs, *args):
        widths.append(len(seqs))
        return verify(self, seqs, *args)

    monkeypatch.setattr(Speculator, "_verify", counted)
    prompts, lengths = [RECURRENT if kind == "mamba2" else MISLED, LOOPY, PROMPTS[3]], [30, 24, 20]
    reqs = [request(p, max_tokens=n) for p, n in zip(prompts, lengths, strict=True)]
    engines = []

    def started(engine) -> None:
        engines.append(engine)
        engine.batch.speculator.cost = PriorCost()  # the machine's load must not decide
        engine.batch.speculator.priors = FlatPriors()

    # Every prompt fits one chunk, so the three prefill back to back before the first decode
    # step and decode merged from it: with smaller chunks the engine interleaves them with
    # decode steps by measured time (engine/schedule.py), and on a loaded machine a row that
    # copies could finish before the next one joined (no merged verify pass to see).
    serve_together(m, reqs, prefill_step=64, speculation="auto", started=started)
    for req, p, n in zip(reqs, prompts, lengths, strict=True):
        assert tokens_of(req.text) == reference(m, p, n)
    assert engines[0].batch.speculator.passes > 0
    assert max(widths) == len(reqs), widths  # all the rows speculated merged


@pytest.mark.parametrize("kind", KINDS)
def test_a_lone_row_rolls_back_windows_and_recurrent_states_exactly(kind):
    """A lone row on each kind of model, with drafts kept and rejected (MISLED): the tokens of
    mlx-lm's plain loop, and the row's caches continue exactly like a fresh prefill of its
    tokens (its next logits)."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from tests.unit.test_engine_units import reference

    m = kinds_of_model(kind)
    prompt = RECURRENT if kind == "mamba2" else MISLED
    req = request(prompt, max_tokens=40)
    driver = serve(driver_for(m, "auto"), [req])
    assert tokens_of(req.text) == reference(m, prompt, 40)
    speculator = driver.batch.speculator
    assert speculator.accepted > 0
    if kind != "kv":  # drafts rejected too: the window rewound, the recurrent state replayed
        assert speculator.drafted > speculator.accepted
    (seq,) = driver.ended
    fresh = make_prompt_cache(m)
    want = m(mx.array([seq.live.tokens + [5]]), cache=fresh)[0, -1]
    got = m(mx.array([[5]]), cache=seq.live.caches)[0, -1]
    assert mx.allclose(got, want, atol=1e-4).item()


def test_an_unknown_speculation_mode_is_refused_naming_it(tmp_path, monkeypatch):
    from mlx_kvserve.config.file import ConfigError
    from mlx_kvserve.config.precedence import resolve_settings

    monkeypatch.delenv("MLX_KVSERVE_SPECULATION", raising=False)  # the default, not a shell's
    assert resolve_settings({}, tmp_path / "absent.toml").settings.speculation == "auto"
    flags = {"speculation": "off"}
    assert resolve_settings(flags, tmp_path / "absent.toml").settings.speculation == "off"
    with pytest.raises(ConfigError, match="speculation.*'on' is not one of auto, off"):
        resolve_settings({"speculation": "on"}, tmp_path / "absent.toml")
    monkeypatch.setenv("MLX_KVSERVE_SPECULATION", "fast")
    with pytest.raises(ConfigError, match="^MLX_KVSERVE_SPECULATION: setting 'speculation'"):
        resolve_settings({}, tmp_path / "absent.toml")


def test_no_match_keeps_the_step_pipelined(model, monkeypatch):
    """A row whose tokens so far have no earlier match does not read its pending token before
    the pass (that would give up the pipelining overlap for nothing); one that has, does."""
    reads = []
    step = Speculator.step

    def spy(self, seqs, merged, model, read, leave):
        def counted(pairs):
            reads.append(len(pairs))
            read(pairs)

        return step(self, seqs, merged, model, counted, leave)

    monkeypatch.setattr(Speculator, "step", spy)
    for prompt, read_first in ((list(range(1, 40)), False), (LOOPY, True)):
        reads.clear()
        driver = Driver(model)
        driver.batch = DecodeBatch(model, driver._end, speculation="auto")
        driver.join(request(prompt, max_tokens=10))
        driver.step()
        assert bool(reads) == read_first


@pytest.mark.parametrize("rows", [1, 3], ids=["solo", "merged"])
def test_a_request_that_opted_out_drafts_nothing_and_its_company_still_does(model, rows):
    """`SamplingParams.speculative` False (the API's `speculative: false`, Ollama's
    `draft_num_predict: 0`): that row drafts nothing, alone or beside rows that do, and every
    row answers as without speculation."""
    prompts, lengths = [LOOPY, MISLED, PROMPTS[3]][:rows], [30, 34, 24][:rows]
    _, plain = run(model, prompts, lengths, "off")
    reqs = [request(p, max_tokens=n) for p, n in zip(prompts, lengths, strict=True)]
    reqs[0].params = replace(reqs[0].params, speculative=False)
    driver = serve(driver_for(model, "auto"), reqs)
    for a, b in zip(plain, reqs, strict=True):
        assert tokens_of(b.text) == tokens_of(a.text), b.request_id
    drafted = {seq.req.request_id: seq.timings.drafted for seq in driver.ended}
    assert drafted[reqs[0].request_id] == 0
    speculator = driver.batch.speculator
    assert (speculator.passes > 0) == (rows > 1)  # alone it never speculates
    assert sum(drafted.values()) == speculator.drafted
    check_caches(driver.ended)


def logprobs_of(req) -> list:
    return [lp for e in req.events if isinstance(e, TextChunk) for lp in e.logprobs]


@pytest.mark.parametrize("rows", [1, 3], ids=["solo", "merged"])
def test_logprob_rows_speculate_and_report_the_targets_logprobs(model, rows):
    """A row with logprobs (and top alternatives) speculates: its tokens are those of plain
    decoding, and each emitted token's logprob and top list are the model's at that position
    (a wider pass may differ in float32 rounding only)."""
    prompts, lengths = [LOOPY, MISLED, PROMPTS[3]][:rows], [30, 34, 24][:rows]
    kinds = [{"logprobs": True, "top_logprobs": 3}, {"logprobs": True}, {}][:rows]

    def go(speculation):
        reqs = [
            request(p, max_tokens=n, **k) for p, n, k in zip(prompts, lengths, kinds, strict=True)
        ]
        return serve(driver_for(model, speculation), reqs), reqs

    _, plain = go("off")
    driver, spec = go("auto")
    assert driver.batch.speculator.accepted > 0
    for a, b, k in zip(plain, spec, kinds, strict=True):
        assert tokens_of(b.text) == tokens_of(a.text), b.request_id
        mine, theirs = logprobs_of(b), logprobs_of(a)
        assert len(mine) == len(theirs) == (b.done.completion_tokens if k else 0)
        for x, y in zip(mine, theirs, strict=True):
            assert x.token == y.token
            assert x.logprob == pytest.approx(y.logprob, abs=1e-4)
            assert [t for t, _ in x.top] == [t for t, _ in y.top]
            assert [v for _, v in x.top] == pytest.approx([v for _, v in y.top], abs=1e-4)
    drafted = {seq.req.request_id: seq.timings.drafted for seq in driver.ended}
    assert drafted[spec[0].request_id] > 0  # the logprob row itself drafted
    check_caches(driver.ended)


def sampled(req, temperature: float, seed: int):
    req.params = replace(req.params, temperature=temperature, seed=seed)
    return req


@pytest.mark.parametrize("temperature", [0.0, 0.7], ids=["greedy", "seeded"])
def test_ignore_eos_rows_run_past_their_end_token_inside_kept_runs(model, temperature):
    """`ignore_eos` with an end id the answer would otherwise take (a token its loop repeats,
    drafted by lookup): the row runs on past it, as its plain steps do, and speculates."""
    _, plain = run(model, [LOOPY], [40], "off")
    eos = tokens_of(plain[0].text)[25]

    def go(speculation):
        reqs = [
            sampled(request(LOOPY, max_tokens=40, ignore_eos=True), temperature, 5),
            sampled(request(MISLED, max_tokens=30), temperature, 6),  # may end on it
        ]
        driver = serve(driver_for(model, speculation, eos=(eos,)), reqs)
        return driver, reqs

    _, want = go("off")
    driver, got = go("auto")
    for a, b in zip(want, got, strict=True):
        assert tokens_of(b.text) == tokens_of(a.text)
        assert b.done.finish_reason == a.done.finish_reason
    assert eos not in tokens_of(got[0].text) and got[0].done.completion_tokens == 40
    assert driver.ended[[s.req for s in driver.ended].index(got[0])].timings.accepted > 0
    check_caches(driver.ended)


@pytest.mark.parametrize("rows", [1, 3], ids=["solo", "merged"])
def test_a_request_cancelled_while_speculating_ends_at_the_next_step(model, rows):
    """A client that leaves in the middle of a verify pass's run of tokens (its cancel flag set
    as a kept draft's text is emitted): the row ends "cancelled" at the next step, within one
    pass of tokens, and every row's caches hold exactly its tokens; the others answer as
    without speculation."""
    prompts, lengths = [LOOPY, MISLED, PROMPTS[3]][:rows], [40, 34, 24][:rows]
    _, plain = run(model, prompts, lengths, "off")
    driver = driver_for(model, "auto")
    reqs = [request(p, max_tokens=n) for p, n in zip(prompts, lengths, strict=True)]
    leaving = reqs[0]
    emit = type(leaving).emit

    def leave_midway(self, event) -> None:
        emit(self, event)
        if len(tokens_of(self.text)) >= 12 and driver.batch.speculator.accepted:
            self.cancel()

    leaving.emit = leave_midway.__get__(leaving)  # type: ignore[method-assign]
    serve(driver, reqs)
    (gone,) = [s for s in driver.ended if s.req is leaving]
    assert gone.timings.finish_reason == "cancelled"
    assert 12 <= gone.timings.completion_tokens <= 12 + driver.batch.speculator.max_depth + 1
    assert tokens_of(leaving.text) == tokens_of(plain[0].text)[: len(tokens_of(leaving.text))]
    for a, b in zip(plain[1:], reqs[1:], strict=True):
        assert tokens_of(b.text) == tokens_of(a.text)
    check_caches(driver.ended)


def test_rows_teach_the_engine_what_their_source_kept():
    """The speculator's `SourcePriors` take every verified draft by its source and match
    length (a read-first alone teaches no rates), and a new row given them drafts deeper from
    its first round than one on the flat prior."""
    model = tiny_model()
    driver = driver_for(model, "auto")
    priors = driver.batch.speculator.priors = SourcePriors()
    serve(driver, [request(LOOPY, max_tokens=40)])
    counts = priors._counts
    assert counts and {source for source, _ in counts} == {"prompt_lookup"}
    learnt = max(counts, key=lambda key: counts[key][0][0])
    assert learnt == ("prompt_lookup", LONG)  # a loop's copy: its match goes far back
    assert priors.rates(learnt)[0] > 0.7
    assert all(priors.rates(key) is None for key in counts if not any(counts[key][0]))
    cost = driver.batch.speculator.cost

    def price(width: int) -> float:
        return cost.cost(1, width)

    flat = DepthController(16).depth(price, 16)
    taught = DepthController(16).depth(price, 16, prior=priors.rates(learnt))
    assert flat <= 4 < 8 <= taught, (flat, taught)


class TimedPriorCost(VerifyCost):
    """Passes are timed (so each batch size's plain pass is asked for), but priced on the
    prior: whether drafting pays on this machine must not decide the test."""

    def __init__(self) -> None:
        super().__init__()
        self.widths: list[tuple[int, int]] = []  # (batch, width) of every observed step

    def observe(self, batch: int, width: int, seconds: float) -> None:
        self.widths.append((batch, width))
        super().observe(batch, width, seconds)

    def cost(self, batch: int, width: int) -> float:
        return 1.0 + self.prior_slope * batch**0.5 * (width - 1) if width > 1 else 1.0

    def read_first(self, batch: int) -> float:
        return 1.0


@pytest.mark.timed_cost
@pytest.mark.parametrize("rows", [1, 4], ids=["solo", "merged"])
def test_each_batch_size_is_timed_plainly_before_it_drafts(model, rows, monkeypatch):
    """Rows that would draft at every step still run one plain step at each batch size first
    (and again every RETIME verify passes), so the wide passes are priced against a timed plain
    one; the tokens are still plain decoding's."""
    monkeypatch.setattr(VerifyCost, "retime", 6)
    driver = driver_for(model, "auto")
    cost = driver.batch.speculator.cost = TimedPriorCost()
    reqs = [request(LOOPY, max_tokens=60) for _ in range(rows)]
    serve(driver, reqs)
    _, plain = run(model, [LOOPY] * rows, [60] * rows, "off")
    assert [tokens_of(r.text) for r in reqs] == [tokens_of(r.text) for r in plain]
    assert driver.batch.speculator.accepted > 0
    seen: dict[int, int] = {}  # batch size -> verify passes since its last plain step
    for batch, width in cost.widths:
        if width > 1:
            assert batch in seen, f"a verify pass of {batch} rows before a plain one"
            seen[batch] += 1
            assert seen[batch] <= 6, cost.widths
        elif width == 1:
            seen[batch] = 0
