"""Ollama's native API: the routes VS Code Copilot, Zed, Continue, Open WebUI and Enchanted's
"Ollama" providers call, onto the same internal request as every other protocol.

`ollama_schemas` checks the bodies, `ollama_request` turns them into the ChatRequest,
`ollama_stream` writes the NDJSON lines or the one object, `ollama_models` describes models
from their files. Errors are `{"error": "..."}` with Ollama's status codes (api/errors.py); a
model name this server does not serve is a 404, whatever `--strict-model-names` says, since
Ollama's clients read it as "not pulled". `name:latest` names the model `name`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response

from mlx_kvserve.api import status
from mlx_kvserve.api.body import read_json
from mlx_kvserve.api.engine_view import EngineView
from mlx_kvserve.api.errors import APIError
from mlx_kvserve.api.generation import acquire_model, start_chat
from mlx_kvserve.api.images import image_reader
from mlx_kvserve.api.ollama_models import show as show_body
from mlx_kvserve.api.ollama_models import tag, tokens_from
from mlx_kvserve.api.ollama_request import chat_request, read_images
from mlx_kvserve.api.ollama_schemas import (
    ChatBody,
    NamedModel,
    Options,
    keep_alive_seconds,
)
from mlx_kvserve.api.ollama_stream import Answer, Timing, created_at, piece
from mlx_kvserve.api.ollama_stream import streamed as streamed_answer
from mlx_kvserve.api.ollama_stream import whole as whole_answer
from mlx_kvserve.api.reading import Generation
from mlx_kvserve.api.schemas import Body, parse
from mlx_kvserve.models.pool import LOADED, ModelPool, Slot

# What `/api/version` reports: a release whose API this adapter follows (docs/openapi.yaml of
# ollama/ollama describes it). VS Code Copilot wants at least 0.6.4, each part a number.
OLLAMA_VERSION = "0.12.6"
RUNNING = "Ollama is running"


async def root(request: Request) -> Response:
    """`Ollama is running` as plain text (Ollama's reachability probe, and Claude Code's
    `HEAD /`); a browser (which asks for HTML) gets the status page."""
    if "text/html" in request.headers.get("accept", ""):
        return await status.page(request)
    return PlainTextResponse(RUNNING)


async def version(request: Request) -> Response:
    """Ollama's `/api/version`: a version Ollama's clients accept."""
    return JSONResponse({"version": OLLAMA_VERSION})


async def tags(request: Request) -> Response:
    """Ollama's `/api/tags`: every configured model and alias, with its size, digest and
    details, loaded or not."""
    pool: ModelPool = request.app.state.pool
    return JSONResponse({"models": [tag(s, name) for s in pool.slots for name in s.names]})


async def show(request: Request) -> Response:
    """Ollama's `/api/show`: a model's `model_info` (architecture, context length),
    `capabilities`, chat template, parameters and details, without loading it."""
    body = await read_body(request, NamedModel)
    return JSONResponse(await show_body(find_model(request, body.wanted())))


async def not_supported(request: Request) -> Response:
    """Ollama's `/api/create`, `/api/copy`, `/api/delete`, `/api/push` and `/api/blobs/...`:
    a 501 saying why (this server serves the models it was started with)."""
    what = request.url.path.removeprefix("/api/").split("/", 1)[0]
    raise APIError(
        501,
        f"/api/{what} is not supported: mlx-kvserve serves the models it was started with "
        "(--model or the config file's [[models]]); it does not create, copy, delete, push or "
        "upload models.",
    )


async def chat(request: Request) -> Response:
    """Ollama's `/api/chat`: messages, tools (arguments as objects), `format`, `options`,
    `think`, `keep_alive`; NDJSON lines, or one object with `stream: false`. No messages
    loads the model (`keep_alive: 0`: unloads it)."""
    timing = Timing()
    body = await read_body(request, ChatBody)
    options = Options(body.options)
    keep = keep_alive_seconds(body.keep_alive)
    slot = find_model(request, body.model)
    if not body.messages:
        return await load_or_unload(request, slot, body.model, keep, "chat")
    images = await run_in_threadpool(read_images, body, image_reader(request))
    answer = Answer("chat", body.model, body.logprobs or body.top_logprobs > 0, body.top_logprobs)

    async def begin(engine: EngineView) -> Generation:
        thinks = tokens_from(engine.tokenizer).thinks
        chat = chat_request(body, options, thinks=thinks, images=images)
        return await start_chat(request, chat, model=slot.name)

    return await answer_with(request, slot, options, keep, body.stream, answer, timing, begin)


async def answer_with(
    request: Request,
    slot: Slot,
    options: Options,
    keep: float | None,
    stream: bool,
    answer: Answer,
    timing: Timing,
    begin: Callable[[EngineView], Awaitable[Generation]],
) -> Response:
    """Load the model (timed), check the request against it, start the generation (`begin`,
    given the loaded engine), and answer as asked."""
    pool: ModelPool = request.app.state.pool
    engine = await acquire_model(request, slot)
    try:
        timing.model_ready()
        window = engine.context_length
        if options.num_ctx is not None and window is not None and options.num_ctx > window:
            raise APIError(
                400,
                f"num_ctx {options.num_ctx} exceeds the model's context length ({window} tokens)",
                param="options.num_ctx",
            )
        generation = await begin(engine)
    finally:
        pool.release(slot)
    slot.requested_keep_alive = keep  # as Ollama: each request sets it (absent: the default)
    if stream:
        keepalive = request.app.state.settings.keepalive_seconds
        return streamed_answer(generation, answer, timing, keepalive)
    return await whole_answer(request, generation, answer, timing)


async def load_or_unload(
    request: Request, slot: Slot, asked: str, keep: float | None, shape: str
) -> Response:
    """An empty request: load the model and keep it as `keep_alive` says, or unload it now
    when that is 0 (Ollama's "load" and "unload" answers)."""
    pool: ModelPool = request.app.state.pool
    answer = Answer("chat" if shape == "chat" else "generate", asked)
    if keep == 0:
        if slot.state == LOADED:
            await pool.unload(slot, "request", "asked to (keep_alive 0)")
        reason = "unload"
    else:
        await acquire_model(request, slot)
        pool.release(slot)
        slot.requested_keep_alive = keep
        reason = "load"
    return JSONResponse(
        {
            "model": asked,
            "created_at": created_at(),
            **piece(answer),
            "done": True,
            "done_reason": reason,
        }
    )


def lookup(pool: ModelPool, name: str) -> Slot | None:
    """The served model `name` (or `name:latest`) stands for, if any."""
    slot = pool.find(name)
    if slot is None and name.endswith(":latest"):
        slot = pool.find(name.removesuffix(":latest"))
    return slot


def find_model(request: Request, name: str) -> Slot:
    """The served model `name` (or `name:latest`) stands for; a 404 as Ollama's otherwise."""
    pool: ModelPool = request.app.state.pool
    slot = lookup(pool, name)
    if slot is None:
        raise APIError(
            404,
            f"model '{name}' not found (this server serves {', '.join(sorted(pool.names()))})",
            param="model",
        )
    return slot


async def read_body(request: Request, model: type[Body]) -> Body:
    """The body parsed as `model`: a 400 in Ollama's shape for bad JSON or a bad field."""
    return parse(model, await read_json(request, request.app.state.settings.max_body_bytes))
