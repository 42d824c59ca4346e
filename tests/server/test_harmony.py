"""gpt-oss's harmony format end to end: rendering, channels, constrained calls, history, controls.

A tiny random-weight `gpt_oss` model (tests/support/harmony_model.py) carries gpt-oss's control
tokens and its real chat template (tests/fixtures/templates/gpt-oss.jinja). It speaks harmony
because the format's grammar leaves it nothing else to say once tools are offered: each choice
inside the format (analysis first or the call at once, the text of the analysis, the arguments)
is the model's own. The server's thinking budget (8 tokens) ends an analysis that runs on, as it
would for the real model. The model is built from seed 0, whose greedy choice after the generation
prompt is to open an analysis message (other seeds call at once): so the same prompt reasons in
every protocol.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import date
from pathlib import Path
from typing import Any

import anthropic
import httpx
import jinja2
import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support.fuzz_values import name, schema
from tests.support.fuzzing import check, json_body
from tests.support.harmony_model import TEMPLATE, build_harmony_model
from tests.support.seeded import PLAIN
from tests.support.servers import ServerProcess, serve_model
from tests.support.tool_checks import (
    SERVED_FUZZ,
    assert_format_named_once,
    forced_replies,
    post_fuzzed,
    valid,
)
from tests.support.tool_parsing import server_render

pytestmark = pytest.mark.slow

CONTROL = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|call|>")
CONTROL += ("<|return|>",)
BUDGET = 8
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 16},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
PING = {  # nothing left to choose: every token of the call is forced
    "type": "object",
    "properties": {"host": {"type": "string", "enum": ["localhost"]}},
    "required": ["host"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "ping", "description": "Ping.", "parameters": PING}},
]
SCHEMAS = {"get_weather": WEATHER, "ping": PING}
ASK = [{"role": "user", "content": "What's the weather in Paris?"}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_harmony_model(tmp_path_factory.mktemp("harmony") / "gpt-oss", seed=0)


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path):
    from mlx_lm import load

    from mlx_kvserve.chat.formats import add_end_tokens

    tok = load(str(model_dir))[1]
    add_end_tokens(tok)
    return tok


@pytest.fixture(scope="module")
def served(model_dir: Path) -> Iterator[ServerProcess]:
    yield from serve_model(model_dir, "--thinking-budget", "8")


def claude(server: ServerProcess) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0)


def _clean(text: str | None) -> None:
    assert not any(token in (text or "") for token in CONTROL), text


# -- start-up and rendering
def test_the_format_is_named_once_at_start_up(served: ServerProcess) -> None:
    assert_format_named_once(served, "harmony")


def _template(messages: list[dict], **kwargs: Any) -> str:
    """The fixture template rendered by jinja2 alone, with the helpers transformers gives it."""

    def raise_exception(message: str) -> None:
        raise jinja2.TemplateError(message)

    env = jinja2.Environment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = lambda x: json.dumps(x, ensure_ascii=False)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: date.today().strftime(fmt)
    source = TEMPLATE.read_text(encoding="utf-8")
    return env.from_string(source).render(messages=messages, add_generation_prompt=True, **kwargs)


CALL = {"id": "c1", "type": "function", "function": {"name": "get_weather"}}


def test_our_prompt_is_the_templates_own(tokenizer) -> None:
    """An OpenAI-shaped history (system prompt, past analysis of a call turn, tool result, a
    second call in one message, effort) renders as the real template renders the same
    conversation in its own terms (`thinking`, one call per assistant message)."""
    args = {"city": "Paris", "days": 2}
    history = [
        {"role": "system", "content": "Be brief."},
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "reasoning_content": "I should look it up.",
            "tool_calls": [
                {**CALL, "function": {**CALL["function"], "arguments": json.dumps(args)}},
                {
                    "id": "c2",
                    "type": "function",
                    "function": {"name": "ping", "arguments": '{"host": "localhost"}'},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "c2", "content": "pong"},
    ]
    ours = server_render(
        tokenizer, {"messages": history, "tools": TOOLS, "reasoning_effort": "high"}
    )
    tools = [
        {
            "type": "function",
            "function": {**t["function"], "description": t["function"].get("description", "")},
        }
        for t in TOOLS
    ]
    own = [
        {"role": "system", "content": "Be brief."},
        *ASK,
        {
            "role": "assistant",
            "content": "",
            "thinking": "I should look it up.",
            "tool_calls": [{**CALL, "function": {"name": "get_weather", "arguments": args}}],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "c2",
                    "type": "function",
                    "function": {"name": "ping", "arguments": {"host": "localhost"}},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c2", "content": "pong"},
    ]
    text = _template(own, tools=tools, reasoning_effort="high")
    assert ours == tokenizer.encode(text, add_special_tokens=False)
    assert "Reasoning: high" in text
    assert (
        "<|start|>assistant<|channel|>analysis<|message|>I should look it up.<|end|>"
        "<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>"
        '{"city": "Paris", "days": 2}<|call|>'
        '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"sunny"<|end|>'
        "<|start|>assistant to=functions.ping"
    ) in text
    assert text.endswith("<|end|><|start|>assistant")


@pytest.mark.parametrize(
    ("protocol", "effort", "expected"),
    [
        ("chat", "low", "low"),
        ("chat", "minimal", "low"),
        ("responses", "high", "high"),
        ("responses", "xhigh", "high"),
        ("anthropic", "medium", "medium"),
        ("anthropic", "max", "high"),
        ("chat", "none", "low"),  # gpt-oss cannot stop reasoning: as little as it can
        ("responses", "none", "low"),
        ("anthropic", "disabled", "low"),
    ],
)
def test_effort_reaches_the_template(tokenizer, protocol: str, effort: str, expected: str) -> None:
    from mlx_kvserve.api import anthropic_request, openai_chat, openai_responses
    from mlx_kvserve.api.anthropic_schemas import MessagesRequest
    from mlx_kvserve.api.openai_responses_schemas import ResponsesRequest
    from mlx_kvserve.api.schemas import ChatCompletionRequest
    from mlx_kvserve.chat.render import render_chat

    if protocol == "chat":
        body = ChatCompletionRequest.model_validate(
            {"model": "m", "messages": ASK, "reasoning_effort": effort}
        )
        req = openai_chat.to_chat_request(body)
    elif protocol == "responses":
        body = ResponsesRequest.model_validate(
            {"model": "m", "input": ASK[0]["content"], "reasoning": {"effort": effort}}
        )
        req = openai_responses.to_chat_request(body)
    else:
        control = (
            {"thinking": {"type": "disabled"}}
            if effort == "disabled"
            else {"output_config": {"effort": effort}}
        )
        body = MessagesRequest.model_validate(
            {"model": "m", "max_tokens": 4, "messages": ASK, **control}
        )
        req = anthropic_request.to_chat_request(body, keep_billing_header=False)
    text = tokenizer.decode(render_chat(tokenizer, req).tokens)
    assert f"Reasoning: {expected}\n" in text


# -- constrained calls
@pytest.mark.parametrize("named", [True, False], ids=["named", "required"])
def test_forced_calls_always_validate(client, named: bool) -> None:
    """20 seeds at temperature 1: one declared tool, valid arguments, the analysis (if the model
    opened one) apart, and no control token anywhere."""
    reasoned = 0
    choices = forced_replies(
        client, named, max_tokens=80, schemas=SCHEMAS, tools=TOOLS, parallel=None, model="m"
    )
    for choice in choices:
        assert len(choice.message.tool_calls) == 1
        call = choice.message.tool_calls[0]
        reasoning = getattr(choice.message, "reasoning_content", None)
        _clean(reasoning)
        _clean(call.function.arguments)
        reasoned += bool(reasoning)
    assert reasoned  # some seeds open an analysis first: the call follows it


def test_the_grammar_admits_only_declared_tools(tokenizer) -> None:
    import llguidance

    from mlx_kvserve.chat import ChatRequest, Message, Tool, ToolChoice
    from mlx_kvserve.chat.formats import tool_format_for
    from mlx_kvserve.chat.grammar import GrammarCompiler

    fmt = tool_format_for(tokenizer)
    assert fmt.name == "harmony" and fmt.constrained
    tools = [Tool(t["function"]["name"], None, t["function"]["parameters"]) for t in TOOLS]
    compiler = GrammarCompiler(tokenizer)

    def accepts(mode: str, text: str) -> bool:
        req = ChatRequest([Message("user", "hi")], tools=tools, tool_choice=ToolChoice(mode))
        matcher = llguidance.LLMatcher(
            compiler._llg_tokenizer(), compiler.grammar_for(req, fmt), log_level=0
        )
        ids = tokenizer.encode(text, add_special_tokens=False)
        return all(matcher.consume_token(t) for t in ids)

    analysis = "<|channel|>analysis<|message|>Let me see.<|end|><|start|>assistant"
    call = ' to=functions.ping<|channel|>commentary json<|message|>{"host": "localhost"}'
    natural = (
        '<|channel|>commentary to=functions.ping <|constrain|>json<|message|>{"host": "localhost"}'
    )
    assert accepts("auto", analysis + call)
    assert accepts("auto", analysis + natural)
    assert accepts("auto", analysis + "<|channel|>final<|message|>It is sunny.")
    assert accepts("required", call)
    assert accepts("required", analysis + call)
    assert not accepts("required", "<|channel|>final<|message|>No.")
    assert not accepts("auto", " to=functions.pong<|channel|>")  # an invented tool
    assert not accepts("required", call.replace("localhost", "example.com"))


def _stream_chat(client, **kwargs: Any) -> tuple[str, str, list[tuple[str, str]]]:
    reasoning, content = "", ""
    calls: dict[int, dict] = {}
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        extra = delta.model_extra or {}
        reasoning += extra.get("reasoning_content") or ""
        content += delta.content or ""
        for part in delta.tool_calls or []:
            entry = calls.setdefault(part.index, {"name": None, "arguments": ""})
            if part.id:
                assert entry["name"] is None and entry["arguments"] == ""  # id and name first
                entry["name"] = part.function.name
            if part.function and part.function.arguments:
                entry["arguments"] += part.function.arguments
    return reasoning, content, [(c["name"], c["arguments"]) for c in calls.values()]


@pytest.mark.parametrize("choice", ["auto", "required"])
def test_streamed_results_equal_the_whole_ones(client, choice: str) -> None:
    for seed in range(4):
        kwargs = dict(
            model="m",
            messages=ASK,
            tools=TOOLS,
            tool_choice=choice,
            temperature=1.0,
            seed=seed,
            max_tokens=60,
            extra_body=PLAIN,  # compared token for token: tests/support/seeded.py
        )
        whole = client.chat.completions.create(**kwargs).choices[0].message
        reasoning, content, calls = _stream_chat(client, **kwargs)
        assert reasoning == (getattr(whole, "reasoning_content", None) or "")
        assert content == (whole.content or "")
        assert calls == [(c.function.name, c.function.arguments) for c in whole.tool_calls or []]
        _clean(reasoning)
        _clean(content)


# -- reasoning apart, in the three protocols
def test_reasoning_is_apart_in_every_protocol(served: ServerProcess, client) -> None:
    """The same greedy answer (analysis, then a call) in OpenAI chat, Anthropic and Responses,
    streamed and not."""
    chat = client.chat.completions.create(
        model="m", messages=ASK, tools=TOOLS, tool_choice="required", temperature=0, max_tokens=60
    )
    message = chat.choices[0].message
    reasoning = message.reasoning_content
    assert reasoning and message.model_extra["reasoning"] == reasoning
    _clean(reasoning)
    call = message.tool_calls[0]
    assert chat.usage.completion_tokens_details.reasoning_tokens > 0
    streamed = _stream_chat(
        client,
        model="m",
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        temperature=0,
        max_tokens=60,
    )
    assert streamed == (reasoning, "", [(call.function.name, call.function.arguments)])

    tools = [  # the same tools, so the same prompt
        {
            "name": t["function"]["name"],
            "input_schema": t["function"]["parameters"],
            **(
                {"description": t["function"]["description"]}
                if "description" in t["function"]
                else {}
            ),
        }
        for t in TOOLS
    ]
    ask = dict(
        model="m",
        max_tokens=60,
        messages=ASK,
        tools=tools,
        tool_choice={"type": "any"},
        extra_body={"temperature": 0},
    )
    whole = claude(served).messages.create(**ask)
    assert [b.type for b in whole.content] == ["thinking", "tool_use"]
    assert whole.content[0].thinking == reasoning
    assert whole.content[1].input == json.loads(call.function.arguments)
    with claude(served).messages.stream(**ask) as stream:
        deltas = [
            e.delta.thinking
            for e in stream
            if e.type == "content_block_delta" and e.delta.type == "thinking_delta"
        ]
        final = stream.get_final_message()
    assert "".join(deltas) == reasoning
    assert [(b.type, getattr(b, "input", None)) for b in final.content] == [
        (b.type, getattr(b, "input", None)) for b in whole.content
    ]

    rtools = [{"type": "function", **t["function"]} for t in TOOLS]
    respond = dict(
        model="m",
        input=ASK[0]["content"],
        tools=rtools,
        tool_choice="required",
        temperature=0,
        max_output_tokens=60,
    )
    response = client.responses.create(**respond)
    assert [item.type for item in response.output] == ["reasoning", "function_call"]
    assert response.output[0].content[0].text == reasoning
    assert response.output[1].arguments == call.function.arguments
    assert response.usage.output_tokens_details.reasoning_tokens > 0
    with client.responses.create(**respond, stream=True) as stream:
        events = list(stream)
    text = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert text == reasoning


def test_response_format_makes_the_final_answer_that_json(client) -> None:
    """Without tools, a json_schema answer still speaks harmony: the analysis (seed 0 opens one,
    the budget ends it) is the reasoning, the final channel is the JSON."""
    answer = {
        "type": "object",
        "properties": {"answer": {"type": "string", "maxLength": 10}},
        "required": ["answer"],
        "additionalProperties": False,
    }
    reply = client.chat.completions.create(
        model="m",
        messages=ASK,
        temperature=0,
        max_tokens=60,
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": answer}},
    )
    message = reply.choices[0].message
    assert reply.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(message.content), answer)
    assert message.reasoning_content
    _clean(message.reasoning_content)


def test_no_control_token_reaches_the_answer(client) -> None:
    """Without tools nothing constrains the random model: whatever it writes (control tokens
    included, now and then), none reaches the content or the reasoning."""
    for seed in range(6):
        reply = client.chat.completions.create(
            model="m", messages=ASK, temperature=1.5, seed=seed, max_tokens=40
        )
        _clean(reply.choices[0].message.content)
        _clean(getattr(reply.choices[0].message, "reasoning_content", None))


# -- history and the prompt cache
def test_a_tool_loop_hits_the_cache(client, tokenizer) -> None:
    """Three turns of calls: each turn's reply, replayed with its reasoning, re-renders as the
    model sampled it, so the next turn reads the whole previous prompt and the reply from the
    cache (all but the last sampled token, which ended the generation unfed)."""
    messages = list(ASK)
    previous = None
    for turn in range(3):
        reply = client.chat.completions.create(
            model="m",
            messages=messages,
            tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "ping"}},
            temperature=0,
            max_tokens=60,
            # gpt-oss's sliding-window layers cannot be trimmed back: only a reply that
            # re-renders token for token is reused, and a random model's free text seldom
            # re-tokenizes as it was sampled; one token of analysis does
            extra_body={"thinking_token_budget": 1},
            # with logprobs every token is sampled and fed; otherwise the tokens the grammar
            # forces at the end (here the whole call) end the generation unfed, and the next
            # turn prefills them again
            logprobs=True,
        )
        usage = reply.usage
        if previous is not None:
            prompt_tokens, completion = previous
            cached = usage.prompt_tokens_details.cached_tokens
            assert cached >= prompt_tokens + completion - 1, (turn, cached, previous)
        message = reply.choices[0].message
        call = message.tool_calls[0]
        valid(call, SCHEMAS)
        assert message.reasoning_content  # the analysis is replayed: the template keeps it
        messages.append(message.model_dump(exclude_none=True))
        messages.append({"role": "tool", "tool_call_id": call.id, "content": "pong"})
        previous = (usage.prompt_tokens, usage.completion_tokens)


# -- bad input
@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"reasoning_effort": "extreme"}, "reasoning_effort"),
        (
            {"messages": [*ASK, {"role": "tool", "tool_call_id": "nope", "content": "x"}]},
            "messages[1]",
        ),
        (
            {
                "messages": [
                    *ASK,
                    {"role": "assistant", "content": "<|channel|>analysis<|message|>hi"},
                    *ASK,
                ]
            },
            "messages",
        ),
        (
            {
                "messages": [
                    *ASK,
                    {
                        "role": "assistant",
                        "content": None,
                        "tool_calls": [{**CALL, "function": {"name": "f", "arguments": "[1]"}}],
                    },
                ]
            },
            "messages[1]",
        ),
    ],
)
def test_bad_input_is_a_400_naming_the_field(
    served: ServerProcess, fields: dict, param: str
) -> None:
    body = {"model": "m", "messages": ASK, "max_tokens": 2, **fields}
    r = httpx.post(served.base_url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"].startswith(param), r.json()


# -- fuzzing
harmony_tool = st.fixed_dictionaries(
    {
        "type": st.just("function"),
        "function": st.fixed_dictionaries(
            {"name": st.one_of(name, st.sampled_from(["a b", "x<y", "functions.f"]))},
            optional={
                "parameters": schema,
                "description": st.one_of(st.none(), st.text(max_size=8)),
            },
        ),
    }
)
history_call = st.fixed_dictionaries(
    {
        "id": st.sampled_from(["c1", "c2"]),
        "type": st.just("function"),
        "function": st.fixed_dictionaries(
            {"name": name, "arguments": st.sampled_from(["{}", '{"a": 1}', "[", "null"])}
        ),
    }
)
history_message = st.one_of(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "system"]), "content": st.text(max_size=12)}
    ),
    st.fixed_dictionaries(
        {"role": st.just("assistant"), "content": st.one_of(st.none(), st.text(max_size=12))},
        optional={
            "reasoning_content": st.text(max_size=12),
            "tool_calls": st.lists(history_call, min_size=1, max_size=2),
        },
    ),
    st.fixed_dictionaries(
        {
            "role": st.just("tool"),
            "tool_call_id": st.sampled_from(["c1", "c2"]),
            "content": st.text(max_size=8),
        }
    ),
)


@SERVED_FUZZ
@given(
    tools=st.lists(harmony_tool, max_size=2),
    choice=st.sampled_from(["auto", "required", "none"]),
    history=st.lists(history_message, max_size=4),
    effort=st.sampled_from([None, "low", "high", "none", "bogus"]),
)
def test_fuzzed_requests_never_break_harmony(served: ServerProcess, tools, choice, history, effort):
    body: dict[str, Any] = {"messages": [*ASK, *history], "max_tokens": 4}
    if tools:
        body |= {"tools": tools, "tool_choice": choice}
    if effort is not None:
        body["reasoning_effort"] = effort
    r = post_fuzzed(served, body)
    if r.status_code == 200:
        message = r.json()["choices"][0]["message"]
        _clean(message.get("content"))
        _clean(message.get("reasoning_content"))


@settings(SERVED_FUZZ, max_examples=30)
@given(data=st.data())
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages", "/v1/responses"])
def test_fuzzed_bodies_never_break_harmony(served: ServerProcess, path: str, data) -> None:
    body = data.draw(json_body(path))
    with httpx.Client(base_url=served.base_url, timeout=60) as http:
        r = http.post(path, content=body, headers={"content-type": "application/json"})
        streamed = r.headers.get("content-type", "").startswith("text/event-stream")
        assert check(r.status_code, r.content, streamed, path) is None, (body, r.text[:300])
        if r.status_code == 200 and path == "/v1/chat/completions":  # it echoes nothing back
            for token in CONTROL:
                assert token.encode() not in r.content, (body, r.text[:300])
