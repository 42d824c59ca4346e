"""Ollama's `/api/pull` through the official `ollama` client, against a server started with
`--allow-pull` whose Hub is a directory of `org/name` repos (models/pull.py's seam,
`MLX_KVSERVE_PULL_FROM`: nothing reaches the network). A pulled model is fetched file by file
with Ollama's progress lines, checked against its digests, listed by `/api/tags` and served.
Every answer is validated against Ollama's OpenAPI description.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import ollama
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from starlette.testclient import TestClient

from tests.support.fuzz_values import anything, text
from tests.support.ollama_spec import Recorded, Recorder, check
from tests.support.servers import ServerProcess
from tests.support.tiny_models import make_model_dir

SERVED = "tiny"
GREEDY = {"temperature": 0, "num_predict": 3}


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("hub")
    make_model_dir(root / "acme" / "tiny-coder", "llama", seed=5)
    make_model_dir(root / "acme" / "tiny-chat", "llama", seed=6)
    make_model_dir(root / "acme" / "tiny-left", "llama", seed=7)
    (root / "acme" / "no-weights").mkdir()
    (root / "acme" / "no-weights" / "config.json").write_text("{}")
    return root


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, hub: Path) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("pull")
    model = make_model_dir(root / SERVED, "llama")
    env = {"MLX_KVSERVE_PULL_FROM": str(hub), "MLX_KVSERVE_DATA_DIR": str(root / "data")}
    proc = ServerProcess(root, "--model", str(model), "--allow-pull", env=env)
    yield proc.wait_ready()
    proc.stop()


@pytest.fixture
def client(served: ServerProcess) -> Iterator[ollama.Client]:
    recorder = Recorder()
    yield ollama.Client(host=served.base_url, event_hooks=recorder.hooks())
    assert recorder.check() > 0


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_pull_fetches_checks_lists_and_serves(client: ollama.Client, hub: Path) -> None:
    repo = hub / "acme" / "tiny-coder"
    statuses = list(client.pull("hf.co/acme/tiny-coder", stream=True))
    said = [s.status for s in statuses]
    assert said[0] == "pulling manifest"
    assert said[-3:] == ["verifying sha256 digest", "writing manifest", "success"]
    pulled = {s.digest: s for s in statuses if s.digest}
    files = [p for p in repo.iterdir() if p.is_file()]
    assert set(pulled) == {f"sha256:{sha256(p)}" for p in files}  # every file, its digest
    weights = repo / "model.safetensors"
    digest = sha256(weights)
    lines = [s for s in statuses if s.digest == f"sha256:{digest}"]
    assert [(s.status, s.total, s.completed) for s in lines] == [
        (f"pulling {digest[:12]}", weights.stat().st_size, 0),
        (f"pulling {digest[:12]}", weights.stat().st_size, weights.stat().st_size),
    ]
    listed = [m.model for m in client.list().models]
    assert listed[0] == SERVED and "acme/tiny-coder" in listed
    answer = client.chat(
        model="hf.co/acme/tiny-coder",  # the name it was pulled by
        messages=[{"role": "user", "content": "Hi"}],
        options=GREEDY,
    )
    assert answer.eval_count == 3 and answer.done_reason == "length"
    assert client.show("acme/tiny-coder").capabilities[0] == "completion"
    again = list(client.pull("acme/tiny-coder", stream=True))  # served: nothing to fetch
    assert [s.status for s in again] == ["pulling manifest", "success"]


def test_pull_without_streaming_and_what_it_refuses(client: ollama.Client) -> None:
    assert client.pull("acme/tiny-chat", stream=False).status == "success"
    assert "acme/tiny-chat" in [m.model for m in client.list().models]
    for name, status, words in (
        ("acme/missing", 404, "no model"),
        ("acme/no-weights", 400, "no MLX weights"),
        ("llama3.2:1b", 404, "not found"),  # an Ollama library name: not a Hugging Face repo
    ):
        with pytest.raises(ollama.ResponseError) as refused:
            client.pull(name)
        assert refused.value.status_code == status and words in refused.value.error


def test_a_client_that_leaves_mid_pull_leaves_the_server_whole(
    served: ServerProcess, client: ollama.Client
) -> None:
    """A client gone after the first progress line: the pull stops there; pulled again, the
    model is fetched and served once."""
    body = {"model": "acme/tiny-left"}
    with httpx.stream("POST", served.base_url + "/api/pull", json=body, timeout=60) as reply:
        first = next(reply.iter_lines())
    assert json.loads(first) == {"status": "pulling manifest"}
    assert client.pull("acme/tiny-left").status == "success"
    listed = [m.model for m in client.list().models]
    assert listed.count("acme/tiny-left") == 1


def test_pull_is_refused_unless_the_server_allows_it(tmp_path: Path, hub: Path) -> None:
    """Secure by default: without --allow-pull a 403 naming the flag (in process)."""
    from mlx_lm import load

    from mlx_kvserve.api.app import create_app
    from mlx_kvserve.config.settings import Settings
    from mlx_kvserve.engine import Engine
    from mlx_kvserve.models.pool import ModelPool

    model = make_model_dir(tmp_path / SERVED, "llama")
    pool = ModelPool.single(Engine(lambda: load(str(model)), cache_enabled=False), SERVED)
    with TestClient(create_app(Settings(), pool), base_url="http://localhost") as http:
        reply = http.post("/api/pull", json={"model": "acme/tiny-chat"})
        assert reply.status_code == 403 and "--allow-pull" in reply.json()["error"]
        assert list(reply.json()) == ["error"]
        whole = http.post("/api/pull", json={"model": SERVED, "stream": False})
        assert whole.json() == {"status": "success"}


name_part = st.from_regex(r"[A-Za-z0-9][\w.-]{0,8}", fullmatch=True)
names = st.one_of(
    st.builds("{}/{}".format, name_part, name_part),
    st.builds("hf.co/{}/{}:latest".format, name_part, name_part),
    st.sampled_from(["acme/no-weights", "acme/../acme/tiny-chat", "a/b/c", "hf.co/", SERVED]),
    text,
    anything,
)


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    model=names, stream=st.one_of(st.booleans(), anything), key=st.sampled_from(["model", "name"])
)
def test_fuzzed_pulls_never_5xx(served: ServerProcess, model, stream, key: str) -> None:
    """Whatever the name, an answer in Ollama's shape (a 4xx `{"error"}` or valid lines)."""
    body = json.dumps({key: model, "stream": stream}, ensure_ascii=True)  # lone surrogates too
    headers = {"Content-Type": "application/json"}
    reply = httpx.post(served.base_url + "/api/pull", content=body, headers=headers, timeout=120)
    assert reply.status_code < 500, (model, reply.status_code, reply.text[:300])
    media = reply.headers.get("content-type", "").split(";")[0]
    check(Recorded("POST", "/api/pull", reply.status_code, media, reply.content))
