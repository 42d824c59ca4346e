"""Whether a model decodes rows merged as it decodes them alone: checked once, at load.

Merging (engine/batch.py) relies on each architecture's attention honouring the batch mask
and the per-row offsets of mlx-lm's batch caches. Most do; some do not, and answer wrong
without an error: mlx-lm's Gemma 2 reshapes its queries to (batch, kv heads, repeats, ...) and
broadcasts the (batch, 1, L, S) mask over the KV heads instead of the rows, so a row attends
under another row's padding; GPT-BigCode reads the cache's offset as one integer and fails.
The class names would not say which models are affected (a new architecture may be), so the
model is asked: two prompts of different lengths are prefilled alone, their caches merged with
the layer classes' own `merge`, as the batch does, and one merged step must give each row the
next-token log-probabilities its own step gives. A model that does not is decoded one
sequence at a time (always correct), with one log line saying why.
"""

from __future__ import annotations

import logging

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

log = logging.getLogger("mlx_kvserve.engine")

# Two prompts of different lengths (so the merged rows are padded), ids every vocabulary has.
PROMPTS = ([1, 5, 9, 2, 7, 3, 11, 4, 6, 8, 10, 12], [3, 7, 5])
NEXT = (13, 14)
TOP = 8  # the solo step's most likely tokens, compared
ATOL = 0.5  # nats: a wrong mask moves them by far more; rounding (bf16 on Metal) by far less


def merged_decoding_agrees(model: nn.Module) -> bool:
    """True if a merged step gives each row what its solo step gives (see the module doc)."""
    try:
        return _agrees(model)
    except Exception as exc:  # noqa: BLE001 - an architecture that cannot merge at all
        log.warning("rows of this model decode one at a time: a merged step failed (%r)", exc)
        return False


def _agrees(model: nn.Module) -> bool:
    rows = []
    for prompt in PROMPTS:
        caches = make_prompt_cache(model)
        mx.eval(model(mx.array([prompt]), cache=caches))
        rows.append(caches)
    merged = [type(layer[0]).merge(list(layer)) for layer in zip(*rows, strict=True)]
    together = _logprobs(model(mx.array([[t] for t in NEXT]), cache=merged))
    for i, (caches, token) in enumerate(zip(rows, NEXT, strict=True)):
        alone = _logprobs(model(mx.array([[token]]), cache=caches))[0]
        top = mx.argsort(-alone)[:TOP]
        gap = mx.max(mx.abs(together[i][top] - alone[top])).item()
        if not gap <= ATOL:  # NaN counts as a disagreement
            log.warning(
                "rows of this model decode one at a time: merged with another row, its "
                "next-token log-probabilities move by %.2f nats (the architecture's attention "
                "does not honour the batch mask)",
                gap,
            )
            return False
    return True


def _logprobs(logits: mx.array) -> mx.array:
    last = logits[:, -1, :].astype(mx.float32)
    return last - mx.logsumexp(last, axis=-1, keepdims=True)
