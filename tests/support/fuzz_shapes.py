"""Hypothesis strategies for the shapes the agent CLIs send: Responses (Codex) tools, items and
reasoning; Anthropic (Claude Code) blocks, signatures, thinking and context edits."""

from __future__ import annotations

from hypothesis import strategies as st

from tests.support.fuzz_values import anything, integers, maybe, message, name, schema, text

# Responses (Codex) tool shapes: function, custom (freeform, with grammars llguidance may reject),
# namespace groups, built-in tools the server skips, and unknown types.
grammar_format = st.one_of(
    st.just({"type": "text"}),
    st.fixed_dictionaries(
        {
            "type": maybe(st.just("grammar")),
            "syntax": maybe(st.sampled_from(["lark", "regex", "ebnf"])),
            "definition": st.one_of(
                st.sampled_from(
                    [
                        'start: "*** Begin Patch" LF /(.+)/ LF\n%import common.LF',
                        "start: (",
                        "[a-z]+",
                        "((",
                        "start: @nowhere",
                        '%llguidance {"bad": 1}\nstart: "x"',
                        "start: a\na: a",
                    ]
                ),
                text,
                anything,
            ),
        }
    ),
    anything,
)
responses_function = st.fixed_dictionaries(
    {"type": st.just("function"), "name": maybe(name)},
    optional={"parameters": schema, "description": maybe(text), "strict": maybe(st.booleans())},
)
custom_tool = st.fixed_dictionaries(
    {"type": st.just("custom"), "name": maybe(st.one_of(st.just("apply_patch"), name))},
    optional={"format": grammar_format, "description": maybe(text)},
)
responses_tool = st.one_of(
    responses_function,
    custom_tool,
    st.fixed_dictionaries(
        {
            "type": st.just("namespace"),
            "name": maybe(st.one_of(st.just("mcp__agents__"), text)),
            "tools": st.one_of(
                st.lists(st.one_of(responses_function, custom_tool), max_size=2), anything
            ),
        },
        optional={"description": maybe(text)},
    ),
    st.fixed_dictionaries(
        {"type": st.sampled_from(["web_search", "file_search", "mcp", "local_shell", "hologram"])}
    ),
)
responses_item = st.one_of(
    message,
    st.fixed_dictionaries(
        {"type": st.sampled_from(["function_call", "custom_tool_call"])},
        optional={
            "call_id": maybe(st.just("call_1")),
            "name": maybe(st.sampled_from(["apply_patch", "spawn", "get_weather"])),
            "namespace": maybe(st.just("mcp__agents__")),
            "arguments": maybe(text),
            "input": maybe(text),
        },
    ),
    st.fixed_dictionaries(
        {"type": st.sampled_from(["function_call_output", "custom_tool_call_output"])},
        optional={"call_id": maybe(st.just("call_1")), "output": maybe(text)},
    ),
    st.fixed_dictionaries(
        {"type": st.just("reasoning")},
        optional={
            "summary": st.one_of(
                st.lists(st.fixed_dictionaries({"type": st.just("summary_text"), "text": text})),
                anything,
            ),
            "content": anything,
            "encrypted_content": st.one_of(
                st.just("mkv1.aGk.AAAA"), st.just("gAAAAB-openai-opaque"), text, anything
            ),
        },
    ),
)
cache_control = st.one_of(
    st.just({"type": "ephemeral"}), st.just({"type": "ephemeral", "ttl": "1h"}), anything
)
anthropic_tool = st.fixed_dictionaries(
    {"name": maybe(name)},
    optional={
        "input_schema": schema,
        "description": maybe(text),
        "cache_control": cache_control,
        "type": maybe(
            st.sampled_from(
                ["custom", "web_search_20250305", "bash_20250124", "text_editor_20250728", "x"]
            )
        ),
    },
)
# Anthropic content blocks: every type the API lists that Claude Code sends, and some it does not.
block_type = st.sampled_from(
    ["text", "tool_use", "tool_result", "thinking", "redacted_thinking", "image", "document"]
    + ["server_tool_use", "search_result", "compaction", "", "wizard"]
)
signature = st.one_of(
    st.just("mkv1.aGk.AAAA"), st.just("mkv1..."), st.just("EqQBCkYIBxgC"), text, anything
)
anthropic_block = st.fixed_dictionaries(
    {"type": maybe(block_type)},
    optional={
        "text": maybe(text),
        "thinking": maybe(text),
        "signature": signature,
        "data": signature,
        "id": maybe(text),
        "name": maybe(name),
        "input": anything,
        "tool_use_id": maybe(text),
        "content": st.one_of(text, st.lists(st.fixed_dictionaries({"type": block_type}))),
        "cache_control": cache_control,
    },
)
anthropic_message = st.fixed_dictionaries(
    {
        "role": maybe(st.sampled_from(["user", "assistant", "system", "developer"])),
        "content": st.one_of(text, st.lists(anthropic_block, max_size=3), anything),
    },
    optional={"clear_at": maybe(st.sampled_from(["next_user_message", "never"]))},
)
thinking = st.one_of(
    st.fixed_dictionaries(
        {"type": maybe(st.sampled_from(["enabled", "adaptive", "disabled", "between_tools"]))},
        optional={
            "budget_tokens": maybe(st.sampled_from([0, 1023, 1024, 2048, 2**64])),
            "display": maybe(st.sampled_from(["summarized", "omitted", "updates"])),
        },
    ),
    anything,
)
context_edit = st.fixed_dictionaries(
    {
        "type": maybe(
            st.sampled_from(["clear_thinking_20251015", "clear_tool_uses_20250919"])
            | st.sampled_from(["compact_20260112", "clear_all"])
        )
    },
    optional={
        "keep": st.one_of(
            st.just("all"),
            st.fixed_dictionaries(
                {"type": maybe(st.sampled_from(["thinking_turns", "all", "tool_uses"]))},
                optional={"value": maybe(integers)},
            ),
            anything,
        ),
        "trigger": anything,
        "exclude_tools": anything,
        "clear_tool_inputs": anything,
    },
)
