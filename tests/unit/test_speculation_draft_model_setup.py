"""`--draft-model` from settings to a serving engine (models/draft.py, models/serving.py): a
draft model of the same tokenizer drafts (`/metrics` and the status page count
`source="draft_model"`) and changes no answer; another vocabulary, a server-wide draft model
beside several models, or one asked with speculation off are refused or left out at start,
naming why. In-process, on the real app, engine and tokenizers (the default model's, padded)."""

from __future__ import annotations

import json
import logging
import random
import re

import pytest
from starlette.testclient import TestClient

from mlx_kvserve.config.settings import Settings
from mlx_kvserve.engine.speculation.depth import VerifyCost
from mlx_kvserve.engine.speculation.draft_model import DraftModel
from mlx_kvserve.engine.speculation.drafts import PromptLookup
from mlx_kvserve.models.serving import ModelSetupError, prepare_slots
from tests.support.tiny_models import make_model_dir

LOCAL = "http://localhost"
rng = random.Random(5)
PROMPT = [rng.randrange(1000, 40000) for _ in range(40)]  # no repeats: lookup has little to say


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("draft-model")
    target = make_model_dir(root / "target", "llama", seed=0)
    other = make_model_dir(
        root / "other", "llama", seed=1, num_hidden_layers=1, tie_word_embeddings=False
    )
    swapped = make_model_dir(root / "swapped", "llama", seed=1)
    tokenizer = json.loads((swapped / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]  # two tokens trade ids: same names, another map
    a, b = sorted(vocab, key=vocab.__getitem__)[500:502]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (swapped / "tokenizer.json").write_text(json.dumps(tokenizer))
    return {"target": target, "other": other, "swapped": swapped, "a": a}


@pytest.fixture
def prior_cost(monkeypatch: pytest.MonkeyPatch) -> None:
    """Drafting on the cost prior, with draft passes as if the draft model were far smaller
    than its target (these drafts are as large or half as large): the path, not the payoff."""
    monkeypatch.setattr(VerifyCost, "observe", lambda self, batch, width, seconds: None)
    monkeypatch.setattr(DraftModel, "__init__", cheap(DraftModel.__init__))


def cheap(init):
    def __init__(self, model, prefill_step=512, prior=0.25):
        init(self, model, prefill_step, prior=0.02)

    return __init__


def slots(settings: Settings):
    from mlx_lm import load

    return prepare_slots(settings, lambda *args: None, load)


def serve(settings: Settings) -> TestClient:
    from mlx_kvserve.api.app import create_app
    from mlx_kvserve.models.pool import ModelPool

    (slot,), engines = slots(settings)
    engine = engines(slot)
    return TestClient(create_app(settings, ModelPool.single(engine, "tiny")), base_url=LOCAL)


def answer(client: TestClient) -> list[int]:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 40, "temperature": 0}
    reply = client.post("/v1/completions", json=body | {"ignore_eos": True, "logprobs": 0})
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]["logprobs"]["tokens"]


def kv_per_token(client: TestClient) -> int:
    return client.app.state.pool.default.engine.room.ledger.cost.per_token


def draft_counts(client: TestClient) -> tuple[float, float]:
    text = client.get("/metrics").text
    out = []
    for name in ("drafted_tokens", "accepted_tokens"):
        pattern = rf'^mlx_kvserve_speculation_{name}_total\{{source="draft_model"\}} (\S+)$'
        (value,) = re.findall(pattern, text, re.M)
        out.append(float(value))
    return out[0], out[1]


@pytest.mark.parametrize("draft", ["target", "other"])
def test_a_draft_model_drafts_and_changes_no_answer(dirs, draft, prior_cost, monkeypatch):
    """The target as its own draft keeps nearly all; a one-layer model of other weights keeps
    few; both answer as the server without speculation, and say so in /metrics and /v1/status."""
    monkeypatch.setattr(PromptLookup, "propose", lambda self, limit: None)
    model = str(dirs["target"])
    with serve(Settings(model=[model], speculation="off")) as client:
        plain = [answer(client) for _ in range(2)]
        alone = kv_per_token(client)
    settings = Settings(model=[model], speculation="auto", draft_model=str(dirs[draft]))
    with serve(settings) as client:
        got = [answer(client) for _ in range(2)]
        drafted, accepted = draft_counts(client)
        status = client.get("/v1/status").json()["speculation"]["by_source"]["draft_model"]
        beside = kv_per_token(client)
    assert got == plain
    # the KV ledger counts each row's draft KV beside its own (the target: twice as much)
    assert beside == 2 * alone if draft == "target" else alone < beside < 2 * alone
    assert drafted > 10
    assert accepted >= 0.9 * drafted if draft == "target" else accepted < 0.6 * drafted
    assert (status["drafted"], status["accepted"]) == (drafted, accepted)


def test_a_draft_model_of_another_vocabulary_is_refused_at_start_naming_it(dirs):
    model = str(dirs["target"])
    settings = Settings(model=[model], speculation="auto", draft_model=str(dirs["swapped"]))
    with pytest.raises(ModelSetupError, match=re.escape(repr(dirs["a"]))) as caught:
        slots(settings)
    assert "its tokenizer is not the model's" in str(caught.value)
    missing = Settings(model=[model], speculation="auto", draft_model=str(dirs["target"] / "no"))
    with pytest.raises(ModelSetupError, match="draft model"):
        slots(missing)


def test_the_engine_refuses_a_draft_model_of_another_vocabulary(dirs):
    """The engine checks the tokenizers it loaded too (an engine made without the start-up
    check): its load fails naming the cause."""
    from mlx_lm import load

    from mlx_kvserve.engine import Engine

    model, swapped = str(dirs["target"]), str(dirs["swapped"])
    engine = Engine(lambda: load(model), speculation="auto", draft_loader=lambda: load(swapped))
    engine.start()
    engine.join(timeout=120)
    assert engine.load_error and "its tokenizer is not the model's" in engine.load_error


def test_several_models_take_their_draft_model_per_model(dirs, tmp_path):
    model, other = str(dirs["target"]), str(dirs["other"])
    with pytest.raises(ModelSetupError, match="set it per model"):
        slots(Settings(model=[f"a={model}", f"b={other}"], draft_model=model))
    tables = [
        {"name": "a", "path": model, "settings": {"speculation": "auto", "draft_model": other}},
        {"name": "b", "path": other},
    ]
    found, engines = slots(Settings(models=tables))
    assert [engines._places[s.name][2] for s in found] == [dirs["other"], None]


def test_a_draft_model_with_speculation_off_is_not_loaded(dirs, caplog):
    model = str(dirs["target"])
    with caplog.at_level(logging.WARNING, logger="mlx_kvserve"):
        settings = Settings(model=[model], draft_model=model, speculation="off")
        (slot,), engines = slots(settings)
    assert engines._places[slot.name][2] is None
    assert "not loaded: --speculation is off" in caplog.text
