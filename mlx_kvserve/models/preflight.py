"""A model directory mlx-lm cannot load is refused before the server starts.

The model itself loads on the engine thread after the server is up (so /health can say
"loading"); a directory that can never load would leave a server that answers 503 for ever. The
checks here are the cheap ones `mlx_lm.load` would fail on first: a readable config.json with a
`model_type`, an architecture the installed mlx-lm implements, no custom code to run, weights.
"""

from __future__ import annotations

import json
from pathlib import Path


def model_dir_problem(model_dir: Path) -> str | None:
    """Why mlx-lm cannot load `model_dir`, or None. Imports mlx_lm: call after the BLAS preload."""
    path = Path(model_dir) / "config.json"
    try:
        config = json.loads(path.read_text())
    except OSError as exc:
        return f"{path} cannot be read: {exc.strerror or exc}"
    except ValueError as exc:
        return f"{path} is not valid JSON: {exc}"
    if not isinstance(config, dict) or not isinstance(config.get("model_type"), str):
        return f"{path} names no model_type"
    if config.get("model_file") is not None:
        return f"the model needs its own code ({config['model_file']!r}), which is not run"
    import mlx_lm
    from mlx_lm.utils import _get_classes  # what mlx_lm.load resolves the architecture with

    try:
        _get_classes(config)
    except (ValueError, ImportError, AttributeError) as exc:
        return (
            f"mlx-lm {mlx_lm.__version__} cannot load model_type {config['model_type']!r} ({exc})"
        )
    if not any(Path(model_dir).glob("model*.safetensors")):
        return f"no model*.safetensors weights in {model_dir}"
    return None
