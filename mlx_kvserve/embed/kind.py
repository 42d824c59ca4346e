"""Which models are embedding models, and how each pools, read from its files.

An embedding model built on a decoder (Qwen3-Embedding, and others converted for
sentence-transformers) ships sentence-transformers' module list: `modules.json` names a Pooling
module whose `config.json` says the mode (`1_Pooling/config.json` in Qwen3-Embedding:
`pooling_mode_lasttoken`). That is what its model card's code does, so it is what this server
does. Any other model is a generative model: it still embeds, by the mean of its last hidden
states over the input's tokens, but it is not reported as an embedding model. Instructions
(Qwen3-Embedding's `Instruct: ...\\nQuery: ...` for queries) are the client's to send.
"""

from __future__ import annotations

import functools
import json
import logging
from dataclasses import dataclass
from pathlib import Path

from mlx_kvserve.embed.pooling import FIRST, LAST, MEAN
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


def encoder_problem(model_dir: Path) -> str | None:
    """Why the model's embeddings cannot be computed as its model card says, or None: an
    encoder (mlx-lm runs causal models only), or a decoder made bidirectional or followed by
    Dense layers (EmbeddingGemma), which mlx-lm would load as a causal model and whose vectors
    would silently differ from the model card's."""
    config = _json(model_dir / "config.json")
    if not isinstance(config, dict):
        return None
    model_type = config.get("model_type")
    modules = _json(model_dir / "modules.json")
    dense = isinstance(modules, list) and any(
        isinstance(m, dict) and m.get("type") == DENSE_MODULE for m in modules
    )
    if model_type in ENCODERS:
        why = f"{model_type} is a bidirectional encoder, which mlx-lm does not run"
    elif config.get("use_bidirectional_attention") is True or dense:
        why = (
            f"this {model_type} embedding model attends both ways or projects its pooled "
            "vector through Dense layers (as EmbeddingGemma does), which mlx-lm's causal "
            f"{model_type} would not: its vectors would not be its model card's"
        )
    else:
        return None
    return f"{why}; this server does not serve such embedding models yet (docs/embeddings.md)"


def kind_of(model_dir: Path | None) -> EmbeddingKind:
    """The model's kind from its sentence-transformers files (read once per directory)."""
    return _kind(str(model_dir)) if model_dir is not None else GENERATIVE


@functools.cache
def _kind(model_dir: str) -> EmbeddingKind:
    root = Path(model_dir)
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
