"""The model fingerprint that names a prompt-cache sub-directory.

KV states are only valid for the exact weights, config and tokenizer that made them, and for the
cache format and mlx / mlx-lm versions that laid them out (`cache.model_fingerprint` adds those).
`manifest.model_fingerprint_source` says how the files are identified: by content, never by
mtime, so the ranks of a job holding copies of one model agree on it (distributed/join.py).
"""

from __future__ import annotations

import json
from pathlib import Path

from mlx_kvserve.cache import model_fingerprint
from mlx_kvserve.models.manifest import model_fingerprint_source


def fingerprint_model(model_dir: Path, model_id: str, kv_dtype: str | None = None) -> str:
    """A stable digest of everything that makes a stored KV state valid for this model.

    `kv_dtype` is the dtype the model is served in when it is not its own (see
    `models.precision`): KV of another dtype must never be restored into it. `model_id` only
    names the digest for people (an empty one: the bare digest).
    """
    source = model_fingerprint_source(Path(model_dir))
    return model_fingerprint(
        weights=json.dumps(source["weights"], sort_keys=True),
        config=source["config"] or {},
        tokenizer=source["tokenizer_sha256"],
        name=model_id,
        extra={"kv_dtype": kv_dtype} if kv_dtype else None,
    )
