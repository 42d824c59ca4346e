"""The tools the tool-format tests offer (tests/server/test_tools*.py and their unit twins): one
copy, so that every format is held to the same schemas and a change to them reaches all."""

from __future__ import annotations

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 24},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "detailed": {"type": "boolean"},
        "hours": {
            "type": "array",
            "items": {"type": "integer", "minimum": 0, "maximum": 23},
            "maxItems": 3,
        },
    },
    "required": ["city", "unit", "days"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"timezone": {"type": "string", "maxLength": 20}},
    "required": ["timezone"],
    # strict, as the Agents SDK sends: a JSON call (a JSON-body one such as Kimi's) is bounded
    # only so
    "additionalProperties": False,
}
PING = {  # a call with nothing left to choose (but a format's index): every token of it is forced
    "type": "object",
    "properties": {"host": {"type": "string", "enum": ["localhost"]}},
    "required": ["host"],
    "additionalProperties": False,
}


def function_tools(schemas: dict[str, dict]) -> list[dict]:
    """OpenAI chat tools, one a function, in the order given."""
    return [
        {"type": "function", "function": {"name": n, "parameters": p}} for n, p in schemas.items()
    ]


def opened(schema: dict) -> dict:
    """The schema without `additionalProperties` (as many clients send theirs)."""
    return {k: v for k, v in schema.items() if k != "additionalProperties"}


SCHEMAS = {"get_weather": WEATHER, "get_time": TIME, "ping": PING}
TOOLS = function_tools(SCHEMAS)
NAMED = {"type": "function", "function": {"name": "get_weather"}}
ASK = [{"role": "user", "content": "What's the weather in Paris?"}]
