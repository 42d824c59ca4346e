"""Embeddings through the official clients: the OpenAI Python SDK (both encodings), the OpenAI
Node SDK (whose default is base64), and the `ollama` Python client; Ollama's answers validated
against its OpenAPI description (tests/support/ollama_spec.py). Then fuzzed bodies (never a
5xx), embeddings beside a running generation (both complete, the generation's text unchanged)
and a client that leaves mid-request (its inputs not yet computed are dropped).

One server for the module, of two tiny random-weight llamas (the model does not matter here):
"gen", a generative model, and "embedder", whose sentence-transformers files say last-token
pooling, as Qwen3-Embedding's do.
"""

from __future__ import annotations

import base64
import json
import re
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import ollama
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.fuzz_embeddings import PATHS, embedding_body
from tests.support.node_scripts import run_node_script
from tests.support.ollama_spec import Recorded, Recorder, check
from tests.support.servers import ServerProcess
from tests.support.tiny_models import embedding_model_dir, make_model_dir

WIDTH = 64  # the tiny llamas' hidden size
TEXTS = ["Hello there", "The sky is blue because of Rayleigh scattering.", "short"]
NPM_OPENAI = "openai@4.104.0"


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("embeddings")
    gen = make_model_dir(root / "gen", "llama")
    embedder = embedding_model_dir(root / "embedder")
    proc = ServerProcess(
        root, "--model", f"gen={gen}", "--model", f"embedder={embedder}", "--max-loaded-models", "2"
    )
    yield proc.wait_ready()
    proc.stop()


@pytest.fixture
def sdk(served: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=served.base_url + "/v1", api_key="unused", max_retries=0)


def test_openai_sdk_float_and_base64_agree(sdk: openai.OpenAI) -> None:
    floats = sdk.embeddings.create(model="gen", input=TEXTS, encoding_format="float")
    packed = sdk.embeddings.create(model="gen", input=TEXTS, encoding_format="base64")
    # asked for by name, base64 comes back as the string; asked for by default (the SDK's
    # own choice), the SDK decodes it
    default = sdk.embeddings.create(model="gen", input=TEXTS)
    want = [d.embedding for d in floats.data]
    assert [
        np.frombuffer(base64.b64decode(d.embedding), "<f4").tolist() for d in packed.data
    ] == want
    assert [d.embedding for d in default.data] == want
    assert all(len(d.embedding) == WIDTH for d in floats.data)
    assert floats.usage.prompt_tokens == floats.usage.total_tokens > len(TEXTS)
    assert floats.model == "gen"
    cut = sdk.embeddings.create(model="embedder", input=TEXTS[1], dimensions=16)
    assert len(cut.data[0].embedding) == 16
    assert abs(float(np.linalg.norm(cut.data[0].embedding)) - 1) < 1e-5
    with pytest.raises(openai.BadRequestError) as wide:
        sdk.embeddings.create(model="gen", input="x", dimensions=WIDTH + 1)
    assert wide.value.body["param"] == "dimensions"
    with pytest.raises(openai.BadRequestError) as empty:
        sdk.embeddings.create(model="gen", input=[])
    assert empty.value.body["param"] == "input"


def test_openai_node_sdk_reads_every_dimension(served: ServerProcess, tmp_path: Path) -> None:
    """The Node SDK asks for base64 unless told otherwise, and decodes it as float32: a server
    that answered floats would leave it a quarter of the dimensions (LocalAI #9135)."""
    env = {
        "BASE": served.base_url + "/v1",
        "TEXTS": json.dumps(TEXTS),
    }
    out = run_node_script(NPM_OPENAI, "openai-js", NODE_SCRIPT, tmp_path, env)
    floats = httpx.post(
        served.base_url + "/v1/embeddings", json={"model": "gen", "input": TEXTS}, timeout=60
    ).json()
    assert out["base64"] is True  # the SDK's own request asked for it
    assert out["vectors"] == [d["embedding"] for d in floats["data"]]


NODE_SCRIPT = """
const OpenAI = require('openai');
const client = new OpenAI({ baseURL: process.env.BASE, apiKey: 'unused', maxRetries: 0 });
let asked = null;
const fetchAndLook = async (url, init) => {
  asked = JSON.parse(init.body).encoding_format === 'base64';
  return fetch(url, init);
};
(async () => {
  const seen = new OpenAI({ baseURL: process.env.BASE, apiKey: 'unused', fetch: fetchAndLook });
  const texts = JSON.parse(process.env.TEXTS);
  const reply = await seen.embeddings.create({ model: 'gen', input: texts });
  const vectors = reply.data.map((d) => Array.from(d.embedding));
  console.log(JSON.stringify({ base64: asked, vectors }));
})().catch((e) => { console.error(e); process.exit(1); });
"""


def test_ollama_client_embed_and_embeddings(served: ServerProcess) -> None:
    recorder = Recorder()
    client = ollama.Client(host=served.base_url, event_hooks=recorder.hooks())
    many = client.embed(model="gen", input=TEXTS)
    assert len(many.embeddings) == len(TEXTS) and all(len(e) == WIDTH for e in many.embeddings)
    assert all(abs(float(np.linalg.norm(e)) - 1) < 1e-5 for e in many.embeddings)
    assert many.prompt_eval_count > len(TEXTS) and many.total_duration > 0
    one = client.embed(model="gen", input=TEXTS[0], dimensions=8, keep_alive="10m")
    assert len(one.embeddings[0]) == 8
    legacy = client.embeddings(model="gen", prompt=TEXTS[0])
    assert len(legacy.embedding) == WIDTH
    unit = np.array(legacy.embedding) / np.linalg.norm(legacy.embedding)
    np.testing.assert_allclose(unit, many.embeddings[0], atol=1e-5)  # the same, not normalised
    assert client.show("embedder").capabilities == ["embedding"]
    assert "embedding" not in client.show("gen").capabilities
    with pytest.raises(ollama.ResponseError) as long:
        client.embed(model="gen", input="word " * 9000, truncate=False)
    assert long.value.status_code == 400 and "context" in long.value.error
    assert recorder.check() >= 5


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_fuzzed_bodies_never_5xx(served: ServerProcess, data: st.DataObject) -> None:
    path = data.draw(st.sampled_from(PATHS))
    body = data.draw(embedding_body(path, ["gen", "embedder", "", "nope", 5]))
    headers = {"Content-Type": "application/json"}
    reply = httpx.post(served.base_url + path, content=body, headers=headers, timeout=120)
    assert reply.status_code < 500, (body, reply.status_code, reply.text[:300])
    if path.startswith("/api/"):
        media = reply.headers.get("content-type", "").split(";")[0]
        check(Recorded("POST", path, reply.status_code, media, reply.content))
    elif reply.status_code >= 400:
        assert reply.json()["error"]["message"]


def _generate(served: ServerProcess) -> str:
    body = {
        "model": "gen",
        "prompt": "Once upon a time",
        "max_tokens": 48,
        "temperature": 1.0,
        "seed": 5,
        "ignore_eos": True,
    }
    reply = httpx.post(served.base_url + "/v1/completions", json=body, timeout=300)
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] == 48
    return reply.json()["choices"][0]["text"]


def test_embeddings_beside_a_generation(served: ServerProcess) -> None:
    """Both complete; the generation's tokens are those it has alone."""
    alone = _generate(served)
    answers: list[int] = []

    def embed_many() -> None:
        for i in range(6):
            inputs = [f"{t} {i} " * (1 + i) for t in TEXTS] * 8
            reply = httpx.post(
                served.base_url + "/v1/embeddings",
                json={"model": "gen", "input": inputs},
                timeout=300,
            )
            answers.append(reply.status_code)
            assert len(reply.json()["data"]) == len(inputs)

    embedding = threading.Thread(target=embed_many)
    embedding.start()
    beside = _generate(served)
    embedding.join()
    assert beside == alone
    assert answers == [200] * 6


def _inputs_counted(served: ServerProcess) -> dict[str, float]:
    text = httpx.get(served.base_url + "/metrics").text
    found = re.findall(r'mlx_kvserve_embedding_inputs_total\{outcome="(\w+)"\} ([0-9.e+]+)', text)
    return {outcome: float(value) for outcome, value in found}


def test_a_client_that_leaves_drops_its_inputs(served: ServerProcess) -> None:
    """2,048 inputs of 400 tokens, and the client hangs up once it has sent them: the inputs
    not yet computed are dropped (counted), and the server goes on serving."""
    before = _inputs_counted(served)
    rows = [[(7 * i + j) % 5000 + 10 for j in range(400)] for i in range(2048)]
    payload = json.dumps({"model": "gen", "input": rows}).encode()
    head = (
        f"POST /v1/embeddings HTTP/1.1\r\nHost: 127.0.0.1:{served.port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", served.port)) as sock:
        sock.sendall(head + payload)
        time.sleep(1.0)  # the server reads the body and starts (no assertion rests on it)
    deadline = time.monotonic() + 120
    counted = before
    while time.monotonic() < deadline:
        counted = _inputs_counted(served)
        moved = sum(counted.values()) - sum(before.values())
        if moved >= len(rows):
            break
        time.sleep(0.2)
    dropped = counted.get("dropped", 0) - before.get("dropped", 0)
    embedded = counted.get("embedded", 0) - before.get("embedded", 0)
    assert dropped + embedded == len(rows)
    assert dropped > 0
    after = httpx.post(served.base_url + "/v1/embeddings", json={"input": "hi"}, timeout=60)
    assert after.status_code == 200
