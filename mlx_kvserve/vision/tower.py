"""A checkpoint's vision weights, and only those: the tower and projector modules get the
tensors under their prefixes (the language model's are mlx-lm's, loaded once)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from mlx_kvserve.json_value import JSON


def vision_weights(model_dir: Path, prefixes: tuple[str, ...]) -> dict[str, mx.array]:
    """The tensors named under `prefixes` (a leading `model.`, transformers 5's layout,
    dropped), read lazily from every safetensors file of `model_dir`."""
    out: dict[str, mx.array] = {}
    for file in sorted(Path(model_dir).glob("*.safetensors")):
        for name, value in mx.load(str(file)).items():
            bare = name.removeprefix("model.")
            if bare.startswith(prefixes):
                out[bare] = value
    return out


def install(
    module: nn.Module,
    weights: dict[str, mx.array],
    config: dict[str, JSON],
    sanitize: Callable[[dict[str, mx.array]], dict[str, mx.array]] = lambda w: w,
) -> None:
    """Load `weights` (already stripped to `module`'s own names) into `module`, quantizing the
    layers a quantized checkpoint stored quantized."""
    weights = sanitize(weights)
    quantization = config.get("quantization")
    if isinstance(quantization, dict):
        nn.quantize(
            module,
            group_size=int(quantization.get("group_size", 64)),
            bits=int(quantization.get("bits", 4)),
            mode=str(quantization.get("mode", "affine")),
            class_predicate=lambda path, _m: f"{path}.scales" in weights,
        )
    module.load_weights(list(weights.items()), strict=True)
    module.eval()
    mx.eval(module.parameters())


def under(weights: dict[str, mx.array], prefix: str) -> dict[str, mx.array]:
    """The tensors under `prefix.`, named without it."""
    head = prefix + "."
    return {k.removeprefix(head): v for k, v in weights.items() if k.startswith(head)}
