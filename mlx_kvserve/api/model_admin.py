"""Which models are loaded, and unloading one: `GET /api/ps` (Ollama's shape, so tools that
read `ollama ps` can read ours) and `POST /v1/models/{name}/unload`. Both need the API key."""

from __future__ import annotations

import time

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from mlx_kvserve.api.errors import APIError
from mlx_kvserve.models.pool import LOADED, ModelPool


async def loaded_models(request: Request) -> Response:
    """The loaded models, as Ollama's `/api/ps` lists them (plus our own fields)."""
    pool: ModelPool = request.app.state.pool
    now = time.time()
    models = []
    for info in pool.describe():
        if info["state"] != LOADED:
            continue
        idle, keep = info["idle_seconds"], info["keep_alive_seconds"]
        expires = None
        if idle is not None and keep and not info["pinned"]:
            expires = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now - idle + keep))
        models.append(
            {
                "name": info["name"],
                "model": info["id"],
                "size": info["footprint_bytes"],
                "size_vram": info["footprint_bytes"],
                "expires_at": expires,
                "idle_seconds": idle,
                "keep_alive_seconds": keep,
                "pinned": info["pinned"],
                "default": info["default"],
                "aliases": info["aliases"],
            }
        )
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
