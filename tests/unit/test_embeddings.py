"""Embeddings in process: the real app and engine on tiny random-weight models, checked against
a plain mlx-lm forward of the same tokens with the same pooling computed here.

"gen" is a generative llama with a 64-token context (mean pooling); "embedder" is the same
architecture with sentence-transformers' files saying last-token pooling (as Qwen3-Embedding's
do). The server's vectors equal the plain forward's, batched equals one by one, `dimensions`
cuts and re-normalises, base64 is the float vector's bytes, and every bad input is a 400 in the
route's shape, naming the field.
"""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from starlette.testclient import TestClient

from mlx_kvserve.embed.pooling import LAST, MEAN, embed_rows
from tests.support.in_process import serve
from tests.support.tiny_models import embedding_model_dir, make_model_dir

CONTEXT = 64
TEXTS = ["Hello", "The sky is blue because of Rayleigh scattering.", "a b c d e f g", "x" * 40]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("embed")
    return {
        "gen": make_model_dir(root / "gen", "llama", max_position_embeddings=CONTEXT),
        "embedder": embedding_model_dir(root / "embedder"),
    }


@pytest.fixture(scope="module")
def gen(dirs: dict[str, Path]) -> Iterator[TestClient]:
    with serve(dirs["gen"], "gen") as client:
        yield client


@pytest.fixture(scope="module")
def embedder(dirs: dict[str, Path]) -> Iterator[TestClient]:
    with serve(dirs["embedder"], "embedder") as client:
        yield client


def plain(model_dir: Path, text: str | list[int], pooling: str) -> np.ndarray:
    """The plain mlx-lm forward of one input's tokens, pooled here, normalised."""
    from mlx_lm import load

    model, tokenizer = load(str(model_dir))
    tokens = tokenizer.encode(text) if isinstance(text, str) else text
    hidden = model.model(mx.array([tokens]))[0].astype(mx.float32)
    pooled = hidden[-1] if pooling == LAST else hidden.mean(axis=0)
    vector = np.array(pooled)
    return vector / np.linalg.norm(vector)


def vectors(client: TestClient, **body) -> list[np.ndarray]:
    reply = client.post("/v1/embeddings", json={"model": "m", **body})
    assert reply.status_code == 200, reply.text
    out = reply.json()
    assert [d["index"] for d in out["data"]] == list(range(len(out["data"])))
    return [np.array(d["embedding"], dtype=np.float32) for d in out["data"]]


def test_a_text_embeds_as_a_plain_forward_with_mean_pooling(gen, dirs) -> None:
    for text in TEXTS[:2]:
        (got,) = vectors(gen, input=text)
        np.testing.assert_allclose(got, plain(dirs["gen"], text, MEAN), atol=2e-5)
        assert abs(float(np.linalg.norm(got)) - 1) < 1e-5


def test_an_embedding_model_pools_its_last_token(embedder, dirs) -> None:
    (got,) = vectors(embedder, input=TEXTS[1])
    np.testing.assert_allclose(got, plain(dirs["embedder"], TEXTS[1], LAST), atol=2e-5)


def test_batched_equals_one_by_one(gen) -> None:
    batched = vectors(gen, input=TEXTS)
    alone = [vectors(gen, input=text)[0] for text in TEXTS]
    for one, other in zip(batched, alone, strict=True):
        np.testing.assert_allclose(one, other, atol=2e-5)


def test_token_ids_embed_as_their_text(gen, dirs) -> None:
    from mlx_lm import load

    _, tokenizer = load(str(dirs["gen"]))
    ids = [tokenizer.encode(text) for text in TEXTS[:2]]
    by_text = vectors(gen, input=TEXTS[:2])
    for got, want in (
        (vectors(gen, input=ids[0])[0], by_text[0]),
        *zip(vectors(gen, input=ids), by_text, strict=True),
    ):
        np.testing.assert_allclose(got, want, atol=2e-5)


def test_dimensions_cut_and_renormalise(gen) -> None:
    (full,) = vectors(gen, input=TEXTS[1])
    (cut,) = vectors(gen, input=TEXTS[1], dimensions=8)
    assert cut.shape == (8,)
    np.testing.assert_allclose(cut, full[:8] / np.linalg.norm(full[:8]), atol=1e-6)


def test_base64_is_the_float_vectors_bytes(gen) -> None:
    floats = vectors(gen, input=TEXTS[:2])
    reply = gen.post("/v1/embeddings", json={"input": TEXTS[:2], "encoding_format": "base64"})
    decoded = [
        np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in reply.json()["data"]
    ]
    for one, other in zip(decoded, floats, strict=True):
        assert one.tolist() == other.tolist()


def test_usage_and_model(gen, dirs) -> None:
    from mlx_lm import load

    _, tokenizer = load(str(dirs["gen"]))
    body = gen.post("/v1/embeddings", json={"model": "gen", "input": TEXTS}).json()
    tokens = sum(len(tokenizer.encode(t)) for t in TEXTS)
    assert body["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}
    assert body["model"] == "gen" and body["object"] == "list"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": []}, "input"),
        ({"input": ""}, "input"),
        ({"input": ["a", ""]}, "input[1]"),
        ({"input": ["a"] * 2049}, "input"),
        ({"input": "word " * 200}, "input"),
        ({"input": ["a", "word " * 200]}, "input[1]"),
        ({"input": [[1, 2], []]}, "input[1]"),
        ({"input": [10**6]}, "input"),
        ({"input": "a", "dimensions": 65}, "dimensions"),
        ({"input": "a", "dimensions": 0}, "dimensions"),
        ({"input": "a", "encoding_format": "int8"}, "encoding_format"),
        ({"input": 3}, "input"),
        ({}, "input"),
    ],
)
def test_bad_input_is_a_400_naming_the_field(gen, body: dict, param: str) -> None:
    reply = gen.post("/v1/embeddings", json=body)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] is not None and error["param"].startswith(param), error
    assert error["type"] == "invalid_request_error" and error["message"]


def test_ollama_embed_normalises_and_truncates(gen, dirs) -> None:
    reply = gen.post("/api/embed", json={"model": "gen", "input": TEXTS[:2]})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["model"] == "gen" and len(body["embeddings"]) == 2
    for got, text in zip(body["embeddings"], TEXTS[:2], strict=True):
        np.testing.assert_allclose(got, plain(dirs["gen"], text, MEAN), atol=2e-5)
    assert body["total_duration"] >= body["load_duration"] >= 0 and body["prompt_eval_count"] > 0
    long = {"model": "gen", "input": "word " * 200}
    assert gen.post("/api/embed", json=long).json()["prompt_eval_count"] == CONTEXT
    capped = gen.post("/api/embed", json={**long, "options": {"num_ctx": 16}}).json()
    assert capped["prompt_eval_count"] == 16
    refused = gen.post("/api/embed", json={**long, "truncate": False})
    assert refused.status_code == 400 and "context" in refused.json()["error"]
    cut = gen.post("/api/embed", json={"model": "gen", "input": TEXTS[1], "dimensions": 4}).json()
    np.testing.assert_allclose(np.linalg.norm(cut["embeddings"][0]), 1, atol=1e-6)
    empty = gen.post("/api/embed", json={"model": "gen", "input": []}).json()
    assert empty["embeddings"] == []


def test_ollama_legacy_embeddings_are_not_normalised(gen, dirs) -> None:
    from mlx_lm import load

    model, tokenizer = load(str(dirs["gen"]))
    reply = gen.post("/api/embeddings", json={"model": "gen", "prompt": TEXTS[1]})
    assert reply.status_code == 200, reply.text
    hidden = model.model(mx.array([tokenizer.encode(TEXTS[1])]))[0].astype(mx.float32)
    np.testing.assert_allclose(
        reply.json()["embedding"], np.array(hidden.mean(axis=0)), rtol=1e-4, atol=1e-5
    )
    assert gen.post("/api/embeddings", json={"model": "gen", "prompt": ""}).json() == {
        "embedding": []
    }


@pytest.mark.parametrize(
    ("path", "body", "status"),
    [
        ("/api/embed", {"model": "gen", "input": [1, 2]}, 400),
        ("/api/embed", {"model": "gen", "input": "a", "dimensions": 65}, 400),
        ("/api/embed", {"model": "gen", "input": "a", "dimensions": -1}, 400),
        ("/api/embed", {"model": "gen", "input": "a", "options": {"num_ctx": "big"}}, 400),
        ("/api/embed", {"model": "gen", "input": "a", "keep_alive": "soon"}, 400),
        ("/api/embed", {"input": "a"}, 400),
        ("/api/embed", {"model": "nope", "input": "a"}, 404),
        ("/api/embeddings", {"model": "gen", "prompt": 5}, 400),
    ],
)
def test_ollama_errors_in_its_shape(gen, path: str, body: dict, status: int) -> None:
    reply = gen.post(path, json=body)
    assert reply.status_code == status, reply.text
    assert isinstance(reply.json()["error"], str)


def test_capabilities_say_what_the_model_is_for(gen, embedder) -> None:
    assert embedder.post("/api/show", json={"model": "embedder"}).json()["capabilities"] == [
        "embedding"
    ]
    assert "embedding" not in gen.post("/api/show", json={"model": "gen"}).json()["capabilities"]
    assert embedder.get("/v1/models").json()["data"][0]["capabilities"] == ["embedding"]
    assert gen.get("/v1/models").json()["data"][0]["capabilities"] == ["completion"]


@pytest.mark.parametrize("model_type", ["llama", "gemma3", "qwen3_5", "mamba"])
def test_rows_padded_in_a_batch_equal_rows_alone(tmp_path: Path, model_type: str) -> None:
    """Right padding needs no mask on causal attention, sliding windows or recurrent layers."""
    from mlx_lm import load

    model, _ = load(str(make_model_dir(tmp_path / model_type, model_type)))
    rows = [[5, 9, 14, 3, 7, 22, 8], [11, 4], [6, 6, 6, 6]]
    for pooling in (MEAN, LAST):
        batched = embed_rows(model, rows, pooling)
        for row, got in zip(rows, batched, strict=True):
            np.testing.assert_allclose(
                got, embed_rows(model, [row], pooling)[0], rtol=1e-4, atol=1e-5
            )


def test_embedding_models_mlx_lm_would_compute_wrongly_are_refused_before_serving(
    dirs, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An encoder this server cannot serve (an architecture mlx-vlm's embedding models lack,
    or the embeddings extra not installed), and a decoder made bidirectional or followed by
    Dense layers (EmbeddingGemma's files on another architecture), are refused by the preflight
    with why, instead of loading as a causal model whose vectors are not the model card's."""
    import json
    import shutil

    from mlx_kvserve.embed import encoder
    from mlx_kvserve.models.preflight import model_dir_problem
    from tests.support.tiny_models import EMBEDDING_MODULES

    assert model_dir_problem(dirs["embedder"]) is None
    mpnet = tmp_path / "mpnet"
    mpnet.mkdir()
    (mpnet / "config.json").write_text(json.dumps({"model_type": "mpnet", "hidden_size": 32}))
    assert "mpnet is an embedding model that attends both ways" in model_dir_problem(mpnet)
    bert = tmp_path / "bert"
    bert.mkdir()
    (bert / "config.json").write_text(json.dumps({"model_type": "bert", "hidden_size": 32}))
    monkeypatch.setattr(encoder, "encoder_library", lambda: "install the embeddings extra")
    assert "install the embeddings extra" in model_dir_problem(bert)
    both_ways = shutil.copytree(dirs["embedder"], tmp_path / "both-ways")
    config = json.loads((both_ways / "config.json").read_text())
    config["use_bidirectional_attention"] = True
    (both_ways / "config.json").write_text(json.dumps(config))
    dense = shutil.copytree(dirs["embedder"], tmp_path / "dense")
    dense_module = {"path": "2_Dense", "type": "sentence_transformers.models.Dense"}
    (dense / "modules.json").write_text(json.dumps([*EMBEDDING_MODULES, dense_module]))
    for model in (both_ways, dense):
        problem = model_dir_problem(model)
        assert problem is not None and "llama is an embedding model that attends" in problem
