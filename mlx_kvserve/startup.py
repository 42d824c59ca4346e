"""What `serve` checks and sets up before it listens: exposure, browser settings, caches that
cannot be written, and the connection layer (limits, timeouts, open files, quiet logs)."""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict, TypeVar

from mlx_kvserve.config.settings import Settings

if TYPE_CHECKING:  # MLX and uvicorn are imported when the server starts
    from uvicorn.protocols.http.h11_impl import H11Protocol

    from mlx_kvserve.cache import PromptCache
    from mlx_kvserve.engine.namespaces import CacheSet

log = logging.getLogger("mlx_kvserve")
Cache = TypeVar("Cache")


class UvicornOptions(TypedDict):
    """Keyword arguments of `uvicorn.Config` for the connection layer (`uvicorn_options`)."""

    http: type[H11Protocol]
    timeout_keep_alive: float
    backlog: int


def is_loopback_bind(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 and 'localhost'; anything else may be reachable from outside."""
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def api_keys(settings: Settings) -> list[str]:
    return [k for k in dict.fromkeys([settings.api_key or "", *settings.api_keys]) if k]


def startup_problem(settings: Settings) -> str | None:
    """A reason to refuse to start, or None."""
    from mlx_kvserve.api.guard import BrowserGuard

    if not is_loopback_bind(settings.host) and not api_keys(settings):
        if not settings.insecure_public:
            return (
                f"refusing to listen on {settings.host} without an API key: anyone who can "
                "reach it could use it. Set --api-key, or pass --insecure-public to accept that."
            )
        log.warning("listening on %s without an API key (--insecure-public)", settings.host)
    try:
        BrowserGuard(lambda *_: None, settings.allowed_hosts, settings.allowed_origins)
    except ValueError as exc:
        return str(exc)
    return None


def open_or_degrade(open_cache: Callable[[Path | None], Cache], root: Path) -> Cache:
    """`open_cache(root)`, or `open_cache(None)` (RAM only) with one warning if the directory
    cannot be used (read-only, not ours, writable by others). A locked directory still fails."""
    from mlx_kvserve.cache import CacheLockedError

    try:
        return open_cache(root)
    except CacheLockedError:
        raise
    except OSError as exc:
        log.warning(
            "prompt cache directory %s is not usable (%s); running with the disk tier off: "
            "checkpoints stay in RAM and are lost at exit",
            root,
            exc.strerror or exc,
        )
        return open_cache(None)


def open_namespaced(
    open_cache: Callable[[Path | None], PromptCache], root: Path, keys: list[str]
) -> CacheSet:
    """One cache per API key under root/keys/<namespace> (--isolate-cache)."""
    from mlx_kvserve.cache.disk import NAMESPACES_DIR
    from mlx_kvserve.engine.namespaces import CacheSet, namespace_of

    caches = {}
    for key in keys:
        namespace = namespace_of(key)
        caches[namespace] = open_or_degrade(open_cache, root / NAMESPACES_DIR / namespace)
    return CacheSet(caches)


def uvicorn_options(settings: Settings) -> UvicornOptions:
    """The connection layer: our h11 protocol with its cap and header deadline, the idle
    timeout, a raised open-file limit, and resource-exhaustion logs once per interval."""
    from mlx_kvserve.net.connections import ConnectionLimits, guarded_protocol
    from mlx_kvserve.net.resources import connection_cap, install_log_filters, raise_fd_limit

    install_log_filters()
    soft = raise_fd_limit()
    cap, backlog = connection_cap(settings.max_connections, soft)
    if cap < settings.max_connections:
        log.info(
            "open-file limit %d: at most %d connections (not %d), accept backlog %d",
            soft,
            cap,
            settings.max_connections,
            backlog,
        )
    limits = ConnectionLimits(max_connections=cap, header_timeout=settings.header_timeout)
    return {
        "http": guarded_protocol(limits),
        "timeout_keep_alive": settings.idle_timeout,
        "backlog": backlog,
    }
