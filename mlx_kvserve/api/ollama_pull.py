"""Ollama's `/api/pull`: a model this server serves is there already (`success`); any other
`org/name` (or Ollama's `hf.co/org/name`) is downloaded from Hugging Face and served beside the
others, only when the server was started with `--allow-pull` (else a 403 saying so: a server
whose clients may fill its disk and memory with any model is not a default).

Progress is Ollama's NDJSON: `pulling manifest`, then per file `pulling <digest>` with `digest`,
`total` and `completed` bytes, `verifying sha256 digest` (each large file against the digest
the Hub lists), `writing manifest`, `success`; with `stream: false`, the last status alone, or
the error with its status. A failure once the stream began is one `{"error": ...}` line, as
Ollama writes it. The files go through models/pull.py's `Hub` seam.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from mlx_kvserve import paths
from mlx_kvserve.api.errors import APIError
from mlx_kvserve.api.ollama import lookup, read_body
from mlx_kvserve.api.ollama_schemas import NamedModel
from mlx_kvserve.api.ollama_stream import NDJSON, line, status_lines
from mlx_kvserve.json_value import JSON
from mlx_kvserve.models.pool import ModelPool
from mlx_kvserve.models.pull import Hub, PullError, RemoteFile, hub, sha256_of
from mlx_kvserve.models.resolve import hub_repo
from mlx_kvserve.models.serving import ModelSetupError

_HUB_HOSTS = ("hf.co/", "huggingface.co/")


async def pull(request: Request) -> Response:
    """Ollama's `/api/pull`: `success` for a model served; an `org/name` from Hugging Face,
    fetched with progress lines and served, when `--allow-pull` lets it."""
    body = await read_body(request, NamedModel)
    asked = body.wanted()
    pool: ModelPool = request.app.state.pool
    if lookup(pool, asked) is not None:
        return status_lines([{"status": "pulling manifest"}, {"status": "success"}], body.stream)
    repo = repo_of(asked)
    if repo is None:
        raise APIError(
            404,
            f"model '{asked}' not found: this server pulls Hugging Face models named org/name "
            f"(it serves {', '.join(sorted(pool.names()))})",
            param="model",
        )
    if not request.app.state.settings.allow_pull:
        raise APIError(
            403,
            f"pulling models is turned off on this server: start it with --allow-pull to let "
            f"/api/pull download {repo} from Hugging Face",
            param="model",
        )
    if pool.adopt is None:
        raise APIError(501, "this server cannot add models while it serves", param="model")
    source = hub(paths.data_dir())
    try:
        files = await run_in_threadpool(source.files, repo)
    except PullError as exc:
        raise APIError(exc.status, exc.message, param="model") from None
    if not any(f.name.endswith(".safetensors") for f in files):
        raise APIError(400, f"{repo} has no MLX weights (model*.safetensors)", param="model")
    aliases = tuple(dict.fromkeys(a for a in (asked, asked.removesuffix(":latest")) if a != repo))
    steps = _steps(pool, source, repo, files, aliases)
    if body.stream:
        return StreamingResponse(_lines(steps), media_type=NDJSON)
    last: dict[str, JSON] = {}
    try:
        async for status in steps:
            last = status
    except PullError as exc:
        raise APIError(exc.status, exc.message, param="model") from None
    return JSONResponse(last)


def repo_of(asked: str) -> str | None:
    """The Hugging Face repo a pull names (Ollama's `hf.co/org/name[:latest]` too), or None."""
    name = asked.removesuffix(":latest")
    for host in _HUB_HOSTS:
        name = name.removeprefix(host)
    return name if hub_repo(name) else None


async def _lines(steps: AsyncIterator[dict[str, JSON]]) -> AsyncIterator[str]:
    try:
        async for status in steps:
            yield line(status)
    except PullError as exc:
        yield line({"error": exc.message})


async def _steps(
    pool: ModelPool, source: Hub, repo: str, files: list[RemoteFile], aliases: tuple[str, ...]
) -> AsyncIterator[dict[str, JSON]]:
    """Fetch, check and serve the model, saying so step by step (PullError: it failed)."""
    yield {"status": "pulling manifest"}
    for remote in files:
        if remote.sha256:
            yield _pulling(remote.sha256, remote.size, 0)
        try:
            path = await run_in_threadpool(source.fetch, repo, remote.name)
            digest = await run_in_threadpool(sha256_of, path)
        except OSError as exc:
            raise PullError(502, f"pulling {remote.name}: {exc}") from None
        if remote.sha256 and digest != remote.sha256:
            raise PullError(
                502, f"{remote.name}: digest mismatch (sha256:{digest}, listed {remote.sha256})"
            )
        yield _pulling(digest, remote.size, remote.size)
    yield {"status": "verifying sha256 digest"}
    yield {"status": "writing manifest"}
    if lookup(pool, repo) is None:  # else a pull beside this one served it first
        adopt = pool.adopt
        assert adopt is not None
        try:
            folder = await run_in_threadpool(source.folder, repo)
            slot = await run_in_threadpool(adopt, repo, folder, aliases)
        except (ModelSetupError, OSError, ValueError) as exc:
            raise PullError(400, str(exc)) from None
        if lookup(pool, repo) is None:
            pool.add(slot)
    yield {"status": "success"}


def _pulling(digest: str, total: int, completed: int) -> dict[str, JSON]:
    return {
        "status": f"pulling {digest[:12]}",
        "digest": f"sha256:{digest}",
        "total": total,
        "completed": completed,
    }
