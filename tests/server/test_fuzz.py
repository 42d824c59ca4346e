"""Property-based fuzzing of every endpoint: no client input produces a 5xx, a traceback or a hang.

CI runs a few dozen examples against the shared server; `scripts/fuzz_server.py` runs thousands.
"""

from __future__ import annotations

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.fuzzing import Probe, anthropic_probes, check, json_body, probes, send

CI_EXAMPLES = 60


@settings(
    max_examples=CI_EXAMPLES,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(probe=probes())
def test_no_input_produces_a_server_error(server, probe: Probe) -> None:
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        status, body, streamed = send(client, probe)
        problem = check(status, body, streamed, probe.path)
        assert problem is None, (probe, problem)
        # The connection stays usable after whatever that was (no reset keep-alive).
        assert client.get("/health").status_code == 200


@settings(
    max_examples=CI_EXAMPLES,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(probe=anthropic_probes())
def test_claude_code_shapes_never_produce_a_server_error(server, probe: Probe) -> None:
    """Mostly valid Messages bodies (system messages in place, thinking blocks and signatures,
    thinking / effort / context edits, typed tools) with hostile values in them."""
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        status, body, streamed = send(client, probe)
        assert check(status, body, streamed, probe.path) is None, (probe, body[:300])


@settings(
    max_examples=CI_EXAMPLES,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(body=json_body("/v1/responses"))
def test_codex_shaped_responses_never_produce_a_server_error(server, body: bytes) -> None:
    """The Responses shapes Codex sends (namespace, custom tools and their grammars, built-in
    tools, reasoning items, include) mutated: a 200 or a 400 in the OpenAI error shape."""
    probe = Probe("POST", "/v1/responses", body)
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        status, reply, streamed = send(client, probe)
        problem = check(status, reply, streamed, probe.path)
        assert problem is None, (probe, problem)


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    st.one_of(
        st.lists(st.integers(-5, 60000), max_size=12),
        st.lists(st.lists(st.integers(-5, 50000), max_size=6), max_size=2),
    )
)
def test_token_id_prompts_are_served_or_refused(server, ids):
    """Any token-id prompt is an answer or a 400 naming `prompt`, never a 5xx."""
    resp = httpx.post(
        server.base_url + "/v1/completions", json={"prompt": ids, "max_tokens": 1}, timeout=60
    )
    assert resp.status_code in (200, 400), resp.text
    if resp.status_code == 400:
        assert resp.json()["error"]["param"].startswith("prompt")
