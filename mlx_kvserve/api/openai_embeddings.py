"""OpenAI's `/v1/embeddings`: `input` as a string, a list of strings, a list of token ids or a
list of such lists; `encoding_format` "float" or "base64"; `dimensions`.

Vectors are L2-normalised, as OpenAI's are; `dimensions` keeps the first that many and
normalises again (Matryoshka truncation). "base64" is the vector's little-endian float32 bytes,
which the OpenAI SDKs ask for by default (the Node SDK always, the Python SDK with numpy) and
decode with `Float32Array`/`np.frombuffer`: answering floats to such a request would store a
quarter of the dimensions (LocalAI #9135).
"""

from __future__ import annotations

import base64
from typing import Annotated, Literal

from pydantic import Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from mlx_kvserve.api.body import read_json
from mlx_kvserve.api.embedding import Input, embed
from mlx_kvserve.api.errors import APIError
from mlx_kvserve.api.generation import served_model
from mlx_kvserve.api.schemas import _Body, parse
from mlx_kvserve.embed.pooling import normalized
from mlx_kvserve.json_value import JSON

TokenIds = list[Annotated[int, Field(ge=0, lt=2**31)]]


class EmbeddingsBody(_Body):
    model: str | None = None
    input: str | list[str] | TokenIds | list[TokenIds]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Field(ge=1)] | None = None
    user: str | None = None


async def embeddings(request: Request) -> Response:
    """OpenAI embeddings of one input or many, batched with other requests' on the model's
    engine thread, between generation's decode steps."""
    settings = request.app.state.settings
    body = parse(EmbeddingsBody, await read_json(request, settings.max_body_bytes))
    inputs = _inputs(body.input)
    slot = served_model(request, body.model)
    done = await embed(request, slot, inputs, field="input", dimensions=body.dimensions)
    if done is None:  # the client left
        return Response(status_code=204)
    data: list[JSON] = []
    for i, vector in enumerate(done.vectors):
        unit = normalized(vector, body.dimensions)
        encoded: JSON = (
            base64.b64encode(unit.astype("<f4").tobytes()).decode("ascii")
            if body.encoding_format == "base64"
            else unit.tolist()
        )
        data.append({"object": "embedding", "index": i, "embedding": encoded})
    return JSONResponse(
        {
            "object": "list",
            "data": data,
            "model": slot.name,
            "usage": {"prompt_tokens": done.tokens, "total_tokens": done.tokens},
        }
    )


def _inputs(value: str | list[str] | list[int] | list[list[int]]) -> list[Input]:
    """The inputs as a list: one text, texts, one list of token ids, or several."""
    if isinstance(value, str):
        if not value:
            raise APIError(400, "'input' cannot be an empty string", param="input")
        return [value]
    if not value:
        raise APIError(400, "'input' cannot be an empty list", param="input")
    if all(isinstance(v, int) for v in value):
        return [[v for v in value if isinstance(v, int)]]
    inputs: list[Input] = []
    for i, v in enumerate(value):
        if isinstance(v, str | list) and not v:
            raise APIError(400, f"'input[{i}]' cannot be empty", param=f"input[{i}]")
        if isinstance(v, str | list):
            inputs.append(v)
    return inputs
