"""Request shapes of the real agent CLIs, recorded as fixtures with their texts redacted.

A recorded request keeps what makes it a protocol case: method, path and query string, the
protocol headers, every key, role, block and tool type, tool names, JSON Schemas' structure, ids
and numbers. Every prose string (system prompts, tool descriptions, user words, reminders) is the
vendor's text, not ours: it is replaced by filler of the same length, so the replayed request
tokenizes to about as many tokens as the real one. Claude Code's billing-header line is kept (its
shape is what the server strips). The slow CLI tests (tests/clients/test_agent_clis.py) write
the fixtures when run with `MLX_KVSERVE_RECORD_CLI_SHAPES=1`; tests/clients/test_cli_shapes.py
replays them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.support.cli_proxy import Exchange

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "cli"

# Headers that carry protocol, not identity (session ids, user agents, installation ids go).
PROTOCOL_HEADERS = ("accept", "content-type", "anthropic-version", "anthropic-beta", "x-app")
# String values kept as they are: they name structure, not prose.
STRUCTURAL_KEYS = frozenset(
    {
        "type",
        "role",
        "name",
        "model",
        "effort",
        "summary",
        "tool_choice",
        "id",
        "tool_use_id",
        "call_id",
        "status",
        "syntax",
        "format",
        "keep",
        "trigger",
        "$schema",
        "namespace",
        "verbosity",
        "truncation",
        "service_tier",
        "detail",  # an image's detail level
        "display",  # thinking's display mode
        "media_type",
    }
)
STRUCTURAL_LISTS = frozenset({"required", "enum", "include", "type"})
KEPT_PREFIXES = ("x-anthropic-billing-header:",)
FILLER = "lorem ipsum dolor sit amet consectetur adipiscing elit sed do eiusmod tempor "


def filler(text: str) -> str:
    """Filler of `text`'s length, keeping its line breaks (templates and tokenizers see them)."""
    out = []
    for i, line in enumerate(text.split("\n")):
        reps = FILLER * (len(line) // len(FILLER) + 1)
        out.append(("\n" if i else "") + reps[: len(line)])
    return "".join(out)


def redact(value: Any, key: str | None = None, in_structural_list: bool = False) -> Any:
    if isinstance(value, dict):
        return {k: redact(v, k) for k, v in value.items()}
    if isinstance(value, list):
        return [redact(v, key, key in STRUCTURAL_LISTS) for v in value]
    if isinstance(value, str):
        if key in STRUCTURAL_KEYS or in_structural_list or value.startswith(KEPT_PREFIXES):
            return value
        return filler(value)
    return value


def shape_of(exchange: Exchange) -> dict[str, Any]:
    headers = {k: v for k, v in exchange.headers.items() if k.lower() in PROTOCOL_HEADERS}
    return {
        "method": exchange.method,
        "path": exchange.path,
        "query": exchange.query,
        "headers": headers,
        "body": redact(exchange.body),
        "status": exchange.status,
    }


def write_fixture(name: str, exchanges: list[Exchange], note: str) -> Path:
    """Write the redacted shapes of a CLI run to tests/fixtures/cli/NAME.json."""
    FIXTURES.mkdir(parents=True, exist_ok=True)
    path = FIXTURES / f"{name}.json"
    doc = {"note": note, "requests": [shape_of(e) for e in exchanges if e.body is not None]}
    path.write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n")
    return path


def load_fixture(name: str) -> list[dict[str, Any]]:
    return json.loads((FIXTURES / f"{name}.json").read_text())["requests"]
