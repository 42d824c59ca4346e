"""Model names and paths: any name is served unless names are strict; /v1 is optional."""

from __future__ import annotations

import httpx
import openai

from tests.support.servers import client_for

MODEL = "SmolLM2-135M-Instruct"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def test_any_model_name_is_served_by_the_loaded_model(openai_client):
    for name in ("gpt-4o", "claude-sonnet-4", "my-local-default"):
        reply = openai_client.chat.completions.create(
            model=name, messages=QUESTION, temperature=0, max_tokens=2
        )
        assert reply.model == MODEL  # the response names what served it
    assert openai_client.models.retrieve("gpt-4o").id == "gpt-4o"


def test_paths_without_v1_prefix(server):
    chat = httpx.post(
        server.base_url + "/chat/completions",
        json={"messages": QUESTION, "max_tokens": 2},
        timeout=60,
    )
    assert chat.status_code == 200 and chat.json()["object"] == "chat.completion"
    text = httpx.post(
        server.base_url + "/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=60
    )
    assert text.status_code == 200 and text.json()["object"] == "text_completion"
    models = httpx.get(server.base_url + "/models", timeout=10).json()
    assert [m["id"] for m in models["data"]] == [MODEL]


def test_aliases_listed_and_strict_names_refuse_others(start_server):
    srv = start_server(
        "--served-model-name", "gpt-4o", "--served-model-name", "coder", "--strict-model-names"
    )
    client = client_for(srv)
    assert [m.id for m in client.models.list().data] == [MODEL, "gpt-4o", "coder"]
    reply = client.chat.completions.create(model="coder", messages=QUESTION, max_tokens=1)
    assert reply.model == MODEL
    try:
        client.chat.completions.create(model="gpt-5", messages=QUESTION, max_tokens=1)
    except openai.NotFoundError as exc:
        assert exc.body["code"] == "model_not_found" and exc.body["param"] == "model"
    else:
        raise AssertionError("an unknown model name was served under --strict-model-names")
    missing = httpx.get(srv.base_url + "/v1/models/gpt-5", timeout=10)
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == "model_not_found"
