"""Errors in each protocol's own shape.

OpenAI routes answer {"error": {"message", "type", "param", "code"}}; the Anthropic Messages
routes answer {"type": "error", "error": {"type", "message"}} with Anthropic's error types (and
529 for a full queue); Ollama's native routes (`/api/...`) answer {"error": "message"}. Every
failure a client can cause maps to one of these; tracebacks stay in the server log.
"""

from __future__ import annotations

from starlette.responses import JSONResponse

from mlx_kvserve.json_value import JSON

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
}


ANTHROPIC_PREFIXES = ("/v1/messages", "/messages")
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def is_anthropic(path: str) -> bool:
    return path.startswith(ANTHROPIC_PREFIXES)


def is_ollama(path: str) -> bool:
    return path == "/api" or path.startswith("/api/")


class APIError(Exception):
    """Raise anywhere in a handler to answer with an error in the route's protocol's shape."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
        overloaded: bool = False,
    ) -> None:
        super().__init__(message)
        self.overloaded = overloaded  # the queue is full (Anthropic: 529 overloaded_error)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, JSON]:
        return {
            "error": {
                "message": self.message,
                "type": _TYPES.get(self.status, "invalid_request_error"),
                "param": self.param,
                "code": self.code,
            }
        }

    def anthropic_body(self) -> dict[str, JSON]:
        kind = "overloaded_error" if self.overloaded else None
        kind = kind or _ANTHROPIC_TYPES.get(self.status, "invalid_request_error")
        return {"type": "error", "error": {"type": kind, "message": self.message}}

    def ollama_body(self) -> dict[str, JSON]:
        return {"error": self.message}

    def response(self, path: str = "") -> JSONResponse:
        """The error as an HTTP response, shaped for the protocol that `path` belongs to."""
        if is_ollama(path):
            return JSONResponse(self.ollama_body(), status_code=self.status, headers=self.headers)
        if is_anthropic(path):
            status = 529 if self.overloaded else self.status
            return JSONResponse(self.anthropic_body(), status_code=status, headers=self.headers)
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)
