#!/usr/bin/env python3
"""What a verify pass and a per-row rollback cost on this machine (docs/speculation.md).

    python scripts/bench_verify.py                    # default model, contexts 512 and 2048
    python scripts/bench_verify.py --contexts 512 --reps 5

One process, the default model (or --model), greedy, no server. For each context length and
batch size 1, 4, 8 it builds a merged `BatchKVCache` of that many rows (each row prefilled with
its own random prompt of the context's length, then merged as the engine's batch does) and
times, median of --reps after a warm-up, each followed by a uniform trim back to where it began:

* one decode pass (every row feeds 1 token): the unit;
* verify passes that feed k+1 tokens per row (k = 1..8 drafts), logits for every position.

Then the rollback of a batch whose rows kept different numbers of drafts (after a width-9 pass,
rows reject 0, 2, 4, 8, ... tokens), each option exact, timed in units of the decode pass:

* `roll`: BatchKVCache's own `prepare(right_padding)` + `finalize()`: each row's valid tokens
  are rolled right so the rejected slots become left padding (a copy of every layer's KV);
* `remerge`: extract every row, trim it, merge again (what oMLX ships; copies twice);
* `holes`: rejected slots stay where they are, marked invalid in a per-row mask that the
  attention mask ANDs in, and the row's RoPE offset steps back (no copy; the cost is a wider
  mask each pass, timed as the decode pass's overhead with a mask in place).

The three are checked against each other: the next pass's logits after each rollback.

Last, the state a non-trimmable layer must snapshot before a verify, per layer at the shapes of
real checkpoints (a GatedDeltaNet layer's conv and recurrent state; a sliding-window layer's
window): what copying it costs, against the decode pass.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mlx_kvserve.blas import preload_optimised_blas  # noqa: E402

preload_optimised_blas()  # before MLX is imported (Linux only; a no-op on macOS)

import mlx.core as mx  # noqa: E402
from mlx_lm import load  # noqa: E402
from mlx_lm.models.base import create_causal_mask  # noqa: E402
from mlx_lm.models.cache import (  # noqa: E402
    BatchKVCache,
    KVCache,
    RotatingKVCache,
    make_prompt_cache,
)

BATCHES = (1, 4, 8)
DEPTHS = range(1, 9)
REJECT = (0, 2, 4, 8, 1, 3, 5, 7)  # rows' rejected drafts after a width-9 verify


class HoleyBatchKVCache(BatchKVCache):
    """A BatchKVCache whose rows can give back their newest slots without moving anything: the
    slots are marked invalid (ANDed into the attention mask) and the row's offset steps back,
    so its next tokens get the right positions. A prototype for the study, not engine code."""

    valid: mx.array | None = None  # (B, slots) bool

    def rollback(self, rejected: list[int]) -> None:
        slots = mx.arange(self._idx)[None]
        r = mx.array(rejected)[:, None]
        gone = slots >= self._idx - r
        self.valid = ~gone if self.valid is None else self.valid[:, : self._idx] & ~gone
        self.offset = self.offset - mx.array(rejected)

    def make_mask(self, N: int, return_array: bool = False, **kwargs):  # type: ignore[override]
        mask = create_causal_mask(N, offset=self._idx, left_padding=self.left_padding, **kwargs)
        if self.valid is None:
            return mask
        valid = self.valid[:, : self._idx]
        if valid.shape[1] < self._idx:  # slots written since the last rollback
            fresh = mx.ones((valid.shape[0], self._idx - valid.shape[1]), dtype=mx.bool_)
            valid = mx.concatenate([valid, fresh], axis=1)
        ext = mx.concatenate([valid, mx.ones((valid.shape[0], N), dtype=mx.bool_)], axis=1)
        return mask & ext[:, None, None, :]


def median_seconds(fn: Callable[[], None], reps: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


_ROWS: dict[int, list[list]] = {}  # context -> prefilled rows (their own per-layer caches)


def build(model, batch: int, context: int, cls=BatchKVCache) -> list:
    """Per layer, a fresh merged cache of `batch` rows holding `context` random tokens each
    (rows are prefilled once per context and merged anew each time, so nothing is shared)."""
    rows = _ROWS.setdefault(context, [])
    mx.random.seed(context)
    while len(rows) < batch:
        cache = make_prompt_cache(model)
        model(mx.random.randint(100, 20000, (1, context)), cache=cache)
        mx.eval([c.state for c in cache])
        rows.append(cache)
    merged = []
    for layer in zip(*rows[:batch], strict=True):
        assert all(isinstance(c, KVCache) for c in layer), "the study's model is attention-only"
        m = BatchKVCache.merge(list(layer))
        if cls is not BatchKVCache:
            m.__class__ = cls
        merged.append(m)
    mx.eval([c.state for c in merged])
    return merged


def pass_seconds(model, cache: list, batch: int, width: int, reps: int) -> float:
    tokens = mx.random.randint(100, 20000, (batch, width))

    def run() -> None:
        mx.eval(model(tokens, cache=cache))
        for c in cache:
            c.trim(width)

    return median_seconds(run, reps)


def verify_table(model, contexts: list[int], reps: int) -> None:
    print("\nverify pass / one decode pass (same batch, same context), median of", reps)
    for context in contexts:
        header = "  k  " + "".join(f"  B={b:<2} ctx={context:<6}" for b in BATCHES)
        print(header)
        unit, ratios = {}, {}
        for b in BATCHES:
            cache = build(model, b, context)
            unit[b] = pass_seconds(model, cache, b, 1, reps)
            ratios[b] = [pass_seconds(model, cache, b, k + 1, reps) / unit[b] for k in DEPTHS]
        for i, k in enumerate(DEPTHS):
            print(f"  {k:<3}" + "".join(f"  {ratios[b][i]:>16.2f}x" for b in BATCHES))
        print("  1 pass " + "".join(f"  {unit[b] * 1000:>14.1f} ms" for b in BATCHES))


def roll(cache: list, rejected: list[int]) -> None:
    for c in cache:
        c.prepare(right_padding=rejected)
        c.finalize()
    mx.eval([c.state for c in cache])


def remerge(cache: list, rejected: list[int]) -> list:
    new = []
    for c in cache:
        rows = [c.extract(i) for i in range(len(rejected))]
        for row, r in zip(rows, rejected, strict=True):
            row.trim(r)
        new.append(BatchKVCache.merge(rows))
    mx.eval([c.state for c in new])
    return new


def holes(cache: list, rejected: list[int]) -> None:
    for c in cache:
        c.rollback(rejected)
    mx.eval([c.valid for c in cache] + [c.offset for c in cache])


def rollback_table(model, contexts: list[int], reps: int) -> None:
    print("\nper-row rollback after a width-9 verify, in decode passes (same batch, context)")
    print(f"  rows reject {REJECT[:8]} drafts (first B of them)")
    for context in contexts:
        for b in BATCHES[1:]:
            rejected = list(REJECT[:b])
            tokens = mx.random.randint(100, 20000, (b, 9))
            nxt = mx.random.randint(100, 20000, (b, 1))
            unit = pass_seconds(model, build(model, b, context), b, 1, reps)

            results, logits, over = {}, {}, 0.0
            for name, cls, fn in (
                ("roll", BatchKVCache, roll),
                ("remerge", BatchKVCache, remerge),
                ("holes", HoleyBatchKVCache, holes),
            ):
                times = []
                for rep in range(reps + 1):
                    cache = build(model, b, context, cls=cls)
                    mx.eval(model(tokens, cache=cache))
                    t0 = time.perf_counter()
                    out = fn(cache, rejected)
                    times.append(time.perf_counter() - t0)
                    cache = out if out is not None else cache
                    if rep == 0:
                        logits[name] = model(nxt, cache=cache)
                        mx.eval(logits[name])
                        if name == "holes":  # the mask's cost on every later pass
                            over = pass_seconds(model, cache, b, 1, reps) / unit - 1
                results[name] = statistics.median(times[1:]) / unit
            diff = max(
                mx.abs(logits[n] - logits["remerge"]).max().item() for n in ("roll", "holes")
            )
            print(
                f"  B={b} ctx={context:<6} roll {results['roll']:.3f}  remerge "
                f"{results['remerge']:.3f}  holes {results['holes']:.3f} ({over:+.3f} per later"
                f" pass)  max |logits diff| vs remerge {diff:.2e}"
            )


def state_table(unit_seconds: float, reps: int) -> None:
    """Snapshot (copy) cost of one layer's non-trimmable state, per row, against a decode pass
    of the default model at batch 1."""
    print("\nsnapshot of one layer's state per row (a copy), in default-model decode passes")
    shapes = {
        "GatedDeltaNet conv (Qwen3-Next)": (1, 3, 8192),
        "GatedDeltaNet recurrent (Qwen3-Next, 32 v-heads 128x128)": (1, 32, 128, 128),
        "Mamba2 ssm (nemotron-h, 128 heads 64x128)": (1, 128, 64, 128),
        "sliding window 512 (Gemma 3 270M: 1 kv head x 256), K+V": (2, 1, 1, 512, 256),
        "sliding window 1024 (Gemma 3 27B: 16 kv heads x 128), K+V": (2, 1, 16, 1024, 128),
    }
    for name, shape in shapes.items():
        x = mx.random.normal(shape).astype(mx.bfloat16)
        mx.eval(x)
        s = median_seconds(lambda x=x: mx.eval(mx.array(x) + 0), reps)
        print(f"  {name:<58} {x.nbytes / 2**20:7.2f} MiB  {s / unit_seconds:.4f}")


def rotating_check(window: int = 8) -> None:
    """Rolling back a sliding-window layer (single row): after a verify pass of S tokens keeps
    `window - 1 + S` slots in temporal order, `trim(r)` and then dropping the r rejected slots
    at the tail is exact (the next passes see what plain decoding's would), while `trim(r)`
    alone, once the window has wrapped, leaves the rejected keys visible."""

    def feed(c: RotatingKVCache, values: range) -> None:
        for x in values:
            v = mx.full((1, 1, 1, 2), float(x))
            c.update_and_fetch(v, v)

    def seen(c: RotatingKVCache, token: int) -> list[int]:
        v = mx.full((1, 1, 1, 2), float(token))
        keys, _ = c.update_and_fetch(v, v)
        return sorted(int(x) for x in keys[0, 0, :, 0].tolist())

    results = {"trim+slice": True, "trim": True}
    for before in (3, 7, 8, 20):
        for width in (2, 4, 6):
            for rejected in range(width):
                for how in results:
                    ref, c = RotatingKVCache(window), RotatingKVCache(window)
                    feed(ref, range(1, before + 1))
                    feed(c, range(1, before + 1))
                    v = mx.arange(before + 1, before + 1 + width, dtype=mx.float32)
                    v = mx.broadcast_to(v.reshape(1, 1, width, 1), (1, 1, width, 2))
                    c.update_and_fetch(v, v)  # the verify pass
                    c.trim(rejected)
                    if how == "trim+slice":
                        c.keys, c.values = c.keys[..., : c._idx, :], c.values[..., : c._idx, :]
                    feed(ref, range(before + 1, before + 1 + width - rejected))
                    nxt = before + 1 + width - rejected
                    for t in range(nxt, nxt + 3):
                        results[how] &= seen(c, t) == seen(ref, t)
    print(f"\nsliding window (single row, window {window}): exact after a partial reject?")
    for how, exact in results.items():
        print(f"  {how:<11} {'exact' if exact else 'NOT exact'}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", type=Path, default=None, help="mlx-lm model dir (default: built-in)")
    p.add_argument("--contexts", default="512,2048", help="context lengths, comma-separated")
    p.add_argument("--reps", type=int, default=5, help="timed repetitions per cell")
    args = p.parse_args(argv)
    if args.model is None:
        from mlx_kvserve import paths
        from mlx_kvserve.models.default_model import ensure_default_model

        args.model = ensure_default_model(paths.data_dir(), progress=True)
    model, _ = load(str(args.model))
    contexts = [int(c) for c in args.contexts.split(",")]
    print(f"model {args.model.name} on {mx.default_device()}")
    verify_table(model, contexts, args.reps)
    rollback_table(model, contexts, args.reps)
    unit = pass_seconds(model, build(model, 1, contexts[0]), 1, 1, args.reps)
    state_table(unit, args.reps)
    rotating_check()
    return 0


if __name__ == "__main__":
    sys.exit(main())
