"""`mlx-kvserve cache ls|stats|clear|verify`: look after the prompt cache from a terminal.

`ls`, `stats` and `verify` open the cache read-only, so they work beside a running server;
`clear` needs the directory lock and so asks for the server to be stopped first.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import TYPE_CHECKING

from mlx_kvserve.config.settings import Settings

if TYPE_CHECKING:  # imports MLX: only when a cache command runs
    from mlx_kvserve.cache import PromptCache


def add_cache_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    cache = sub.add_parser(
        "cache",
        help="inspect, verify or clear the prompt cache",
        description="Inspect, verify or clear the persistent prompt (KV) cache. The cache "
        "directory comes from --cache-dir, MLX_KVSERVE_CACHE_DIR, the config file, or the "
        "per-user cache directory.",
    )
    cache.add_argument("--cache-dir", dest="cache_dir", default=None, help="cache directory")
    cache.add_argument("--json", action="store_true", help="print JSON instead of a table")
    actions = cache.add_subparsers(dest="cache_command", metavar="ACTION", required=True)
    actions.add_parser("ls", help="list entries: tokens, kind, reason, bytes, hits, age")
    actions.add_parser("stats", help="totals per model: entries, tokens, bytes, hits")
    actions.add_parser("verify", help="read every file and check checksums; exit 1 if bad")
    actions.add_parser("clear", help="delete every entry (the server must be stopped)")


def _open_all(root: Path, *, read_only: bool) -> list[PromptCache]:
    from mlx_kvserve.cache import PromptCache, model_directories

    return [
        PromptCache(root, d["fingerprint"], disk_budget=None, ram_budget=0, read_only=read_only)
        for d in model_directories(root)
    ]


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def run_cache_command(args: argparse.Namespace, settings: Settings) -> int:
    from mlx_kvserve.cache import CacheLockedError

    root = settings.cache_root()
    action = args.cache_command
    try:
        caches = _open_all(root, read_only=action != "clear")
    except CacheLockedError as exc:
        print(f"error: {exc} (stop the server before 'cache clear')")
        return 1
    try:
        return _ACTIONS[action](caches, root, args.json)
    finally:
        for cache in caches:
            cache.close()


def _ls(caches: list[PromptCache], root: Path, as_json: bool) -> int:
    rows = [(c.fingerprint, e) for c in caches for e in c.entries()]
    if as_json:
        print(json.dumps([{"fingerprint": fp, **e.as_dict()} for fp, e in rows], indent=2))
        return 0
    print(f"{root}: {len(rows)} entries")
    print(
        f"{'model':<14}{'key':<14}{'tokens':>8}  {'kind':<9}{'reason':<12}{'bytes':>11}"
        f"{'hits':>6}{'age':>9}  flags"
    )
    now = time.time()
    for fp, e in rows:
        flags = ",".join(f for f, on in (("anchor", e.anchor), ("suspect", e.suspect)) if on)
        age = f"{(now - e.created) / 60:.0f}m"
        print(
            f"{fp[:12]:<14}{e.key[:12]:<14}{e.n_tokens:>8}  {e.kind:<9}{e.reason:<12}"
            f"{_human(e.file_bytes):>11}{e.hits:>6}{age:>9}  {flags}"
        )
    return 0


def _stats(caches: list[PromptCache], root: Path, as_json: bool) -> int:
    stats = [{**c.stats(), "entry_hits": sum(e.hits for e in c.entries())} for c in caches]
    if as_json:
        print(json.dumps(stats, indent=2))
        return 0
    print(f"{root}: {len(stats)} model(s)")
    for s in stats:
        print(
            f"  {s['fingerprint'][:12]}  entries={s['entries']} tokens={s['tokens']} "
            f"disk={_human(s['disk_bytes'])} budget={_human(s['disk_budget'])} "
            f"anchors={s['anchors']} suspect={s['suspect']} hits={s['entry_hits']}"
        )
    return 0


def _verify(caches: list[PromptCache], root: Path, as_json: bool) -> int:
    problems = [(c.fingerprint, key, why) for c in caches for key, why in c.verify()]
    checked = sum(len(c.entries()) for c in caches)
    if as_json:
        print(json.dumps({"checked": checked, "problems": problems}, indent=2))
    else:
        print(f"{root}: checked {checked} entries, {len(problems)} bad")
        for fp, key, why in problems:
            print(f"  {fp[:12]} {key[:12]}: {why}")
    return 1 if problems else 0


def _clear(caches: list[PromptCache], root: Path, as_json: bool) -> int:
    removed = sum(c.clear() for c in caches)
    print(json.dumps({"removed": removed}) if as_json else f"{root}: removed {removed} entries")
    return 0


_ACTIONS = {"ls": _ls, "stats": _stats, "verify": _verify, "clear": _clear}
