"""Hypothesis strategies for hostile values: text with lone surrogates and template markup,
integers past 2^64, anything nested, and the shared shapes of messages, schemas and tools.

Used by tests/support/fuzz_shapes.py, tests/support/fuzzing.py and the tool-format tests' hostile
tools; needs hypothesis.
"""

from __future__ import annotations

from hypothesis import strategies as st

MODEL = "SmolLM2-135M-Instruct"
POST_PATHS = (
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/messages",
    "/v1/messages/count_tokens",
    "/v1/responses",
    "/v1/messages?beta=true",  # as Claude Code calls it
    "/v1/messages/count_tokens?beta=true",
    "/tokenize",
    "/detokenize",
)
GET_PATHS = ("/health", "/v1/models", "/v1/cache", "/tokenizer_info")
TOKEN_LIMITS = ("max_tokens", "max_completion_tokens", "max_output_tokens")
MAX_GENERATED = 2
DEEP = "__DEEP__"

lone_surrogates = st.sampled_from(["\ud800", "\udfff", "a\ud800b", "\udc00x", "x\udbff"])
special_text = st.sampled_from(
    ["", " ", "\x00", "\u2028", "😀", "<|im_start|>system\n", "{{ raise_exception('x') }}", "%s"]
)
text = st.one_of(st.text(max_size=40), lone_surrogates, special_text)
integers = st.one_of(
    st.integers(min_value=-3, max_value=3),
    st.sampled_from([-(2**63), 2**63 - 1, 2**64 - 1, 2**64, 2**70, -(2**64)]),
    st.integers(),
)
leaf = st.one_of(
    st.none(), st.booleans(), integers, st.floats(allow_nan=False, allow_infinity=False), text
)
anything = st.recursive(
    leaf,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(text, inner, max_size=3),
    max_leaves=8,
)


def maybe(strategy: st.SearchStrategy) -> st.SearchStrategy:
    return st.one_of(strategy, anything)


role = st.sampled_from(["system", "developer", "user", "assistant", "tool", "wizard", ""])
part = st.fixed_dictionaries(
    {"type": st.sampled_from(["text", "image_url", "input_text", "tool_result"])},
    optional={"text": maybe(text), "content": maybe(text)},
)
message = st.fixed_dictionaries(
    {},
    optional={
        "role": maybe(role),
        "content": st.one_of(text, st.lists(part, max_size=3), anything),
        "name": maybe(text),
        "tool_call_id": maybe(text),
        "tool_calls": anything,
        "reasoning_content": maybe(text),
        "reasoning": maybe(text),
    },
)
# Tools and output formats: the grammar compiler is a failure surface of its own.
schema = st.one_of(
    st.just({"type": "object", "properties": {"a": {"type": "string"}}}),
    st.just({"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}),
    st.just({"type": "string", "pattern": "(("}),
    st.just({"type": "array", "minItems": 5, "maxItems": 1}),
    st.dictionaries(st.sampled_from(["type", "properties", "required", "enum"]), anything),
    anything,
)
name = st.one_of(st.just("get_weather"), text)
openai_tool = st.fixed_dictionaries(
    {"type": maybe(st.just("function"))},
    optional={
        "function": st.fixed_dictionaries(
            {"name": maybe(name)}, optional={"parameters": schema, "strict": maybe(st.booleans())}
        )
    },
)
tool_choice = st.one_of(
    st.sampled_from(["auto", "required", "none", "any"]),
    st.fixed_dictionaries(
        {
            "type": st.sampled_from(
                ["function", "tool", "auto", "any", "none", "custom", "web_search"]
            )
        },
        optional={"name": maybe(name), "function": st.fixed_dictionaries({"name": maybe(name)})},
    ),
)
response_format = st.one_of(
    st.just({"type": "json_object"}),
    st.fixed_dictionaries(
        {"type": st.just("json_schema")},
        optional={
            "json_schema": st.fixed_dictionaries({"name": maybe(text)}, optional={"schema": schema})
        },
    ),
)
# Template variables: the ones templates read, apply_chat_template's own parameters (which must
# be refused, not passed on), and any other name.
template_key = st.one_of(
    st.sampled_from(
        ["enable_thinking", "thinking", "reasoning_effort", "preserve_thinking", "tools"]
        + ["tokenize", "add_generation_prompt", "chat_template", "messages", "return_dict"]
    ),
    text,
)
effort = st.sampled_from(["none", "minimal", "low", "medium", "high", "xhigh", "max", "extreme"])


def hostile_property(
    leaf: st.SearchStrategy, *others: st.SearchStrategy, **bounds: st.SearchStrategy
) -> st.SearchStrategy:
    """A parameter's schema as hostile clients write it: one of `schema`'s, or typed with odd
    bounds (more in `bounds`) and list items of `leaf`'s shape, or one of `others`."""
    typed = st.fixed_dictionaries(
        {"type": st.sampled_from(["string", "integer", "number", "boolean", "null", "array"])},
        optional={
            "enum": st.lists(st.text(max_size=8), max_size=3),
            "maxLength": st.integers(-2, 5),
            **bounds,
            "items": leaf,
        },
    )
    return st.one_of(schema, typed, *others)


def hostile_tool(
    key: st.SearchStrategy, prop: st.SearchStrategy, odd_names: list[str]
) -> st.SearchStrategy:
    """Function tools as hostile clients write them for one call syntax: names it cannot hold
    (`odd_names`), schemas of every shape, and parameters under `key`s of `prop`'s shapes."""
    tool_name = st.one_of(
        st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,8}", fullmatch=True),
        st.sampled_from(odd_names),
        name,
    )
    parameters = st.fixed_dictionaries(
        {"type": st.just("object"), "properties": st.dictionaries(key, prop, max_size=3)},
        optional={"required": st.lists(key, max_size=3)},
    )
    return st.fixed_dictionaries(
        {
            "type": st.just("function"),
            "function": st.fixed_dictionaries(
                {"name": tool_name}, optional={"parameters": st.one_of(schema, parameters)}
            ),
        }
    )
