"""Speculation on gpt-oss rows: Harmony's analysis gate around the format's real grammar.

In-process, on the real app and engine with the tiny gpt-oss model (tests/support/
harmony_model.py: gpt-oss's control tokens and chat template). The server's thinking budget
ends the analysis with a forced `<|end|>`; the format's grammar then writes the call's header
(`<|start|>assistant<|channel|>commentary to=functions.NAME ...`). The conversation holds an
earlier turn of such calls, so prompt lookup drafts the header and the call from it, through
the gate and the grammar, where the model then rejects some of it. A draft is walked through a
copy of the gate (`HarmonyGate.fork`), so the row's own grammar only ever takes the tokens the
row emits (a walk on the row's own gate fails this test with a 500, as a rollback through
it failed a server: llguidance refused the header after `<|end|><|start|>`). The answers
equal `--speculation off`'s, and drafts were walked and kept. The verify cost is left out
(the controller drafts on its cost prior).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from starlette.testclient import TestClient

from mlx_kvserve.config.settings import Settings
from mlx_kvserve.engine import Engine
from mlx_kvserve.engine.live import Timings
from mlx_kvserve.engine.speculation.depth import VerifyCost
from tests.support.harmony_model import build_harmony_model

LOCAL = "http://localhost"
BUDGET = 8
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 16}, "days": {"type": "integer"}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
PING = {"type": "object", "properties": {"host": {"type": "string"}}, "required": ["host"]}
TOOLS = [
    {"type": "function", "function": {"name": name, "parameters": schema}}
    for name, schema in (("get_weather", WEATHER), ("ping", PING))
]
ASK = {"role": "user", "content": "What's the weather in Paris?"}
CALL = {"name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'}
EARLIER = [  # an earlier turn of the same call: lookup drafts the header and call from it
    ASK,
    {
        "role": "assistant",
        "reasoning_content": "The user asks for the weather.",
        "tool_calls": [{"id": "c1", "type": "function", "function": CALL}],
    },
    {"role": "tool", "tool_call_id": "c1", "content": "Sunny."},
    {"role": "assistant", "content": "It is sunny."},
    ASK,
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_harmony_model(tmp_path_factory.mktemp("harmony-spec") / "gpt-oss", seed=0)


@pytest.fixture
def prior_cost(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(VerifyCost, "observe", lambda self, batch, width, seconds: None)


def answers(model_dir: Path, speculation: str, bodies: list[dict]) -> tuple[list, list[Timings]]:
    """Each body's reply (reasoning, content, calls without their ids, finish) from an app
    with `speculation`, and the requests' timings (what each drafted and kept)."""
    from mlx_lm import load

    from mlx_kvserve.api.app import create_app
    from mlx_kvserve.models.pool import ModelPool

    engine = Engine(lambda: load(str(model_dir)), cache_enabled=False, speculation=speculation)
    settings = Settings(speculation=speculation, thinking_budget=BUDGET)
    seen: list[Timings] = []
    out = []
    app = create_app(settings, ModelPool.single(engine, "m"))
    with TestClient(app, base_url=LOCAL) as client:
        engine.add_observer(lambda req, timings: seen.append(timings))
        for body in bodies:
            reply = client.post("/v1/chat/completions", json={"model": "m", **body})
            assert reply.status_code == 200, reply.text
            choice = reply.json()["choices"][0]
            message = choice["message"]
            calls = [
                (c["function"]["name"], c["function"]["arguments"])
                for c in message.get("tool_calls") or []
            ]
            reasoning = message.get("reasoning_content")
            out.append((reasoning, message.get("content"), calls, choice["finish_reason"]))
    return out, seen


def test_harmony_rows_speculate_through_the_header_and_answer_the_same(
    model_dir, prior_cost
) -> None:
    """Greedy: seeded draws at temperature 1 on this random model's nearly uniform
    distributions flip between adjacent ids where a verify pass rounds otherwise
    (docs/speculation.md, "Exact, up to float rounding"); the unit tests of the step check
    seeded rows on a model where no draw is that close."""
    bodies = [
        {
            "messages": messages,
            "tools": TOOLS,
            "tool_choice": choice,
            "temperature": 0.0,
            "seed": seed,
            "max_tokens": 80,
        }
        for messages in (EARLIER, EARLIER[:3])
        for choice in ("required", "auto")
        for seed in (0, 1)
    ]
    plain, _ = answers(model_dir, "off", bodies)
    spec, seen = answers(model_dir, "auto", bodies)
    assert spec == plain
    assert any(calls for _, _, calls, _ in spec)
    assert sum(t.drafted for t in seen) > 0 and sum(t.accepted for t in seen) > 0
