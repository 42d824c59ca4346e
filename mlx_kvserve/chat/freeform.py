"""Calls to custom (freeform) tools in the model's text: recognising them and their raw input.

In the Hermes fallback (chat.formats.hermes) a custom tool's call is its name alone as JSON on
the first line, then the raw input unquoted, then `\\n</tool_call>`. On a native template a
custom tool is shown as a function of one string parameter, `input`, so its call comes back as
JSON arguments `{"input": ...}`. Both become one `ToolCall(kind="custom")` carrying the raw input.
"""

from __future__ import annotations

import json

from mlx_kvserve.json_value import JSON


def freeform_name(body: str, custom: set[str]) -> str | None:
    """The custom tool a call body `{"name": ...}` (the name alone) opens, or None."""
    try:
        value = json.loads(body)
    except (json.JSONDecodeError, RecursionError):
        return None
    if isinstance(value, dict) and list(value) == ["name"] and value["name"] in custom:
        return value["name"]
    return None


def freeform_head(name: str) -> str:
    """The first line of a Hermes-fallback custom-tool call: the tool's name alone."""
    return json.dumps({"name": name}, ensure_ascii=False)


def raw_input(after_name: str) -> str:
    """The raw input of a freeform call from the text after its name line (the newline that
    separates them is not part of the input)."""
    return after_name[1:] if after_name.startswith("\n") else after_name


def input_from_arguments(arguments: JSON) -> str:
    """A custom tool's raw input from the JSON-arguments form `{"input": "..."}`; any other
    shape is passed on as its JSON text, so nothing the model wrote is lost."""
    if isinstance(arguments, dict) and isinstance(arguments.get("input"), str):
        return arguments["input"]
    if isinstance(arguments, str):
        return arguments
    return json.dumps(arguments, ensure_ascii=False)
