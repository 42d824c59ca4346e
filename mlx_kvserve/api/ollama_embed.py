"""Ollama's `/api/embed` and the older `/api/embeddings`, as Ollama's server answers them
(ollama/ollama `server/routes.go`: EmbedHandler, EmbeddingsHandler).

`/api/embed`: `input` a string or a list of strings; each vector L2-normalised (after cutting
it to `dimensions`); an input longer than the context (or `options.num_ctx`, if smaller) is cut
to it unless `truncate` is false (then a 400); an empty input answers no embeddings. The answer
has `embeddings`, `prompt_eval_count` and durations in nanoseconds. `/api/embeddings`: `prompt`
-> one `embedding`, not normalised (Ollama's legacy route returns the pooled vector as it is);
an empty prompt answers an empty vector. Options are checked for their types as on `/api/chat`
and otherwise have no effect here; `keep_alive` sets how long the model stays loaded.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from mlx_kvserve.api.embedding import Embedded, embed
from mlx_kvserve.api.errors import APIError
from mlx_kvserve.api.ollama import find_model, read_body
from mlx_kvserve.api.ollama_schemas import Options, keep_alive_seconds
from mlx_kvserve.api.schemas import _Body
from mlx_kvserve.embed.pooling import normalized
from mlx_kvserve.json_value import JSON
from mlx_kvserve.models.pool import Slot


class _Embedding(_Body):
    model: Annotated[str, Field(min_length=1)]
    options: dict[str, JSON] | None = None
    keep_alive: str | float | int | None = None


class EmbedBody(_Embedding):
    input: str | list[str] | None = None
    truncate: bool | None = None
    dimensions: int | None = None


class EmbeddingsBody(_Embedding):
    prompt: str = ""


async def embed_endpoint(request: Request) -> Response:
    """Ollama's `/api/embed`: normalised vectors of one input or many, batched with other
    requests' on the model's engine thread."""
    body = await read_body(request, EmbedBody)
    slot, limit, keep = _common(request, body)
    if body.dimensions is not None and body.dimensions < 0:
        raise APIError(400, "dimensions must not be negative", param="dimensions")
    dimensions = body.dimensions or None  # Go's 0: not set
    inputs = [body.input] if isinstance(body.input, str) else list(body.input or [])
    inputs = [] if inputs == [""] else inputs  # Ollama: an empty string embeds nothing
    done = await embed(
        request,
        slot,
        list(inputs),
        field="input",
        truncate=body.truncate is not False,
        dimensions=dimensions,
        limit=limit,
    )
    if done is None:
        return Response(status_code=204)  # the client left
    slot.requested_keep_alive = keep
    return JSONResponse(
        {
            "model": body.model,
            "embeddings": [normalized(v, dimensions).tolist() for v in done.vectors],
            **_durations(done),
            "prompt_eval_count": done.tokens,
        }
    )


async def embeddings_endpoint(request: Request) -> Response:
    """Ollama's older `/api/embeddings`: one `prompt`, one `embedding` (not normalised)."""
    body = await read_body(request, EmbeddingsBody)
    slot, limit, keep = _common(request, body)
    inputs: list[str] = [body.prompt] if body.prompt else []
    done = await embed(request, slot, list(inputs), field="prompt", truncate=True, limit=limit)
    if done is None:
        return Response(status_code=204)  # the client left
    slot.requested_keep_alive = keep
    return JSONResponse({"embedding": done.vectors[0].tolist() if done.vectors else []})


def _common(request: Request, body: _Embedding) -> tuple[Slot, int | None, float | None]:
    """The model, the tokens an input may have (`num_ctx`), and `keep_alive`."""
    options = Options(body.options)
    keep = keep_alive_seconds(body.keep_alive)
    return find_model(request, body.model), options.num_ctx, keep


def _durations(done: Embedded) -> dict[str, JSON]:
    return {
        "total_duration": int(done.total_seconds * 1e9),
        "load_duration": int(done.load_seconds * 1e9),
    }
