"""Which checkpoints see images here: a config with a `vision_config` of a family whose vision
tower this server runs (read from the files, so the API knows before the model loads)."""

from __future__ import annotations

import functools
import json
from pathlib import Path

# model_type -> the family (vision/encoder.py's `load_vision`)
FAMILIES = {
    "gemma3": "gemma3",
    "gemma4": "gemma4",
    "qwen2_5_vl": "qwen2_5_vl",
    "qwen3_vl": "qwen3_vl",
    "qwen3_5": "qwen3_5",
    # the MoE text models (mlx-lm's) with the same towers, rope and markup
    "qwen3_vl_moe": "qwen3_vl",
    "qwen3_5_moe": "qwen3_5",
}
TOWER_PREFIXES = ("visual.", "vision_tower.")  # after a leading `model.` (tower.py)


def vision_family(model_dir: Path | None) -> str | None:
    """The family of `model_dir`'s vision tower, or None: a text model, a family not served
    here, or mlx-vlm not installed (then the model is served as text, images as notes)."""
    if model_dir is None:
        return None
    config = _config(str(model_dir))
    if not isinstance(config, dict) or not config.get("vision_config"):
        return None
    family = FAMILIES.get(str(config.get("model_type")))
    if family is None or vision_library() is not None or not _has_tower(str(model_dir)):
        return None
    return family


@functools.lru_cache(maxsize=64)
def _has_tower(model_dir: str) -> bool:
    """Whether the checkpoint ships its vision tower's tensors (a text-only conversion keeps
    the `vision_config` and drops them): read from the safetensors headers, not the data."""
    for file in sorted(Path(model_dir).glob("*.safetensors")):
        try:
            with file.open("rb") as f:
                size = int.from_bytes(f.read(8), "little")
                names = json.loads(f.read(size))
        except (OSError, ValueError):
            continue
        if any(str(n).removeprefix("model.").startswith(TOWER_PREFIXES) for n in names):
            return True
    return False


@functools.lru_cache(maxsize=64)
def _config(model_dir: str) -> dict | None:
    """`config.json`, read once per directory (asked on every request with an image)."""
    try:
        return json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None


def vision_library() -> str | None:
    """Why vision towers cannot run here (None: mlx-vlm is installed)."""
    try:
        import mlx_vlm.models  # noqa: F401
    except ImportError:
        return "install the vision extra (pip install 'mlx-kvserve[vision]': mlx-vlm)"
    return None
