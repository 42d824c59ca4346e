"""A model directory mlx-lm cannot load is refused before the server starts.

The model itself loads on the engine thread after the server is up (so /health can say
"loading"); a directory that can never load would leave a server that answers 503 for ever. The
checks here are the cheap ones `mlx_lm.load` would fail on first: a readable config.json with a
`model_type`, an architecture the installed mlx-lm implements whose arguments accept the
config, no custom code to run, weights;
and two it would not: an embedding model whose vectors mlx-lm's causal models cannot compute
(embed/kind.py: BERT's family, EmbeddingGemma) unless mlx-vlm's embedding models serve it
(embed/encoder.py), and a tokenizer that writes more ids than the embedding has rows (the
tokenizer of another model), whose ids past the table no loader can reconcile. The opposite, an
embedding padded past the tokenizer, is how Qwen, Gemma 3 and DeepSeek-V3 ship, and is served
(mlx_kvserve/vocabulary.py).
"""

from __future__ import annotations

import json
from pathlib import Path

from mlx_kvserve.json_value import JSON


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
    from mlx_kvserve.embed.kind import encoder_problem, is_encoder

    encoder = is_encoder(Path(model_dir))
    problem = encoder_problem(Path(model_dir)) if encoder else None
    if problem is not None:
        return problem
    import mlx_lm
    from mlx_lm.utils import _get_classes  # what mlx_lm.load resolves the architecture with

    try:
        if not encoder:  # mlx-vlm's, not mlx-lm's (embed/encoder.py)
            _, args_class = _get_classes(config)
    except (ValueError, ImportError, AttributeError) as exc:
        return (
            f"mlx-lm {mlx_lm.__version__} cannot load model_type {config['model_type']!r} ({exc})"
        )
    if not encoder and (problem := arguments_problem(Path(model_dir), args_class)):
        return f"mlx-lm {mlx_lm.__version__} cannot build {config['model_type']!r}: {problem}"
    if not any(Path(model_dir).glob("model*.safetensors")):
        return f"no model*.safetensors weights in {model_dir}"
    return vocabulary_problem(Path(model_dir), config)


def arguments_problem(model_dir: Path, args_class: type) -> str | None:
    """Why the architecture's arguments refuse this config, or None: what `mlx_lm.load` does
    before it reads a weight (DeepSeek-V4.1's configs name engram layers mlx-lm does not
    implement, and its `ModelArgs` says so only then, after the server looked healthy)."""
    from mlx_lm.utils import load_config

    try:
        args_class.from_dict(load_config(model_dir))
    except (ValueError, TypeError, KeyError, AttributeError, AssertionError) as exc:
        return str(exc) or type(exc).__name__
    return None


NESTED = ("text_config", "language_config", "llm_config")  # as models/context.py reads them


def vocabulary_problem(model_dir: Path, config: dict[str, JSON]) -> str | None:
    """Why the tokenizer cannot serve this embedding (more ids than rows), or None. Only what
    the files state is compared: a config without `vocab_size` or a directory without
    tokenizer.json passes (mlx-lm finds out, or the model has a tokenizer of its own kind)."""
    nested = [config[k] for k in NESTED if isinstance(config.get(k), dict)]
    rows = next(
        (c["vocab_size"] for c in [*nested, config] if isinstance(c.get("vocab_size"), int)),
        None,
    )
    tokens = tokenizer_ids(model_dir)
    if rows is None or tokens is None or tokens <= rows:
        return None
    return (
        f"its tokenizer writes {tokens} token ids but its embedding has only {rows} rows "
        f"(config.json vocab_size {rows}): ids {rows} to {tokens - 1} would have no embedding; "
        "the tokenizer files are not this model's"
    )


def tokenizer_ids(model_dir: Path) -> int | None:
    """The highest token id tokenizer.json and tokenizer_config.json give + 1, or None."""
    try:
        tokenizer = json.loads((model_dir / "tokenizer.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    model = tokenizer.get("model") if isinstance(tokenizer, dict) else None
    vocab = model.get("vocab") if isinstance(model, dict) else None
    ids = list(vocab.values()) if isinstance(vocab, dict) else []
    if isinstance(vocab, list):  # Unigram: [[piece, score], ...] in id order
        ids.append(len(vocab) - 1)
    ids += [t.get("id") for t in tokenizer.get("added_tokens") or [] if isinstance(t, dict)]
    try:
        extra = json.loads((model_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
        decoder = extra.get("added_tokens_decoder") if isinstance(extra, dict) else None
        ids += [int(k) for k in decoder or {} if str(k).isdigit()]
    except (OSError, ValueError):
        pass
    ids = [i for i in ids if isinstance(i, int) and not isinstance(i, bool)]
    return max(ids) + 1 if ids else None
