"""A model whose embedding has more rows than its tokenizer has ids, in process.

That is how Qwen2.5/3/3.5, Gemma 3 and DeepSeek-V3 ship (Qwen: 151,669 tokens in 151,936 rows):
the logits are wider than the vocabulary llguidance knows. A grammar's mask must still cover
every logit (the rows past the tokenizer never allowed), and no row a token does not use may be
sampled or named in logprobs, with or without a grammar: it has no text.

On the default model's tokenizer (SmolLM2's 49,152 ids) and a tiny random llama padded as a real
checkpoint is (tests/support/tiny_models.py `padded_vocab`), whose padded rows are made to win
every step (the worst a checkpoint's unused rows can do).
"""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest

from mlx_kvserve.chat.formats.hermes import FORMAT as HERMES
from mlx_kvserve.chat.grammar import GrammarCompiler
from mlx_kvserve.chat.request import ChatRequest, Message, Tool, ToolChoice
from mlx_kvserve.engine.batch import DecodeBatch
from mlx_kvserve.engine.generate import Generator
from mlx_kvserve.engine.prompt_state import PromptStates
from mlx_kvserve.engine.requests import SamplingParams
from tests.support.tiny_models import VOCAB, default_tokenizer_dir, padded_vocab
from tests.unit.test_engine_units import request

PADDED = padded_vocab(VOCAB)
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}},
    "required": ["city"],
    "additionalProperties": False,
}
WEATHER = Tool("get_weather", None, SCHEMA)


@pytest.fixture(scope="module")
def tokenizer():
    from mlx_lm.tokenizer_utils import load

    return load(default_tokenizer_dir())


@pytest.fixture(scope="module")
def compiler(tokenizer) -> GrammarCompiler:
    return GrammarCompiler(tokenizer)


def _chat(choice: str) -> ChatRequest:
    return ChatRequest(
        [Message("user", "What is the weather in Paris?")],
        tools=[WEATHER],
        tool_choice=ToolChoice(choice),
    )


def _constraint(compiler: GrammarCompiler, kind: str):
    if kind == "json_schema":
        return compiler.json_constraint(SCHEMA, "response_format.json_schema.schema")
    constraint = compiler.constraint_for(_chat(kind), HERMES)
    assert constraint is not None
    return constraint


@pytest.mark.parametrize("kind", ["json_schema", "auto", "required"])
def test_a_grammar_masks_every_logit_of_a_padded_vocabulary(compiler, kind):
    """The mask is as wide as the logits; the padded rows are never allowed, step after step."""
    constraint = _constraint(compiler, kind)
    for _ in range(6):
        mask = constraint.allowed(PADDED)
        assert mask.shape == (PADDED,) and mask.dtype == bool
        assert mask[:VOCAB].any()
        assert not mask[VOCAB:].any()
        constraint.advance(int(np.flatnonzero(mask)[-1]))  # the highest id it allows
        if constraint.finished:
            break


class PaddingWins:
    """A padded checkpoint whose unused rows have the highest logits at every position."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.boost = mx.concatenate([mx.zeros(VOCAB), mx.full((PADDED - VOCAB,), 40.0)])

    @property
    def layers(self):
        return self.inner.layers

    def __call__(self, inputs, cache):
        return self.inner(inputs, cache=cache) + self.boost


@pytest.fixture(scope="module")
def model():
    from mlx_lm.models import llama

    mx.random.seed(5)
    inner = llama.Model(
        llama.ModelArgs(
            model_type="llama",
            hidden_size=32,
            num_hidden_layers=2,
            intermediate_size=64,
            num_attention_heads=4,
            num_key_value_heads=2,
            rms_norm_eps=1e-5,
            vocab_size=PADDED,
        )
    )
    mx.eval(inner.parameters())
    return PaddingWins(inner)


def _run(model, tokenizer, reqs) -> None:
    gen = Generator(model, tokenizer, PromptStates(model, None, enabled=False))
    batch = DecodeBatch(model, gen.finish)
    for req in reqs:
        _, seq = gen.start(req)
        batch.add(seq)
    while batch.seqs:
        batch.step()


def test_no_padded_row_is_ever_sampled_or_named(model, tokenizer, compiler):
    """Greedy, seeded temperature 1, with logprobs and under a JSON grammar, batched: every
    sampled id is one the tokenizer has, and so is every top_logprobs alternative."""
    prompt = tokenizer.encode("What is the weather in Paris?", add_special_tokens=False)
    greedy = request(prompt, max_tokens=8)
    warm = request(prompt, max_tokens=8)
    warm.params = SamplingParams(temperature=1.0, max_tokens=8, seed=3)
    named = request(prompt, max_tokens=8, logprobs=True, top_logprobs=5)
    constrained = request(prompt, max_tokens=24)
    constrained.constraint = _constraint(compiler, "json_schema")
    reqs = [greedy, warm, named, constrained]
    _run(model, tokenizer, reqs)
    for req in reqs:
        assert req.sampled and max(req.sampled) < VOCAB, req.sampled
        assert req.done.finish_reason in {"stop", "length"}
    names = [int(t.token) for c in named.events if hasattr(c, "logprobs") for t in c.logprobs]
    names += [
        int(alt)
        for c in named.events
        if hasattr(c, "logprobs")
        for t in c.logprobs
        for alt, _ in t.top
    ]
    assert names and max(names) < VOCAB
    text = "".join(getattr(e, "text", "") for e in constrained.events)
    assert json.loads(text)["city"] is not None


def test_an_end_id_past_the_tokenizer_does_not_break_grammars():
    """A config may list an end-of-sequence id in the padded rows; llguidance refuses such an
    id, so it is left out of the grammar's tokenizer (the sampler never draws it anyway)."""
    from mlx_lm.tokenizer_utils import load

    tokenizer = load(default_tokenizer_dir(), eos_token_ids=[2, PADDED - 1])
    assert tokenizer.eos_token_ids == {2, PADDED - 1}
    constraint = _constraint(GrammarCompiler(tokenizer), "required")
    assert not constraint.allowed(PADDED)[VOCAB:].any()


def test_a_prompt_of_ids_may_not_name_a_padded_row(tokenizer):
    from mlx_kvserve.chat.invalid_request import InvalidRequest
    from mlx_kvserve.chat.render import render_token_ids

    assert render_token_ids(tokenizer, [1, VOCAB - 1]).tokens == [1, VOCAB - 1]
    for bad in (VOCAB, PADDED - 1, -1):
        with pytest.raises(InvalidRequest, match=str(bad)):
            render_token_ids(tokenizer, [1, bad])


# -- a tokenizer larger than the embedding: refused before the model is served ----------------
@pytest.mark.parametrize("model_type", ["llama", "qwen3_5"])  # plain, and under text_config
def test_a_tokenizer_larger_than_the_embedding_is_refused(tmp_path, model_type):
    from mlx_kvserve.models.preflight import model_dir_problem
    from tests.support.tiny_models import make_model_dir

    assert model_dir_problem(make_model_dir(tmp_path / "padded", model_type)) is None
    exact = make_model_dir(tmp_path / "exact", model_type, vocab_size=VOCAB)
    assert model_dir_problem(exact) is None
    short = make_model_dir(tmp_path / "short", model_type, vocab_size=VOCAB - 100)
    problem = model_dir_problem(short)
    assert problem is not None
    assert f"writes {VOCAB} token ids" in problem
    assert f"only {VOCAB - 100} rows" in problem


def test_added_tokens_count_toward_the_tokenizer(tmp_path):
    """Ids added past the base vocabulary (here `<think>`, `</think>`) need rows too."""
    from mlx_kvserve.models.preflight import model_dir_problem, tokenizer_ids
    from tests.support.thinking_models import build_thinking_model

    model = build_thinking_model(tmp_path / "m", "qwen3", vocab_size=VOCAB + 2)
    assert tokenizer_ids(model) == VOCAB + 2 and model_dir_problem(model) is None
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "vocab_size": VOCAB + 1}))
    problem = model_dir_problem(model)
    assert problem is not None and f"writes {VOCAB + 2} token ids" in problem


# -- a config the architecture's arguments refuse: refused before the server looks healthy ----
def test_a_config_the_architecture_refuses_is_refused_before_it_loads(tmp_path):
    """DeepSeek-V4.1's released configs name engram layers mlx-lm's deepseek_v41 does not
    implement: its ModelArgs raises, which mlx_lm.load would only do after the server started
    and said it was loading."""
    from mlx_kvserve.models.preflight import model_dir_problem
    from tests.support.tiny_models import make_model_dir

    model = make_model_dir(tmp_path / "v41", "deepseek_v41")
    assert model_dir_problem(model) is None
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "engram_layer_ids": [1]}))
    problem = model_dir_problem(model)
    assert problem is not None
    assert "cannot build 'deepseek_v41'" in problem and "engram" in problem
