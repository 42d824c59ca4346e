"""The one alias for a JSON value, the only thing in the package typed `Any`.

A JSON value is recursive (objects and arrays of values) and untyped where it crosses the
boundary: a request body, a peer's message, a config or model file, a chat template's
variables. Until code checks its shape (pydantic models, `isinstance`), nothing better than
`Any` can be said of it, so it is said once, here, under its own name. Everything else, a
collaborator above all, has a real type: a class, a `Protocol` or a `Callable[...]`
(tests/unit/test_any_is_json.py keeps it so).
"""

from typing import Any

JSON = Any
"""A parsed JSON value: None, bool, int, float, str, list[JSON] or dict[str, JSON]."""

__all__ = ["JSON"]
