"""Ollama's `/api/generate`, as its `GenerateHandler` (ollama/ollama `server/routes.go`) builds
the prompt:

* `raw`: the prompt as it is; with `template`, `system` or `context` a 400 (Ollama's words),
  and no `context` comes back.
* `suffix`: fill in the middle in the model's own tokens (chat/fill_in_middle.py), or through
  `template` if one is given (`.Prompt` and `.Suffix`); a model without such tokens is
  Ollama's 400 "... does not support insert" (its `/api/show` says `insert` when it has them).
* `template`: the Go-template subset clients send (api/ollama_template.py) with `.System` and
  `.Prompt`, rendered in place of the model's chat template; the answer is then plain text
  (`format` still holds it to JSON, as with `raw` and `suffix`).
* otherwise: `system` and the prompt as a user turn through the model's chat template, with
  its reasoning and `format` as on `/api/chat`.
* `images` (base64): read before the model loads and placed before the prompt in its user
  turn (api/images.py decides what a model that does not see images is shown); a `raw`,
  `suffix` or `template` prompt takes none.
* `context`: the token ids the last answer returned (the prompt's and the answer's), put
  before the new prompt, as Ollama does with their text; the last object returns the new ones.

An empty prompt loads the model (`keep_alive: 0`: unloads it).
"""

from __future__ import annotations

import json

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response

from mlx_kvserve.api.engine_view import EngineView
from mlx_kvserve.api.errors import APIError
from mlx_kvserve.api.generation import start_chat, start_text
from mlx_kvserve.api.images import image_reader
from mlx_kvserve.api.ollama import answer_with, find_model, load_or_unload, read_body
from mlx_kvserve.api.ollama_models import tokens_from
from mlx_kvserve.api.ollama_request import (
    generate_request,
    output_format,
    read_images,
    sampling,
    thinking,
)
from mlx_kvserve.api.ollama_schemas import GenerateBody, Options, keep_alive_seconds
from mlx_kvserve.api.ollama_stream import Answer, Timing
from mlx_kvserve.api.ollama_template import TemplateError, render
from mlx_kvserve.api.reading import Generation
from mlx_kvserve.chat.fill_in_middle import fill_format
from mlx_kvserve.json_value import JSON
from mlx_kvserve.vocabulary import unknown_token_id


async def generate(request: Request) -> Response:
    """Ollama's `/api/generate`: a prompt (after `system`) through the chat template, as it
    is with `raw`, or through the request's `template`; `suffix` fills in the middle, `context`
    continues the last exchange; `format`, `options`, `think`, `keep_alive`."""
    timing = Timing()
    body = await read_body(request, GenerateBody)
    options = Options(body.options)
    keep = keep_alive_seconds(body.keep_alive)
    slot = find_model(request, body.model)
    _check(body)
    images = await run_in_threadpool(read_images, body, image_reader(request))
    if not body.prompt:
        return await load_or_unload(request, slot, body.model, keep, "generate")
    logprobs = body.logprobs or body.top_logprobs > 0
    answer = Answer("generate", body.model, logprobs, body.top_logprobs, context=not body.raw)
    context = list(body.context or [])

    async def begin(engine: EngineView) -> Generation:
        tokenizer = engine.tokenizer
        thinks = tokens_from(tokenizer).thinks
        thinking(body.think, thinks, body.model)  # a 400 as Ollama's whatever the prompt
        unknown = unknown_token_id(tokenizer, context)
        if unknown is not None:
            raise APIError(
                400,
                f"context: token id {unknown[0]} is outside the vocabulary (0 to {unknown[1] - 1})",
                param="context",
            )
        text_sampling = sampling(options, body.logprobs, body.top_logprobs)
        schema = _schema(body)
        if body.raw:
            return await start_text(
                request, body.prompt, text_sampling, model=slot.name, schema=schema
            )
        text = _text_prompt(body, tokenizer)
        if text is None:
            chat = generate_request(body, options, thinks=thinks, images=images)
            return await start_chat(request, chat, model=slot.name, context=context)
        ids = context + list(await run_in_threadpool(tokenizer.encode, text))
        if not ids:
            raise APIError(400, "template: the prompt it makes is empty", param="template")
        return await start_text(request, ids, text_sampling, model=slot.name, schema=schema)

    return await answer_with(request, slot, options, keep, body.stream, answer, timing, begin)


def _check(body: GenerateBody) -> None:
    """What Ollama refuses before it loads the model, and a template that does not parse."""
    if body.raw and (body.template or body.system or body.context):
        raise APIError(400, "raw mode does not support template, system, or context")
    _schema(body)  # a `format` that is neither "json" nor a schema: a 400 before loading
    if body.template:
        try:
            render(body.template, {})
        except TemplateError as exc:
            raise APIError(400, f"template: {exc}", param="template") from None


def _schema(body: GenerateBody) -> tuple[dict[str, JSON], str] | None:
    """`format` as the JSON Schema a plain-text answer follows (raw, `suffix`, `template`)."""
    output = output_format(body.format)
    if output.kind == "json_object":
        return {"type": "object"}, "format"
    if output.kind == "json_schema":
        return output.schema or {"type": "object"}, "format"
    return None


def _text_prompt(body: GenerateBody, tokenizer: object) -> str | None:
    """The prompt's text when `suffix` or `template` makes it (None: the chat template's)."""
    if body.suffix:
        fmt = fill_format(tokenizer)
        if fmt is None:
            raise APIError(
                400,
                f"{json.dumps(body.model)} does not support insert: its tokenizer has no "
                "fill-in-the-middle tokens",
                param="suffix",
            )
        if not body.template:
            return fmt.prompt(body.prompt, body.suffix)
        return render(body.template, {"Prompt": body.prompt, "Suffix": body.suffix})
    if body.template:
        return render(body.template, {"System": body.system or "", "Prompt": body.prompt})
    return None
