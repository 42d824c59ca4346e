"""Which models are loaded, and unloading one: `GET /api/ps` (Ollama's shape, so tools that
read `ollama ps` can read ours) and `POST /v1/models/{name}/unload`. Both need the API key."""

from __future__ import annotations

import math
import time

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from mlx_kvserve.api.errors import APIError
from mlx_kvserve.api.ollama_models import running
from mlx_kvserve.models.pool import LOADED, ModelPool


async def loaded_models(request: Request) -> Response:
    """The loaded models, as Ollama's `/api/ps` lists them (plus our own fields)."""
    pool: ModelPool = request.app.state.pool
    now = time.time()
    models = []
    for slot, info in zip(pool.slots, pool.describe(), strict=True):
        if info["state"] != LOADED:
            continue
        idle, keep = info["idle_seconds"], pool.keep_alive_of(slot)
        expires = None  # kept for good
        if keep != math.inf:  # a busy model unloads no sooner than `keep` after it ends
            at = now - (idle if isinstance(idle, float | int) else 0) + keep
            expires = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(at))
        models.append(running(slot, info, expires))
    return JSONResponse({"models": models})


async def unload_model(request: Request) -> Response:
    """Unload a model now (after its running requests end); it loads again when asked for."""
    pool: ModelPool = request.app.state.pool
    name = request.path_params["model_id"]
    slot = pool.find(name)
    if slot is None:
        raise APIError(
            404,
            f"The model {name!r} does not exist; this server serves {sorted(pool.names())}.",
            param="model",
            code="model_not_found",
        )
    unloaded = await pool.unload(slot, "request", "asked to")
    return JSONResponse({"model": slot.name, "unloaded": unloaded, "state": slot.state})
