"""The model's tokenizer over HTTP, in vLLM's shapes, as lm-evaluation-harness's
`tokenizer_backend=remote` calls it: `POST /tokenize` (`prompt`, `add_special_tokens`) answers
`tokens`, `count` and `max_model_len`; `POST /detokenize` (`tokens`) answers `prompt`;
`GET /tokenizer_info` answers the special tokens, the chat template and the context length.
Each takes an optional `model` (a query parameter for the GET); the model loads if it must.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, TypeVar

from pydantic import Field
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from mlx_kvserve.api.body import read_json
from mlx_kvserve.api.engine_view import EngineView
from mlx_kvserve.api.errors import APIError
from mlx_kvserve.api.generation import acquire_model, served_model
from mlx_kvserve.api.schemas import _Body, parse
from mlx_kvserve.json_value import JSON
from mlx_kvserve.vocabulary import unknown_token_id, vocabulary_size

T = TypeVar("T")


class TokenizeBody(_Body):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True


class DetokenizeBody(_Body):
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0, lt=2**31)]]


async def tokenize(request: Request) -> Response:
    """A text's token ids (`prompt`, `add_special_tokens`), in vLLM's shape."""
    body = parse(TokenizeBody, await read_json(request, request.app.state.settings.max_body_bytes))

    def run(engine: EngineView) -> dict[str, JSON]:
        tokenizer = engine.tokenizer
        assert tokenizer is not None
        tokens = list(tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens))
        return {"count": len(tokens), "max_model_len": engine.context_length, "tokens": tokens}

    return JSONResponse(await _on_model(request, body.model, run))


async def detokenize(request: Request) -> Response:
    """The text of token ids (`tokens`), in vLLM's shape."""
    body = parse(
        DetokenizeBody, await read_json(request, request.app.state.settings.max_body_bytes)
    )

    def run(engine: EngineView) -> dict[str, JSON]:
        tokenizer = engine.tokenizer
        assert tokenizer is not None
        unknown = unknown_token_id(tokenizer, body.tokens)
        if unknown is not None:
            bad, size = unknown
            raise APIError(
                400,
                f"Invalid value for 'tokens': token id {bad} is outside the vocabulary "
                f"(0 to {size - 1}).",
                param="tokens",
            )
        return {"prompt": tokenizer.decode(body.tokens)}

    return JSONResponse(await _on_model(request, body.model, run))


async def tokenizer_info(request: Request) -> Response:
    """The tokenizer's special tokens, chat template and context length, in vLLM's shape."""

    def run(engine: EngineView) -> dict[str, JSON]:
        tokenizer = engine.tokenizer
        assert tokenizer is not None
        hf = getattr(tokenizer, "_tokenizer", tokenizer)
        info: dict[str, JSON] = {"tokenizer_class": type(hf).__name__}
        for name in ("eos_token", "bos_token", "pad_token", "unk_token"):
            value = getattr(hf, name, None)
            info[name] = value if isinstance(value, str) else None
        template = getattr(hf, "chat_template", None)
        info["chat_template"] = template if isinstance(template, str) else None
        info["model_max_length"] = engine.context_length
        info["vocab_size"] = vocabulary_size(tokenizer)
        return info

    return JSONResponse(await _on_model(request, request.query_params.get("model"), run))


async def _on_model(request: Request, model: str | None, run: Callable[[EngineView], T]) -> T:
    """`run` on the named model's tokenizer, off the event loop, holding a lease on it."""
    slot = served_model(request, model)
    engine = await acquire_model(request, slot)
    try:
        return await run_in_threadpool(run, engine)
    finally:
        request.app.state.pool.release(slot)
