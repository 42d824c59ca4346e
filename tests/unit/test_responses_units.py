"""The Responses adapter's pure parts, without a server: tools (namespace, custom, built-in),
input items (developer, custom calls, reasoning and its seal), and the stream state machine fed
hand-made output events (the reasoning events included, before the engine emits them)."""

from __future__ import annotations

from pathlib import Path

import pytest

from mlx_kvserve.api.errors import APIError
from mlx_kvserve.api.openai_responses import to_chat_request
from mlx_kvserve.api.openai_responses_schemas import ResponsesRequest
from mlx_kvserve.api.reading import Finished, Usage
from mlx_kvserve.api.responses_output import ResponseEvents, Shape
from mlx_kvserve.api.responses_tools import flat_name, parse_tools
from mlx_kvserve.chat.events import ContentDelta, ReasoningDelta, ToolCallDelta, ToolCallStarted
from mlx_kvserve.chat.reasoning.reasoning_seal import ReasoningSeal

PATCH_GRAMMAR = (
    Path(__file__).parents[1] / "fixtures" / "codex" / "tool_apply_patch.lark"
).read_text()
APPLY_PATCH = {
    "type": "custom",
    "name": "apply_patch",
    "description": "Edit files with a patch.",
    "format": {"type": "grammar", "syntax": "lark", "definition": PATCH_GRAMMAR},
}
AGENTS = {
    "type": "namespace",
    "name": "mcp__agents__",
    "description": "Sub-agents",
    "tools": [
        {"type": "function", "name": "spawn", "parameters": {"type": "object"}},
        {"type": "custom", "name": "note"},
    ],
}
SHELL = {"type": "function", "name": "shell", "parameters": {"type": "object"}}


def body(**fields) -> ResponsesRequest:
    return ResponsesRequest.model_validate({"input": "hi", **fields})


def test_codex_flat_names_follow_codex():
    assert flat_name("mcp__agents__", "spawn") == "mcp__agents__spawn"
    assert flat_name("crm", "_lookup") == "crm__lookup"
    assert flat_name(None, "shell") == "shell"


def test_tools_offered_and_built_ins_skipped():
    tools = parse_tools(body(tools=[SHELL, AGENTS, {"type": "web_search"}, APPLY_PATCH]))
    assert [(t.name, t.kind) for t in tools.tools] == [
        ("shell", "function"),
        ("mcp__agents__spawn", "function"),
        ("mcp__agents__note", "custom"),
        ("apply_patch", "custom"),
    ]
    assert tools.skipped == ["web_search"]
    assert tools.wire("mcp__agents__spawn") == ("mcp__agents__", "spawn")
    assert tools.wire("apply_patch") == (None, "apply_patch")
    assert tools.tools[3].grammar.definition == PATCH_GRAMMAR


@pytest.mark.parametrize(
    ("tools", "choice", "param"),
    [
        ([{"type": "hologram"}], None, "tools[0].type"),
        (
            [{**APPLY_PATCH, "format": {**APPLY_PATCH["format"], "definition": "start: ("}}],
            None,
            "tools[0].format.definition",
        ),
        (
            [
                {
                    **AGENTS,
                    "tools": [
                        {
                            "type": "custom",
                            "name": "x",
                            "format": {"type": "grammar", "syntax": "regex", "definition": "(("},
                        }
                    ],
                }
            ],
            None,
            "tools[0].tools[0].format.definition",
        ),
        ([{**AGENTS, "tools": [{"type": "web_search"}]}], None, "tools[0].tools[0].type"),
        ([SHELL, SHELL], None, "tools[1].name"),
        (
            [
                {
                    "type": "custom",
                    "name": "x",
                    "format": {"type": "grammar", "syntax": "ebnf", "definition": "a"},
                }
            ],
            None,
            "tools[0].format",
        ),
        ([{"type": "web_search"}], {"type": "web_search"}, "tool_choice.type"),
        ([SHELL], {"type": "allowed_tools", "mode": "auto", "tools": []}, "tool_choice.type"),
        ([SHELL], {"type": "custom", "name": "shell"}, "tool_choice"),
        ([AGENTS], {"type": "function", "name": "spawn", "namespace": "other"}, "tool_choice"),
    ],
)
def test_bad_tools_are_400s_naming_the_field(tools, choice, param):
    fields = {"tools": tools} | ({"tool_choice": choice} if choice else {})
    with pytest.raises(APIError) as caught:
        to_chat_request(body(**fields))
    assert caught.value.status == 400
    assert caught.value.param is not None and caught.value.param.startswith(param)


def test_tool_choice_finds_namespaced_and_custom_tools():
    tools = [AGENTS, APPLY_PATCH]
    forced = to_chat_request(body(tools=tools, tool_choice={"type": "function", "name": "spawn"}))
    assert (forced.tool_choice.mode, forced.tool_choice.name) == ("function", "mcp__agents__spawn")
    custom = to_chat_request(
        body(tools=tools, tool_choice={"type": "custom", "name": "apply_patch"})
    )
    assert custom.tool_choice.name == "apply_patch"


def test_codex_input_items(tmp_path):
    seal = ReasoningSeal.for_install(tmp_path)
    sealed = seal.seal("exact  sampled\ntext")
    items = [
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "D"}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "U"}]},
        {
            "type": "reasoning",
            "summary": [{"type": "summary_text", "text": "shown"}],
            "encrypted_content": sealed,
        },
        {"type": "custom_tool_call", "call_id": "call_1", "name": "apply_patch", "input": "RAW"},
        {"type": "custom_tool_call_output", "call_id": "call_1", "output": "done"},
        {
            "type": "reasoning",
            "summary": [{"type": "summary_text", "text": "visible"}],
            "encrypted_content": sealed[:-2] + "AA",
        },
        {
            "type": "function_call",
            "call_id": "call_2",
            "name": "spawn",
            "namespace": "mcp__agents__",
            "arguments": "{}",
        },
        {"type": "function_call_output", "call_id": "call_2", "output": "ok"},
    ]
    chat = to_chat_request(body(input=items, tools=[AGENTS, APPLY_PATCH]), seal=seal)
    roles = [m.role for m in chat.messages]
    assert roles == ["system", "user", "assistant", "tool", "assistant", "tool"]
    first, second = chat.messages[2], chat.messages[4]
    assert first.reasoning == "exact  sampled\ntext"  # the seal opened: the exact text
    assert first.tool_calls[0].kind == "custom" and first.tool_calls[0].arguments == "RAW"
    assert second.reasoning == "visible"  # a tampered seal: the visible text, never trusted
    assert second.tool_calls[0].name == "mcp__agents__spawn"


def test_non_string_encrypted_content_is_a_400():
    from mlx_kvserve.api.schemas import parse

    item = {"type": "reasoning", "summary": [], "encrypted_content": 12}
    with pytest.raises(APIError) as caught:
        parse(ResponsesRequest, {"input": [item]})
    assert caught.value.param == "input.0.encrypted_content"


def test_unknown_include_is_a_400_and_documented_ones_pass():
    from mlx_kvserve.api.schemas import parse

    parse(ResponsesRequest, {"input": "x", "include": ["reasoning.encrypted_content"]})
    with pytest.raises(APIError) as caught:
        parse(ResponsesRequest, {"input": "x", "include": ["reasoning.everything"]})
    assert caught.value.param.startswith("include")


def _machine(tmp_path, **fields) -> tuple[ResponseEvents, ReasoningSeal]:
    seal = ReasoningSeal.for_install(tmp_path)
    request = body(tools=[SHELL, AGENTS, APPLY_PATCH], **fields)
    return ResponseEvents(Shape("abc", "m", request, parse_tools(request), seal)), seal


FINISHED = Finished("stop", Usage(prompt_tokens=10, cached_tokens=4, completion_tokens=7))


def test_stream_machine_reasoning_then_message_then_calls(tmp_path):
    machine, seal = _machine(
        tmp_path, reasoning={"summary": "auto"}, include=["reasoning.encrypted_content"]
    )
    events = machine.start()
    for event in [
        ReasoningDelta("Let me "),
        ReasoningDelta("think."),
        ContentDelta("Done."),
        ToolCallStarted(0, "call_a", "mcp__agents__spawn"),
        ToolCallDelta(0, "{}"),
        ToolCallStarted(1, "call_b", "apply_patch"),
        ToolCallDelta(1, "*** Begin Patch\n"),
        ToolCallDelta(1, "*** End Patch"),
    ]:
        events += machine.feed(event)
    events += machine.finish(FINISHED)
    kinds = [k for k, _ in events]
    assert kinds[:5] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.reasoning_summary_part.added",
    ]
    for kind in [
        "response.reasoning_text.delta",
        "response.reasoning_summary_text.delta",
        "response.reasoning_text.done",
        "response.reasoning_summary_text.done",
        "response.function_call_arguments.done",
        "response.custom_tool_call_input.delta",
        "response.custom_tool_call_input.done",
    ]:
        assert kind in kinds, kind
    assert kinds[-1] == "response.completed"
    output = events[-1][1]["response"]["output"]
    assert [item["type"] for item in output] == [
        "reasoning",
        "message",
        "function_call",
        "custom_tool_call",
    ]
    reasoning = output[0]
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "Let me think."}]
    assert reasoning["summary"] == [{"type": "summary_text", "text": "Let me think."}]
    assert seal.open(reasoning["encrypted_content"]) == "Let me think."
    assert output[2]["name"] == "spawn" and output[2]["namespace"] == "mcp__agents__"
    assert output[3]["input"] == "*** Begin Patch\n*** End Patch" and "namespace" not in output[3]
    # output indexes are those of the items, in order
    done = [p for k, p in events if k == "response.output_item.done"]
    assert [p["output_index"] for p in done] == [0, 1, 2, 3]
    # and the stream parses with the official SDK's event types
    from openai.types.responses import ResponseStreamEvent
    from pydantic import TypeAdapter

    adapter = TypeAdapter(ResponseStreamEvent)
    for n, (kind, payload) in enumerate(events):
        adapter.validate_python({"type": kind, "sequence_number": n, **payload})


def test_stream_machine_without_summary_or_seal(tmp_path):
    machine, _ = _machine(tmp_path)
    events = machine.feed(ReasoningDelta("hmm")) + machine.finish(FINISHED)
    kinds = [k for k, _ in events]
    assert "response.reasoning_summary_text.delta" not in kinds
    reasoning = events[-1][1]["response"]["output"][0]
    assert reasoning["summary"] == [] and "encrypted_content" not in reasoning


@pytest.fixture(scope="module")
def tokenizer():
    from mlx_lm.tokenizer_utils import load

    from mlx_kvserve import paths
    from mlx_kvserve.models.resolve import local_model_dir, resolve_model

    _, ref = resolve_model(None, paths.data_dir(), progress=False)
    return load(Path(local_model_dir(ref)))


def test_replayed_custom_call_renders_as_the_grammar_made_the_model_write_it(tokenizer):
    """What the forced grammar lets the model write, replayed as a custom_tool_call item with its
    output, re-renders to the same text (so the prompt cache keeps the turn)."""
    import llguidance

    from mlx_kvserve.chat.grammar import GrammarCompiler
    from mlx_kvserve.chat.render import render_chat

    tools = [SHELL, AGENTS, {"type": "web_search"}, APPLY_PATCH]
    first = body(
        input=[{"role": "user", "content": "Add a.txt"}],
        tools=tools,
        tool_choice={"type": "custom", "name": "apply_patch"},
    )
    chat = to_chat_request(first)
    prompt = render_chat(tokenizer, chat)
    written = (
        '<tool_call>\n{"name": "apply_patch"}\n'
        "*** Begin Patch\n*** Add File: a.txt\n+hi\n*** End Patch\n\n</tool_call>"
    )
    compiler = GrammarCompiler(tokenizer)
    matcher = llguidance.LLMatcher(
        compiler._llg_tokenizer(), compiler.grammar_for(chat, prompt.tool_format), log_level=0
    )
    ids = compiler._llg_tokenizer().tokenize_str(written)
    assert matcher.validate_tokens(ids) == len(ids)  # the grammar allows exactly this text
    call = {"type": "custom_tool_call", "call_id": "call_1", "name": "apply_patch"}
    call["input"] = "*** Begin Patch\n*** Add File: a.txt\n+hi\n*** End Patch\n"
    output = {"type": "custom_tool_call_output", "call_id": "call_1", "output": "Done!"}
    second = body(input=[{"role": "user", "content": "Add a.txt"}, call, output], tools=tools)
    replayed = tokenizer.decode(render_chat(tokenizer, to_chat_request(second)).tokens)
    assert replayed.startswith(tokenizer.decode(prompt.tokens) + written)


def _feed_in_pieces(parser, text: str, seed: int) -> list:
    import random

    rnd = random.Random(seed)
    events, at = [], 0
    while at < len(text):
        size = rnd.randint(1, 9)
        events += parser.feed(text[at : at + size])
        at += size
    return events + parser.finish()


@pytest.mark.parametrize("seed", range(12))
def test_parser_reads_freeform_calls_in_any_split(seed):
    """Hermes-fallback freeform calls: the raw input (which may hold the closing tag inside a
    line) streams in deltas that concatenate to the call's input; function calls still parse."""
    from mlx_kvserve.chat.formats.hermes import FORMAT as HERMES
    from mlx_kvserve.chat.output import OutputParser

    tools = parse_tools(body(tools=[SHELL, APPLY_PATCH, {"type": "custom", "name": "note"}]))
    patch = "*** Begin Patch\n*** Add File: a.txt\n+</tool_call> is fine here\n*** End Patch\n"
    text = (
        "Sure.\n"
        f'<tool_call>\n{{"name": "apply_patch"}}\n{patch}\n</tool_call>\n'
        '<tool_call>\n{"name": "shell", "arguments": {"command": ["ls"]}}\n</tool_call>\n'
        '<tool_call>\n{"name": "note"}\n\n</tool_call>'
    )
    parser = OutputParser(HERMES, tools.tools)
    events = _feed_in_pieces(parser, text, seed)
    assert [(c.name, c.kind, c.arguments) for c in parser.calls] == [
        ("apply_patch", "custom", patch),
        ("shell", "function", '{"command": ["ls"]}'),
        ("note", "custom", ""),
    ]
    first = "".join(e.arguments for e in events if isinstance(e, ToolCallDelta) and e.index == 0)
    assert first == patch and parser.content == "Sure."


@pytest.mark.parametrize("cut", range(1, len("\n</tool_call>")))
def test_a_call_cut_inside_its_closing_tag_keeps_only_its_input(cut):
    """Generation cut off (max_tokens) part-way through the closing tag: the tag's start is not
    the call's, freeform input and function arguments alike."""
    from mlx_kvserve.chat.formats.hermes import FORMAT as HERMES
    from mlx_kvserve.chat.output import OutputParser

    tools = parse_tools(body(tools=[SHELL, APPLY_PATCH]))
    patch = "*** Begin Patch\n*** Add File: a.txt\n+hi\n*** End Patch\n"
    closing = "\n</tool_call>"[:cut]
    freeform = f'<tool_call>\n{{"name": "apply_patch"}}\n{patch}{closing}'
    function = f'<tool_call>\n{{"name": "shell", "arguments": {{"command": ["ls"]}}}}{closing}'
    for text, expected in ((freeform, patch), (function, '{"command": ["ls"]}')):
        parser = OutputParser(HERMES, tools.tools)
        events = _feed_in_pieces(parser, text, cut)
        assert [c.arguments for c in parser.calls] == [expected], text
        streamed = "".join(e.arguments for e in events if isinstance(e, ToolCallDelta))
        assert streamed == expected and parser.content == ""


def test_parser_reads_a_custom_call_in_its_json_form():
    """A model with its own template calls a custom tool as a function of `input`."""
    from mlx_kvserve.chat.formats.hermes import FORMAT as HERMES
    from mlx_kvserve.chat.output import OutputParser

    tools = parse_tools(body(tools=[APPLY_PATCH]))
    parser = OutputParser(HERMES, tools.tools)
    text = '<tool_call>\n{"name": "apply_patch", "arguments": {"input": "a\\nb"}}\n</tool_call>'
    events = _feed_in_pieces(parser, text, 0)
    assert [(c.kind, c.arguments) for c in parser.calls] == [("custom", "a\nb")]
    deltas = [e.arguments for e in events if isinstance(e, ToolCallDelta)]
    assert deltas == ["a\nb"]  # sent whole, raw, never as JSON fragments
