"""Hostile request generation for the fuzz test (tests/server/test_fuzz.py) and
scripts/fuzz_server.py.

Needs hypothesis (a test dependency). Bodies mix the parameters of every endpoint, valid and not:
wrong types, out-of-range numbers, integers past 2^64, lone UTF-16 surrogates (sent as `\\ud800`
escapes, as a hostile client would), control characters, chat-template markup, nesting thousands
of levels deep, and raw bytes that are not JSON at all. A body that would generate keeps its
token limits tiny, so a run spends its time on validation, not on decoding.

`check` states the contract: never a 5xx, every 4xx in the protocol's error shape, and a 200
stream that finishes the protocol's way and carries no error event.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

from hypothesis import strategies as st

from tests.support.fuzz_shapes import (
    anthropic_block,
    anthropic_message,
    anthropic_tool,
    cache_control,
    context_edit,
    responses_item,
    responses_tool,
    signature,
    thinking,
)
from tests.support.fuzz_values import (
    DEEP,
    GET_PATHS,
    MAX_GENERATED,
    MODEL,
    POST_PATHS,
    TOKEN_LIMITS,
    anything,
    effort,
    integers,
    maybe,
    message,
    name,
    openai_tool,
    response_format,
    special_text,
    template_key,
    text,
    tool_choice,
)

FIELDS: dict[str, st.SearchStrategy] = {
    "model": st.one_of(st.just(MODEL), st.just(MODEL), st.just(MODEL), text, anything),
    "messages": st.one_of(
        st.lists(message, max_size=3), st.lists(anthropic_message, max_size=3), anything
    ),
    "prompt": st.one_of(
        text,
        st.lists(text, max_size=3),
        st.lists(integers, max_size=4),
        st.lists(st.lists(st.integers(-2, 60000), max_size=4), max_size=3),
        anything,
    ),
    "echo": maybe(st.booleans()),
    "tokens": st.one_of(st.lists(integers, max_size=5), anything),
    "add_special_tokens": maybe(st.booleans()),
    "input": st.one_of(text, st.lists(responses_item, max_size=3), anything),
    "system": maybe(text),
    "instructions": maybe(text),
    "temperature": maybe(st.floats(min_value=-5, max_value=5)),
    "top_p": maybe(st.floats(min_value=-1, max_value=2)),
    "seed": maybe(integers),
    "max_tokens": maybe(integers),
    "max_completion_tokens": maybe(integers),
    "max_output_tokens": maybe(integers),
    "stop": st.one_of(text, st.lists(text, max_size=20), anything),
    "stop_sequences": st.one_of(st.lists(text, max_size=5), anything),
    "stream": maybe(st.booleans()),
    "stream_options": st.one_of(
        st.fixed_dictionaries({"include_usage": maybe(st.booleans())}), anything
    ),
    "n": maybe(integers),
    "user": maybe(text),
    "tools": st.one_of(
        st.lists(st.one_of(openai_tool, anthropic_tool, responses_tool), max_size=3), anything
    ),
    "tool_choice": st.one_of(tool_choice, anything),
    "response_format": st.one_of(response_format, anything),
    "parallel_tool_calls": maybe(st.booleans()),
    "logprobs": st.one_of(maybe(st.booleans()), st.integers(-2, 25)),
    "speculative": st.one_of(st.booleans(), anything),  # the opt-out extension
    "top_logprobs": maybe(integers),
    "text": anything,  # Responses: {"format": ...}
    "chat_template_kwargs": st.one_of(
        st.dictionaries(template_key, anything, max_size=3), anything
    ),
    "reasoning_effort": maybe(effort),
    "thinking_token_budget": maybe(integers),
    # Anthropic Messages, as Claude Code sends them (the rest of the API's fields are ignored).
    "thinking": thinking,
    "output_config": st.one_of(
        st.fixed_dictionaries(
            {},
            optional={
                "effort": maybe(st.sampled_from(["low", "high", "xhigh", "max", "none"])),
                "format": anything,
            },
        ),
        anything,
    ),
    "context_management": st.one_of(
        st.fixed_dictionaries({"edits": st.one_of(st.lists(context_edit, max_size=2), anything)}),
        anything,
    ),
    "metadata": st.one_of(st.fixed_dictionaries({"user_id": maybe(text)}), anything),
    "service_tier": anything,
    "container": anything,
    "mcp_servers": anything,
    "cache_control": cache_control,
    # Responses as Codex sends it
    "reasoning": st.one_of(
        st.fixed_dictionaries(
            {},
            optional={
                "effort": maybe(st.sampled_from(["none", "low", "high", "max", "ultra"])),
                "summary": maybe(st.sampled_from(["auto", "detailed", "verbose"])),
            },
        ),
        anything,
    ),
    "include": st.one_of(
        st.lists(
            st.sampled_from(["reasoning.encrypted_content", "web_search_call.results", "x.y"]),
            max_size=2,
        ),
        anything,
    ),
    "prompt_cache_key": maybe(text),
    "client_metadata": anything,
    "store": maybe(st.booleans()),
}


def _limit_generation(body: Any, path: str) -> Any:
    """Keep any generation a valid body could start to a couple of tokens."""
    if isinstance(body, dict):
        for name in TOKEN_LIMITS:
            value = body.get(name)
            if name in body and value is None:
                body[name] = MAX_GENERATED
            elif isinstance(value, int) and not isinstance(value, bool) and value > 0:
                body[name] = min(value, MAX_GENERATED)
        body.setdefault(
            "max_output_tokens" if path == "/v1/responses" else "max_tokens", MAX_GENERATED
        )
    return body


def _base(path: str, draw: st.DrawFn) -> dict[str, Any]:
    """A valid body for `path` with odd but legal text, to be mutated."""
    words = draw(text)
    if path in ("/v1/completions", "/tokenize"):
        return {"model": MODEL, "prompt": words or "x"}
    if path == "/detokenize":
        return {"tokens": [1, 2, 3]}
    if path == "/v1/responses":
        return {"model": MODEL, "input": words or "x"}
    return {"model": MODEL, "messages": [{"role": "user", "content": words}]}


@st.composite
def json_body(draw: st.DrawFn, path: str = "/v1/chat/completions") -> bytes:
    """A JSON body (as a hostile client would encode it): a valid body for `path` with a few
    fields replaced, an object of random known fields, any JSON value, or very deep nesting."""
    kind = draw(st.sampled_from(["mutated"] * 3 + ["fields"] * 2 + ["any", "deep"]))
    if kind == "any":
        body: Any = draw(anything)
    elif kind == "mutated":
        body = _base(path, draw)
        names = draw(st.lists(st.sampled_from(list(FIELDS)), max_size=2, unique=True))
        body.update({name: draw(FIELDS[name]) for name in names})
    else:
        body = draw(st.fixed_dictionaries({}, optional=FIELDS))
        body.update(draw(st.dictionaries(text, anything, max_size=2)))
    body = _limit_generation(body, path)
    if kind == "deep":
        body[draw(st.sampled_from(list(FIELDS)))] = DEEP
    raw = json.dumps(body, ensure_ascii=True)  # lone surrogates become \udxxx escapes
    if kind == "deep":
        depth = draw(st.integers(min_value=60, max_value=5000))
        opener = draw(st.sampled_from(["[", '{"a":']))
        closer = "]" if opener == "[" else "}"
        raw = raw.replace(f'"{DEEP}"', opener * depth + "1" + closer * depth, 1)
    return raw.encode()


@st.composite
def anthropic_body(draw: st.DrawFn) -> dict[str, Any]:
    """A mostly valid Messages body in Claude Code's shape, so that hostile values reach the
    conversion and the template rather than stopping at validation."""
    words = st.one_of(st.text(max_size=20), special_text)
    valid_block = st.one_of(
        st.fixed_dictionaries({"type": st.just("text"), "text": words}),
        st.fixed_dictionaries(
            {"type": st.just("thinking"), "thinking": words, "signature": signature}
        ),
        st.fixed_dictionaries({"type": st.just("redacted_thinking"), "data": signature}),
        st.fixed_dictionaries(
            {"type": st.just("tool_use"), "id": st.just("toolu_1"), "name": name, "input": anything}
        ),
        st.fixed_dictionaries(
            {"type": st.just("tool_result"), "tool_use_id": st.just("toolu_1"), "content": words}
        ),
        anthropic_block,
    )
    turn = st.fixed_dictionaries(
        {
            "role": st.sampled_from(["user", "assistant", "system"]),
            "content": st.one_of(words, st.lists(valid_block, min_size=1, max_size=3)),
        },
        optional={"clear_at": st.sampled_from(["next_user_message", "never"])},
    )
    body: dict[str, Any] = {
        "model": MODEL,
        "max_tokens": draw(st.sampled_from([1, MAX_GENERATED, 32000])),
        "messages": [{"role": "user", "content": draw(words)}, *draw(st.lists(turn, max_size=4))],
    }
    system = st.lists(
        st.fixed_dictionaries(
            {"type": st.just("text"), "text": words}, optional={"cache_control": cache_control}
        ),
        max_size=2,
    )
    for field, strategy in [
        ("system", st.one_of(words, system)),
        ("thinking", thinking),
        ("output_config", FIELDS["output_config"]),
        ("context_management", FIELDS["context_management"]),
        ("tools", st.lists(anthropic_tool, max_size=3)),
        ("metadata", FIELDS["metadata"]),
        ("stream", st.booleans()),
    ]:
        if draw(st.booleans()):
            body[field] = draw(strategy)
    return _limit_generation(body, "/v1/messages")


@dataclass(frozen=True)
class Probe:
    """One request to send."""

    method: str
    path: str
    body: bytes | None = None
    content_type: str = "application/json"
    headers: tuple[tuple[str, str], ...] = ()


raw_bytes = st.one_of(
    st.binary(max_size=64),
    st.sampled_from([b"", b"{", b"[]", b"null", b'{"a":NaN}', b'{"max_tokens":1e999}']),
    st.just(b'{"prompt":"x","max_tokens":' + b"9" * 5000 + b"}"),
)


@st.composite
def probes(draw: st.DrawFn) -> Probe:
    """A request to any endpoint: mostly JSON POSTs, some raw bytes, some GETs."""
    kind = draw(st.sampled_from(["json"] * 6 + ["raw", "get", "model"]))
    if kind == "get":
        return Probe("GET", draw(st.sampled_from(GET_PATHS)))
    if kind == "model":
        name = draw(st.one_of(text, st.just(MODEL)))
        return Probe("GET", "/v1/models/" + quote(name.encode("utf-8", "surrogatepass"), safe=""))
    path = draw(st.sampled_from(POST_PATHS))
    body = draw(json_body(path)) if kind == "json" else draw(raw_bytes)
    headers: tuple[tuple[str, str], ...] = ()
    if path.startswith("/v1/messages"):  # any anthropic-beta value is accepted
        visible = st.characters(min_codepoint=33, max_codepoint=126)  # h11 refuses edge spaces
        beta = st.lists(st.text(alphabet=visible))
        headers = (("anthropic-beta", ",".join(draw(beta))),)
    return Probe("POST", path, body, headers=headers)


@st.composite
def anthropic_probes(draw: st.DrawFn) -> Probe:
    """A Claude-Code-shaped request with hostile values, to either Messages endpoint."""
    path = draw(st.sampled_from([p for p in POST_PATHS if p.startswith("/v1/messages")]))
    body = draw(anthropic_body())
    if "count_tokens" in path:
        body.pop("max_tokens", None)
    raw = json.dumps(body, ensure_ascii=True).encode()
    return Probe(
        "POST", path, raw, headers=(("anthropic-beta", "mid-conversation-system-2026-04-07"),)
    )


# Streams whose events may contain the word "error" in generated text without being errors.
TYPED_STREAMS = ("/v1/messages", "/v1/responses")


def check(status: int, body: bytes, streamed: bool, path: str = "") -> str | None:
    """What is wrong with a response, or None: the contract every endpoint keeps (errors in the
    protocol's own shape: Anthropic's for /v1/messages, OpenAI's elsewhere)."""
    if status >= 500:
        return f"{status}: {body[:300]!r}"
    if status >= 400:
        anthropic = path.startswith("/v1/messages")
        try:
            data = json.loads(body)
            error = data["error"]
            ok = (
                isinstance(error["message"], str)
                and error["message"]
                and isinstance(error["type"], str)
                and "Traceback" not in error["message"]
            )
            if anthropic:
                ok = ok and data["type"] == "error"
            else:
                ok = (
                    ok
                    and (error["param"] is None or isinstance(error["param"], str))
                    and (error["code"] is None or isinstance(error["code"], str))
                )
        except (ValueError, KeyError, TypeError):
            ok = False
        return None if ok else f"{status} not in the error shape: {body[:300]!r}"
    if streamed:
        text_body = body.decode("utf-8", "replace")
        if "event: error" in text_body or "response.failed" in text_body:
            return f"200 stream carried an error event: {text_body[-300:]!r}"
        if path.split("?")[0] not in TYPED_STREAMS and '"error"' in text_body:
            return f"200 stream carried an error event: {text_body[-300:]!r}"
        done = "response.completed" in text_body or "response.incomplete" in text_body
        if not ("data: [DONE]" in text_body or "event: message_stop" in text_body or done):
            return f"200 stream did not finish: {text_body[-300:]!r}"
    return None


def send(client: Any, probe: Probe) -> tuple[int, bytes, bool]:
    """Send `probe` with an httpx.Client; (status, whole body, whether it was an event stream)."""
    headers = dict(probe.headers)
    if probe.body is not None:
        headers["content-type"] = probe.content_type
    request = client.build_request(probe.method, probe.path, content=probe.body, headers=headers)
    response = client.send(request, stream=True)
    try:
        data = response.read()
    finally:
        response.close()
    streamed = response.headers.get("content-type", "").startswith("text/event-stream")
    return response.status_code, data, streamed
