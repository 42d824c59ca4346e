#!/usr/bin/env python3
"""Decode tokens/s of the server's generation path against bare `mlx_lm.stream_generate`.

    python scripts/bench_decode.py                       # default model, 8 rounds of 128 tokens
    python scripts/bench_decode.py --model DIR --tokens 256 --rounds 12

One process loads the model once and runs, round after round in alternating order, the same
greedy request (same model directory, same prompt tokens, EOS ignored so every run decodes
exactly --tokens tokens) through:

* `mlx_lm`: `mlx_lm.stream_generate`, the loop mlx_lm.server and `mlx_lm.generate` use;
* `server`: our `Generator.run` (engine/generate.py + engine/decode.py), exactly as the engine
  thread runs a request, with the prompt cache off so no checkpoint is taken;
* `unpipelined` (unless --no-unpipelined): the same Generator with decode pipelining switched
  off, i.e. the loop the server ran before pipelining (evaluate and read token k, then build step
  k+1), which is also the path grammar-constrained requests take.

Both sides are timed the same way, from outside: from the first token handed to the caller to
the last, over tokens - 1 intervals, so prefill is excluded. Alternating rounds spread the noise
of a shared machine evenly; the figure is the median over rounds. The ratio is server / mlx_lm.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from mlx_kvserve.blas import preload_optimised_blas  # noqa: E402

preload_optimised_blas()  # before MLX is imported (Linux only; a no-op on macOS)

import mlx.core as mx  # noqa: E402
from mlx_lm import load, stream_generate  # noqa: E402
from mlx_lm.sample_utils import make_sampler  # noqa: E402

from mlx_kvserve.engine import decode as decode_module  # noqa: E402
from mlx_kvserve.engine.generate import Generator  # noqa: E402
from mlx_kvserve.engine.prompt_state import PromptStates  # noqa: E402
from mlx_kvserve.engine.requests import (  # noqa: E402
    Done,
    GenerationRequest,
    SamplingParams,
    TextChunk,
)

PROMPT = "Write a long story about a lighthouse keeper who finds a message in a bottle."


@dataclass
class TimedRequest(GenerationRequest):
    """A request that records when each event reaches the caller instead of sending it."""

    times: list[float] = field(default_factory=list)
    done: Done | None = None

    def emit(self, event: Any) -> None:
        if isinstance(event, TextChunk):
            self.times.append(time.perf_counter())
        elif isinstance(event, Done):
            self.times.append(time.perf_counter())
            self.done = event


def run_server(gen: Generator, prompt: list[int], tokens: int) -> float:
    req = TimedRequest(
        list(prompt), SamplingParams(temperature=0.0, max_tokens=tokens), kind="text"
    )
    gen.run(req)
    assert req.done is not None and req.done.completion_tokens == tokens, req.done
    return (tokens - 1) / (req.times[-1] - req.times[0])


def run_mlx_lm(model: Any, tokenizer: Any, prompt: list[int], tokens: int) -> float:
    times = []
    n = 0
    for response in stream_generate(
        model, tokenizer, prompt, max_tokens=tokens, sampler=make_sampler(temp=0.0)
    ):
        times.append(time.perf_counter())
        n = response.generation_tokens
    assert n == tokens, n
    return (tokens - 1) / (times[-1] - times[0])


def default_model_dir() -> Path:
    from mlx_kvserve import paths
    from mlx_kvserve.models.default_model import ensure_default_model

    return ensure_default_model(paths.data_dir(), progress=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", type=Path, default=None, help="mlx-lm model dir (default: built-in)")
    p.add_argument("--tokens", type=int, default=128, help="tokens decoded per run")
    p.add_argument("--rounds", type=int, default=8, help="timed rounds (after one warm-up)")
    p.add_argument("--no-unpipelined", action="store_true", help="skip the unpipelined loop")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)

    model_dir = args.model or default_model_dir()
    model, tokenizer = load(str(model_dir))
    tokenizer.eos_token_ids = []  # decode exactly --tokens tokens on every path
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": PROMPT}], add_generation_prompt=True
    )
    gen = Generator(model, tokenizer, PromptStates(model, None, enabled=False))
    pipelined = decode_module.Decoder.pipelined

    def unpipelined() -> float:
        decode_module.Decoder.pipelined = property(lambda self: False)  # type: ignore[assignment]
        try:
            return run_server(gen, prompt, args.tokens)
        finally:
            decode_module.Decoder.pipelined = pipelined  # type: ignore[assignment]

    paths = {
        "mlx_lm": lambda: run_mlx_lm(model, tokenizer, prompt, args.tokens),
        "server": lambda: run_server(gen, prompt, args.tokens),
    }
    if not args.no_unpipelined:
        paths["unpipelined"] = unpipelined
    for run in paths.values():  # warm-up: kernels, allocator, detokenizer tables
        run()
    rates: dict[str, list[float]] = {name: [] for name in paths}
    order = list(paths)
    for r in range(args.rounds):
        for name in order if r % 2 == 0 else reversed(order):
            rates[name].append(paths[name]())

    med = {name: statistics.median(v) for name, v in rates.items()}
    result = {
        "model": str(model_dir),
        "device": str(mx.default_device()),
        "prompt_tokens": len(prompt),
        "tokens": args.tokens,
        "rounds": args.rounds,
        "median_tok_s": med,
        "all_tok_s": rates,
        "ratio_server_vs_mlx_lm": med["server"] / med["mlx_lm"],
    }
    if "unpipelined" in med:
        result["ratio_unpipelined_vs_mlx_lm"] = med["unpipelined"] / med["mlx_lm"]
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"model {model_dir} on {result['device']}; prompt {len(prompt)} tokens")
    print(f"{args.tokens} tokens per run, {args.rounds} rounds (median, then min..max)")
    for name, values in rates.items():
        print(f"  {name:<12} {med[name]:7.1f} tok/s   ({min(values):.1f} .. {max(values):.1f})")
    print(f"ratio server / mlx_lm: {result['ratio_server_vs_mlx_lm']:.3f}")
    if "unpipelined" in med:
        print(f"ratio unpipelined / mlx_lm: {result['ratio_unpipelined_vs_mlx_lm']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
