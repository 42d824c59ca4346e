"""Hugging Face tokenizer files rebuilt from a GGUF's embedded BPE vocabulary.

A GGUF carries everything a byte-level BPE tokenizer needs (tokens, merges, token types, special
ids, chat template) but no ``tokenizer.json``. Both ``mlx_lm.load`` and
``transformers.AutoTokenizer`` want the Hugging Face files, so we write them.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, TypeAlias

from mlx_kvserve.json_value import JSON

if TYPE_CHECKING:  # MLX is imported only after the BLAS preload (mlx_kvserve.blas)
    import mlx.core as mx

    # A GGUF metadata value as `mx.load(path, return_metadata=True)` gives it: an array (0-d
    # for a number), a string, or a list of strings.
    MetadataValue: TypeAlias = mx.array | str | list[str]
    Scalar: TypeAlias = int | float | bool | str | list[str]

# GGUF token types (llama.cpp `llama_token_type`).
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4

# llama.cpp pre-tokenizer names whose behaviour we reproduce. "smollm" (and "gpt-2") are the
# GPT-2 byte-level regex; "smollm" first splits every digit on its own.
_DIGIT_SPLITTING_PRE = {"smollm"}
_SUPPORTED_PRE = {"smollm", "gpt-2", "default"}


def _scalar(value: MetadataValue) -> Scalar:
    """GGUF metadata scalars arrive as 0-d mx.arrays; turn them into Python values."""
    return value.item() if hasattr(value, "item") else value


def _int_list(value: mx.array | Sequence[int]) -> list[int]:
    return [int(v) for v in (value.tolist() if hasattr(value, "tolist") else value)]


def build_tokenizer_json(metadata: Mapping[str, MetadataValue]) -> str:
    """Serialise a ``tokenizers`` byte-level BPE tokenizer equivalent to the GGUF's."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    model_kind = _scalar(metadata.get("tokenizer.ggml.model"))
    if model_kind != "gpt2":
        raise ValueError(f"unsupported GGUF tokenizer model {model_kind!r} (need byte-level BPE)")
    pre = _scalar(metadata.get("tokenizer.ggml.pre", "default"))
    if pre not in _SUPPORTED_PRE:
        raise ValueError(f"unsupported GGUF pre-tokenizer {pre!r}")

    tokens: Sequence[str] = metadata["tokenizer.ggml.tokens"]
    merges = [tuple(m.split(" ", 1)) for m in metadata["tokenizer.ggml.merges"]]
    types = _int_list(metadata.get("tokenizer.ggml.token_type", [1] * len(tokens)))
    vocab = {tok: i for i, tok in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ValueError("GGUF vocabulary has duplicate tokens")

    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGIT_SPLITTING_PRE:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)

    special = [
        AddedToken(tokens[i], special=True, normalized=False)
        for i, t in enumerate(types)
        if t == _TOKEN_TYPE_CONTROL
    ]
    user = [
        AddedToken(tokens[i], special=False, normalized=False)
        for i, t in enumerate(types)
        if t == _TOKEN_TYPE_USER_DEFINED
    ]
    tok.add_special_tokens(special)
    if user:
        tok.add_tokens(user)
    return tok.to_str(pretty=False)


def build_tokenizer_config(metadata: Mapping[str, MetadataValue]) -> dict[str, JSON]:
    """``tokenizer_config.json`` contents: special tokens as strings, template, max length."""
    tokens: Sequence[str] = metadata["tokenizer.ggml.tokens"]

    def token(key: str) -> str | None:
        idx = metadata.get(f"tokenizer.ggml.{key}_token_id")
        return None if idx is None else tokens[int(_scalar(idx))]

    types = _int_list(metadata.get("tokenizer.ggml.token_type", [1] * len(tokens)))
    context = metadata.get("llama.context_length")
    config: dict[str, JSON] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("bos"),
        "eos_token": token("eos"),
        "pad_token": token("padding"),
        "unk_token": token("unknown"),
        "add_bos_token": bool(_scalar(metadata.get("tokenizer.ggml.add_bos_token", False))),
        "add_eos_token": bool(_scalar(metadata.get("tokenizer.ggml.add_eos_token", False))),
        "add_prefix_space": bool(_scalar(metadata.get("tokenizer.ggml.add_space_prefix", False))),
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(_scalar(context)) if context is not None else 2048,
        "additional_special_tokens": [
            tokens[i] for i, t in enumerate(types) if t == _TOKEN_TYPE_CONTROL
        ],
    }
    template = metadata.get("tokenizer.chat_template")
    if template:
        config["chat_template"] = str(template)
    return {k: v for k, v in config.items() if v is not None}


def write_tokenizer_files(metadata: Mapping[str, MetadataValue], out_dir: Path) -> list[Path]:
    """Write tokenizer.json, tokenizer_config.json (and chat_template.jinja); return the paths."""
    written = []
    path = out_dir / "tokenizer.json"
    path.write_text(build_tokenizer_json(metadata), encoding="utf-8")
    written.append(path)
    config = build_tokenizer_config(metadata)
    path = out_dir / "tokenizer_config.json"
    path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    written.append(path)
    if "chat_template" in config:
        # transformers >= 4.43 also reads (and >= 5 saves) the template as a separate file.
        path = out_dir / "chat_template.jinja"
        path.write_text(config["chat_template"], encoding="utf-8")
        written.append(path)
    return written
