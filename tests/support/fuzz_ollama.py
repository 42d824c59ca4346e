"""Hostile Ollama bodies for `/api/chat`, `/api/generate`, `/api/show` and `/api/pull`
(tests/clients/test_ollama.py): a valid body with some fields replaced by odd or wrong values
(options of every known name and unknown ones, durations, think levels, formats, tool calls
with object or text arguments, images, Go templates, token-id contexts, suffixes), or any JSON
value. Generation stays at two tokens at
most, and a valid `keep_alive` never unloads the module's model.
"""

from __future__ import annotations

import json
from typing import Any

from hypothesis import strategies as st

from tests.support.fuzz_values import anything, integers, maybe, name, schema, text

MODEL = "SmolLM2-135M-Instruct"
PATHS = ("/api/chat", "/api/generate", "/api/show", "/api/pull")
OPTION_NAMES = ["num_predict", "temperature", "top_k", "top_p", "min_p", "seed", "stop"]
OPTION_NAMES += ["num_ctx", "repeat_penalty", "use_mmap", "num_gpu", "mirostat", "tfs_z", ""]
OPTION_NAMES += ["draft_num_predict"]
numbers = st.one_of(integers, st.floats(allow_nan=False, allow_infinity=False))
option_value = st.one_of(numbers, st.booleans(), text, st.lists(text, max_size=3), anything)
options = st.one_of(st.dictionaries(st.sampled_from(OPTION_NAMES), option_value), anything)
# never 0 or another duration a random draw could make: the model would unload
keep_alive = st.one_of(st.sampled_from(["5m", "1h30m", -1, "-1m", "soon", "5 m", "", True]), text)
think = st.one_of(
    st.sampled_from([True, False, "low", "medium", "high", "max", "extreme"]), anything
)
arguments = st.one_of(st.dictionaries(text, anything, max_size=2), text, anything)
tool_call = st.fixed_dictionaries(
    {"function": st.fixed_dictionaries({"name": maybe(name)}, optional={"arguments": arguments})},
    optional={"id": maybe(text)},
)
message = st.fixed_dictionaries(
    {"role": maybe(st.sampled_from(["system", "user", "assistant", "tool", "USER", "wizard"]))},
    optional={
        "content": maybe(text),
        "thinking": maybe(text),
        "images": st.one_of(st.just([]), st.lists(text, max_size=1), anything),
        "tool_calls": st.one_of(st.lists(tool_call, max_size=2), anything),
        "tool_name": maybe(name),
        "tool_call_id": maybe(text),
    },
)
ollama_tool = st.fixed_dictionaries(
    {"type": maybe(st.just("function"))},
    optional={
        "function": st.fixed_dictionaries({"name": maybe(name)}, optional={"parameters": schema})
    },
)
# Go templates of the subset the server renders (api/ollama_template.py), and broken ones
template_part = st.one_of(
    st.sampled_from(
        [
            "{{ .System }}",
            "{{ .Prompt }}",
            "{{ .Response }}",
            "{{ .Suffix }}",
            "{{ if .System }}",
            "{{ if .Suffix }}",
            "{{ else if .Prompt }}",
            "{{ else }}",
            "{{ end }}",
            "{{- .Prompt -}}",
            "{{/* note */}}",
            "{{ range .Messages }}",
            "{{ .Prompt",
            "}}",
        ]
    ),
    text,
)
go_template = st.lists(template_part, max_size=6).map("".join)
FIELDS: dict[str, st.SearchStrategy] = {
    "model": st.one_of(st.just(MODEL), st.just(MODEL + ":latest"), text, anything),
    "messages": st.one_of(st.lists(message, max_size=3), anything),
    "prompt": maybe(text),
    "system": maybe(text),
    "suffix": maybe(text),
    "template": st.one_of(go_template, maybe(text)),
    "raw": maybe(st.booleans()),
    "context": st.one_of(
        st.lists(st.integers(0, 49151), max_size=8), st.lists(integers, max_size=3), anything
    ),
    "images": st.one_of(st.just([]), anything),
    "format": st.one_of(st.sampled_from(["json", "", "yaml"]), schema),
    "options": options,
    "stream": maybe(st.booleans()),
    "keep_alive": keep_alive,
    "think": think,
    "tools": st.one_of(st.lists(ollama_tool, max_size=2), anything),
    "logprobs": maybe(st.booleans()),
    "top_logprobs": maybe(integers),
    "name": maybe(text),
    "verbose": maybe(st.booleans()),
}


@st.composite
def ollama_body(draw: st.DrawFn, path: str) -> bytes:
    if draw(st.integers(0, 9)) == 0:
        return json.dumps(draw(anything), ensure_ascii=True).encode()
    body: dict[str, Any] = {"model": MODEL}
    if path == "/api/chat":
        body["messages"] = [{"role": "user", "content": draw(text)}]
    elif path == "/api/generate":
        body["prompt"] = draw(text) or "x"
    fields = draw(st.lists(st.sampled_from(list(FIELDS)), max_size=3, unique=True))
    body.update({field: draw(FIELDS[field]) for field in fields})
    if isinstance(body.get("options"), dict) or "options" not in body:
        given = body.get("options") or {}
        body["options"] = {**given, "num_predict": 2}  # a valid body answers in two tokens
    return json.dumps(body, ensure_ascii=True).encode()  # lone surrogates as \udxxx escapes
