"""/health is 503 while the model loads (and after a failed load), then 200.

The model load is gated by an event so the loading window can be observed deterministically;
the app, engine and model are the real ones, driven in-process through Starlette's TestClient.
"""

from __future__ import annotations

import threading
import time

from starlette.testclient import TestClient

from mlx_kvserve import paths
from mlx_kvserve.api.app import create_app
from mlx_kvserve.config.settings import Settings
from mlx_kvserve.engine import Engine
from mlx_kvserve.models import ensure_default_model
from mlx_kvserve.models.pool import ModelPool

MODEL_ID = "SmolLM2-135M-Instruct"
CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "temperature": 0}

LOCAL = "http://localhost"  # the Host guard answers only to names of this server


def test_health_and_requests_wait_for_the_model():
    from mlx_lm import load

    model_dir = ensure_default_model(paths.data_dir(), progress=False)
    gate = threading.Event()

    def gated_load():
        gate.wait(60)
        return load(str(model_dir))

    engine = Engine(gated_load)
    with TestClient(
        create_app(Settings(), ModelPool.single(engine, MODEL_ID)), base_url=LOCAL
    ) as client:
        loading = client.get("/health")
        assert loading.status_code == 503
        assert loading.json()["status"] == "loading"
        assert loading.headers["Retry-After"].isdigit()
        # a request meanwhile waits for the model (as for any model loading on first use)
        waiting: list = []
        asking = threading.Thread(
            target=lambda: waiting.append(client.post("/v1/chat/completions", json=CHAT))
        )
        asking.start()
        time.sleep(0.5)
        assert not waiting and client.get("/health").status_code == 503
        gate.set()
        asking.join(120)
        assert waiting and waiting[0].status_code == 200, waiting
        for _ in range(600):
            if client.get("/health").status_code == 200:
                break
            time.sleep(0.05)
        ready = client.get("/health").json()
        assert ready["status"] == "ok" and ready["model"] == MODEL_ID
        assert client.post("/v1/chat/completions", json=CHAT).status_code == 200


def test_failed_model_load_is_reported_not_hidden():
    def broken_load():
        raise FileNotFoundError("config.json not found in the model directory")

    engine = Engine(broken_load)
    with TestClient(
        create_app(Settings(), ModelPool.single(engine, MODEL_ID)), base_url=LOCAL
    ) as client:
        for _ in range(200):
            if engine.load_error:
                break
            time.sleep(0.05)
        health = client.get("/health")
        assert health.status_code == 503
        assert health.json()["status"] == "error"
        assert "config.json" in health.json()["error"]
        resp = client.post("/v1/chat/completions", json=CHAT)
        assert resp.status_code == 503
        assert "config.json" in resp.json()["error"]["message"]
