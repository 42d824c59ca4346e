"""How much memory models may take together, and what one model takes: the numbers the model
pool (models.pool) swaps by. Estimates, read before a model loads: its weights as stored on
disk, plus the KV budget its engine may fill.
"""

from __future__ import annotations

import os
from pathlib import Path

from mlx_kvserve import macos
from mlx_kvserve.config.values import parse_size

AUTO_SHARE = 0.75  # of the GPU working set (Metal) or of RAM (CPU)
KV_SHARE = 0.5  # an auto KV budget, as a share of the weights, for the estimate
KV_CAP = 8 << 30


def weights_bytes(model_dir: Path) -> int:
    """The model's weights as stored (safetensors; MLX maps them as they are)."""
    return sum(p.stat().st_size for p in Path(model_dir).glob("*.safetensors") if p.is_file())


def footprint(model_dir: Path, kv_budget: int | None) -> int:
    """Weights plus the KV the engine may hold: its --kv-budget, or for `auto` an estimate
    (half the weights, at most 8 GiB) that the engine refines once loaded."""
    weights = weights_bytes(model_dir)
    kv = kv_budget if kv_budget is not None else min(int(weights * KV_SHARE), KV_CAP)
    return weights + kv


def system_memory() -> int:
    """What models may use at most: the recommended GPU working set on Metal, else RAM."""
    try:
        size = macos.metal_working_set()
    except Exception:  # no MLX device information: fall back to RAM
        size = None
    if size is not None:
        return size
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def memory_budget(setting: str) -> int:
    """--memory-budget: a size, or `auto` (75% of `system_memory()`)."""
    if setting == "auto":
        return int(system_memory() * AUTO_SHARE)
    return parse_size(setting)
