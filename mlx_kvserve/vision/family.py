"""Which checkpoints see images here: a config with a `vision_config` of a family whose vision
tower this server runs (read from the files, so the API knows before the model loads)."""

from __future__ import annotations

import functools
import json
from pathlib import Path

# model_type -> the family module (mlx_kvserve/vision/<module>.py)
FAMILIES = {"gemma3": "gemma3", "gemma4": "gemma4"}


def vision_family(model_dir: Path | None) -> str | None:
    """The family of `model_dir`'s vision tower, or None: a text model, a family not served
    here, or mlx-vlm not installed (then the model is served as text, images as notes)."""
    if model_dir is None:
        return None
    config = _config(str(model_dir))
    if not isinstance(config, dict) or not config.get("vision_config"):
        return None
    family = FAMILIES.get(str(config.get("model_type")))
    if family is None or vision_library() is not None:
        return None
    return family


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
