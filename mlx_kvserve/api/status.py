"""The status page: `GET /` serves it, `/v1/status` and `/v1/status/events` feed it.

The page is static files inside the package (no CDN: it works offline), read once at import
into a fixed table, so no request path ever reaches the filesystem. The HTML and its assets hold
no data and are open (as `HEAD /` must be for Claude Code's probe); the figures come from
`/v1/status` (a JSON snapshot) and `/v1/status/events` (the same snapshot as server-sent events,
once a second), which follow the API's rules: API key, Host and Origin. The page asks for the
key when the server wants one and keeps it for the browser tab only (sessionStorage).

The snapshot puts together what `/health`, `/v1/cache` and `/metrics` report, read the same way
(the cache on the engine thread), plus the recent requests and live series of
`observe.activity`: the numbers on the page are those of the API.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from importlib import resources
from importlib.resources.abc import Traversable

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from mlx_kvserve import __version__
from mlx_kvserve.api.engine_view import EngineView
from mlx_kvserve.engine import EngineNotReady
from mlx_kvserve.engine.namespaces import cache_for, current_namespace
from mlx_kvserve.json_value import JSON
from mlx_kvserve.models.pool import ModelPool, Slot

SNAPSHOT_TIMEOUT = 5.0  # the engine may be in the middle of a prefill chunk
EVENT_INTERVAL = 1.0
MAX_CHAINS = 30

_TYPES = {".html": "text/html", ".js": "text/javascript", ".css": "text/css", ".txt": "text/plain"}


def _load_assets() -> dict[str, tuple[bytes, str]]:
    """Every file of the page, by the URL path that serves it."""
    root = resources.files("mlx_kvserve.api") / "static"
    found: dict[str, tuple[bytes, str]] = {}

    def walk(folder: Traversable, prefix: str) -> None:
        for item in folder.iterdir():
            if item.is_dir():
                walk(item, f"{prefix}{item.name}/")
            else:
                kind = _TYPES.get("." + item.name.rsplit(".", 1)[-1])
                if kind is not None:
                    found[f"/ui/{prefix}{item.name}"] = (item.read_bytes(), kind)

    walk(root, "")
    found["/"] = found.pop("/ui/index.html")
    return found


ASSETS = _load_assets()
OPEN_PATHS = frozenset(ASSETS)
_HEADERS = {
    "Cache-Control": "no-cache",
    "X-Content-Type-Options": "nosniff",
    # the page runs its own files only, and talks to this server only
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
        "img-src 'self' data:; frame-ancestors 'none'; base-uri 'none'; form-action 'none'"
    ),
}


async def page(request: Request) -> Response:
    """The status page (`/`) and its files (`/ui/...`), which hold no data and need no key.

    A 404 for any other path."""
    asset = ASSETS.get(request.url.path)
    if asset is None:
        return JSONResponse({"error": {"message": "Not Found", "type": "not_found"}}, 404)
    body, kind = asset
    charset = "; charset=utf-8"
    return Response(body, media_type=kind + charset, headers=_HEADERS)


async def status(request: Request) -> Response:
    """What the status page shows, as JSON: models, requests, prompt cache, memory, recent
    requests and the charts' series."""
    return JSONResponse(await snapshot(request))


async def status_events(request: Request) -> Response:
    """What `/v1/status` shows, once a second, as server-sent events until the client goes
    away."""

    async def events() -> AsyncIterator[str]:
        yield "retry: 2000\n\n"
        while not await request.is_disconnected():
            body = await snapshot(request)
            yield f"event: status\ndata: {json.dumps(body, separators=(',', ':'))}\n\n"
            await asyncio.sleep(EVENT_INTERVAL)

    return StreamingResponse(
        events(),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


async def snapshot(request: Request) -> dict[str, JSON]:
    """Models and memory, requests, the default model's prompt cache, recent requests and live
    series."""
    state = request.app.state
    pool: ModelPool = state.pool
    default = pool.default
    engine: EngineView | None = default.engine
    engines = pool.engines()
    ready = engine is not None and engine.ready.is_set()
    failed = (engine is not None and engine.load_error) or default.error
    body: dict[str, JSON] = {
        "version": __version__,
        "time": time.time(),
        "uptime_seconds": time.time() - state.started,
        "status": "error" if failed else ("ok" if ready or default.loaded_at else "loading"),
        "models": _models(pool),
        "requests": {
            "running": sum(e.running for e in engines),
            "queued": sum(e.queued for e in engines),
        },
        **state.activity.snapshot(),
    }
    if not ready:
        body.update(memory=None, cache={"enabled": False})
        return body
    cache = cache_for(engine.prompt_cache, current_namespace.get())

    def read() -> dict[str, JSON]:
        figures: dict[str, JSON] = {"memory": engine.memory.stats()}
        if cache is not None:
            entries = [e.as_dict() for e in cache.entries()]
            figures["cache"] = {"enabled": True, **cache.stats(), "chains": chains(entries)}
        return figures

    try:
        body.update(
            await asyncio.wait_for(asyncio.wrap_future(engine.call(read)), SNAPSHOT_TIMEOUT)
        )
    except (EngineNotReady, TimeoutError):
        body["memory"] = None
    body.setdefault("cache", {"enabled": False})
    if body["cache"]["enabled"]:
        body["cache"].pop("directory", None)  # a path of this machine: not for a web page
    return body


def _models(pool: ModelPool) -> list[dict[str, JSON]]:
    """Every model as `ModelPool.describe` gives it (one call), with its engine's figures."""
    described = {m["name"]: m for m in pool.describe()}
    return [_model(slot, described[slot.name]) for slot in pool.slots]


def _model(slot: Slot, described: dict[str, JSON]) -> dict[str, JSON]:
    """One model's description, with its engine's figures while loaded."""
    engine: EngineView | None = slot.engine
    if engine is not None and not engine.ready.is_set():
        engine = None
    layout = engine.layout if engine is not None else None
    return {
        **described,
        "id": slot.name,
        "context_length": engine.context_length if engine else None,
        "kv_bytes_per_token": layout.bytes_per_token if layout is not None else None,
        "layers": layout.summary() if layout is not None else None,
        "kv_budget": engine.kv_budget if engine else None,
    }


def chains(entries: list[dict[str, JSON]]) -> list[dict[str, JSON]]:
    """The cache's conversations: each leaf entry with the chain of entries it extends, newest
    first. An entry's tokens are its own plus its parents' (deltas name their parent)."""
    by_key = {e["key"]: e for e in entries}
    leaves = [e for e in entries if not e["children"]]
    out = []
    for leaf in leaves:
        links, node, seen = [], leaf, set()
        while node is not None and node["key"] not in seen:
            seen.add(node["key"])
            links.append(node)
            node = by_key.get(node["parent"]) if node["parent"] else None
        links.reverse()
        out.append(
            {
                "key": leaf["key"][:16],
                "tokens": leaf["n_tokens"],
                "links": [
                    {"tokens": e["n_tokens"], "kind": e["kind"], "reason": e["reason"]}
                    for e in links
                ],
                "bytes": sum(e["file_bytes"] or e["payload_bytes"] for e in links),
                "hits": sum(e["hits"] for e in links),
                "last_used": max(e["last_used"] for e in links),
                "in_ram": leaf["in_ram"],
            }
        )
    out.sort(key=lambda c: c["last_used"], reverse=True)
    return out[:MAX_CHAINS]
