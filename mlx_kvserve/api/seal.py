"""The app's one ReasoningSeal, shared by every protocol that hands out replay handles
(Anthropic `signature`, Responses `encrypted_content`)."""

from __future__ import annotations

import logging
import secrets

from starlette.requests import Request

from mlx_kvserve.chat.reasoning.reasoning_seal import ReasoningSeal
from mlx_kvserve.chat.reasoning.seal_key import KEY_BYTES

log = logging.getLogger("mlx_kvserve.api")


def make_reasoning_seal() -> ReasoningSeal:
    """The install's seal (its key kept in the data directory, so seals outlive a restart); with
    an unwritable data directory, a key for this process only (seals open until it exits)."""
    try:
        return ReasoningSeal.for_install()
    except OSError as exc:
        log.warning("reasoning seals last until exit: cannot keep their key (%s)", exc)
        return ReasoningSeal(secrets.token_bytes(KEY_BYTES))


def reasoning_seal(request: Request) -> ReasoningSeal:
    """`app.state.reasoning_seal`, made with the app (api/app.py)."""
    return request.app.state.reasoning_seal
