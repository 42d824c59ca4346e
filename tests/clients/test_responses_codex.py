"""/v1/responses as Codex speaks it, against the real server, with the official SDK and httpx:
namespace tools, custom (freeform) tools constrained by their own Lark grammar, built-in tools
skipped, reasoning/include/prompt_cache_key/client_metadata/store false, developer items."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest
from openai.types.responses import ResponseStreamEvent
from pydantic import TypeAdapter

from tests.support.concurrently import concurrently

MODEL = "gpt-5.1-codex"
PATCH_GRAMMAR = (
    Path(__file__).parents[1] / "fixtures" / "codex" / "tool_apply_patch.lark"
).read_text()
APPLY_PATCH = {
    "type": "custom",
    "name": "apply_patch",
    "description": "Use the `apply_patch` tool to edit files. This is a FREEFORM tool.",
    "format": {"type": "grammar", "syntax": "lark", "definition": PATCH_GRAMMAR},
}
SHELL = {
    "type": "function",
    "name": "shell",
    "description": "Runs a shell command.",
    "strict": False,
    "parameters": {
        "type": "object",
        "properties": {"command": {"type": "array", "items": {"type": "string"}, "maxItems": 3}},
        "required": ["command"],
        "additionalProperties": False,
    },
}
AGENTS = {
    "type": "namespace",
    "name": "mcp__agents__",
    "description": "Sub-agents.",
    "tools": [
        {
            "type": "function",
            "name": "spawn_agent",
            "description": "Start a sub-agent on a task.",
            "strict": False,
            "parameters": {
                "type": "object",
                "properties": {"task": {"type": "string", "maxLength": 40}},
                "required": ["task"],
                "additionalProperties": False,
            },
        }
    ],
}
CODEX_TOOLS = [SHELL, AGENTS, {"type": "web_search"}, APPLY_PATCH]
DEVELOPER = {
    "type": "message",
    "role": "developer",
    "content": [{"type": "input_text", "text": "You are a coding agent. Be brief."}],
}


def user(text: str) -> dict:
    return {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}


def codex_body(**extra) -> dict:
    """The keys Codex 0.169 sends (DESIGN.md), on a small prompt."""
    return {
        "model": MODEL,
        "instructions": "You are Codex.",
        "input": [DEVELOPER, user("Create hello.txt saying hi.")],
        "tools": CODEX_TOOLS,
        "tool_choice": "auto",
        "parallel_tool_calls": False,
        "reasoning": {"effort": "medium", "summary": "auto"},
        "store": False,
        "stream": True,
        "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": "0198-session-id",
        "client_metadata": {"originator": "codex_exec"},
        "max_output_tokens": 48,
        "temperature": 0,
        **extra,
    }


def sse_events(text: str) -> list[dict]:
    return [
        json.loads(line[len("data: ") :]) for line in text.splitlines() if line.startswith("data: ")
    ]


def test_codex_shaped_stream_is_valid_per_the_sdk(server):
    resp = httpx.post(server.base_url + "/v1/responses", json=codex_body(), timeout=300)
    assert resp.status_code == 200, resp.text
    events = sse_events(resp.text)
    adapter = TypeAdapter(ResponseStreamEvent)
    for event in events:
        adapter.validate_python(event)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    final = events[-1]
    assert final["type"] in {"response.completed", "response.incomplete"}
    assert final["response"]["tools"] == CODEX_TOOLS  # echoed as sent
    # and the SDK's own stream reader takes it whole
    import openai

    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
    body = codex_body()
    body.pop("stream")
    extra = {k: body.pop(k) for k in ["client_metadata"]}
    with client.responses.stream(**body, extra_body=extra) as stream:
        for _ in stream:
            pass
        reply = stream.get_final_response()
    assert reply.status in {"completed", "incomplete"}


def forced(server, choice: dict, max_tokens: int = 80, temperature: float = 0, **extra) -> dict:
    body = codex_body(
        tool_choice=choice, stream=False, max_output_tokens=max_tokens, temperature=temperature
    )
    body.update(extra)
    resp = httpx.post(server.base_url + "/v1/responses", json=body, timeout=300)
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_forced_namespace_call_round_trips_and_hits_the_cache(server):
    first = forced(server, {"type": "function", "name": "spawn_agent"})
    calls = [item for item in first["output"] if item["type"] == "function_call"]
    assert len(calls) == 1, first["output"]
    call = calls[0]
    assert call["name"] == "spawn_agent" and call["namespace"] == "mcp__agents__"
    assert isinstance(json.loads(call["arguments"])["task"], str)
    # Codex replays the item as it got it, with the output
    replay = {k: call[k] for k in ["type", "call_id", "name", "namespace", "arguments"]}
    output = {"type": "function_call_output", "call_id": call["call_id"], "output": "started"}
    body = codex_body(stream=False, max_output_tokens=8)
    body["input"] = [*body["input"], replay, output]
    second = httpx.post(server.base_url + "/v1/responses", json=body, timeout=300).json()
    cached = second["usage"]["input_tokens_details"]["cached_tokens"]
    assert cached > first["usage"]["input_tokens"], (cached, first["usage"])


def test_forced_custom_call_round_trips_and_hits_the_cache(server):
    first = forced(server, {"type": "custom", "name": "apply_patch"}, max_tokens=200)
    calls = [item for item in first["output"] if item["type"] == "custom_tool_call"]
    assert len(calls) == 1, first["output"]
    call = calls[0]
    assert call["name"] == "apply_patch" and "namespace" not in call
    assert call["input"].startswith("*** Begin Patch\n")
    replay = {k: call[k] for k in ["type", "call_id", "name", "input"]}
    output = {"type": "custom_tool_call_output", "call_id": call["call_id"], "output": "Done!"}
    body = codex_body(stream=False, max_output_tokens=8)
    body["input"] = [*body["input"], replay, output]
    second = httpx.post(server.base_url + "/v1/responses", json=body, timeout=300).json()
    cached = second["usage"]["input_tokens_details"]["cached_tokens"]
    assert cached > first["usage"]["input_tokens"], (cached, first["usage"])


def test_custom_call_streams_its_input(server):
    body = codex_body(tool_choice={"type": "custom", "name": "apply_patch"}, max_output_tokens=200)
    resp = httpx.post(server.base_url + "/v1/responses", json=body, timeout=300)
    events = sse_events(resp.text)
    deltas = "".join(
        e["delta"] for e in events if e["type"] == "response.custom_tool_call_input.delta"
    )
    done = [e for e in events if e["type"] == "response.custom_tool_call_input.done"]
    final = [i for i in events[-1]["response"]["output"] if i["type"] == "custom_tool_call"]
    assert len(done) == 1 and deltas == done[0]["input"] == final[0]["input"]


@pytest.fixture(scope="module")
def patch_check():
    """Checks a text against Codex's apply_patch grammar with a fresh llguidance matcher:
    "complete" (a whole patch), "prefix" (every byte allowed, not finished) or "invalid"."""
    import llguidance
    import llguidance.hf
    from mlx_lm.tokenizer_utils import load

    from mlx_kvserve import paths
    from mlx_kvserve.models.resolve import local_model_dir, resolve_model

    _, ref = resolve_model(None, paths.data_dir(), progress=False)
    tokenizer = llguidance.hf.from_tokenizer(load(Path(local_model_dir(ref)))._tokenizer)
    grammar = llguidance.LLMatcher.grammar_from_lark(PATCH_GRAMMAR)

    def check(text: str) -> str:
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        tokens = tokenizer.tokenize_str(text)
        if matcher.validate_tokens(tokens) != len(tokens) or not matcher.consume_tokens(tokens):
            return "invalid"
        return "complete" if matcher.is_accepting() else "prefix"

    assert check("*** Begin Patch\n*** Delete File: a.txt\n*** End Patch\n") == "complete"
    assert check("*** Begin Patch\n*** Add File: a.txt\n+hi") == "prefix"
    assert check("*** Begin Patch\n*** End Patch\n") == "invalid"  # a patch needs a hunk
    assert check("--- a/x\n+++ b/x\n") == "invalid"
    return check


@pytest.mark.slow
def test_forced_custom_calls_follow_the_lark_grammar_at_temperature_1(server, patch_check):
    """8/8 forced calls at temperature 1 on the default model follow Codex's own apply_patch
    grammar: every call the model closed is a whole patch, and a call cut off by
    max_output_tokens (the 135M model often rambles on at temperature 1 past any budget a test can
    afford; nothing makes a grammar end) is a valid beginning of one, never anything else. That a
    forced freeform call does end, whole, is shown on a grammar that ends by itself: 8/8 calls at
    temperature 1 complete with an input the grammar accepts. Each set of 8 is sent at once, so
    the grammars are also checked side by side in one batch (seeded rows draw alike either way)."""
    patches = concurrently(
        lambda seed: forced(
            server,
            {"type": "custom", "name": "apply_patch"},
            max_tokens=160,
            temperature=1.0,
            seed=seed,
            input=[DEVELOPER, user(f"Add a file note{seed}.txt that says hi.")],
        ),
        range(8),
    )
    for reply in patches:
        calls = [i for i in reply["output"] if i["type"] == "custom_tool_call"]
        assert len(calls) == 1, reply["output"]
        verdict = patch_check(calls[0]["input"])
        expected = "complete" if reply["status"] == "completed" else "prefix"
        assert verdict == expected, (reply["status"], calls[0]["input"])
    verdict_tool = {
        "type": "custom",
        "name": "verdict",
        "description": "Say whether the patch applies.",
        "format": {
            "type": "grammar",
            "syntax": "lark",
            "definition": 'start: ("applies" | "conflicts") " at line " /[1-9][0-9]?/',
        },
    }
    verdicts = concurrently(
        lambda seed: forced(
            server,
            {"type": "custom", "name": "verdict"},
            max_tokens=40,
            temperature=1.0,
            seed=seed,
            tools=[*CODEX_TOOLS, verdict_tool],
        ),
        range(8),
    )
    for reply in verdicts:
        calls = [i for i in reply["output"] if i["type"] == "custom_tool_call"]
        assert reply["status"] == "completed" and len(calls) == 1, reply
        assert re.fullmatch(r"(applies|conflicts) at line [1-9][0-9]?", calls[0]["input"]), calls


@pytest.mark.parametrize(
    ("change", "param"),
    [
        (
            {"tools": [{**APPLY_PATCH, "format": {**APPLY_PATCH["format"], "definition": "s: ("}}]},
            "tools[0].format.definition",
        ),
        ({"tools": [{"type": "hologram"}]}, "tools[0].type"),
        (
            {"tools": [{"type": "web_search"}], "tool_choice": {"type": "web_search"}},
            "tool_choice.type",
        ),
        ({"include": ["reasoning.everything"]}, "include"),
        (
            {"input": [{"type": "reasoning", "summary": [], "encrypted_content": ["x"]}]},
            "input.0.encrypted_content",
        ),
        (
            {"input": [{"type": "custom_tool_call_output", "call_id": "call_x", "output": "1"}]},
            "input[0]",
        ),
        (
            {"input": [{"type": "custom_tool_call", "call_id": "c", "name": "apply_patch"}]},
            "input[0]",
        ),
        ({"tool_choice": {"type": "custom", "name": "shell"}}, "tool_choice"),
        ({"store": True}, "store"),
        ({"tools": [{"type": "web_search"}], "tool_choice": "required"}, "tool_choice"),
    ],
    ids=[
        "grammar",
        "tool-type",
        "forced-builtin",
        "include",
        "encrypted",
        "orphan-custom-output",
        "custom-call-no-input",
        "custom-choice-on-function",
        "store",
        "required-with-only-builtins",
    ],
)
def test_bad_codex_shapes_are_400s_naming_the_field(server, change, param):
    body = {**codex_body(stream=False), **change}
    resp = httpx.post(server.base_url + "/v1/responses", json=body, timeout=60)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert (error["param"] or "").startswith(param), error
