"""Reading a request body safely: bounded in size and time, JSON only, precise errors.

Past the JSON parser, the parsed value is checked once, without recursion, for what would
otherwise surface as a 500 deep inside a handler: nesting deeper than MAX_DEPTH (recursive code
downstream, e.g. JSON Schema compilers, would hit RecursionError) and strings holding lone UTF-16
surrogates (`"\\ud800"` is valid JSON escape syntax but cannot be encoded as UTF-8, so any error
message, log line or tokenizer call that touches it fails). Both are 400s naming the parameter.
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import NoReturn

from starlette.requests import ClientDisconnect, Request

from mlx_kvserve.api.errors import APIError
from mlx_kvserve.engine import faults
from mlx_kvserve.json_value import JSON

MAX_DEPTH = 64


async def read_json(request: Request, limit: int) -> JSON:
    """Return the parsed JSON body; 413 past `limit` bytes (checked while reading), 400 if bad,
    408 if the client takes longer than the body timeout to send it."""
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            too_big = int(declared) > limit
        except ValueError:
            raise APIError(400, "Invalid Content-Length header.", code="invalid_request") from None
        if too_big:
            raise _too_large(limit)
    timeout: float = request.app.state.settings.body_timeout
    try:
        async with asyncio.timeout(timeout):
            raw = await _read(request, limit)
    except TimeoutError:
        raise APIError(
            408,
            f"The request body did not arrive within {timeout:g} s.",
            code="request_timeout",
            headers={"Connection": "close"},
        ) from None
    faults.maybe_fail("read_body")
    return parse_json(raw)


async def _read(request: Request, limit: int) -> bytes:
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise _too_large(limit)
            chunks.append(chunk)
    except ClientDisconnect:
        raise APIError(400, "The client disconnected before sending the whole body.") from None
    return b"".join(chunks)


def parse_json(raw: bytes) -> JSON:
    """Parse and check a JSON body: strict JSON (no NaN), bounded depth, encodable strings."""
    if not raw.strip():
        raise APIError(
            400, "The request body is empty; expected a JSON object.", code="invalid_json"
        )
    try:
        value = json.loads(raw, parse_constant=_no_constant)
    except RecursionError:
        raise _too_deep(_deep_key(raw)) from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise APIError(
            400, f"The request body is not valid JSON: {exc}", code="invalid_json"
        ) from None
    except ValueError as exc:  # e.g. an integer with more digits than Python will convert
        raise APIError(
            400, f"The request body is not acceptable JSON: {exc}", code="invalid_json"
        ) from None
    check_value(value)
    return value


def check_value(value: JSON) -> None:
    """Raise a 400 naming the first string with a lone surrogate or the first too-deep value."""
    stack: list[tuple[JSON, tuple[str, ...]]] = [(value, ())]
    while stack:
        item, path = stack.pop()
        if len(path) > MAX_DEPTH:
            raise _too_deep(path)
        if isinstance(item, str):
            _check_text(item, path)
        elif isinstance(item, dict):
            for key, child in item.items():
                _check_text(key, (*path, key))
                stack.append((child, (*path, key)))
        elif isinstance(item, list):
            stack.extend((child, (*path, str(i))) for i, child in enumerate(item))


def _check_text(text: str, path: tuple[str, ...]) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        param = _param(path)
        raise APIError(
            400,
            f"Invalid value for '{param}': the string contains a lone UTF-16 surrogate "
            "(an unpaired \\ud800-\\udfff escape), which is not valid Unicode text.",
            param=param,
            code="invalid_value",
        ) from None


def _param(path: tuple[str, ...]) -> str:
    """'messages.0.content', with any undecodable part of a key shown escaped."""
    text = ".".join(path) if path else "(body)"
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _no_constant(name: str) -> NoReturn:
    raise APIError(
        400,
        f"The request body is not valid JSON: {name} is not a JSON value.",
        code="invalid_json",
    )


_TOKENS = re.compile(rb'"(?:[^"\\]|\\.)*"|[\[\]{}]')


def _deep_key(raw: bytes) -> tuple[str, ...] | None:
    """The top-level key under which `raw` nests too deeply (when the parser gave up first)."""
    depth, key = 0, None
    for match in _TOKENS.finditer(raw):
        token = match.group()
        if token[:1] == b'"':
            if depth == 1:
                key = token
        elif token in (b"[", b"{"):
            depth += 1
            if depth > MAX_DEPTH:
                break
        else:
            depth -= 1
    else:
        return None
    try:
        return (json.loads(key),) if key is not None else None
    except ValueError:
        return None


def _too_deep(path: tuple[str, ...] | None) -> APIError:
    where = f" under '{_param(path[:1])}'" if path else ""
    return APIError(
        400,
        f"The request body is nested more than {MAX_DEPTH} levels deep{where}.",
        param=_param(path[:1]) if path else None,
        code="invalid_json",
    )


def _too_large(limit: int) -> APIError:
    return APIError(
        413, f"The request body exceeds the limit of {limit} bytes.", code="request_too_large"
    )
