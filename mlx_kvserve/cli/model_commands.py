"""`mlx-kvserve ps`, `models` and `unload NAME`: the running server's models, as `ollama ps`
shows them. They talk to the server the settings describe (host, port, API key), so the same
flags, environment and config file apply."""

from __future__ import annotations

import argparse
import json
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable

from mlx_kvserve.config.settings import Settings
from mlx_kvserve.json_value import JSON
from mlx_kvserve.startup import api_keys

TIMEOUT = 10.0
FOREVER_YEAR = "2318-"  # api/ollama_models.py: FOREVER
UNLOAD_TIMEOUT = 600.0  # unloading waits for the model's running requests to end


def add_model_commands(
    sub: argparse._SubParsersAction[argparse.ArgumentParser],
    add_flags: Callable[[argparse.ArgumentParser], None],
) -> None:
    ps = sub.add_parser("ps", help="list the models the running server has loaded")
    models = sub.add_parser("models", help="list the configured models and which are loaded")
    unload = sub.add_parser("unload", help="unload a model from the running server now")
    unload.add_argument("name", help="the model's name or alias")
    for parser in (ps, models, unload):
        add_flags(parser)


def run_model_command(args: argparse.Namespace, settings: Settings) -> int:
    try:
        if args.command == "ps":
            return _ps(settings)
        if args.command == "models":
            return _models(settings)
        return _unload(settings, args.name)
    except ServerError as exc:
        print(f"error: {exc}")
        return 1


class ServerError(Exception):
    """The server did not answer, or answered with an error (the message says which)."""


def _ps(settings: Settings) -> int:
    loaded = _call(settings, "GET", "/api/ps")["models"]
    rows = [
        [
            m["name"] + (" (default)" if m["default"] else ""),
            _size(m["size"]),
            "pinned" if m["pinned"] else _idle(m["idle_seconds"]),
            _unloads_at(m),
        ]
        for m in loaded
    ]
    _table(["NAME", "SIZE", "IDLE", "UNLOADS AT"], rows)
    return 0


def _unloads_at(m: dict[str, JSON]) -> str:
    """When `ps` says the model unloads: `expires_at` is Ollama's far future for "never"."""
    if m["pinned"] or str(m["expires_at"]).startswith(FOREVER_YEAR):
        return "never"
    return "busy" if m["idle_seconds"] is None else m["expires_at"]


def _models(settings: Settings) -> int:
    status = _call(settings, "GET", "/v1/status")
    rows = [
        [
            m["name"] + (" (default)" if m["default"] else ""),
            m["state"],
            ", ".join(m["aliases"]) or "-",
            _size(m["footprint_bytes"]),
            "pinned" if m["pinned"] else _idle(m["keep_alive_seconds"]) or "never",
        ]
        for m in status["models"]
    ]
    _table(["NAME", "STATE", "ALIASES", "SIZE", "KEEP-ALIVE"], rows)
    return 0


def _unload(settings: Settings, name: str) -> int:
    path = f"/v1/models/{urllib.parse.quote(name, safe='/')}/unload"
    answer = _call(settings, "POST", path, body={}, timeout=UNLOAD_TIMEOUT)
    if answer["unloaded"]:
        print(f"unloaded {answer['model']}")
    else:
        print(f"{answer['model']} was not loaded ({answer['state']})")
    return 0


def _call(
    settings: Settings, method: str, path: str, body: JSON = None, timeout: float = TIMEOUT
) -> JSON:
    host = settings.host
    if host in ("0.0.0.0", "", "*"):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    url = f"http://{f'[{host}]' if ':' in host else host}:{settings.port}{path}"
    headers = {"Content-Type": "application/json"}
    keys = api_keys(settings)
    if keys:
        headers["Authorization"] = f"Bearer {keys[0]}"
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:  # noqa: S310 (ours)
            return json.loads(response.read())
    except urllib.error.HTTPError as exc:
        try:
            message = json.loads(exc.read())["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = exc.reason
        raise ServerError(f"{url}: HTTP {exc.code}: {message}") from None
    except (OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        raise ServerError(f"no server answers at {url} ({reason}); is it running?") from None


def _size(n: int | None) -> str:
    if not n:
        return "-"
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return "-"


def _idle(seconds: float | None) -> str:
    if seconds is None:
        return "busy"
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def _table(header: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        print("  ".join(str(cell).ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
