"""An encoder embedding model (a tiny random-weight BERT, tests/support/encoder_models.py)
served by a real server process through the `embeddings` extra, and asked by the official
clients: the OpenAI Python SDK (float and base64) and the `ollama` Python client (answers
validated against Ollama's OpenAPI description). The server's own surfaces (`/health`,
`/metrics`, `/v1/status`) read its engine, which has no KV; a chat request is a 400. Skipped
without the extra.
"""

from __future__ import annotations

import base64
from collections.abc import Iterator

import httpx
import numpy as np
import ollama
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("mlx_vlm.embedding_loader", reason="the embeddings extra (mlx-vlm)")

from tests.support.encoder_models import tiny_bert_dir  # noqa: E402
from tests.support.fuzz_embeddings import PATHS, embedding_body  # noqa: E402
from tests.support.ollama_spec import Recorded, Recorder, check  # noqa: E402
from tests.support.servers import ServerProcess  # noqa: E402

TEXTS = ["The sky is blue.", "def add(a, b): return a + b", "fox"]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("encoder")
    bert = tiny_bert_dir(root / "bert")
    proc = ServerProcess(root, "--model", f"bert={bert}")
    yield proc.wait_ready()
    proc.stop()


def test_the_official_clients_embed_with_an_encoder(served: ServerProcess) -> None:
    sdk = openai.OpenAI(base_url=served.base_url + "/v1", api_key="unused", max_retries=0)
    floats = sdk.embeddings.create(model="bert", input=TEXTS, encoding_format="float")
    packed = sdk.embeddings.create(model="bert", input=TEXTS, encoding_format="base64")
    want = [d.embedding for d in floats.data]
    assert [np.frombuffer(base64.b64decode(d.embedding), "<f4").tolist() for d in packed.data] == (
        want
    )
    assert all(len(v) == 32 and abs(float(np.linalg.norm(v)) - 1) < 1e-5 for v in want)
    assert floats.usage.prompt_tokens > 2 * len(TEXTS)  # [CLS] and [SEP] on each
    recorder = Recorder()
    client = ollama.Client(host=served.base_url, event_hooks=recorder.hooks())
    embedded = client.embed(model="bert", input=TEXTS)
    assert np.allclose(embedded.embeddings, want, atol=1e-6)
    assert client.show("bert").capabilities == ["embedding"]
    with pytest.raises(ollama.ResponseError) as chat:
        client.chat(model="bert", messages=[{"role": "user", "content": "Hi"}])
    assert chat.value.status_code == 400 and "embedding model" in chat.value.error
    assert recorder.check() == 3
    for path in ("/health", "/metrics", "/v1/status", "/api/ps"):
        assert httpx.get(served.base_url + path).status_code == 200, path
    status = httpx.get(served.base_url + "/v1/status").json()
    assert status["models"][0]["layers"] == "an encoder: no KV cache"


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_fuzzed_bodies_never_5xx(served: ServerProcess, data: st.DataObject) -> None:
    """Whatever the body, an encoder answers in the route's shape: never a 5xx."""
    path = data.draw(st.sampled_from(PATHS))
    body = data.draw(embedding_body(path, ["bert", "", "nope", 5]))
    headers = {"Content-Type": "application/json"}
    reply = httpx.post(served.base_url + path, content=body, headers=headers, timeout=120)
    assert reply.status_code < 500, (body, reply.status_code, reply.text[:300])
    if path.startswith("/api/"):
        media = reply.headers.get("content-type", "").split(";")[0]
        check(Recorded("POST", path, reply.status_code, media, reply.content))
