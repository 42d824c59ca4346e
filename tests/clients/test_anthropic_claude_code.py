"""Requests in the shape current Claude Code sends them, against the agents' shared server (a
tiny llama with a 128k context: what is tested is the protocol, not the model).

The shape is the one recorded in DESIGN.md ("What the real CLIs sent"): `POST
/v1/messages?beta=true` with an `anthropic-beta` list, a system list whose first block is the
billing line, `cache_control` on blocks, system parts and tools, a mid-conversation system message,
`thinking: adaptive`, `output_config.effort`, `context_management`, `metadata.user_id`, 24 tools
and `max_tokens: 32000`. Texts are ours.
"""

from __future__ import annotations

import json
import uuid

import anthropic
import httpx
import pytest

MODEL = "claude-opus-4-7"
BETAS = (
    "claude-code-20250219,interleaved-thinking-2025-05-14,thinking-token-count-2026-05-13,"
    "context-management-2025-06-27,prompt-caching-scope-2026-01-05,"
    "mid-conversation-system-2026-04-07,effort-2025-11-24"
)
HEADERS = {
    "x-api-key": "unused",
    "anthropic-version": "2023-06-01",
    "anthropic-beta": BETAS,
    "anthropic-dangerous-direct-browser-access": "true",
    "x-app": "cli",
}
EPHEMERAL = {"type": "ephemeral"}


@pytest.fixture
def server(agent_server):
    """The agents' server: Claude Code's 24 tools prefill in seconds on its tiny model."""
    return agent_server


def tools(n: int = 24) -> list[dict]:
    out = []
    for i in range(n):
        schema = {
            "type": "object",
            "properties": {"path": {"type": "string", "description": "Where."}},
            "required": ["path"],
            "additionalProperties": False,
            "$schema": "http://json-schema.org/draft-07/schema#",
        }
        out.append({"name": f"Tool{i}", "description": f"Tool number {i}.", "input_schema": schema})
    # Claude Code's record-typed fields use `propertyNames`, which llguidance does not implement.
    env = {"type": "object", "propertyNames": {"pattern": "^[A-Z_]+$"}}
    out[0]["input_schema"]["properties"]["env"] = {
        **env,
        "additionalProperties": {"type": "string"},
    }
    out[-1]["cache_control"] = EPHEMERAL
    return out


def claude_code_body(**changes) -> dict:
    body = {
        "model": MODEL,
        "max_tokens": 32000,
        "system": [
            {
                "type": "text",
                "text": "x-anthropic-billing-header: cc_version=2.1.197.476; cch=1f2e3;",
            },
            {"type": "text", "text": "You are a coding agent.", "cache_control": EPHEMERAL},
            {"type": "text", "text": "Be brief.", "cache_control": {**EPHEMERAL, "ttl": "1h"}},
        ],
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "<system-reminder>context</system-reminder>"},
                    {"type": "text", "text": "Say OK.", "cache_control": EPHEMERAL},
                ],
            },
            {"role": "system", "content": "Available agent types: general, explore."},
        ],
        "tools": tools(),
        "metadata": {"user_id": json.dumps({"device_id": "d", "session_id": str(uuid.uuid4())})},
        "thinking": {"type": "adaptive"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "output_config": {"effort": "high"},
        "temperature": 0,
        # Not Claude Code's: a stop sequence keeps the CPU model's answer to a few tokens.
        "stop_sequences": [" ", "\n", "."],
        "stream": False,
    }
    body.update(changes)
    return body


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.base_url + path, json=body, headers=HEADERS, timeout=300)


def test_claude_code_request_is_served(server):
    resp = post(server, "/v1/messages?beta=true", claude_code_body())
    assert resp.status_code == 200, resp.text
    reply = resp.json()
    assert reply["type"] == "message"
    assert reply["stop_reason"] in {"end_turn", "stop_sequence", "tool_use"}
    usage = reply["usage"]
    total = usage["input_tokens"] + usage["cache_read_input_tokens"]
    count_body = {k: v for k, v in claude_code_body().items() if k not in {"max_tokens", "stream"}}
    counted = post(server, "/v1/messages/count_tokens?beta=true", count_body)
    assert counted.status_code == 200, counted.text
    assert counted.json()["input_tokens"] == total


def test_claude_code_request_streams(server):
    with httpx.stream(
        "POST",
        server.base_url + "/v1/messages?beta=true",
        json=claude_code_body(stream=True),
        headers=HEADERS,
        timeout=300,
    ) as resp:
        assert resp.status_code == 200, resp.read()
        events = [line[7:] for line in resp.iter_lines() if line.startswith("event: ")]
    assert events[0] == "message_start" and events[-2:] == ["message_delta", "message_stop"]
    assert "error" not in events


def test_the_sdk_beta_client_with_every_control(server):
    client = anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0)
    body = claude_code_body()
    with client.beta.messages.stream(
        betas=BETAS.split(","),
        model=MODEL,
        max_tokens=32000,
        system=body["system"],
        messages=body["messages"],
        tools=body["tools"],
        metadata=body["metadata"],
        thinking={"type": "enabled", "budget_tokens": 2048, "display": "omitted"},
        output_config={"effort": "xhigh"},
        context_management={
            "edits": [
                {"type": "clear_thinking_20251015", "keep": {"type": "thinking_turns", "value": 2}},
                {
                    "type": "clear_tool_uses_20250919",
                    "trigger": {"type": "input_tokens", "value": 30000},
                    "keep": {"type": "tool_uses", "value": 3},
                    "clear_at_least": {"type": "input_tokens", "value": 5000},
                    "exclude_tools": ["Tool0"],
                    "clear_tool_inputs": True,
                },
            ]
        },
        stop_sequences=body["stop_sequences"],
        service_tier="auto",
        extra_body={"temperature": 0, "container": None, "mcp_servers": [], "speed": "standard"},
    ) as stream:
        reply = stream.get_final_message()
    assert reply.type == "message" and reply.usage.input_tokens > 0
    counted = client.beta.messages.count_tokens(
        betas=BETAS.split(","),
        model=MODEL,
        system=body["system"],
        messages=body["messages"],
        tools=body["tools"],
        thinking={"type": "adaptive"},
    )
    usage = reply.usage
    assert counted.input_tokens == usage.input_tokens + usage.cache_read_input_tokens


def count(server, messages: list[dict], **extra) -> int:
    resp = post(
        server, "/v1/messages/count_tokens", {"model": MODEL, "messages": messages, **extra}
    )
    assert resp.status_code == 200, resp.text
    return resp.json()["input_tokens"]


def test_a_mid_conversation_system_message_is_rendered(server):
    user = {"role": "user", "content": "Say OK."}
    reminder = {"role": "system", "content": "Reminder: be brief."}
    plain = count(server, [user])
    with_reminder = count(server, [user, reminder])
    assert with_reminder > plain
    cleared = {**reminder, "clear_at": "next_user_message"}
    assert count(server, [user, cleared, {"role": "assistant", "content": "OK"}, user]) == count(
        server, [user, {"role": "assistant", "content": "OK"}, user]
    )


def assert_anthropic_400(resp: httpx.Response, param: str) -> None:
    assert resp.status_code == 400, resp.text
    data = resp.json()
    assert data["type"] == "error" and data["error"]["type"] == "invalid_request_error"
    assert param in data["error"]["message"], data


ASSISTANT = {"role": "assistant", "content": [{"type": "text", "text": "OK"}]}


@pytest.mark.parametrize(
    ("changes", "param"),
    [
        ({"thinking": {"type": "enabled", "budget_tokens": 100}}, "thinking.budget_tokens"),
        ({"thinking": {"type": "enabled", "budget_tokens": 40000}}, "thinking.budget_tokens"),
        ({"thinking": {"type": "psychic"}}, "thinking.type"),
        ({"output_config": {"effort": "extreme"}}, "output_config.effort"),
        (
            {"context_management": {"edits": [{"type": "forget_everything_20990101"}]}},
            "context_management.edits.0.type",
        ),
        ({"tools": [{"type": "bash_20250124", "name": "bash"}]}, "tools.0.type"),
        ({"tools": [{"type": "teleport_20990101", "name": "t"}]}, "tools.0.type"),
        (
            {
                "messages": [
                    {"role": "user", "content": "x"},
                    {
                        "role": "assistant",
                        "content": [{"type": "thinking", "thinking": "t", "signature": 12}],
                    },
                    {"role": "user", "content": "y"},
                ]
            },
            "messages.1.content.0.signature",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": "x"},
                    ASSISTANT,
                    {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "video"}]},
                ]
            },
            "messages.2.content.1.type",
        ),
        (
            {"messages": [{"role": "user", "content": "x"}, {"role": "narrator", "content": "y"}]},
            "messages.1.role",
        ),
    ],
    ids=[
        "budget-floor",
        "budget-over-max",
        "thinking-type",
        "effort",
        "edit-type",
        "anthropic-tool",
        "unknown-tool",
        "signature-type",
        "block-type",
        "role",
    ],
)
def test_bad_claude_code_shapes_are_400s_naming_the_field(server, changes, param):
    assert_anthropic_400(post(server, "/v1/messages?beta=true", claude_code_body(**changes)), param)


def test_server_tools_are_not_offered(server):
    """Claude Code's web search runs on Anthropic's servers; here it is left out, documented."""
    search = {"type": "web_search_20250305", "name": "web_search", "max_uses": 8}
    without = count(server, [{"role": "user", "content": "x"}], tools=tools(2))
    assert count(server, [{"role": "user", "content": "x"}], tools=[*tools(2), search]) == without
