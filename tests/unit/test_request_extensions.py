"""The `seed` and `ignore_eos` request extensions on every generation route, and `--seed`.

In-process, on the real app and engine with a tiny random model whose end-of-turn token is
likely (the agent-CLI model: answers of a few tokens at temperature 1). `ignore_eos` makes an
answer exactly `max_tokens` long in all four protocols; a seed, in the body or from the server's
`--seed`, makes a sampled answer the same every time; a wrong value for either is a 400 naming it.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from mlx_kvserve.config.precedence import load_settings
from mlx_kvserve.config.settings import Settings
from mlx_kvserve.config.values import check_value
from mlx_kvserve.engine import Engine
from tests.support.agent_clis import agent_model_dir

LOCAL = "http://localhost"  # the Host guard answers only to names of this server
HI = [{"role": "user", "content": "Hi"}]
LENGTH = 24
CHAT_PROMPT: list[str] = []  # HI as the model's template writes it, for /v1/completions


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return agent_model_dir(tmp_path_factory.mktemp("extensions") / "m")


def serve(model_dir: Path, settings: Settings) -> TestClient:
    from mlx_lm import load

    from mlx_kvserve.api.app import create_app
    from mlx_kvserve.models.pool import ModelPool

    engine = Engine(lambda: load(str(model_dir)), cache_enabled=False)
    return TestClient(create_app(settings, ModelPool.single(engine, "tiny")), base_url=LOCAL)


@pytest.fixture(scope="module")
def client(model_dir: Path) -> Iterator[TestClient]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    CHAT_PROMPT[:] = [tokenizer.apply_chat_template(HI, tokenize=False, add_generation_prompt=True)]
    with serve(model_dir, Settings()) as client:
        yield client


def ask(client: TestClient, route: str, **extra) -> tuple[int, dict]:
    """One request on `route` at temperature 1 with `extra` fields; (status, body)."""
    body: dict = {"model": "tiny", "max_tokens": LENGTH, "temperature": 1.0, **extra}
    if route == "/v1/completions":  # the chat prompt as text: the model's turn comes next
        body["prompt"] = CHAT_PROMPT[0]
    elif route == "/v1/responses":
        body["input"] = "Hi"
        body["max_output_tokens"] = body.pop("max_tokens")
    else:
        body["messages"] = HI
    reply = client.post(route, json=body)
    return reply.status_code, reply.json()


def outcome(route: str, body: dict) -> tuple[str, int, str]:
    """(how it ended, output tokens, text) in each protocol's words, "length" for the limit."""
    if route == "/v1/messages":
        text = "".join(b.get("text", "") for b in body["content"])
        finish = "length" if body["stop_reason"] == "max_tokens" else body["stop_reason"]
        return finish, body["usage"]["output_tokens"], text
    if route == "/v1/responses":
        details = body.get("incomplete_details") or {}
        finish = "length" if details.get("reason") == "max_output_tokens" else body["status"]
        text = "".join(
            part["text"]
            for item in body["output"]
            if item["type"] == "message"
            for part in item["content"]
        )
        return finish, body["usage"]["output_tokens"], text
    choice = body["choices"][0]
    text = choice["text"] if route == "/v1/completions" else choice["message"]["content"] or ""
    return choice["finish_reason"], body["usage"]["completion_tokens"], text


ROUTES = ["/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses"]


@pytest.mark.parametrize("route", ROUTES)
def test_ignore_eos_makes_every_answer_max_tokens_long(client: TestClient, route: str) -> None:
    lengths = []
    for seed in range(4):
        status, body = ask(client, route, seed=seed)
        assert status == 200, body
        finish, tokens, _ = outcome(route, body)
        lengths.append(tokens)
        status, body = ask(client, route, seed=seed, ignore_eos=True)
        assert status == 200, body
        assert outcome(route, body)[:2] == ("length", LENGTH), body
    assert min(lengths) < LENGTH, lengths  # without it, this model ends early


@pytest.mark.parametrize("route", ROUTES)
def test_a_seed_gives_the_same_sample(client: TestClient, route: str) -> None:
    texts = [outcome(route, ask(client, route, seed=s, ignore_eos=True)[1])[2] for s in (1, 1, 2)]
    assert texts[0] == texts[1] and texts[0] != texts[2], texts


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize(
    ("field", "value"), [("ignore_eos", "yes"), ("ignore_eos", 1), ("seed", -1), ("seed", 1.5)]
)
def test_a_wrong_extension_value_is_a_400_naming_it(
    client: TestClient, route: str, field: str, value: object
) -> None:
    status, body = ask(client, route, **{"seed": 0, field: value})
    assert status == 400, body
    error = body["error"]
    assert field in error["message"], error
    if "param" in error:
        assert error["param"] == field


def test_the_server_seed_is_the_default_and_a_request_seed_wins(model_dir: Path) -> None:
    with serve(model_dir, Settings(seed=7)) as client:
        route = "/v1/chat/completions"
        unseeded = [outcome(route, ask(client, route, ignore_eos=True)[1])[2] for _ in range(2)]
        seven = outcome(route, ask(client, route, ignore_eos=True, seed=7)[1])[2]
        eight = outcome(route, ask(client, route, ignore_eos=True, seed=8)[1])[2]
    assert unseeded[0] == unseeded[1] == seven != eight


def test_the_server_seed_setting(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    assert Settings().seed == -1  # none: unseeded requests are random
    monkeypatch.setenv("MLX_KVSERVE_SEED", "5")
    assert load_settings({}, tmp_path / "none.toml").seed == 5
    assert check_value("seed", 2**64 - 1) == 2**64 - 1
    for wrong in (-2, 2**64):
        with pytest.raises(ValueError, match="not a seed"):
            check_value("seed", wrong)
