"""Speculation seen from outside: `/metrics`' drafted, accepted and pass counters by source, and
the status page's acceptance rate and tokens per pass (`/v1/status`), after requests that
speculated, read back equal to what the engine counted for them.

In-process, on the real app and engine (`--speculation auto`) with the agent-CLI tiny model.
A text completion of token ids that repeat: the random model's greedy answer loops too, so
prompt lookup drafts and verification keeps some. Measured verify cost is left out (a loaded
machine may make drafting not pay): the controller drafts on its cost prior.
"""

from __future__ import annotations

import re

import pytest
from starlette.testclient import TestClient

from mlx_kvserve.config.settings import Settings
from mlx_kvserve.engine import Engine
from mlx_kvserve.engine.live import Timings
from mlx_kvserve.engine.speculation.depth import VerifyCost
from tests.support.agent_clis import agent_model_dir

LOCAL = "http://localhost"  # the Host guard answers only to names of this server
LOOP = [1000, 2000, 3000, 4000, 5000, 6000] * 6
COUNTERS = ("drafted_tokens", "accepted_tokens", "passes")
SOURCES = ("prompt_lookup", "prompt_cache")  # the row's own tokens; finished requests'


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory):
    return agent_model_dir(tmp_path_factory.mktemp("spec-metrics") / "m")


def serve(model_dir, speculation: str) -> TestClient:
    from mlx_lm import load

    from mlx_kvserve.api.app import create_app
    from mlx_kvserve.models.pool import ModelPool

    engine = Engine(lambda: load(str(model_dir)), cache_enabled=False, speculation=speculation)
    settings = Settings(speculation=speculation)
    return TestClient(create_app(settings, ModelPool.single(engine, "tiny")), base_url=LOCAL)


@pytest.fixture
def prior_cost(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(VerifyCost, "observe", lambda self, batch, width, seconds: None)


def counters(client: TestClient, source: str | None = None) -> dict[str, float]:
    """The counters of one draft source, or summed over both."""
    text = client.get("/metrics").text
    out = dict.fromkeys(COUNTERS, 0.0)
    for name in COUNTERS:
        for each in SOURCES if source is None else (source,):
            pattern = rf'^mlx_kvserve_speculation_{name}_total\{{source="{each}"\}} (\S+)$'
            (value,) = re.findall(pattern, text, re.M)
            out[name] += float(value)
    return out


def complete(client: TestClient, **extra: object) -> dict:
    body = {"model": "tiny", "prompt": LOOP, "max_tokens": 48, "temperature": 0}
    reply = client.post("/v1/completions", json=body | {"ignore_eos": True} | extra)
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_metrics_and_status_count_what_speculation_did(model_dir, prior_cost) -> None:
    seen: list[Timings] = []
    with serve(model_dir, "auto") as client:
        assert counters(client) == dict.fromkeys(COUNTERS, 0.0)  # the series exist at 0
        status = client.get("/v1/status").json()["speculation"]
        assert status == {"acceptance_rate": None, "tokens_per_pass": None, "by_source": {}}
        engine = client.app.state.pool.default.engine
        engine.add_observer(lambda req, timings: seen.append(timings))
        answers = [complete(client)["choices"][0]["text"] for _ in range(2)]
        complete(client, speculative=False)  # opted out: counts nothing
        got = counters(client)
        by_source = {source: counters(client, source) for source in SOURCES}
        status = client.get("/v1/status").json()
    assert answers[0] == answers[1]
    drafted = sum(t.drafted for t in seen)
    accepted = sum(t.accepted for t in seen)
    passes = sum(t.verify_passes for t in seen)
    assert seen[-1].drafted == 0 and seen[0].drafted > 0
    assert got == {"drafted_tokens": drafted, "accepted_tokens": accepted, "passes": passes}
    for source in SOURCES:  # the second request drafts the first one's answer too
        counts = [t.by_source.get(source, [0, 0, 0]) for t in seen]
        assert list(by_source[source].values()) == [sum(c[i] for c in counts) for i in range(3)]
        assert by_source[source]["accepted_tokens"] > 0
        shown = status["speculation"]["by_source"][source]  # the status page, by source too
        assert [shown["drafted"], shown["accepted"], shown["passes"]] == list(
            by_source[source].values()
        )
    assert drafted >= accepted > 0 and passes > 0
    assert status["totals"]["drafted_tokens"] == drafted
    assert status["totals"]["accepted_tokens"] == accepted
    assert status["speculation"]["acceptance_rate"] == pytest.approx(accepted / drafted)
    assert status["speculation"]["tokens_per_pass"] == pytest.approx((accepted + passes) / passes)
    assert status["speculation"]["tokens_per_pass"] > 1  # each pass gave more than one token


def test_without_speculation_the_counters_stay_at_zero(model_dir, prior_cost) -> None:
    with serve(model_dir, "off") as client:
        complete(client)
        assert counters(client) == dict.fromkeys(COUNTERS, 0.0)
        assert client.get("/v1/status").json()["speculation"]["tokens_per_pass"] is None
