"""The model fingerprint that names a prompt-cache sub-directory.

KV states are only valid for the exact weights, config and tokenizer that made them, and for the
cache format and mlx / mlx-lm versions that laid them out (`cache.fingerprint` adds those). A
converted default model's manifest already holds sha256 digests of its files, so those are used;
for other models the weights are identified by name, size and mtime (hashing many GB at every
start would be too slow), and the small config and tokenizer files are hashed in full.
"""

from __future__ import annotations

import json
from pathlib import Path

from mlx_kvserve.cache import hash_files, model_fingerprint

MANIFEST = "manifest.json"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "special_tokens_map.json",
    "tokenizer.model",
)


def _manifest_digest(model_dir: Path) -> str | None:
    try:
        manifest = json.loads((model_dir / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    files = manifest.get("files")
    if not isinstance(files, dict) or not files:
        return None
    return json.dumps(files, sort_keys=True)


def fingerprint_model(model_dir: Path, model_id: str) -> str:
    """A stable digest of everything that makes a stored KV state valid for this model."""
    model_dir = Path(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    weights = _manifest_digest(model_dir) or hash_files(
        sorted(model_dir.glob("*.safetensors")), full=False
    )
    tokenizer = hash_files([model_dir / n for n in TOKENIZER_FILES if (model_dir / n).is_file()])
    return model_fingerprint(weights=weights, config=config, tokenizer=tokenizer, name=model_id)
