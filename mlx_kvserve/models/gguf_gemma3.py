"""Convert a Gemma 3 GGUF (any llama.cpp quantisation, K-quants included) into an mlx-lm
``gemma3_text`` model directory.

``mx.load`` reads only Q4_0/Q4_1/Q8_0 GGUF tensors, and Gemma 3 270M's Q4_K_M file mixes Q4_K,
Q6_K, Q5_0 and Q8_0. So the tensors are read with the ``gguf`` package (llama.cpp's own Python
reader) and dequantised to float32 by its ``gguf.quants.dequantize``, the reference
implementation of every llama.cpp block format. Two inverse steps of llama.cpp's converter:

- Gemma's RMSNorm multiplies by ``1 + weight``; llama.cpp stores ``weight + 1`` in the GGUF
  (``convert_hf_to_gguf.py``, ``Gemma3Model``), mlx-lm's ``gemma3_text`` adds the 1 itself, so
  every ``*norm.weight`` gets 1 subtracted (as transformers' GGUF loader does);
- the tokenizer is rebuilt from the GGUF vocabulary by transformers' own GGUF tokenizer builder
  (``convert_gguf_tokenizer``: sentencepiece merges recovered from the file's token order).

Hyper-parameters the GGUF does not store are the ones llama.cpp hard-codes for ``gemma3``: every
6th layer global (the rest a sliding window), local RoPE base 10000, query scale 1/sqrt(head_dim).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from mlx_kvserve.json_value import JSON

if TYPE_CHECKING:  # imported when a conversion runs (MLX only after the BLAS preload)
    from gguf import GGUFReader, ReaderTensor

# llama.cpp `llm_load_hparams`, LLM_ARCH_GEMMA3: hparams.set_swa_pattern(6),
# rope_freq_base_train_swa = 10000, f_attention_scale = 1/sqrt(n_embd_head_k) (all but 27B).
SLIDING_WINDOW_PATTERN = 6
ROPE_LOCAL_BASE_FREQ = 10_000.0
# llama.cpp ends generation at `<end_of_turn>` too (it marks it end-of-generation by its text);
# the Hugging Face Gemma 3 checkpoints list it in generation_config's eos_token_id.
END_OF_TURN = "<end_of_turn>"

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm"}
_BLOCK = re.compile(r"^blk\.(\d+)\.([a-z_]+)$")


def mlx_name(gguf_tensor: str) -> str:
    """``blk.3.ffn_norm.weight`` -> ``model.layers.3.pre_feedforward_layernorm.weight``."""
    module, _, param = gguf_tensor.rpartition(".")
    if module in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[module]}.{param}"
    match = _BLOCK.match(module)
    if match and match.group(2) in _LAYER_NAMES:
        return f"model.layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}.{param}"
    raise ValueError(f"unexpected Gemma 3 GGUF tensor {gguf_tensor!r}")


def _field(reader: GGUFReader, key: str, default: JSON = None) -> JSON:
    """A metadata value: a string, number, boolean or array of those (JSON's kinds)."""
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def gemma3_config(reader: GGUFReader, eos_ids: list[int]) -> dict[str, JSON]:
    """An mlx-lm / Hugging Face ``gemma3_text`` config.json from the GGUF's hyper-parameters."""
    arch = _field(reader, "general.architecture")
    if arch != "gemma3":
        raise ValueError(f"unsupported GGUF architecture {arch!r} (expected gemma3)")

    def get(key: str) -> JSON:
        value = _field(reader, f"gemma3.{key}")
        if value is None:
            raise ValueError(f"GGUF metadata lacks gemma3.{key}")
        return value

    head_dim = int(get("attention.key_length"))
    config: dict[str, JSON] = {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "hidden_size": int(get("embedding_length")),
        "num_hidden_layers": int(get("block_count")),
        "intermediate_size": int(get("feed_forward_length")),
        "num_attention_heads": int(get("attention.head_count")),
        "num_key_value_heads": int(get("attention.head_count_kv")),
        "head_dim": head_dim,
        "query_pre_attn_scalar": head_dim,
        # float32 -> float64 would print as 9.999999974752427e-07; round to what was meant.
        "rms_norm_eps": float(f"{float(get('attention.layer_norm_rms_epsilon')):.6g}"),
        "rope_theta": float(get("rope.freq_base")),
        "rope_local_base_freq": ROPE_LOCAL_BASE_FREQ,
        "sliding_window": int(get("attention.sliding_window")),
        "sliding_window_pattern": SLIDING_WINDOW_PATTERN,
        "max_position_embeddings": int(get("context_length")),
        "vocab_size": len(_field(reader, "tokenizer.ggml.tokens")),
        "tie_word_embeddings": True,
        "hidden_activation": "gelu_pytorch_tanh",
        "bos_token_id": int(_field(reader, "tokenizer.ggml.bos_token_id")),
        "eos_token_id": eos_ids,
        "pad_token_id": int(_field(reader, "tokenizer.ggml.padding_token_id", 0)),
    }
    return config


def _tokenizer_dict(reader: GGUFReader) -> dict[str, JSON]:
    """The GGUF's tokenizer keys under the names transformers' GGUF builder reads."""
    return {
        "tokenizer_type": _field(reader, "tokenizer.ggml.model"),
        "pre_tokenizer_type": _field(reader, "tokenizer.ggml.pre"),
        "tokens": _field(reader, "tokenizer.ggml.tokens"),
        "scores": _field(reader, "tokenizer.ggml.scores"),
        "token_type": _field(reader, "tokenizer.ggml.token_type"),
    }


def write_gemma3_tokenizer(reader: GGUFReader, out_dir: Path, chat_template: str) -> list[int]:
    """tokenizer.json / tokenizer_config.json / chat_template.jinja; returns the stop ids."""
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    try:
        from transformers.integrations.gguf import convert_gguf_tokenizer
    except ImportError as exc:
        raise RuntimeError(
            "this transformers has no GGUF tokenizer builder (transformers.integrations.gguf, "
            f"transformers 5): upgrade transformers to convert Gemma 3 ({exc})"
        ) from exc

    data = _tokenizer_dict(reader)
    if data["tokenizer_type"] != "llama":
        raise ValueError(f"unsupported Gemma tokenizer model {data['tokenizer_type']!r}")
    backend, _ = convert_gguf_tokenizer("gemma3", data)
    tokens = data["tokens"]

    def token(key: str) -> str | None:
        idx = _field(reader, f"tokenizer.ggml.{key}_token_id")
        return None if idx is None else tokens[int(idx)]

    bos = token("bos")
    if _field(reader, "tokenizer.ggml.add_bos_token", False) and bos is not None:
        bos_id = tokens.index(bos)
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
        )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=bos,
        eos_token=token("eos"),
        unk_token=token("unknown"),
        pad_token=token("padding"),
        model_max_length=int(_field(reader, "gemma3.context_length")),
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(str(out_dir))
    eos = tokens.index(token("eos"))
    return [eos, tokens.index(END_OF_TURN)] if END_OF_TURN in tokens else [eos]


def convert_gemma3_gguf(
    gguf_path: Path, out_dir: Path, *, chat_template: str, progress: bool = True
) -> None:
    """Write config.json, model.safetensors (float32) and the tokenizer files into out_dir."""
    import mlx.core as mx
    import numpy as np
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from tqdm import tqdm

    reader = GGUFReader(str(gguf_path))
    out_dir.mkdir(parents=True, exist_ok=True)
    eos_ids = write_gemma3_tokenizer(reader, out_dir, chat_template)
    config = gemma3_config(reader, eos_ids)

    weights: dict[str, mx.array] = {}
    bar: Callable[..., Iterable[ReaderTensor]] = tqdm if progress else (lambda it, **_: it)
    for tensor in bar(reader.tensors, desc="dequantising", unit="tensor", disable=not progress):
        name = mlx_name(tensor.name)
        # GGUF lists dimensions innermost first; numpy's shape is the reverse (rows, columns).
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        values = dequantize(tensor.data, tensor.tensor_type).astype(np.float32).reshape(shape)
        if name.endswith("norm.weight"):
            values = values - np.float32(1.0)
        weights[name] = mx.array(values)
        mx.eval(weights[name])
    if len(weights) != len(reader.tensors):
        raise ValueError("GGUF holds two tensors with the same name")

    mx.save_safetensors(str(out_dir / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out_dir / "config.json").write_text(
        json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8"
    )
