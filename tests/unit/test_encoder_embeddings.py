"""Encoder embedding models (BERT's family) in process, through the `embeddings` extra
(mlx-vlm's embedding models; skipped without it): the engine the server makes for such a model
(models/serving.py's `make_engine`), its vectors against mlx-vlm's own model run on each input
alone, padded rows masked, the Pooling config honoured, and generation refused.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from starlette.testclient import TestClient

pytest.importorskip("mlx_vlm.embedding_loader", reason="the embeddings extra (mlx-vlm)")

from mlx_kvserve.config.settings import Settings  # noqa: E402
from tests.support import in_process  # noqa: E402
from tests.support.encoder_models import tiny_bert_dir, tiny_embeddinggemma_dir  # noqa: E402

TEXTS = ["The sky is blue.", "def add(a, b): return a + b", "fox", "Servers batch requests " * 3]


def serve(model_dir: Path, name: str) -> TestClient:
    """The app on the engine the server makes for the model (models/serving.py)."""
    from mlx_kvserve.embed.encoder import EncoderEngine
    from mlx_kvserve.models.serving import make_engine

    engine = make_engine(Settings(), model_dir, name, lambda *args: None, lambda path: None)
    assert isinstance(engine, EncoderEngine)
    return in_process.serve(model_dir, name, engine)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("encoders")
    return {
        "cls": tiny_bert_dir(root / "cls", "pooling_mode_cls_token"),
        "mean": tiny_bert_dir(root / "mean", "pooling_mode_mean_tokens"),
    }


@pytest.fixture(scope="module")
def cls(dirs: dict[str, Path]) -> Iterator[TestClient]:
    with serve(dirs["cls"], "bert") as client:
        yield client


def alone(model_dir: Path, text: str, pooling: str) -> np.ndarray:
    """mlx-vlm's BERT on one input (no padding), pooled here from its hidden states."""
    import mlx.core as mx
    from mlx_lm.utils import load_tokenizer
    from mlx_vlm.embedding_loader import load_embedding_model

    model = load_embedding_model(model_dir)
    ids = mx.array([load_tokenizer(model_dir).encode(text)])
    hidden = np.array(model(ids).last_hidden_state[0].astype(mx.float32))
    vector = hidden[0] if pooling == "cls" else hidden.mean(axis=0)
    return vector / np.linalg.norm(vector)


def vectors(client: TestClient, inputs: list[str]) -> list[np.ndarray]:
    reply = client.post("/v1/embeddings", json={"input": inputs})
    assert reply.status_code == 200, reply.text
    return [np.array(d["embedding"], dtype=np.float32) for d in reply.json()["data"]]


def test_vectors_are_the_models_own_with_padding_masked(cls: TestClient, dirs) -> None:
    batched = vectors(cls, TEXTS)  # rows of several lengths: padded in one batch
    for text, vector in zip(TEXTS, batched, strict=True):
        assert np.allclose(vector, alone(dirs["cls"], text, "cls"), atol=1e-5)
        assert np.allclose(vector, vectors(cls, [text])[0], atol=1e-5)


def test_the_pooling_config_is_honoured(dirs) -> None:
    with serve(dirs["mean"], "bert") as mean:
        got = vectors(mean, TEXTS[:2])
    for text, vector in zip(TEXTS[:2], got, strict=True):
        assert np.allclose(vector, alone(dirs["mean"], text, "mean"), atol=1e-5)
        assert not np.allclose(vector, alone(dirs["mean"], text, "cls"), atol=1e-3)


def test_an_encoder_embeds_on_every_route_and_generates_nothing(cls: TestClient) -> None:
    shown = cls.post("/api/show", json={"model": "bert"}).json()
    assert shown["capabilities"] == ["embedding"]
    embedded = cls.post("/api/embed", json={"model": "bert", "input": TEXTS[:2]}).json()
    assert len(embedded["embeddings"]) == 2 and len(embedded["embeddings"][0]) == 32
    legacy = cls.post("/api/embeddings", json={"model": "bert", "prompt": "fox"}).json()
    assert len(legacy["embedding"]) == 32
    too_wide = cls.post("/v1/embeddings", json={"model": "bert", "input": "x", "dimensions": 33})
    assert too_wide.status_code == 400 and "dimensions" in too_wide.json()["error"]["message"]
    for path, body in (
        ("/api/chat", {"messages": [{"role": "user", "content": "Hi"}], "stream": False}),
        ("/api/generate", {"prompt": "Hi", "stream": False}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
        ("/v1/completions", {"prompt": "Hi"}),
    ):
        reply = cls.post(path, json={"model": "bert", **body})
        assert reply.status_code == 400, (path, reply.text)
        assert "embedding model" in reply.text, (path, reply.text)


def test_embeddinggemma_pools_then_projects_through_its_dense_layers(tmp_path: Path) -> None:
    """EmbeddingGemma's files (a bidirectional gemma3_text, mean pooling, `2_Dense` and
    `3_Dense`): its vector is the mean of its hidden states through both Dense layers,
    normalised, whichever rows share its batch."""
    import mlx.core as mx
    from mlx_lm.utils import load_tokenizer
    from mlx_vlm.embedding_loader import load_embedding_model
    from safetensors.numpy import load_file

    model_dir = tiny_embeddinggemma_dir(tmp_path / "embeddinggemma")
    model = load_embedding_model(model_dir)
    tokenizer = load_tokenizer(model_dir)
    dense = [
        load_file(str(model_dir / d / "model.safetensors"))["linear.weight"]
        for d in ("2_Dense", "3_Dense")
    ]
    with serve(model_dir, "gemma") as client:
        shown = client.post("/api/show", json={"model": "gemma"}).json()
        assert shown["capabilities"] == ["embedding"]
        got = vectors(client, TEXTS)
    for text, vector in zip(TEXTS, got, strict=True):
        ids = mx.array([tokenizer.encode(text)])
        hidden = np.array(model(ids).last_hidden_state[0].astype(mx.float32))
        want = dense[1] @ (dense[0] @ hidden.mean(axis=0))
        assert np.allclose(vector, want / np.linalg.norm(want), atol=1e-4)
