"""The draft model a served model speculates with (`--draft-model`, or per model in the config
file's `[[models]] settings`), checked at start.

A draft is a list of token ids the target verifies, so the two must give every token the same
id: the tokenizers' token -> id maps are compared (added tokens too), not their names; an
embedding padded past the tokenizer is fine (the draft's logits are cut to the target's ids).
A draft model with another vocabulary, a missing one, or a server-wide one beside several
models (each needs its own, of its own tokenizer) is refused before anything is served.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path

from mlx_kvserve.vocabulary import token_ids

log = logging.getLogger("mlx_kvserve")


def vocabulary_problem(model: object, draft: object) -> str | None:
    """Why `draft`'s tokenizer cannot draft for `model`'s (token -> id maps differ), or None."""
    mine, theirs = token_ids(model), token_ids(draft)
    if mine == theirs:
        return None
    return "its tokenizer is not the model's: " + difference(mine, theirs)


def difference(mine: Mapping[str, int], theirs: Mapping[str, int]) -> str:
    """The first way two token -> id maps differ, in words."""
    for token, i in sorted(mine.items(), key=lambda item: item[1]):
        j = theirs.get(token)
        if j != i:
            there = "absent" if j is None else f"id {j}"
            return f"{token!r} is id {i} in the model's and {there} in the draft model's"
    extra = next(iter(sorted(set(theirs) - set(mine))), None)
    return f"the draft model's has tokens the model's lacks ({extra!r}; {len(theirs)} tokens)"


def prepare_draft(source: str, model_dir: Path, data_dir: Path) -> Path:
    """The draft model's directory, once it is found, servable and of `model_dir`'s tokenizer
    (ValueError naming the cause otherwise)."""
    from mlx_lm.utils import load_tokenizer

    from mlx_kvserve.models.preflight import model_dir_problem
    from mlx_kvserve.models.resolve import local_model_dir, resolve_model

    try:
        _, ref = resolve_model(source, data_dir, progress=True)
        draft_dir = local_model_dir(ref)
        problem = model_dir_problem(draft_dir)
        if problem is None:
            problem = vocabulary_problem(load_tokenizer(model_dir), load_tokenizer(draft_dir))
    except (ValueError, RuntimeError, OSError) as exc:
        problem = str(exc)
    if problem:
        raise ValueError(f"the draft model {source!r} cannot draft for this model: {problem}")
    return draft_dir
