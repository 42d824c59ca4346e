#!/usr/bin/env python3
"""Time to first token of a conversation that returns after its model was swapped out.

    python scripts/bench_models.py                 # a ~2000-token conversation (~2-3 min)
    python scripts/bench_models.py --tokens 4000   # longer
    python scripts/bench_models.py --no-mlx-lm     # skip the mlx_lm.server comparison

Each server serves the default model and a second, tiny random-weight model ("swap", built in
the temp dir), one model resident at a time, so asking for "swap" puts the default model out of
memory. The sequence, per server, one server at a time (they never share the CPU):

1. two unrelated warm-up requests on the default model;
2. the conversation (a system message of varied text, about `--tokens` tokens, and a question)
   on the default model; its greedy answer A is recorded;
3. one request to "swap": the default model is unloaded (mlx-kvserve: `--max-loaded-models 1`,
   drained, then unloaded; mlx_lm.server: it loads the requested model in place of its own);
4. the **returning turn**: the conversation + A + a new question, on the default model, which
   loads again. Its TTFT is the number compared:

* **mlx-kvserve**: model load + restore of the conversation from its prompt cache on disk
  (the disk tier survives the unload) + prefill of the new question;
* **mlx-kvserve --no-cache**: model load + cold prefill of the whole prompt (step 2 skipped:
  nothing is kept anyway);
* **mlx_lm.server**: its own model swap (`model` field of the request), then whatever its
  in-memory prompt cache still holds of the conversation it saw in step 2.

The returning prompt is the same on every server (the first server's answer A is used).

TTFT is measured by the client, from sending the request to the first content chunk of the
stream; mlx-kvserve's log gives the load time and the cache source. Nothing asserts on time.
"""

from __future__ import annotations

import argparse
import random
import re
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import _bench_common as bc  # noqa: E402

QUESTION = "Which parts of these notes mention the cache? Answer briefly."
WARMUP = [{"role": "user", "content": "Say hello."}]
_LOADED = re.compile(r"model (\S+) loaded in ([0-9.]+) s")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=2000, help="conversation size in tokens")
    p.add_argument("--max-tokens", type=int, default=8, help="new tokens per request")
    p.add_argument("--prefill-step", type=int, default=512, help="every server's prefill chunk")
    p.add_argument("--no-mlx-lm", action="store_true", help="skip the mlx_lm.server comparison")
    p.add_argument("--seed", type=int, default=0, help="seed of the conversation text")
    bc.add_run_options(p)
    return p.parse_args(argv)


def conversation(tokens: int, seed: int) -> list[dict]:
    tok = bc.Tokens()
    body = tok.fit(bc.varied_chunks(random.Random(seed)), max(tokens - 40, 16))
    return [
        {"role": "system", "content": "Project notes. Answer questions about them.\n\n" + body},
        {"role": "user", "content": "Summarise these notes in one sentence."},
    ]


def as_model(server: bc.Server, name: str) -> SimpleNamespace:
    """What `bc.chat` needs to address another model of the same server."""
    return SimpleNamespace(base_url=server.base_url, model_name=name)


def load_seconds(lines: list[str]) -> float | None:
    found = [float(m.group(2)) for line in lines if (m := _LOADED.search(line))]
    return found[-1] if found else None


def run(
    server: bc.Server,
    swap_name: str,
    convo: list[dict],
    answer: str | None,
    args,
    client,
    *,
    first_sight: bool = True,
) -> dict:
    """Steps 1-4 on one started server; the returning turn's figures. `answer` (the first
    server's) keeps the returning prompt the same on every server."""
    for _ in range(2):
        bc.chat(client, server, WARMUP, max_tokens=4)
    first = None
    if first_sight:
        first = bc.chat(client, server, convo, max_tokens=args.max_tokens)
        answer = answer if answer is not None else first.text
        print(f"  first sight: prompt={first.prompt_tokens} ttft={first.ttft:.2f}s", flush=True)
    server.new_log_lines()  # forget what came before the swap
    swap = bc.chat(client, as_model(server, swap_name), WARMUP, max_tokens=2)
    print(f"  swapped to the other model: {swap.total:.2f}s", flush=True)
    returning = [
        *convo,
        {"role": "assistant", "content": answer},
        {"role": "user", "content": QUESTION},
    ]
    started = time.perf_counter()
    reply = bc.chat(client, server, returning, max_tokens=args.max_tokens)
    lines = server.new_log_lines() if server.kind == "kvserve" else []
    engine = [m.groupdict() for line in lines if (m := bc._LOG_LINE.search(line))]
    result = {
        "answer": answer,
        "first": first,
        "reply": reply,
        "load": load_seconds(lines),
        "source": engine[-1]["source"] if engine else None,
        "wall": time.perf_counter() - started,
    }
    print(
        f"  returning turn: prompt={reply.prompt_tokens} cached={reply.cached_tokens} "
        f"ttft={reply.ttft:.2f}s load={result['load']} source={result['source']}",
        flush=True,
    )
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    bc.set_blas_threads(args.blas_threads)
    convo = conversation(args.tokens, args.seed)
    client = bc.http_client()
    started = time.perf_counter()
    with bc.workdir(args.keep) as work:
        from tests.support.tiny_models import make_model_dir

        tiny = make_model_dir(work / "swap-model", "llama", seed=7)
        step = ["--prefill-step", str(args.prefill_step)]
        models = ["--model", "default", "--model", f"swap={tiny}", "--max-loaded-models", "1"]
        print(bc.machine(), flush=True)

        print("mlx-kvserve (prompt cache in a fresh temp dir)", flush=True)
        server = bc.Server("kvserve", work, cache_dir=work / "cache", extra=models + step)
        cached = run(server.start(), "swap", convo, None, args, client)
        server.stop()

        print("mlx-kvserve --no-cache", flush=True)
        server = bc.Server("kvserve", work, no_cache=True, extra=models + step)
        cold = run(server.start(), "swap", convo, cached["answer"], args, client, first_sight=False)
        server.stop()

        mlx_lm = None
        if not args.no_mlx_lm:
            print("mlx_lm.server", flush=True)
            extra = ["--prefill-step-size", str(args.prefill_step)]
            server = bc.Server("mlx_lm", work, extra=extra)
            mlx_lm = run(server.start(), str(tiny), convo, cached["answer"], args, client)
            server.stop()
    report(args, cached, cold, mlx_lm, time.perf_counter() - started)
    return 0


def report(args, cached: dict, cold: dict, mlx_lm: dict | None, seconds: float) -> None:
    def row(label: str, r: dict, how: str) -> str:
        reply = r["reply"]
        load = f"{r['load']:.2f} s" if r["load"] is not None else "n/a"
        return (
            f"| {label} | {how} | {reply.prompt_tokens} | {reply.cached_tokens} | {load} | "
            f"{reply.ttft:.2f} s |"
        )

    print()
    print(f"Conversation of ~{args.tokens} tokens, returning after a model swap; {seconds:.0f} s")
    print("| server | the returning turn | prompt tokens | cached | model load | TTFT |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    print(row("mlx-kvserve", cached, f"reload + restore ({cached['source']})"))
    print(row("mlx-kvserve --no-cache", cold, "reload + cold prefill"))
    if mlx_lm is not None:
        print(row("mlx_lm.server", mlx_lm, "its model swap"))
    speedup = cold["reply"].ttft / cached["reply"].ttft if cached["reply"].ttft else float("nan")
    print(f"\nreload + restore is {speedup:.1f}x faster than reload + cold prefill")


if __name__ == "__main__":
    sys.exit(main())
