"""The activation dtype of the served model, which is the dtype of its KV cache.

The default model's conversion keeps its norms in float32 (see `gguf.py`), so its activations,
and the KV every token adds, are float32: right on the Linux CPU, where float32 through an
optimised BLAS is the fast path and measured best, but on Metal it doubles the KV bytes per
token in unified memory, in the RAM tier and on disk, and runs float32 quantized matmuls. On
Metal (`kv_dtype = "auto"`) a model whose activations are float32, as one token's pass shows,
therefore has its floating tensors cast to HALF (the norms, and the quantization scales and
biases, which must match the activations or the result is promoted back to float32). A model
that computes in half precision is left alone, including the float32 tensors a bf16 checkpoint
holds on purpose (Qwen3.5's `A_log`, the router biases of GLM-4.x and DeepSeek-V3, which
mlx-lm's conversion keeps in float32 through the model's `cast_predicate`): whether some
parameter is float32 decides nothing. A cast honours `cast_predicate` as `mlx_lm.convert` does.
Why float16 rather than bfloat16 for the default model: docs/benchmarks.md, "KV precision"
(`scripts/kv_dtype_check.py`).

The dtype actually served (`served_dtype`: what "auto" decided once the model is loaded) is
part of the prompt cache's fingerprint, so a cache written in one dtype lives in another
directory than one written in another and can never be restored into it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mlx_kvserve import macos
from mlx_kvserve.config.values import KV_DTYPES

if TYPE_CHECKING:  # MLX is imported only after the BLAS preload (mlx_kvserve.blas)
    import mlx.core as mx
    import mlx.nn as nn

HALF = "float16"


def on_metal() -> bool:
    """Whether MLX runs on a Metal GPU here (imports MLX: call after the BLAS preload)."""
    return macos.metal_working_set() is not None


def resolve_kv_dtype(setting: str, *, metal: bool) -> str | None:
    """The dtype to serve the model's activations (and KV) in, or None for the model's own."""
    if setting not in KV_DTYPES:
        raise ValueError(f"kv_dtype must be one of {', '.join(KV_DTYPES)}, not {setting!r}")
    if setting == "native" or (setting == "auto" and not metal):
        return None
    return HALF if setting == "auto" else setting


def served_dtype(setting: str, resolved: str | None, cast: bool) -> str | None:
    """The dtype the model is actually served in, for the fingerprint: `resolved` when it was
    cast (or asked for explicitly: a model already in that dtype needs no cast), the model's own
    (None) when "auto" left it alone, a bf16 model being the usual case."""
    if resolved is None or (setting == "auto" and not cast):
        return None
    return resolved


def activation_dtype(model: nn.Module) -> mx.Dtype:
    """The dtype of the logits of a one-token pass: what the model computes in."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    logits = model(mx.array([[0]]), cache=make_prompt_cache(model))
    mx.eval(logits)
    return logits.dtype


def apply_kv_dtype(model: nn.Module, dtype: str | None, *, only_if_float32: bool) -> bool:
    """Cast the model's floating tensors to `dtype`; returns whether anything changed.

    `only_if_float32` (the "auto" policy) leaves a model alone unless it computes in float32.
    Tensors the model's `cast_predicate` keeps (mlx-lm's deliberate float32) are not cast.
    """
    if dtype is None:
        return False
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_map_with_path

    target = getattr(mx, dtype)
    if only_if_float32 and activation_dtype(model) != mx.float32:
        return False
    keep = getattr(model, "cast_predicate", lambda _path: True)
    changed = False

    def cast(path: str, value: mx.array) -> mx.array:
        nonlocal changed
        if keep(path) and mx.issubdtype(value.dtype, mx.floating) and value.dtype != target:
            changed = True
            return value.astype(target)
        return value

    cast_params = tree_map_with_path(cast, model.parameters())
    if not changed:
        return False
    model.update(cast_params)
    mx.eval([v for _, v in tree_flatten(model.parameters())])  # drop the old buffers now
    return True
