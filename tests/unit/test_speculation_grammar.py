"""Speculation on grammar rows: tool calls (forced and lazy grammars) and JSON output.

A tiny random llama with the default model's real tokenizer writes a script (as in
test_decode_steps.py: a large bonus on the script's token at each position) under llguidance's
real grammars. The prompt holds an earlier call, so prompt lookup drafts the new one; the
second call differs from the first in its argument, so drafts are rejected there too. With
and without speculation the tokens are the same; drafts are checked against the grammar, the
tokens it forces are fed without drafting, and after every step the row's matcher is in the
state of a fresh one fed exactly the tokens the row emitted.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest

from tests.unit.test_decode_steps import Scripted, tokenizer  # noqa: F401  (a fixture)
from tests.unit.test_engine_units import request
from tests.unit.test_speculation_step import FlatPriors, PriorCost, driver_for, serve

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "%s"}}\n</tool_call>'
SCRIPTS = {
    "required": CALL % "Paris" + "\n" + CALL % "Lyon",
    "auto": "Let me look that up.\n" + CALL % "Paris",
    "json_schema": '{"city": "Paris", "days": [1, 2, 3], "unit": "celsius", "city2": "Lyon"}',
}
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "days": {"type": "array", "items": {"type": "integer"}},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "city2": {"type": "string"},
    },
    "required": ["city", "days", "unit", "city2"],
    "additionalProperties": False,
}


COMPILERS: dict = {}


def constraint(tokenizer, kind: str):  # noqa: F811
    from mlx_kvserve.chat.formats.hermes import FORMAT as HERMES
    from mlx_kvserve.chat.grammar import GrammarCompiler
    from mlx_kvserve.chat.request import ChatRequest, Message, Tool, ToolChoice

    compiler = COMPILERS.setdefault(id(tokenizer), GrammarCompiler(tokenizer))
    if kind == "json_schema":
        return compiler.json_constraint(SCHEMA, "response_format")
    tool = Tool("get_weather", None, {"type": "object", "properties": {"city": {}}})
    chat = ChatRequest([Message("user", "Weather?")], tools=[tool], tool_choice=ToolChoice(kind))
    return compiler.constraint_for(chat, HERMES)


@pytest.fixture(scope="module")
def inner(tokenizer):  # noqa: F811
    import mlx.core as mx

    from tests.unit.test_cache_models import tiny_llama

    mx.random.seed(3)
    model = tiny_llama(False, vocab=len(tokenizer.get_vocab()))
    mx.eval(model.parameters())
    return model


def run(inner, tokenizer, kind: str, speculation: str):  # noqa: F811
    from mlx_kvserve.engine.batch import DecodeBatch
    from mlx_kvserve.engine.generate import Generator
    from mlx_kvserve.engine.prompt_state import PromptStates

    script = tokenizer.encode(SCRIPTS[kind], add_special_tokens=False)
    earlier = tokenizer.encode("Earlier: " + CALL % "Paris" + "\nNow:", add_special_tokens=False)
    model = Scripted(inner, len(earlier), script)
    req = request(earlier, max_tokens=len(script) + 8)
    req.constraint = constraint(tokenizer, kind)
    gen = Generator(model, tokenizer, PromptStates(model, None, enabled=False))
    _, seq = gen.start(req)
    ended: list = []
    batch = DecodeBatch(model, ended.append, speculation=speculation)
    if batch.speculator is not None:
        batch.speculator.cost = PriorCost()
        batch.speculator.priors = FlatPriors()
    batch.add(seq)
    vocab = len(tokenizer.get_vocab())
    while batch.seqs:
        batch.step()
        if seq.done:
            break
        fresh = constraint(tokenizer, kind)
        for token in req.sampled:
            fresh.advance(token)
        assert np.array_equal(fresh.allowed(vocab), seq.decoder.constraint.allowed(vocab))
        assert len(seq.live.tokens) == seq.live.caches[0].offset
    return req, seq, batch


@pytest.mark.parametrize("kind", ["required", "auto", "json_schema"])
def test_grammar_rows_speculate_and_answer_the_same(inner, tokenizer, kind):  # noqa: F811
    plain, alone, _ = run(inner, tokenizer, kind, "off")
    req, seq, batch = run(inner, tokenizer, kind, "auto")
    assert req.sampled == plain.sampled
    assert req.text == plain.text
    ends = [(s.timings.finish_reason, s.timings.completion_tokens) for s in (alone, seq)]
    assert ends[0] == ends[1]
    if kind != "auto":
        assert req.text.startswith(SCRIPTS[kind][:20]), req.text
    speculator = batch.speculator
    assert speculator.passes > 0 and speculator.accepted > 0
    assert seq.timings.accepted == speculator.accepted
    assert batch.steps < alone.timings.completion_tokens  # fewer steps than tokens


class Cycle:
    """A forkable grammar of a simple shape, for merged batches on the tiny model: in every
    cycle of five tokens, after two free ones the grammar forces 7 then 9, and the fifth is
    one of `FIFTH`. `fork` copies it, as llguidance's `deep_copy` does."""

    FIFTH = np.array([t % 3 == 0 for t in range(512)])
    lazy = False
    finished = False

    def __init__(self) -> None:
        self.count = 0

    def allowed(self, n_logits: int) -> np.ndarray:
        mask = np.ones(n_logits, dtype=bool)
        phase = self.count % 5
        if phase in (2, 3):
            mask[:] = False
            mask[(7, 9)[phase - 2]] = True
        elif phase == 4:
            mask[:] = False
            mask[: len(self.FIFTH)] = self.FIFTH[:n_logits]
        return mask

    def advance(self, token: int) -> None:
        assert self.allowed(max(token + 1, 512))[token], (token, self.count)
        self.count += 1

    def forced(self, limit: int) -> list[int]:
        out = []
        while self.count % 5 in (2, 3) and len(out) < limit:
            out.append((7, 9)[self.count % 5 - 2])
            self.count += 1
        return out

    def fork(self) -> Cycle:
        return copy.copy(self)


@pytest.mark.parametrize(
    ("logprobs", "temperature"),
    [(False, 0.0), (True, 0.0), (False, 0.8)],
    ids=["forced", "logprobs", "seeded"],
)
def test_merged_grammar_rows_beside_free_rows_answer_the_same(logprobs, temperature):
    """Grammar rows (forced tokens fed in the verify pass; with logprobs they are sampled
    under one-token masks instead) beside free rows, merged: the same tokens as without
    speculation, every row's grammar at its emitted tokens, caches exact."""
    from dataclasses import replace

    from tests.unit.test_batching import check_caches
    from tests.unit.test_engine_units import tiny_model, tokens_of
    from tests.unit.test_speculation_step import LOOPY, MISLED

    model = tiny_model()
    prompts, lengths = [LOOPY, MISLED, LOOPY[3:], MISLED[2:]], [30, 34, 26, 28]

    def go(speculation):
        reqs = [request(p, max_tokens=n) for p, n in zip(prompts, lengths, strict=True)]
        for i, req in enumerate(reqs):
            req.params = replace(req.params, temperature=temperature, seed=10 + i)
        for req in reqs[::2]:
            req.constraint = Cycle()
            req.params = replace(req.params, logprobs=logprobs)
        return serve(driver_for(model, speculation), reqs), reqs

    _, plain = go("off")
    driver, spec = go("auto")
    for a, b in zip(plain, spec, strict=True):
        assert tokens_of(b.text) == tokens_of(a.text), b.request_id
    for req in spec[::2]:
        assert req.constraint.count == len(req.sampled)  # its grammar is at its tokens
        assert all(t in (7, 9) for t in req.sampled[2::5] + req.sampled[3::5])
    drafted = {s.req.request_id: s.timings.drafted for s in driver.ended}
    assert drafted[spec[0].request_id] > 0 and driver.batch.speculator.accepted > 0
    check_caches(driver.ended)


@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "seeded"])
def test_reasoning_gate_rows_speculate_and_answer_the_same(temperature):
    """A reasoning model's rows with a thinking budget and an answer grammar (the reasoning
    gate: free and pipelined while reasoning, the closing marker forced at the budget, then
    the grammar), merged beside free rows: the same tokens with and without speculation, and
    the gate ends where a fresh one fed the row's tokens ends."""
    from dataclasses import replace

    from mlx_kvserve.chat.reasoning.reasoning_gate import ReasoningGate
    from mlx_kvserve.chat.reasoning.thinking import ThinkMarkers
    from tests.unit.test_batching import check_caches
    from tests.unit.test_engine_units import tiny_model, tokens_of
    from tests.unit.test_speculation_step import LOOPY, MISLED

    markers = ThinkMarkers("<t>", "</t>", (90,), (91,), (91, 92))
    model = tiny_model()
    prompts, lengths = [LOOPY, MISLED, MISLED[2:], LOOPY[3:]], [34, 30, 32, 26]

    def gate() -> ReasoningGate:
        return ReasoningGate(markers, reasoning=True, budget=12, inner=Cycle())

    def go(speculation):
        reqs = [request(p, max_tokens=n) for p, n in zip(prompts, lengths, strict=True)]
        for i, req in enumerate(reqs):
            req.params = replace(req.params, temperature=temperature, seed=20 + i)
        for req in reqs[:2]:
            req.constraint = gate()
        return serve(driver_for(model, speculation), reqs), reqs

    _, plain = go("off")
    driver, spec = go("auto")
    for a, b in zip(plain, spec, strict=True):
        assert tokens_of(b.text) == tokens_of(a.text), b.request_id
    for req in spec[:2]:
        fresh = gate()
        for token in req.sampled:
            fresh.advance(token)
        used = req.constraint
        assert (used.reasoning, used.spent, used.closing) == (
            fresh.reasoning,
            fresh.spent,
            fresh.closing,
        )
        assert used.inner.count == fresh.inner.count > 0  # the answer's grammar took over
    drafted = {s.req.request_id: s.timings.drafted for s in driver.ended}
    assert drafted[spec[0].request_id] > 0 and driver.batch.speculator.accepted > 0
    check_caches(driver.ended)


class Count:
    """An answer grammar that allows everything and counts what it took (forkable)."""

    lazy = False
    finished = False

    def __init__(self) -> None:
        self.count = 0

    def allowed(self, n_logits: int) -> None:
        return None

    def advance(self, token: int) -> None:
        self.count += 1

    def forced(self, limit: int) -> list[int]:
        return []

    def fork(self) -> Count:
        return copy.copy(self)


class HarmonyVocab:
    """The harmony control tokens at ids the tiny model writes (its vocabulary is 97)."""

    def get_vocab(self) -> dict[str, int]:
        return {"<|start|>": 80, "<|end|>": 81, "<|message|>": 82, "<|channel|>": 83}


@pytest.mark.parametrize("grammar", [False, True], ids=["budget", "budget+grammar"])
def test_harmony_gate_rows_speculate_and_answer_the_same(grammar):
    """gpt-oss rows under Harmony's analysis gate (a budget of 12 analysis tokens, then
    `<|end|>` forced; with an answer grammar beside it), merged beside free rows: drafts are
    walked through a copy of the gate and kept; the same tokens with and without
    speculation, and the gate ends where a fresh one fed the row's tokens ends."""
    from mlx_kvserve.chat.formats.harmony.analysis_gate import HarmonyGate
    from tests.unit.test_batching import check_caches
    from tests.unit.test_engine_units import tiny_model, tokens_of
    from tests.unit.test_speculation_step import LOOPY, MISLED

    model = tiny_model()
    prompts, lengths = [LOOPY, MISLED, MISLED[2:], LOOPY[3:]], [34, 30, 32, 26]

    def gate() -> HarmonyGate:
        made = HarmonyGate(
            HarmonyVocab(), 12, inner=Count() if grammar else None, decode=lambda _: "analysis"
        )
        made.advance(83)  # the prompt's end: `<|channel|>analysis<|message|>`
        made.advance(82)
        return made

    def go(speculation):
        reqs = [request(p, max_tokens=n) for p, n in zip(prompts, lengths, strict=True)]
        for req in reqs[:2]:
            req.constraint = gate()
        return serve(driver_for(model, speculation), reqs), reqs

    _, plain = go("off")
    driver, spec = go("auto")
    for a, b in zip(plain, spec, strict=True):
        assert tokens_of(b.text) == tokens_of(a.text), b.request_id
    for req in spec[:2]:
        fresh = gate()
        for token in req.sampled:
            fresh.advance(token)
        used = req.constraint
        state = (used.spent, used.closing, used._analysis, used._header)
        assert state == (fresh.spent, fresh.closing, fresh._analysis, fresh._header)
        assert used.spent == 12 and 81 in req.sampled  # the budget ended the analysis
        if grammar:
            assert used.inner.count == fresh.inner.count == len(req.sampled) + 2
    drafted = {s.req.request_id: s.timings.drafted for s in driver.ended}
    assert drafted[spec[0].request_id] > 0 and driver.batch.speculator.accepted > 0
    check_caches(driver.ended)


class Fragile(Cycle):
    """A Cycle whose matcher goes into error on token 3 (as llguidance's does at a parser
    limit, though its mask allowed the token): `advance` raises."""

    def advance(self, token: int) -> None:
        if token == 3:
            raise RuntimeError("grammar rejected token 3: ParserTooComplex")
        super().advance(token)


def test_a_draft_is_walked_on_a_copy_and_an_error_only_ends_it():
    """`Decoder.walk` feeds the draft to a copy of the row's grammar: the row's own grammar
    has taken nothing afterwards, and a drafted token the copy's matcher fails on ends the
    draft there (the row's grammar is not left in error, its next step runs as without it)."""
    from mlx_kvserve.engine.decode import Decoder

    req = request([1, 2, 3], max_tokens=32)
    req.constraint = grammar = Fragile()
    walk = Decoder(req).walk([4, 6, 7, 9, 3, 8], 512, depth=8, left=32, eos=set())
    assert walk.drafts == [4, 6] and walk.forced == [[], [7, 9]]  # 3 (allowed) ended it
    assert len(walk.masks) == 3
    assert grammar.count == 0  # the row's own grammar took none of it
    assert grammar.allowed(512).all()
