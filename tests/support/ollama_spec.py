"""Ollama's own OpenAPI description (tests/fixtures/ollama/openapi.yaml) as a checker of the
server's native responses, and an httpx hook that records every response a client received.

`Recorder` goes into a client's `event_hooks`: it reads each response whole (a streamed one
too: the client then iterates the bytes already read) and keeps (method, path, status,
content type, body). `check(recorded)` validates each against the schema the description
gives that path: one object, or each NDJSON line; an error against `ErrorResponse`, with its
`error` a string (the description requires nothing, so the fields Ollama's own integration tests
require of a final answer are checked here too).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import jsonschema
import yaml

SPEC_PATH = Path(__file__).resolve().parent.parent / "fixtures" / "ollama" / "openapi.yaml"

# path -> (schema of a one-object answer, schema of each NDJSON line); None: not described
SCHEMAS = {
    "/api/version": ("VersionResponse", None),
    "/api/tags": ("ListResponse", None),
    "/api/show": ("ShowResponse", None),
    "/api/ps": ("PsResponse", None),
    "/api/chat": ("ChatResponse", "ChatStreamEvent"),
    "/api/generate": ("GenerateResponse", "GenerateStreamEvent"),
    "/api/pull": ("StatusResponse", "StatusEvent"),
    "/api/embed": ("EmbedResponse", None),
    "/api/embeddings": (None, None),  # the legacy route: not in the description
}
# What ollama/ollama integration/api_test.go requires of a final chat or generate answer.
FINAL_FIELDS = (
    "model",
    "created_at",
    "done_reason",
    "total_duration",
    "load_duration",
    "prompt_eval_count",
    "prompt_eval_duration",
    "eval_count",
    "eval_duration",
)


@functools.cache
def spec() -> dict:
    return yaml.safe_load(SPEC_PATH.read_text(encoding="utf-8"))


def validator(schema: str) -> jsonschema.Draft202012Validator:
    document = {"$ref": f"#/components/schemas/{schema}", "components": spec()["components"]}
    return jsonschema.Draft202012Validator(document)


def validate(payload: object, schema: str) -> None:
    validator(schema).validate(payload)


@dataclass
class Recorded:
    method: str
    path: str
    status: int
    media: str
    body: bytes


@dataclass
class Recorder:
    seen: list[Recorded] = field(default_factory=list)

    def __call__(self, response: httpx.Response) -> None:
        response.read()
        media = response.headers.get("content-type", "").split(";")[0].strip()
        request = response.request
        self.seen.append(
            Recorded(
                request.method, request.url.path, response.status_code, media, response.content
            )
        )

    def hooks(self) -> dict:
        return {"response": [self]}

    def check(self) -> int:
        """Validate everything recorded since the last check; how many answers that was."""
        done, self.seen = self.seen, []
        for item in done:
            check(item)
        return len(done)


def check(item: Recorded) -> None:
    where = f"{item.method} {item.path} -> {item.status}"
    if item.status >= 400:
        body = json.loads(item.body)
        validate(body, "ErrorResponse")
        assert isinstance(body.get("error"), str) and body["error"], where
        assert set(body) == {"error"}, where
        return
    whole, line_schema = SCHEMAS[item.path]
    if item.media == "application/x-ndjson":
        assert line_schema is not None, where
        lines = [json.loads(line) for line in item.body.decode().splitlines() if line.strip()]
        assert lines, where
        for line in lines:
            assert "error" not in line, (where, line)
            validate(line, line_schema)
        _check_final(item.path, lines[-1], whole, where)
        return
    assert item.media == "application/json", where
    body = json.loads(item.body)
    if whole is None:  # a route Ollama's description leaves out: one JSON object
        assert isinstance(body, dict), where
        return
    validate(body, whole)
    _check_final(item.path, body, whole, where)


def _check_final(path: str, body: dict, schema: str, where: str) -> None:
    if path not in ("/api/chat", "/api/generate") or "status" in body:
        return
    validate(body, schema)  # the last line carries the whole answer's fields
    assert body["done"] is True, where
    if body["done_reason"] in ("load", "unload"):
        return
    missing = [name for name in FINAL_FIELDS if name not in body]
    assert not missing, (where, missing)
