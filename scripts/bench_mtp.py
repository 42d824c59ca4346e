#!/usr/bin/env python3
"""What an MTP draft costs against a decode pass of its target (docs/speculation.md, "MTP").

    python scripts/bench_mtp.py                       # a small Qwen3.5 shape and a tiny one
    python scripts/bench_mtp.py --shapes small --context 1024 --reps 9
    python scripts/bench_mtp.py --prefill 512 --context 2048 --reps 3   # a prefill chunk's share

One process, no server, random weights (no checkpoint with MTP heads is reachable here: the
times depend on the shapes, not the values). For each shape it builds a Qwen3.5 model (mlx-lm's,
bfloat16) and its MTP block as models/mtp_heads.py builds it (one full-attention decoder layer
of the family), prefills `--context` tokens, and times, median of `--reps` after a warm-up:

* one decode pass of the target (one token, its hybrid caches): the unit;
* one `MTPDraft.propose(k)` for k = 1..4 (engine/speculation/mtp.py): the pending pair fed,
  then k - 1 more MTP steps, each through the target's output head, and the drafting steps
  trimmed: what a row pays for k drafts per verify pass.

With `--prefill N` it times instead what the MTP source adds to a prefill: a chunk of N prompt
tokens after `--context` ones through the target (its caches only, as engine/generate.py
evaluates a chunk: no output head), and `MTPDraft.chunk` over the same N pairs (one block step,
its cache holding the context's pairs; no output head either).

A draft pays when the tokens it saves outweigh it: with acceptance a per position and a verify
pass of k+1 tokens costing c(k+1) decode passes, one round yields 1 + a + ... + a^k tokens for
c(k+1) + cost(k). The output head is most of an MTP step on a small model (a 248k vocabulary),
so the share of a pass an MTP draft costs falls as the model grows.
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _bench_common import median_seconds  # noqa: E402

from mlx_kvserve.blas import preload_optimised_blas  # noqa: E402

preload_optimised_blas()  # before MLX is imported (Linux only; a no-op on macOS)

import mlx.core as mx  # noqa: E402
from mlx_lm.models import qwen3_5  # noqa: E402

from mlx_kvserve.engine.speculation.mtp import MTPDraft  # noqa: E402
from mlx_kvserve.models.mtp_heads import MTPHeads, _block  # noqa: E402

# Qwen3.5-style text configs: "small" has the published small checkpoints' vocabulary
# (248,320) and a 1024-wide hybrid stack (3 GatedDeltaNet layers to 1 attention layer).
SHAPES = {
    "tiny": dict(hidden_size=64, num_hidden_layers=4, intermediate_size=128, vocab_size=49280,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
                 linear_value_head_dim=16),
    "small": dict(hidden_size=1024, num_hidden_layers=24, intermediate_size=3584,
                  vocab_size=248320, num_attention_heads=8, num_key_value_heads=2, head_dim=256,
                  linear_num_value_heads=16, linear_num_key_heads=16, linear_key_head_dim=128,
                  linear_value_head_dim=128),
}  # fmt: skip


def build(shape: dict) -> tuple[qwen3_5.Model, MTPHeads]:
    text = {
        **shape,
        "model_type": "qwen3_5_text",
        "rms_norm_eps": 1e-6,
        "full_attention_interval": 4,
        "linear_conv_kernel_dim": 4,
        "tie_word_embeddings": True,
        "mtp_num_hidden_layers": 1,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000000.0,
            "partial_rotary_factor": 0.25,
            "mrope_section": [11, 11, 10],
        },
    }
    config = {"model_type": "qwen3_5", "text_config": text}
    model = qwen3_5.Model(qwen3_5.ModelArgs.from_dict(config))
    model.set_dtype(mx.bfloat16)
    block = _block(config, model, 1)
    block.set_dtype(mx.bfloat16)
    mx.eval(model.parameters(), block.parameters())
    return model, MTPHeads(model, block)


def bench(name: str, context: int, reps: int) -> None:
    model, heads = build(SHAPES[name])
    vocab = SHAPES[name]["vocab_size"]
    prompt = mx.random.randint(0, vocab, (1, context))
    cache = model.make_cache()
    mx.eval(model(prompt, cache=cache))
    token = mx.array([[7]])

    def decode() -> None:
        mx.eval(model(token, cache=cache))
        for c in cache:  # back to the context, so every rep sees the same length
            if hasattr(c, "trim") and c.is_trimmable():
                c.trim(1)

    unit = median_seconds(decode, reps)
    hidden = heads.inner(prompt, None)[0]
    source = MTPDraft(heads)
    source.extend(prompt[0].tolist())
    source.record(0, hidden[: context - 1])  # the MTP cache holds the context's pairs
    print(f"{name}: hidden {SHAPES[name]['hidden_size']}, layers "
          f"{SHAPES[name]['num_hidden_layers']}, vocab {vocab}, context {context}")  # fmt: skip
    print(f"  target decode pass  {unit * 1000:8.1f} ms  1.00")
    for k in range(1, 5):

        def draft(k: int = k) -> None:
            source._memo = (-1, [])  # no cached proposal: draft afresh
            assert source.propose(k) is not None

        seconds = median_seconds(draft, reps)
        print(f"  MTP draft of {k}      {seconds * 1000:8.1f} ms  {seconds / unit:.2f}")


def bench_prefill(name: str, context: int, step: int, reps: int) -> None:
    model, heads = build(SHAPES[name])
    vocab = SHAPES[name]["vocab_size"]
    prompt = mx.random.randint(0, vocab, (1, context + step))
    cache = model.make_cache()
    hidden = heads.inner(prompt[:, :context], cache)[0]
    source = MTPDraft(heads)
    tokens = prompt[0].tolist()
    mx.eval(source.chunk(0, tokens[:context], hidden))
    chunk = prompt[:, context:]
    before = [list(c.state) for c in cache]  # copies: an ArraysCache's state is its own list

    def target() -> None:
        mx.eval([c.state for c in cache] + [heads.inner(chunk, cache)])
        for c, state in zip(cache, before, strict=True):  # back to the context
            c.state = list(state) if isinstance(c.state, list) else tuple(state)

    unit = median_seconds(target, reps)
    hidden = heads.inner(chunk, [copy.deepcopy(c) for c in cache])[0]
    mx.eval(hidden)
    saved = (list(source.tokens), dict(source.hidden), source.fed, source.out)

    def mtp() -> None:
        source.tokens, source.hidden, source.fed, source.out = (
            list(saved[0]),
            dict(saved[1]),
            saved[2],
            saved[3],
        )
        mx.eval(source.chunk(context, tokens[context:], hidden))
        for c in source.cache:
            c.trim(step)

    seconds = median_seconds(mtp, reps)
    print(f"{name}: hidden {SHAPES[name]['hidden_size']}, layers "
          f"{SHAPES[name]['num_hidden_layers']}, a chunk of {step} after {context}")  # fmt: skip
    print(f"  target chunk        {unit * 1000:8.1f} ms  1.00")
    print(f"  MTP chunk           {seconds * 1000:8.1f} ms  {seconds / unit:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["tiny", "small"], choices=list(SHAPES))
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--prefill", type=int, default=0, help="time a prefill chunk this long")
    args = parser.parse_args()
    for name in args.shapes:
        if args.prefill:
            bench_prefill(name, args.context, args.prefill, args.reps)
        else:
            bench(name, args.context, args.reps)


if __name__ == "__main__":
    main()
