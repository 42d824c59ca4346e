"""The activation dtype of the served model, which is the dtype of its KV cache.

The default model's conversion keeps its norms in float32 (see `gguf.py`), so its activations,
and the KV every token adds, are float32: right on the Linux CPU, where float32 through an
optimised BLAS is the fast path and measured best, but on Metal it doubles the KV bytes per
token in unified memory, in the RAM tier and on disk, and runs float32 quantized matmuls. On
Metal (`kv_dtype = "auto"`) a model that holds float32 tensors therefore has every floating
tensor cast to HALF (the norms, and the quantization scales and biases, which must match the
activations or the result is promoted back to float32); a model that is already half precision
is left alone. Why float16 rather than bfloat16 for the default model: docs/benchmarks.md,
"KV precision" (`scripts/kv_dtype_check.py`).

The resolved dtype is part of the prompt cache's fingerprint, so a cache written in one dtype
lives in another directory than one written in another and can never be restored into it.
"""

from __future__ import annotations

import sys
from typing import Any

from mlx_kvserve.config import KV_DTYPES

HALF = "float16"


def on_metal() -> bool:
    """Whether MLX runs on a Metal GPU here (imports MLX: call after the BLAS preload)."""
    if sys.platform != "darwin":
        return False
    import mlx.core as mx

    return bool(mx.metal.is_available())


def resolve_kv_dtype(setting: str, *, metal: bool) -> str | None:
    """The dtype to serve the model's activations (and KV) in, or None for the model's own."""
    if setting not in KV_DTYPES:
        raise ValueError(f"kv_dtype must be one of {', '.join(KV_DTYPES)}, not {setting!r}")
    if setting == "native" or (setting == "auto" and not metal):
        return None
    return HALF if setting == "auto" else setting


def apply_kv_dtype(model: Any, dtype: str | None, *, only_if_float32: bool) -> bool:
    """Cast the model's floating tensors to `dtype`; returns whether anything changed.

    `only_if_float32` (the "auto" policy) leaves a model without float32 tensors as it is.
    """
    if dtype is None:
        return False
    import mlx.core as mx
    from mlx.utils import tree_flatten

    target = getattr(mx, dtype)
    params = tree_flatten(model.parameters())
    floats = [p.dtype for _, p in params if mx.issubdtype(p.dtype, mx.floating)]
    if only_if_float32 and mx.float32 not in floats:
        return False
    if all(d == target for d in floats):
        return False
    model.set_dtype(target)
    return True
