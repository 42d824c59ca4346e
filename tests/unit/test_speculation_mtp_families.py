"""The MTP heads of the families added after Qwen and DeepSeek-V3/GLM-4 MoE (models/
mtp_families.py): DeepSeek-V3.2 (`deepseek_v32`, MLA with its indexer, each layer's cache a
`CacheList`), GLM-4.7-Flash (`glm4_moe_lite`), GLM-5 (`glm_moe_dsa`, transformers'
`rope_parameters`), Nemotron-H (an MTP module of an attention and an experts block, beside a
Mamba target) and MiMo (`model.mtp_layers.0`, its fc reading [hidden, embedding]). Per family,
a tiny checkpoint with its heads in its safetensors, named as its real checkpoints name them
(tests/support/mtp_models.py): the heads load strictly; greedy tokens equal plain decoding's
with random heads (drafts rejected) and with heads made to guess right (every draft kept);
seeded sampled rows give the same tokens; the MTP cache equals one fed afresh; the prompt
cache keeps the heads' state where it is a `KVCache`."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load_model

from mlx_kvserve.cache import MTPRestored, PromptCache
from mlx_kvserve.engine.batch import DecodeBatch
from mlx_kvserve.engine.speculation.depth import VerifyCost
from mlx_kvserve.engine.speculation.mtp import SOURCE, MTPDraft, Tap, prefill_source
from mlx_kvserve.models.mtp_heads import heads_problem, load_heads
from tests.support.mtp_models import mtp_model_dir
from tests.unit.test_batching import Driver
from tests.unit.test_engine_units import reference, request, tokens_of
from tests.unit.test_speculation_mtp import PROMPTS, assert_fed_afresh, decode, mtp_counts

FAMILIES = ["deepseek_v32", "glm4_moe_lite", "glm_moe_dsa", "nemotron_h", "mimo"]
N = 28  # past the tiny DeepSeek-V3.2 indexer's 12 positions: its sparse path runs too


@pytest.fixture(autouse=True)
def prior_cost(monkeypatch: pytest.MonkeyPatch) -> None:
    """Draft on the cost prior alone: a loaded machine's timings must not decide the test."""
    monkeypatch.setattr(VerifyCost, "observe", lambda self, batch, width, seconds: None)


@pytest.fixture(scope="module", params=FAMILIES)
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """(family, {"random" | "right": (model, heads, path)})."""
    name = request.param
    out = {}
    for kind, kwargs in {"random": {}, "right": {"predictable": True}}.items():
        path = mtp_model_dir(tmp_path_factory.mktemp(f"{name}-{kind}"), family=name, **kwargs)
        model, _ = load_model(path)  # strict: mlx-lm's sanitize drops the heads itself
        out[kind] = (model, load_heads(path, model), path)
    return name, out


def test_the_heads_load_from_the_checkpoints_own_names(family):
    name, built = family
    model, heads, path = built["random"]
    config = json.loads((path / "config.json").read_text())
    assert config["num_nextn_predict_layers"] == 1
    assert heads is not None and heads_problem(path) is None
    assert heads.depth == (2 if name == "nemotron_h" else 1)  # Nemotron-H's module: `*E`
    tokens = mx.array([PROMPTS[0]])
    assert mx.array_equal(Tap(model, heads)(tokens), model(tokens)).item()
    hidden = heads.inner(tokens, None)
    out = heads.step(tokens[:, 1:], hidden[:, :-1], heads.make_cache())
    assert out.shape == hidden[:, :-1].shape and not mx.isnan(out).any().item()


@pytest.mark.parametrize("kind", ["random", "right"])
def test_greedy_tokens_are_plain_decodings(family, kind):
    _, built = family
    model, heads, _ = built[kind]
    _, plain = decode(model, None, PROMPTS[:1], N, "off")
    driver, spec = decode(model, heads, PROMPTS[:1], N)
    assert tokens_of(spec[0].text) == tokens_of(plain[0].text)
    ((drafted, kept, _),) = mtp_counts(driver)
    assert drafted > 0
    if kind == "right":
        assert kept == drafted
    else:
        assert kept < drafted


def test_seeded_sampled_rows_give_the_same_tokens(family):
    _, built = family
    model, heads, _ = built["right"]
    params = {"temperature": 0.8, "seed": 7}
    _, plain = decode(model, None, PROMPTS[:1], N, "off", **params)
    driver, spec = decode(model, heads, PROMPTS[:1], N, **params)
    assert tokens_of(spec[0].text) == tokens_of(plain[0].text)
    assert mtp_counts(driver)[0][0] > 0


def test_the_mtp_cache_holds_each_committed_pair_once(family):
    """Mid-answer, after random heads' drafts were rejected (their steps trimmed off the MTP's
    caches: DeepSeek-V3.2's indexer keys too), and past the indexer's 12 positions: the row's
    MTP source equals one fed afresh every committed pair."""
    _, built = family
    model, heads, _ = built["random"]
    driver = Driver(model)
    driver.batch = DecodeBatch(model, driver._end, speculation="auto", mtp=heads)
    driver.gen.model = driver.batch.model
    req = request(PROMPTS[0], max_tokens=N)
    driver.join(req)
    for _ in range(N // 2):
        driver.step()
    (seq,) = driver.batch.seqs
    assert seq.timings.by_source[SOURCE][0] > seq.timings.by_source[SOURCE][1]
    assert_fed_afresh(heads, driver.batch.speculator.rows[id(seq)].mtp, 0)
    driver.drain()
    assert tokens_of(req.text) == reference(model, PROMPTS[0], N)


def test_a_conversion_without_the_heads_is_refused_naming_them(tmp_path: Path, family):
    """mlx_lm.convert keeps the config's field but drops the tensors: `--mtp on` says so."""
    name, built = family
    _, _, path = built["random"]
    stripped = tmp_path / "converted"
    stripped.mkdir()
    (stripped / "config.json").write_text((path / "config.json").read_text())
    weights = mx.load(str(path / "model.safetensors"))
    model, _ = load_model(path)
    mx.save_safetensors(str(stripped / "model.safetensors"), dict(model.sanitize(weights)))
    assert load_heads(stripped, model) is None
    prefix = {"nemotron_h": "mtp.", "mimo": "model.mtp_layers.0."}.get(name, "model.layers.2.")
    assert f"hold no {prefix}* tensors" in heads_problem(stripped)


def test_the_heads_compute_in_the_targets_dtype_but_the_router_bias_in_float32(tmp_path: Path):
    """A target cast to bfloat16 as mlx-lm casts (its `cast_predicate` keeps the experts'
    score-correction bias float32): the heads follow it, the bias too."""
    from mlx.utils import tree_map_with_path

    path = mtp_model_dir(tmp_path / "v32", family="deepseek_v32")
    model, _ = load_model(path)

    def cast(key: str, value: mx.array) -> mx.array:
        return value.astype(mx.bfloat16) if model.cast_predicate(key) else value

    model.update(tree_map_with_path(cast, model.parameters()))
    heads = load_heads(path, model)
    assert heads is not None
    assert heads.block.fc.weight.dtype == mx.bfloat16
    gate = heads.block.layers[0].mlp.gate
    assert gate.e_score_correction_bias.dtype == mx.float32
    assert gate.weight.dtype == mx.bfloat16


def test_the_prompt_cache_keeps_the_heads_state_where_it_is_a_kv_cache(family):
    """A checkpoint keeps the MTP layers' state of exactly its tokens beside the target's
    (cache/mtp_part.py) where their cache is a `KVCache` (MLA's latent one too): restored, it
    fits the heads and equals the source's; a `CacheList` (V3.2's and GLM-5's indexer keys
    beside the KV) is not stored, a lost guess after a restore."""
    name, built = family
    model, heads, _ = built["random"]
    tokens = PROMPTS[0] * 3
    source = MTPDraft(heads)
    mx.eval(source.chunk(0, tokens, heads.inner(mx.array([tokens]), None)[0]))
    state = source.state(len(tokens))
    if name in ("deepseek_v32", "glm_moe_dsa"):
        assert state is None
        return
    cache = PromptCache(None, f"tiny-{name}", disk_budget=None, ram_budget=1 << 26)
    caches = make_prompt_cache(model)
    mx.eval(model(mx.array([tokens]), cache=caches))
    assert cache.checkpoint(tokens, caches, "message", mtp=state) is not None
    got, prompt = MTPRestored(), tokens + [1]
    cache.restore(cache.lookup(prompt), make_prompt_cache(model), tokens=prompt, mtp=got)
    tap = Tap(model, heads)
    assert got.state is not None and tap.fits(got.state)
    restored = prefill_source(tap, tokens, True, got.state)
    assert restored.fed == source.fed == len(tokens) - 2 and restored.tail == 0
    for mine, theirs in zip(restored.cache, source.cache, strict=True):
        for a, b in ((mine.keys, theirs.keys), (mine.values, theirs.values)):
            assert mx.array_equal(a[..., : len(tokens) - 1, :], b[..., : len(tokens) - 1, :])
    assert mx.array_equal(restored.hidden[len(tokens) - 1], source.hidden[len(tokens) - 1])
