"""Convert a llama-architecture GGUF into a standard mlx-lm model directory.

``mx.load(path.gguf)`` already decodes Q4_0/Q4_1/Q8_0 tensors into MLX affine-quantized triples
(``weight``/``scales``/``biases``, group size 32). We rename them to mlx-lm's llama names and
either keep them quantized (Metal: fast, small) or dequantize them to float32 (Linux CPU: MLX's
CPU backend is only fast for float32 matmuls, through an optimised BLAS).

Everything in here imports MLX lazily, so importing this module does not defeat the BLAS preload.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from mlx_kvserve.json_value import JSON

if TYPE_CHECKING:  # MLX is imported only after the BLAS preload (mlx_kvserve.blas)
    from .tokenizer_files import MetadataValue, Scalar

GROUP_SIZE = 32  # every GGUF block quantization that mx.load understands uses 32-wide blocks

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK = re.compile(r"^blk\.(\d+)\.([a-z_]+)$")


def _scalar(value: MetadataValue) -> Scalar:
    return value.item() if hasattr(value, "item") else value


def mlx_module_name(gguf_module: str) -> str:
    """``blk.3.attn_q`` -> ``model.layers.3.self_attn.q_proj`` (raises on unknown names)."""
    if gguf_module in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_module]
    match = _BLOCK.match(gguf_module)
    if match and match.group(2) in _LAYER_NAMES:
        return f"model.layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}"
    raise ValueError(f"unexpected GGUF tensor {gguf_module!r}")


def llama_config(metadata: Mapping[str, MetadataValue], has_lm_head: bool) -> dict[str, JSON]:
    """An mlx-lm / Hugging Face style llama ``config.json`` from GGUF hyper-parameters."""
    arch = _scalar(metadata.get("general.architecture"))
    if arch != "llama":
        raise ValueError(f"unsupported GGUF architecture {arch!r} (only llama)")

    def get(key: str, default: float | None = None) -> Scalar:
        value = metadata.get(f"llama.{key}", default)
        if value is None:
            raise ValueError(f"GGUF metadata lacks llama.{key}")
        return _scalar(value)

    hidden = int(get("embedding_length"))
    heads = int(get("attention.head_count"))
    head_dim = int(get("rope.dimension_count", hidden // heads))
    config: dict[str, JSON] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "num_hidden_layers": int(get("block_count")),
        "intermediate_size": int(get("feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "head_dim": head_dim,
        # float32 -> float64 would print as 9.999999747378752e-06; round to what was meant.
        "rms_norm_eps": float(f"{float(get('attention.layer_norm_rms_epsilon')):.6g}"),
        "rope_theta": float(f"{float(get('rope.freq_base', 10000.0)):.6g}"),
        # GGUF stores llama q/k rows in the interleaved (GPT-J style) rotary layout.
        "rope_traditional": True,
        "vocab_size": int(get("vocab_size", len(metadata["tokenizer.ggml.tokens"]))),
        "max_position_embeddings": int(get("context_length")),
        "tie_word_embeddings": not has_lm_head,
        "attention_bias": False,
        "mlp_bias": False,
    }
    for key, name in (
        ("bos_token_id", "bos"),
        ("eos_token_id", "eos"),
        ("pad_token_id", "padding"),
    ):
        value = metadata.get(f"tokenizer.ggml.{name}_token_id")
        if value is not None:
            config[key] = int(_scalar(value))
    return config


def convert_gguf(
    gguf_path: Path,
    out_dir: Path,
    *,
    quantized: bool,
    progress: bool = True,
    extra_config: Mapping[str, JSON] | None = None,
) -> list[Path]:
    """Write ``config.json``, ``model.safetensors`` and tokenizer files into ``out_dir``.

    ``quantized=False`` dequantizes every tensor to float32; ``quantized=True`` keeps the GGUF's
    quantized triples (per-module bits recorded in ``config["quantization"]``, as mlx-lm's loader
    reads it, scales/biases as the GGUF stores them). Returns the files written.
    """
    import mlx.core as mx
    from tqdm import tqdm

    from .tokenizer_files import write_tokenizer_files

    tensors, metadata = mx.load(str(gguf_path), return_metadata=True)
    modules = sorted({name.rsplit(".", 1)[0] for name in tensors})
    has_lm_head = "output.weight" in tensors
    config = llama_config(metadata, has_lm_head)

    out: dict[str, mx.array] = {}
    per_module_quant: dict[str, dict[str, int]] = {}
    bits_seen: dict[int, int] = {}
    bar: Callable[..., Iterable[str]] = tqdm if progress else (lambda it, **_: it)
    for module in bar(modules, desc="converting", unit="tensor", disable=not progress):
        target = mlx_module_name(module)
        weight = tensors[f"{module}.weight"]
        scales = tensors.get(f"{module}.scales")
        if scales is None:
            # Plain float tensors (the norms) stay float32 in both variants: they make the
            # activations, and so the KV cache, float32. Measured on this model, all-float16
            # activations flip ~5% of greedy argmaxes (and a wrong answer to "capital of
            # France?"); float32 activations with the GGUF's float16 scales agree 100%.
            out[f"{target}.weight"] = weight.astype(mx.float32)
            continue
        biases = tensors[f"{module}.biases"]
        in_dims = scales.shape[-1] * GROUP_SIZE
        bits = weight.shape[-1] * 32 // in_dims
        if quantized:
            out[f"{target}.weight"] = weight
            out[f"{target}.scales"] = scales
            out[f"{target}.biases"] = biases
            per_module_quant[target] = {"group_size": GROUP_SIZE, "bits": bits}
            bits_seen[bits] = bits_seen.get(bits, 0) + 1
        else:
            # Dequantize in float32 (as llama.cpp does): fp16 arithmetic would round twice.
            out[f"{target}.weight"] = mx.dequantize(
                weight,
                scales.astype(mx.float32),
                biases.astype(mx.float32),
                group_size=GROUP_SIZE,
                bits=bits,
            )
        mx.eval(out[f"{target}.weight"])

    if quantized and per_module_quant:
        default_bits = max(bits_seen, key=lambda b: bits_seen[b])
        quant: dict[str, JSON] = {"group_size": GROUP_SIZE, "bits": default_bits}
        quant.update({m: q for m, q in per_module_quant.items() if q["bits"] != default_bits})
        config["quantization"] = quant
        config["quantization_config"] = quant
    if extra_config:
        config.update(extra_config)

    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    weights_path = out_dir / "model.safetensors"
    mx.save_safetensors(str(weights_path), out, metadata={"format": "mlx"})
    written.append(weights_path)
    config_path = out_dir / "config.json"
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    written.append(config_path)
    written.extend(write_tokenizer_files(metadata, out_dir))
    return written
