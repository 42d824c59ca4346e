"""Reading a request body safely: bounded in size, JSON only, precise errors."""

from __future__ import annotations

import json
from typing import Any

from starlette.requests import ClientDisconnect, Request

from mlx_kvserve.api.errors import APIError


async def read_json(request: Request, limit: int) -> Any:
    """Return the parsed JSON body; 413 past `limit` bytes (checked while reading), 400 if bad."""
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            too_big = int(declared) > limit
        except ValueError:
            raise APIError(400, "Invalid Content-Length header.", code="invalid_request") from None
        if too_big:
            raise _too_large(limit)
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
    raw = b"".join(chunks)
    if not raw.strip():
        raise APIError(
            400, "The request body is empty; expected a JSON object.", code="invalid_json"
        )
    try:
        return json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise APIError(
            400, f"The request body is not valid JSON: {exc}", code="invalid_json"
        ) from None


def _too_large(limit: int) -> APIError:
    return APIError(
        413, f"The request body exceeds the limit of {limit} bytes.", code="request_too_large"
    )
