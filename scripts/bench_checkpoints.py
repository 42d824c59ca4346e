#!/usr/bin/env python3
"""Checkpoint bytes over a 20-turn conversation, and disk-hit restore time, per architecture.

    python scripts/bench_checkpoints.py                       # every architecture, 20 turns
    python scripts/bench_checkpoints.py --archs gemma3_text qwen3_5 --turns 10
    python scripts/bench_checkpoints.py --archs mamba2 --config state_size=128 num_heads=16 \
        head_dim=64 hidden_size=1024 intermediate_size=1024   # a real model's state per layer

For each tiny random-weight model of `tests/support/tiny_models.py` (mlx-lm's own classes), a
real server with the prompt cache answers a `--turns`-turn conversation (greedy, `--max-tokens`
per answer, the server's default checkpoint policy). Then, from `/v1/cache`:

* **written**: bytes of entry files the writer wrote (`bytes_written`);
* **on disk**: bytes of the entries kept at the end (`disk_bytes`), the cache's final
  footprint; the target is written <= 1.5 x on disk (no whole-snapshot rewrites);
* **headers**: the share of the kept files that is headers (each carries its token ids, 4
  bytes a token: a large share only for these tiny models, whose KV is a few hundred bytes a
  token);
* **KV**: what the final state of the conversation holds in memory, from the model's own
  layer description (`cache.kinds.describe_model(...).bytes_for(tokens)`).

The server is stopped cleanly and the longest entry is restored in this process through the
real `PromptCache` (no RAM tier) into the model's fresh caches, with the page cache dropped
first, and compared with a plain cold read of the same files (see `bench_restore.py`): the
target is a restore within 2x of that read. Medians of `--repeats`. Nothing asserts on time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from _pagecache import evict_page_cache  # noqa: E402
from mlx_lm import load  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

from mlx_kvserve.cache import PromptCache  # noqa: E402
from mlx_kvserve.cache.chain import ChainBuilder  # noqa: E402
from mlx_kvserve.cache.kinds import describe_model  # noqa: E402
from tests.support.servers import ServerProcess  # noqa: E402
from tests.support.tiny_models import make_model_dir  # noqa: E402

ARCHS = ["llama", "qwen3_5", "gemma3_text", "gpt_oss", "deepseek_v3", "mamba2", "falcon_h1"]
TOPICS = ["tyres", "lights", "locks", "bells", "brakes", "chains", "saddles", "pedals", "racks"]


def conversation(server: ServerProcess, turns: int, max_tokens: int) -> tuple[int, list[int]]:
    """Run the conversation; returns (tokens of the final state, cached tokens per turn)."""
    messages = [{"role": "system", "content": "You are the help desk of a bicycle shop."}]
    cached, total = [], 0
    with httpx.Client(base_url=server.base_url, timeout=600) as http:
        for turn in range(turns):
            topic = TOPICS[turn % len(TOPICS)]
            question = f"Turn {turn}: which {topic} do you stock, and what do they cost today?"
            messages.append({"role": "user", "content": question})
            body = {"model": "tiny", "messages": messages, "temperature": 0}
            resp = http.post("/v1/chat/completions", json={**body, "max_tokens": max_tokens})
            resp.raise_for_status()
            doc = resp.json()
            answer = doc["choices"][0]["message"]["content"]
            messages.append({"role": "assistant", "content": answer})
            usage = doc["usage"]
            cached.append(usage["prompt_tokens_details"]["cached_tokens"])
            total = usage["prompt_tokens"] + usage["completion_tokens"]
    return total, cached


def timed_restore(pc: PromptCache, model, tokens: list[int], repeats: int) -> dict:
    """Median cold restore of `tokens[:-1]` and a plain cold read of the files it reads."""
    match = pc.lookup(tokens)
    catalog = pc._catalog  # a benchmark may look inside: which links a restore reads
    entry = catalog.entries[match.key]
    links = ChainBuilder(make_prompt_cache(model), catalog.links(entry, match.usable), match.usable)
    files = [pc.disk.path(link.key) for link in links.links]
    nbytes = sum(p.stat().st_size for p in files)
    restores, reads = [], []
    buf = bytearray(nbytes)
    for _ in range(repeats):
        evict_page_cache(files)
        caches = make_prompt_cache(model)
        started = time.perf_counter()
        pc.restore(match, caches, tokens=tokens)
        restores.append(time.perf_counter() - started)
        evict_page_cache(files)
        view, done = memoryview(buf), 0
        started = time.perf_counter()
        for p in files:
            with open(p, "rb", buffering=0) as f:
                while got := f.readinto(view[done:]):
                    done += got
        reads.append(time.perf_counter() - started)
    return {
        "restored_tokens": match.usable,
        "files_read": len(files),
        "bytes_read": nbytes,
        "restore_s": statistics.median(restores),
        "cold_read_s": statistics.median(reads),
    }


def bench(
    arch: str, work: Path, turns: int, max_tokens: int, repeats: int, overrides: dict | None = None
) -> dict:
    model_dir = make_model_dir(work / "model", arch, **(overrides or {}))
    kv = work / "kv"
    server = ServerProcess(work, "--model", str(model_dir), env={"MLX_KVSERVE_CACHE_DIR": str(kv)})
    try:
        server.wait_ready()
        tokens, cached = conversation(server, turns, max_tokens)
        stats = httpx.get(server.base_url + "/v1/cache").json()
    finally:
        server.stop()
    model, _ = load(str(model_dir))
    layout = describe_model(model)
    (fp_dir,) = [d for d in kv.iterdir() if d.is_dir()]
    with PromptCache(kv, fp_dir.name, disk_budget=1 << 40, ram_budget=0) as pc:
        kept = list(pc._catalog.entries.values())
        payload = sum(e.payload_bytes for e in kept)
        longest = max(kept, key=lambda e: e.n_tokens)
        restore = timed_restore(pc, model, [*longest.tokens.tolist(), 0], repeats)
    written, on_disk = stats["bytes_written"], stats["disk_bytes"]
    return {
        "arch": arch,
        "layers": layout.summary(),
        "tokens": tokens,
        "cached_tokens": cached,
        "entries": stats["entries"],
        "files_written": stats["files_written"],
        "written": written,
        "on_disk": on_disk,
        "kv_bytes": layout.bytes_for(tokens),
        "written_over_disk": written / on_disk if on_disk else None,
        "headers_on_disk": 1 - payload / on_disk if on_disk else None,
        "written_over_kv": written / layout.bytes_for(tokens),
        **restore,
        "restore_over_read": restore["restore_s"] / restore["cold_read_s"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--archs", nargs="+", default=ARCHS)
    ap.add_argument("--turns", type=int, default=20)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", type=Path, help="also write the rows here")
    ap.add_argument(
        "--config",
        nargs="+",
        default=[],
        metavar="KEY=VALUE",
        help="config.json overrides for every model (VALUE is JSON), e.g. a larger state",
    )
    args = ap.parse_args()
    overrides = {k: json.loads(v) for k, v in (item.split("=", 1) for item in args.config)}
    rows = []
    print(
        "| architecture | layers | tokens | files | written | on disk | written / on disk | "
        "headers | final KV | restore (cold) | plain read (cold) | restore / read |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for arch in args.archs:
        with tempfile.TemporaryDirectory(prefix=f"bench-ckpt-{arch}-") as tmp:
            row = bench(arch, Path(tmp), args.turns, args.max_tokens, args.repeats, overrides)
        rows.append(row)
        print(
            f"| {arch} | {row['layers']} | {row['tokens']} | {row['files_written']} | "
            f"{row['written'] / 1024:.0f} KiB | {row['on_disk'] / 1024:.0f} KiB | "
            f"{row['written_over_disk']:.2f} | {row['headers_on_disk']:.0%} | "
            f"{row['kv_bytes'] / 1024:.0f} KiB | "
            f"{row['restore_s'] * 1e3:.1f} ms | {row['cold_read_s'] * 1e3:.1f} ms | "
            f"{row['restore_over_read']:.2f} |",
            flush=True,
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
