"""The per-request opt-out of speculative decoding on every generation route.

`speculative: false` on the OpenAI chat and text, Anthropic and Responses bodies, and Ollama's
`options.draft_num_predict: 0`, reach the engine as `SamplingParams.speculative` False (the
engine's side, that such a row drafts nothing, is in test_speculation_step.py). A wrong type is
a 400 naming the field in each protocol's error shape; any JSON value there is fuzzed.
In-process, on the real app and engine (`--speculation auto`) with the agent-CLI tiny model.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from starlette.testclient import TestClient

from mlx_kvserve.config.settings import Settings
from mlx_kvserve.engine import Engine
from mlx_kvserve.engine.requests import SamplingParams
from tests.support.agent_clis import agent_model_dir
from tests.support.fuzz_values import anything

LOCAL = "http://localhost"  # the Host guard answers only to names of this server
ROUTES = ["/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses"]
OLLAMA = ["/api/chat", "/api/generate"]
SEEN: list[SamplingParams] = []  # what the engine was handed, request by request


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    from mlx_lm import load

    from mlx_kvserve.api.app import create_app
    from mlx_kvserve.models.pool import ModelPool

    model_dir = agent_model_dir(tmp_path_factory.mktemp("optout") / "m")
    engine = Engine(lambda: load(str(model_dir)), cache_enabled=False, speculation="auto")
    submit = engine.submit

    def seen(req):  # the engine's own intake, noting what each request asked
        SEEN.append(req.params)
        submit(req)

    engine.submit = seen  # type: ignore[method-assign]
    app = create_app(Settings(speculation="auto"), ModelPool.single(engine, "tiny"))
    with TestClient(app, base_url=LOCAL) as client:
        yield client


def body(route: str, **extra: object) -> dict:
    """A two-token greedy request on `route` with `extra` fields."""
    out: dict = {"model": "tiny", "temperature": 0, "max_tokens": 2, **extra}
    if route == "/v1/completions":
        out["prompt"] = "Hi"
    elif route == "/v1/responses":
        out["input"] = "Hi"
        out["max_output_tokens"] = out.pop("max_tokens")
    elif route in OLLAMA:
        del out["temperature"], out["max_tokens"]
        out["stream"] = False
        options = {"temperature": 0, "num_predict": 2, **out.pop("options", {})}
        out["options"] = options
        out["prompt" if route == "/api/generate" else "messages"] = (
            "Hi" if route == "/api/generate" else [{"role": "user", "content": "Hi"}]
        )
    else:
        out["messages"] = [{"role": "user", "content": "Hi"}]
    return out


def asked(client: TestClient, route: str, **extra: object) -> tuple[int, dict, bool | None]:
    """(status, body, the `speculative` the engine got, None if nothing reached it)."""
    SEEN.clear()
    data = json.dumps(body(route, **extra))  # escaped: a fuzzed lone surrogate travels too
    reply = client.post(route, content=data, headers={"content-type": "application/json"})
    return reply.status_code, reply.json(), SEEN[-1].speculative if SEEN else None


@pytest.mark.parametrize("route", ROUTES)
def test_speculative_false_reaches_the_engine(client: TestClient, route: str) -> None:
    assert asked(client, route)[::2] == (200, True)  # absent: speculation as the server says
    assert asked(client, route, speculative=True)[::2] == (200, True)
    assert asked(client, route, speculative=False)[::2] == (200, False)


@pytest.mark.parametrize("route", OLLAMA)
def test_ollamas_draft_num_predict_zero_opts_out(client: TestClient, route: str) -> None:
    assert asked(client, route)[::2] == (200, True)
    assert asked(client, route, options={"draft_num_predict": 4})[::2] == (200, True)
    assert asked(client, route, options={"draft_num_predict": 0})[::2] == (200, False)
    status, error, seen = asked(client, route, options={"draft_num_predict": "none"})
    assert (status, seen) == (400, None)
    assert "draft_num_predict" in error["error"]  # Ollama's shape: {"error": "..."}


def wrong(route: str, status: int, reply: dict) -> None:
    """A 400 naming `speculative` in the route's own error shape."""
    assert status == 400, reply
    if route == "/v1/messages":
        assert reply["type"] == "error"
        assert reply["error"]["type"] == "invalid_request_error"
    message = reply["error"]["message"]
    assert "speculative" in message, message
    if "param" in reply["error"]:
        assert reply["error"]["param"].split(".")[0] == "speculative"  # or a path inside it


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("value", ["false", 0, 1, None, [], {"enabled": False}])
def test_a_wrong_type_is_a_400_naming_the_field(
    client: TestClient, route: str, value: object
) -> None:
    status, reply, seen = asked(client, route, speculative=value)
    wrong(route, status, reply)
    assert seen is None


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(route=st.sampled_from(ROUTES), value=st.one_of(st.booleans(), anything))
def test_fuzz_the_field(client: TestClient, route: str, value: object) -> None:
    """Any JSON value: a bool is served and reaches the engine as given, anything else is the
    400 naming the field; never a 5xx."""
    status, reply, seen = asked(client, route, speculative=value)
    if isinstance(value, bool):
        assert (status, seen) == (200, value), reply
    else:
        wrong(route, status, reply)
