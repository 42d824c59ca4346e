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
