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


@settings(max_examples=CI_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    prompt=st.one_of(
        st.text(max_size=30),
        st.lists(st.text(max_size=12), max_size=4),
        st.lists(st.integers(-3, 50000), max_size=8),
        st.lists(st.lists(st.integers(-3, 50000), max_size=6), max_size=4),
    ),
    echo=st.booleans(),
    logprobs=st.one_of(st.none(), st.integers(-1, 21)),
    max_tokens=st.one_of(st.none(), st.integers(-1, 2)),
    stream=st.booleans(),
)
def test_echo_and_prompt_lists_are_served_or_refused(
    server, prompt, echo, logprobs, max_tokens, stream
):
    """lm-eval's fields in any combination: a 200 whose echoed logprobs line up with the
    prompt (the first token's null), or a 400 naming a field."""
    body = {"prompt": prompt, "echo": echo, "logprobs": logprobs, "stream": stream}
    body["max_tokens"] = 2 if max_tokens is None else max_tokens
    resp = httpx.post(server.base_url + "/v1/completions", json=body, timeout=60)
    assert resp.status_code in (200, 400), resp.text
    if resp.status_code == 400:
        assert resp.json()["error"]["param"].split("[")[0] in {
            "prompt",
            "logprobs",
            "max_tokens",
            "echo",
        }, resp.text
        return
    if stream:
        assert "data: [DONE]" in resp.text
        return
    for choice in resp.json()["choices"]:
        lp = choice["logprobs"]
        if echo and logprobs is not None:
            assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
            assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["text_offset"])
            assert all(len(top) <= logprobs for top in lp["top_logprobs"][1:])
