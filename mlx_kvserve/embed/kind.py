"""Which models are embedding models, and how each pools, read from its files.

An embedding model built on a decoder (Qwen3-Embedding, and others converted for
sentence-transformers) ships sentence-transformers' module list: `modules.json` names a Pooling
module whose `config.json` says the mode (`1_Pooling/config.json` in Qwen3-Embedding:
`pooling_mode_lasttoken`). That is what its model card's code does, so it is what this server
does. An encoder (BERT's family, EmbeddingGemma: `is_encoder`) pools inside its own model, as
its Pooling config says (embed/encoder.py). Any other model is a generative model: it still
embeds, by the mean of its last hidden states over the input's tokens, but it is not reported
as an embedding model. Instructions
(Qwen3-Embedding's `Instruct: ...\\nQuery: ...` for queries) are the client's to send.
"""

from __future__ import annotations

import functools
import json
import logging
from dataclasses import dataclass
from pathlib import Path

from mlx_kvserve.embed.pooling import ENCODER, FIRST, LAST, MEAN
from mlx_kvserve.json_value import JSON

log = logging.getLogger("mlx_kvserve.embed")

POOLING_MODULE = "sentence_transformers.models.Pooling"
DENSE_MODULE = "sentence_transformers.models.Dense"
# Bidirectional encoders (BERT's family: all-MiniLM, bge, e5, nomic-embed-text, gte...)
ENCODERS = frozenset(
    {"bert", "distilbert", "roberta", "xlm-roberta", "modernbert", "mpnet", "nomic_bert", "new"}
)
# sentence-transformers' Pooling config keys, in the order of preference when several are set
_MODES = (
    ("pooling_mode_lasttoken", LAST),
    ("pooling_mode_mean_tokens", MEAN),
    ("pooling_mode_cls_token", FIRST),
)


@dataclass(frozen=True)
class EmbeddingKind:
    """How a model embeds: its pooling, and whether it is an embedding model."""

    pooling: str
    embedding_model: bool


GENERATIVE = EmbeddingKind(MEAN, False)


def is_encoder(model_dir: Path) -> bool:
    """An embedding model mlx-lm's causal models cannot compute: an encoder, or a decoder made
    bidirectional or followed by Dense layers (EmbeddingGemma), which mlx-lm would load as a
    causal model whose vectors would silently differ from the model card's."""
    config = _json(model_dir / "config.json")
    if not isinstance(config, dict):
        return False
    modules = _json(model_dir / "modules.json")
    dense = isinstance(modules, list) and any(
        isinstance(m, dict) and m.get("type") == DENSE_MODULE for m in modules
    )
    both_ways = config.get("use_bidirectional_attention") is True
    return config.get("model_type") in ENCODERS or both_ways or dense


def encoder_problem(model_dir: Path) -> str | None:
    """Why an encoder (`is_encoder`) cannot be served here, or None."""
    from mlx_kvserve.embed.encoder import ENCODED, encoder_library

    config = _json(model_dir / "config.json")
    model_type = config.get("model_type") if isinstance(config, dict) else None
    if model_type not in ENCODED:
        return (
            f"{model_type} is an embedding model that attends both ways (or projects its "
            "pooled vector through Dense layers), which mlx-lm does not run and this server "
            f"serves only for {', '.join(sorted(ENCODED))} (docs/embeddings.md)"
        )
    missing = encoder_library()
    if missing is not None:
        return f"{model_type} is an embedding encoder, which mlx-lm does not run: {missing}"
    return None


def pooling_config(model_dir: Path) -> dict[str, JSON] | None:
    """The sentence-transformers Pooling config (None: the model has none)."""
    config = _json(model_dir / _pooling_dir(model_dir) / "config.json")
    return config if isinstance(config, dict) else None


def kind_of(model_dir: Path | None) -> EmbeddingKind:
    """The model's kind from its sentence-transformers files (read once per directory)."""
    return _kind(str(model_dir)) if model_dir is not None else GENERATIVE


@functools.cache
def _kind(model_dir: str) -> EmbeddingKind:
    root = Path(model_dir)
    if is_encoder(root):
        return EmbeddingKind(ENCODER, True)
    config = _json(root / _pooling_dir(root) / "config.json")
    if not isinstance(config, dict):
        return GENERATIVE
    for key, pooling in _MODES:
        if config.get(key) is True:
            return EmbeddingKind(pooling, True)
    log.warning(
        "%s: its sentence-transformers pooling (%s) is not one this server has; it pools by "
        "the mean",
        model_dir,
        ", ".join(k for k, v in config.items() if v is True) or "none",
    )
    return EmbeddingKind(MEAN, True)


def _pooling_dir(root: Path) -> str:
    """The Pooling module's folder as `modules.json` names it (else the usual one)."""
    modules = _json(root / "modules.json")
    if isinstance(modules, list):
        for module in modules:
            if isinstance(module, dict) and module.get("type") == POOLING_MODULE:
                path = module.get("path")
                if isinstance(path, str) and path and ".." not in Path(path).parts:
                    return path
    return "1_Pooling"


def _json(path: Path) -> JSON:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
