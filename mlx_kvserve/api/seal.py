"""The app's one ReasoningSeal, shared by every protocol that hands out replay handles
(Anthropic `signature`, Responses `encrypted_content`)."""

from __future__ import annotations

from starlette.requests import Request

from mlx_kvserve.chat.reasoning_seal import ReasoningSeal


def reasoning_seal(request: Request) -> ReasoningSeal:
    """`app.state.reasoning_seal`, made from the install's key (data directory) on first use."""
    state = request.app.state
    seal = getattr(state, "reasoning_seal", None)
    if seal is None:
        seal = state.reasoning_seal = ReasoningSeal.for_install()
    return seal
