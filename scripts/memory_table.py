"""Print docs/memory.md's table: what fits on 16/32/64/128 GB Macs, by the server's own code.

For each model in tests/fixtures/configs/models.json (published config.json files; no weights
are read) the layers come from models/kv_shape.py (checked against the caches of loaded tiny
models by tests/unit/test_kv_shape.py), the bytes per token and the tokens that fit from
engine/ledger.py's `KVCost`, and the budget from `default_budget`, the rule of
`--kv-budget auto`. Weights: parameters x bits per weight (4-bit affine with group size 64
stores 4.5 bits a weight with its scales and biases; gpt-oss ships MXFP4, 4.25).

Usage: python scripts/memory_table.py [--prompt 20000]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from mlx_kvserve.engine.ledger import RESERVE_TOKENS, KVCost, default_budget
from mlx_kvserve.models.context import context_from_config
from mlx_kvserve.models.kv_shape import layers_from_config

FIXTURES = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "configs"
MACS_GB = (16, 32, 64, 128)
GIB = 2**30


def working_set(ram_gb: int) -> int:
    """Metal's recommended working set (what `mx.device_info()` reports as
    max_recommended_working_set_size): about 2/3 of RAM below 36 GB, 3/4 above."""
    ram = ram_gb * GIB
    return ram * 2 // 3 if ram_gb < 36 else ram * 3 // 4


def old_rule(cost: KVCost, ws: int, weights: int, prompt: int, max_tokens: int) -> bool:
    """Before: prompt + max_tokens charged up front against half of what the weights and a
    1 GiB live budget left."""
    return cost.bytes_for(prompt + max_tokens) <= max((ws - weights - GIB) // 2, 256 << 20)


def rows(prompt: int) -> list[list[str]]:
    out = []
    for model in json.loads((FIXTURES / "models.json").read_text()):
        config = json.loads((FIXTURES / model["config"]).read_text())
        layers = layers_from_config(config, dtype_bytes=2)  # bf16 / fp16 KV
        cost = KVCost.of(layers)
        weights = int(model["params"] * model["bits"] / 8)
        context = context_from_config(config) or 1 << 62
        kv = f"{cost.per_token / 1024:.0f} KiB"
        windows = sum(per * length for per, length in cost.windows)
        if windows:
            kv += f" + {windows / 2**20:.0f} MiB of windows"
        if cost.state_bytes:
            kv += f" + {cost.state_bytes / 2**20:.0f} MiB of state"
        for ram in MACS_GB:
            ws = working_set(ram)
            if weights >= ws:
                out.append(
                    [
                        model["name"],
                        f"{ram} GB",
                        f"{weights / GIB:.1f}",
                        kv,
                        "-",
                        "-",
                        "weights do not fit",
                        "-",
                    ]
                )
                continue
            budget = default_budget(ws, weights)
            fit = min(cost.tokens_within(budget), context)
            now = cost.bytes_for(prompt + RESERVE_TOKENS) <= budget
            before = [
                old_rule(cost, ws, weights, prompt, min(32_000, context - prompt)),
                old_rule(cost, ws, weights, prompt, context - prompt),
            ]
            out.append(
                [
                    model["name"],
                    f"{ram} GB",
                    f"{weights / GIB:.1f}",
                    kv,
                    f"{budget / GIB:.1f}",
                    f"{fit:,}" + (" (context)" if fit == context else ""),
                    "yes" if now else "no",
                    " / ".join("yes" if b else "no" for b in before),
                ]
            )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt", type=int, default=20_000, help="an agent's prompt, tokens")
    args = parser.parse_args()
    head = [
        "model",
        "Mac",
        "weights GiB",
        "KV per token",
        "KV budget GiB",
        "tokens that fit",
        f"{args.prompt:,}-token prompt runs",
        "before (32k max_tokens / none)",
    ]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for row in rows(args.prompt):
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
