"""The one error a request can cause below the wire protocols; each adapter renders it its way."""

from __future__ import annotations


class InvalidRequest(Exception):
    """The client's request cannot be served as sent (a 400 in every protocol)."""

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code or "invalid_request"
