"""`/v1/completions` with `echo`, prompt `logprobs` and several prompts, and the tokenizer
routes, in process: the real app and engine on a tiny random-weight llama (SmolLM2's tokenizer,
a padded vocabulary), checked against a plain mlx-lm forward of the same tokens. Bad input gets
a 400 naming the field.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from starlette.testclient import TestClient

from mlx_kvserve.config.settings import Settings
from mlx_kvserve.engine import Engine
from mlx_kvserve.engine.prompt_logprobs import score
from mlx_kvserve.engine.scorer import LOGITS_BYTES, Scorer
from tests.support.tiny_models import VOCAB, make_model_dir

LOCAL = "http://localhost"
CONTEXT = 64
TEXT = "The sky is blue because of Rayleigh scattering."


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model_dir(tmp_path_factory.mktemp("echo"), "llama", max_position_embeddings=CONTEXT)


@pytest.fixture(scope="module")
def client(model_dir: Path) -> Iterator[TestClient]:
    from mlx_lm import load

    from mlx_kvserve.api.app import create_app
    from mlx_kvserve.models.pool import ModelPool

    engine = Engine(lambda: load(str(model_dir)), cache_enabled=True)
    pool = ModelPool.single(engine, "tiny")
    pool.default.model_dir = model_dir
    with TestClient(create_app(Settings(), pool), base_url=LOCAL) as test_client:
        yield test_client


@pytest.fixture(scope="module")
def loaded(model_dir: Path):
    from mlx_lm import load

    return load(str(model_dir))


def plain(loaded, row: list[int]) -> np.ndarray:
    """Log probabilities of row[1:] by one plain forward of the row alone."""
    model, _ = loaded
    logits = model(mx.array([row]))[0][:, :VOCAB].astype(mx.float32)
    logprobs = np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
    return logprobs[np.arange(len(row) - 1), row[1:]]


def complete(client: TestClient, **body) -> dict:
    reply = client.post("/v1/completions", json={"model": "tiny", **body})
    assert reply.status_code == 200, reply.text
    return reply.json()


def error(client: TestClient, path: str = "/v1/completions", **body) -> dict:
    reply = client.post(path, json={"model": "tiny", **body})
    assert reply.status_code == 400, reply.text
    return reply.json()["error"]


def test_echo_scores_the_prompt_as_a_plain_forward(client, loaded) -> None:
    _, tokenizer = loaded
    row = tokenizer.encode(TEXT)
    out = complete(client, prompt=TEXT, echo=True, logprobs=2, max_tokens=0)
    (choice,) = out["choices"]
    assert choice["text"] == TEXT and choice["finish_reason"] == "length"
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(row)
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    np.testing.assert_allclose(lp["token_logprobs"][1:], plain(loaded, row), atol=1e-4)
    assert all(len(top) <= 2 for top in lp["top_logprobs"][1:])
    for chosen, top in zip(lp["token_logprobs"][1:], lp["top_logprobs"][1:], strict=True):
        assert max(top.values()) >= chosen - 1e-6
    assert "".join(lp["tokens"]) == TEXT
    assert lp["text_offset"][0] == 0 and lp["text_offset"][-1] == len(TEXT) - len(lp["tokens"][-1])
    assert out["usage"]["prompt_tokens"] == len(row) and out["usage"]["completion_tokens"] == 0
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_a_batch_of_token_id_prompts_scores_each(client, loaded) -> None:
    _, tokenizer = loaded
    rows = [tokenizer.encode(t) for t in (TEXT, "Hello there", "a b c d e f g h i j")]
    out = complete(client, prompt=rows, echo=True, logprobs=1, max_tokens=0)
    assert [c["index"] for c in out["choices"]] == [0, 1, 2]
    for choice, row in zip(out["choices"], rows, strict=True):
        assert choice["text"] == tokenizer.decode(row)
        got = choice["logprobs"]["token_logprobs"]
        np.testing.assert_allclose(got[1:], plain(loaded, row), atol=1e-4)
    assert out["usage"]["prompt_tokens"] == sum(map(len, rows))


def test_echo_with_a_completion_appends_the_generated_tokens(client, loaded) -> None:
    """lm-eval's loglikelihood request: echo, logprobs 1, max_tokens 1."""
    _, tokenizer = loaded
    row = tokenizer.encode(TEXT)
    body = {"prompt": row, "temperature": 0, "max_tokens": 3, "ignore_eos": True}
    alone = complete(client, **body, logprobs=1)["choices"][0]
    echoed = complete(client, **body, logprobs=1, echo=True)
    choice = echoed["choices"][0]
    assert choice["text"] == TEXT + alone["text"]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(row) + 3
    assert lp["token_logprobs"][len(row) :] == alone["logprobs"]["token_logprobs"]
    np.testing.assert_allclose(lp["token_logprobs"][1 : len(row)], plain(loaded, row), atol=1e-4)
    assert echoed["usage"]["completion_tokens"] == 3
    plain_echo = complete(client, **body, echo=True)["choices"][0]
    assert plain_echo["text"] == TEXT + alone["text"] and plain_echo["logprobs"] is None


def test_several_prompts_each_get_a_completion(client) -> None:
    prompts = ["Once upon a time", "The capital of France is", "1, 2, 3,"]
    body = {"temperature": 0, "max_tokens": 4, "ignore_eos": True}
    batched = complete(client, prompt=prompts, **body)
    alone = [complete(client, prompt=p, **body)["choices"][0]["text"] for p in prompts]
    assert [c["text"] for c in batched["choices"]] == alone
    assert [c["index"] for c in batched["choices"]] == [0, 1, 2]
    assert batched["usage"]["completion_tokens"] == 12


def test_tokenize_and_detokenize_round_trip(client, loaded) -> None:
    _, tokenizer = loaded
    reply = client.post("/tokenize", json={"prompt": TEXT, "add_special_tokens": False})
    assert reply.status_code == 200, reply.text
    out = reply.json()
    assert out["tokens"] == tokenizer.encode(TEXT, add_special_tokens=False)
    assert out["count"] == len(out["tokens"]) and out["max_model_len"] == CONTEXT
    back = client.post("/detokenize", json={"tokens": out["tokens"]})
    assert back.status_code == 200 and back.json() == {"prompt": TEXT}
    info = client.get("/tokenizer_info").json()
    assert info["eos_token"] == tokenizer.eos_token and info["model_max_length"] == CONTEXT
    assert isinstance(info["chat_template"], str)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "hi", "echo": True, "stream": True}, "echo"),
        ({"prompt": ["a", "b"], "stream": True}, "prompt"),
        ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "hi", "echo": True, "logprobs": 21}, "logprobs"),
        ({"prompt": "hi", "max_tokens": -1}, "max_tokens"),
        ({"prompt": ["x"] * 65, "echo": True}, "prompt"),
        ({"prompt": ["a", ""], "echo": True, "max_tokens": 0}, "prompt[1]"),
        ({"prompt": [[1, 2], [3, VOCAB]], "echo": True, "logprobs": 1}, "prompt[1]"),
        ({"prompt": "word " * (CONTEXT + 5), "echo": True, "max_tokens": 0}, "prompt"),
        ({"prompt": [[1, 2], "text", []], "echo": True}, "prompt"),
    ],
)
def test_bad_input_is_a_400_naming_the_field(client, body: dict, param: str) -> None:
    assert error(client, **body)["param"] == param


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"prompt": 5}, "prompt"),
        ("/detokenize", {"tokens": [1, VOCAB + 3]}, "tokens"),
        ("/detokenize", {"tokens": "abc"}, "tokens"),
    ],
)
def test_bad_tokenizer_input_is_a_400(client, path: str, body: dict, param: str) -> None:
    assert error(client, path, **body)["param"] == param


def test_the_scorer_feeds_chunks_and_drops_a_departed_clients_prompts(client, loaded) -> None:
    """On the real engine thread: a few columns a call (at most `busy_tokens` positions), the
    figures those of one batch; a request cancelled before its turn computes nothing."""
    model, _ = loaded
    assert client.post("/tokenize", json={"prompt": "load"}).status_code == 200
    engine = client.app.state.pool.default.engine
    counts: dict[str, int] = {}
    scorer = Scorer(
        engine, VOCAB, busy_tokens=8, idle_tokens=8, count=lambda o, n: counts.update({o: n})
    )
    rows = [[(5 * i + 3) % 4000 + 10 for i in range(20)], [(7 * i) % 3000 + 10 for i in range(30)]]
    got = scorer.submit(rows, 2).done.result(timeout=60)
    assert scorer.passes == 8  # 29 columns, 4 a pass (2 rows in 8 positions)
    for mine, want in zip(got, score(model, rows, 2, VOCAB), strict=True):
        np.testing.assert_allclose(mine.logprobs, want.logprobs, atol=1e-4)
    assert counts == {"scored": 2}

    gate = threading.Event()
    engine.call(lambda: gate.wait(30))  # holds the engine thread until the request is gone
    job = scorer.submit(rows, 2)
    job.cancel()
    gate.set()
    engine.call(lambda: None).result(timeout=60)  # the scorer's turn came and went
    assert scorer.passes == 8 and counts == {"scored": 2, "dropped": 2}
    assert not job.done.done()


def test_a_wide_vocabulary_narrows_the_scorers_passes(client) -> None:
    """A pass holds at most LOGITS_BYTES of float32 logits: here 3 positions (of 2 rows, 1
    column a pass), whatever the budget."""
    assert client.post("/tokenize", json={"prompt": "load"}).status_code == 200
    engine = client.app.state.pool.default.engine
    scorer = Scorer(engine, LOGITS_BYTES // (4 * 3), busy_tokens=512, idle_tokens=512)
    rows = [[10 + i for i in range(12)], [20 + i for i in range(9)]]
    scorer.submit(rows, 1).done.result(timeout=60)
    assert scorer.passes == 11
