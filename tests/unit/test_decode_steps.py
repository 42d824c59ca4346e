"""Decode shaped for Metal, in-process on the tiny random llama of the engine unit tests.

- A step of the batch samples every row in one call and reads the tokens back once, however
  many rows decode (`DecodeBatch.readbacks` against `DecodeBatch.steps`), with rows of
  different sampler settings, seeds and grammars; greedy tokens stay those of mlx-lm's loop.
- A lazy grammar (tool_choice "auto": free text until a trigger) keeps its sequence pipelined
  while the grammar is in its free text, and gives exactly the tokens of the read-first path.
"""

from __future__ import annotations

import numpy as np
import pytest

from mlx_kvserve.engine import sampling
from tests.unit.test_batching import PROMPTS, AllowAll, Driver
from tests.unit.test_engine_units import reference, request, tiny_model, tokens_of


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def test_one_readback_per_step_whatever_the_batch_size(model, monkeypatch):
    lengths = [24, 24, 24, 24]
    want = [reference(model, p, n) for p, n in zip(PROMPTS, lengths, strict=True)]
    calls = []
    sample = sampling.sample
    monkeypatch.setattr(
        sampling, "sample", lambda rows, logits: calls.append(1) or sample(rows, logits)
    )
    driver = Driver(model)
    reqs = [request(p, max_tokens=n) for p, n in zip(PROMPTS, lengths, strict=True)]
    for req in reqs:
        driver.join(req)
    driver.drain()
    batch = driver.batch
    tokens = sum(req.done.completion_tokens for req in reqs)
    assert max(driver.sizes) == 4
    assert batch.readbacks <= batch.steps + 1  # one per step, plus a newcomer's first read
    assert tokens >= 3 * batch.steps  # the rows really shared their steps
    assert len(calls) <= batch.steps + len(reqs)  # a sampler call per step, and per prefill
    for req, expected in zip(reqs, want, strict=True):
        assert tokens_of(req.text) == expected


def test_mixed_rows_share_the_readback(model):
    """Greedy, sampled, seeded and grammar rows in one batch: still one readback a step, and
    the greedy rows (free and constrained) still give mlx-lm's tokens."""
    n = 16
    driver = Driver(model)
    greedy = request(PROMPTS[0], max_tokens=n)
    constrained = request(PROMPTS[1], max_tokens=n)
    constrained.constraint = AllowAll()
    warm = request(PROMPTS[2], max_tokens=n)
    warm.params = type(warm.params)(temperature=0.8, max_tokens=n)  # unseeded: a row of that kind
    seeded = request(PROMPTS[3], max_tokens=n)
    seeded.params = type(seeded.params)(temperature=1.0, max_tokens=n, seed=7)
    reqs = [greedy, constrained, warm, seeded]
    for req in reqs:
        driver.join(req)
    driver.drain()
    batch = driver.batch
    assert batch.readbacks <= batch.steps + 2
    assert tokens_of(greedy.text) == reference(model, PROMPTS[0], n)
    assert tokens_of(constrained.text) == reference(model, PROMPTS[1], n)
    assert all(req.done.completion_tokens == n for req in reqs)


class LazyCall:
    """A lazy grammar's shape: free text (every token but `banned`) until its trigger (here the
    `opens_at`-th token, whichever it is: the tiny model repeats itself); then a call: the
    grammar forces two tokens (with `forces`), allows only `inside` for three more, and returns
    to free text. `lazy` says the engine may pipeline its free text."""

    finished = False

    def __init__(
        self, opens_at: int, banned: int, inside: set[int], *, lazy: bool, forces: bool
    ) -> None:
        self.opens_at, self.banned, self.inside, self.lazy = opens_at, banned, inside, lazy
        self.forces = forces
        self.state = "free"
        self.seen = 0
        self.left = 0

    def allowed(self, n_logits: int) -> np.ndarray:
        if self.state == "call":
            mask = np.zeros(n_logits, dtype=bool)
            mask[sorted(self.inside)] = True
            return mask
        mask = np.ones(n_logits, dtype=bool)
        mask[self.banned] = False
        return mask

    def advance(self, token: int) -> None:
        self.seen += 1
        if self.state == "free" and self.seen == self.opens_at:
            self.state, self.left = ("opened", 0) if self.forces else ("call", 3)
        elif self.state == "call":
            assert token in self.inside
            self.left -= 1
            if self.left == 0:
                self.state = "free"

    def forced(self, limit: int) -> list[int]:
        if self.state != "opened" or limit <= 0:
            return []
        self.state, self.left = "call", 3
        self.seen += min(2, limit)
        return [5, 6][:limit]


OPENS_AT = 7


def _run_lazy(model, prompts, n, *, lazy: bool, banned: int, forces: bool):
    driver = Driver(model)
    reqs = []
    for p in prompts:
        req = request(p, max_tokens=n)
        req.constraint = LazyCall(OPENS_AT, banned, {11, 12, 13, 14}, lazy=lazy, forces=forces)
        reqs.append(req)
    pipelined: list[bool] = []
    driver.gen.between_steps = lambda: None  # all rows start together
    for req in reqs:
        driver.join(req)
    while driver.batch:
        pipelined += [seq.pipelined for seq in driver.batch.seqs]
        driver.step()
    return [tokens_of(req.text) for req in reqs], pipelined, driver


@pytest.mark.parametrize("forces", [True, False], ids=["forced", "masked"])
@pytest.mark.parametrize("rows", [1, 3], ids=["solo", "merged"])
def test_lazy_grammar_stays_pipelined_until_its_trigger(model, rows, forces):
    n = 20
    prompts = PROMPTS[:rows]
    free = [reference(model, p, n) for p in prompts]
    banned = next(t for t in range(97) if all(t not in f for f in free))
    lazy, pipelined, driver = _run_lazy(model, prompts, n, lazy=True, banned=banned, forces=forces)
    eager, eager_pipelined, _ = _run_lazy(
        model, prompts, n, lazy=False, banned=banned, forces=forces
    )
    assert lazy == eager  # exactly the read-first path's tokens
    for got, want in zip(lazy, free, strict=True):
        assert got[:OPENS_AT] == want[:OPENS_AT]  # free text: the model's own greedy tokens
        call = got[OPENS_AT:]
        if forces:  # the call: forced tokens, then constrained ones
            assert call[:2] == [5, 6]
            call = call[2:]
        assert set(call[:3]) <= {11, 12, 13, 14}
    assert not any(eager_pipelined)
    assert pipelined[: rows * (OPENS_AT - 1)] == [True] * rows * (OPENS_AT - 1)  # free text
    assert not all(pipelined)  # the call was not pipelined
    assert pipelined[-1]  # and free text after it is again
    assert driver.batch.readbacks <= driver.batch.steps + 2


# ------------------------------------------- a real lazy tool grammar, through its trigger --
class Scripted:
    """A tiny random llama that writes `script` after the prompt: each logits row gets a large
    bonus on the script's token at its position (solo decoding: one row, its own KVCache)."""

    def __init__(self, inner, prompt_len: int, script: list[int]) -> None:
        self.inner, self.prompt_len, self.script = inner, prompt_len, script

    @property
    def layers(self):
        return self.inner.layers

    def __call__(self, inputs, cache):
        import mlx.core as mx

        out = self.inner(inputs, cache=cache)
        n, vocab = inputs.shape[1], out.shape[-1]
        first = cache[0].offset - n + 1  # the position the first row predicts
        bias = np.zeros((n, vocab), dtype=np.float32)
        for j in range(n):
            k = first + j - self.prompt_len
            if 0 <= k < len(self.script):
                bias[j, self.script[k]] = 50.0
        return out + mx.array(bias)[None]


@pytest.fixture(scope="module")
def tokenizer():
    from pathlib import Path

    from mlx_lm.tokenizer_utils import load

    from mlx_kvserve import paths
    from mlx_kvserve.models.resolve import local_model_dir, resolve_model

    _, ref = resolve_model(None, paths.data_dir(), progress=False)
    return load(Path(local_model_dir(ref)))


def test_real_lazy_tool_grammar_pipelines_its_text_and_constrains_its_call(tokenizer):
    """tool_choice "auto" with llguidance's lazy grammar on the default model's tokenizer: the
    text before `<tool_call>` decodes pipelined, the call after it reads first, and the tokens
    are exactly those of the read-first path throughout (and free text after the call is
    pipelined again)."""
    import mlx.core as mx
    from mlx_lm.models import llama

    from mlx_kvserve.chat.formats.hermes import FORMAT as HERMES
    from mlx_kvserve.chat.grammar import GrammarCompiler
    from mlx_kvserve.chat.request import ChatRequest, Message, Tool, ToolChoice
    from mlx_kvserve.engine.batch import DecodeBatch
    from mlx_kvserve.engine.generate import Generator
    from mlx_kvserve.engine.prompt_state import PromptStates

    vocab = len(tokenizer.get_vocab())
    mx.random.seed(3)
    inner = llama.Model(
        llama.ModelArgs(
            model_type="llama",
            hidden_size=32,
            num_hidden_layers=2,
            intermediate_size=64,
            num_attention_heads=4,
            num_key_value_heads=2,
            rms_norm_eps=1e-5,
            vocab_size=vocab,
        )
    )
    mx.eval(inner.parameters())
    text = 'Let me look that up for you now.<tool_call>\n{"name": "get_weather", "arguments": '
    text += '{"city": "Paris"}}\n</tool_call>'
    script = tokenizer.encode(text, add_special_tokens=False)
    prompt = tokenizer.encode("What is the weather in Paris?", add_special_tokens=False)
    model = Scripted(inner, len(prompt), script)
    chat = ChatRequest(
        [Message("user", "What is the weather in Paris?")],
        tools=[Tool("get_weather", None, {"type": "object", "properties": {"city": {}}})],
        tool_choice=ToolChoice("auto"),
    )
    compiler = GrammarCompiler(tokenizer)
    opening = len(tokenizer.encode(text.split("<tool_call>")[0], add_special_tokens=False))

    def run(lazy: bool) -> tuple[str, int, list[bool], str | None]:
        constraint = compiler.constraint_for(chat, HERMES)
        assert constraint is not None and constraint.lazy
        constraint.lazy = lazy
        req = request(prompt, max_tokens=len(script) + 5)
        req.constraint = constraint
        gen = Generator(model, tokenizer, PromptStates(model, None, enabled=False))
        _, seq = gen.start(req)
        ended: list = []
        batch = DecodeBatch(model, ended.append)
        batch.add(seq)
        pipelined = []
        while batch.seqs:
            pipelined.append(seq.pipelined)
            batch.step()
        (gone,) = ended
        return req.text, seq.timings.completion_tokens, pipelined, gone.finish

    lazy_text, lazy_count, pipelined, finish = run(True)
    eager_text, eager_count, eager_pipelined, eager_finish = run(False)
    assert (lazy_text, lazy_count, finish) == (eager_text, eager_count, eager_finish)
    assert lazy_text.startswith(text), lazy_text
    assert not any(eager_pipelined)
    assert pipelined[: opening - 1] == [True] * (opening - 1)  # the text, pipelined
    assert pipelined[:opening] == [True] * opening  # the text, pipelined
    call = pipelined.index(False)
    assert opening <= call <= opening + 5  # read first from the marker's last token
    assert pipelined[-1]  # free text again after the call


class Eager:
    """A constraint as the engine saw every grammar before: a mask at every step (all-True
    where the wrapped one has none), so nothing is pipelined; the same tokens."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def allowed(self, n_logits: int) -> np.ndarray:
        mask = self.inner.allowed(n_logits)
        return np.ones(n_logits, dtype=bool) if mask is None else mask

    def advance(self, token: int) -> None:
        self.inner.advance(token)

    def forced(self, limit: int) -> list[int]:
        return self.inner.forced(limit)

    @property
    def finished(self) -> bool:
        return self.inner.finished


def test_a_thinking_budget_keeps_the_reasoning_pipelined(model):
    """A reasoning gate masks nothing while the model reasons: pipelined; its spent budget's
    forced closing marker and the free answer after it give the read-first path's tokens."""
    from mlx_kvserve.chat.reasoning.reasoning_gate import ReasoningGate
    from mlx_kvserve.chat.reasoning.thinking import ThinkMarkers

    markers = ThinkMarkers("<t>", "</t>", (90,), (91,), (91, 92))
    n, budget = 16, 5

    def run(eager: bool):
        gate = ReasoningGate(markers, reasoning=True, budget=budget)
        driver = Driver(model)
        req = request(PROMPTS[0], max_tokens=n)
        req.constraint = Eager(gate) if eager else gate
        driver.join(req)
        pipelined = []
        while driver.batch:
            pipelined += [seq.pipelined for seq in driver.batch.seqs]
            driver.step()
        return tokens_of(req.text), pipelined

    tokens, pipelined = run(False)
    eager, eager_pipelined = run(True)
    assert tokens == eager
    assert tokens[budget : budget + 2] == [91, 92]  # the budget closed the reasoning
    assert not any(eager_pipelined)
    assert pipelined[:budget] == [True] * budget and pipelined[-1]
