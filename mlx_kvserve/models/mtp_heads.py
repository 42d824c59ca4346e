"""A checkpoint's own multi-token-prediction (MTP) heads, kept at load (issue 31, item 2).

Qwen3.5/3.6 (dense and MoE) and Qwen3-Next ship `mtp.*` tensors beside the model, DeepSeek-V3
and GLM-4 MoE a nextn layer (`model.layers.{num_hidden_layers}`): decoder layers that take the
target's last hidden state h_p (after its final norm) and the embedding of the next token
t_{p+1}, and predict t_{p+2} through the target's own output head. mlx-lm drops them in
`sanitize`; here they are read from the same safetensors, after the model loaded, into
`MTPBlock`, built from mlx-lm's own decoder layer of the family (a full-attention one; DeepSeek's
MLA and experts), so the block runs on the target's kernels and RoPE. The shape of the block (fc
over the normed [embedding, hidden] pair, the layers, a final norm) and the zero-centred norms
of Hugging Face checkpoints (+1, as mlx-lm shifts the target's) follow mlx-vlm's
`speculative/drafters/qwen3_5_mtp` (MIT). The embedding and the output head are the target's:
nothing is loaded twice.

`MTPHeads` is what the decode batch uses (engine/speculation/mtp.py): the target's hidden
states and logits from one call (`forward`, the same logits as `model(...)`), and one MTP step.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache

log = logging.getLogger("mlx_kvserve.models")

# model_type -> the config field stating its MTP layers: `mtp.*` tensors (Qwen), or DeepSeek's
# nextn layer `model.layers.{num_hidden_layers}` (one, with its own enorm/hnorm/eh_proj)
FAMILIES = {
    "qwen3_5": "mtp_num_hidden_layers",
    "qwen3_5_moe": "mtp_num_hidden_layers",
    "qwen3_next": "mtp_num_hidden_layers",
    "deepseek_v3": "num_nextn_predict_layers",
    "glm4_moe": "num_nextn_predict_layers",  # GLM-4.5/4.6: DeepSeek's layout, GLM's layer
}
# a nextn layer's names -> the block's (its embed_tokens and shared_head.head: the target's)
_NEXTN = {
    "enorm.": "pre_fc_norm_embedding.",
    "hnorm.": "pre_fc_norm_hidden.",
    "eh_proj.": "fc.",
    "shared_head.norm.": "norm.",
}
_NORMS = (
    ".input_layernorm.weight",
    ".post_attention_layernorm.weight",
    ".q_norm.weight",
    ".k_norm.weight",
    "norm.weight",
    "pre_fc_norm_embedding.weight",
    "pre_fc_norm_hidden.weight",
)


class MTPBlock(nn.Module):
    """fc(norm_e(embedding of t_{p+1}) ++ norm_h(h_p)), the MTP decoder layers, a final norm."""

    def __init__(self, layers: list[nn.Module], hidden_size: int, eps: float) -> None:
        super().__init__()
        self.fc = nn.Linear(2 * hidden_size, hidden_size, bias=False)
        self.pre_fc_norm_embedding = nn.RMSNorm(hidden_size, eps=eps)
        self.pre_fc_norm_hidden = nn.RMSNorm(hidden_size, eps=eps)
        self.layers = layers
        self.norm = nn.RMSNorm(hidden_size, eps=eps)

    def __call__(self, embedded: mx.array, hidden: mx.array, cache: list[KVCache]) -> mx.array:
        h = mx.concatenate(
            [self.pre_fc_norm_embedding(embedded), self.pre_fc_norm_hidden(hidden)], axis=-1
        )
        h = self.fc(h)
        mask = create_attention_mask(h, cache[0], return_array=True)  # MLA takes arrays only
        for layer, c in zip(self.layers, cache, strict=True):
            h = layer(h, mask=mask, cache=c)
        return self.norm(h)


class MTPHeads:
    """A target model's MTP block, bound to the target's embedding and output head."""

    def __init__(self, target: nn.Module, block: MTPBlock) -> None:
        lm = getattr(target, "language_model", target)
        self.inner: nn.Module = lm.model  # returns the hidden states after the final norm
        self.embed: nn.Embedding = self.inner.embed_tokens
        head = getattr(lm, "lm_head", None)
        self.head = head if head is not None else self.embed.as_linear
        self.block = block

    @property
    def depth(self) -> int:
        return len(self.block.layers)

    def forward(self, inputs: mx.array, cache: list | None) -> tuple[mx.array, mx.array]:
        """(hidden states, logits) of the target for `inputs`: the logits `model(inputs,
        cache=cache)` returns (its final norm's output through its head), and what made them."""
        hidden = self.inner(inputs, cache)
        return hidden, self.head(hidden)

    def make_cache(self) -> list[KVCache]:
        return [KVCache() for _ in self.block.layers]

    def step(self, tokens: mx.array, hidden: mx.array, cache: list[KVCache]) -> mx.array:
        """The block over pairs (h_p, t_{p+1}): `tokens` (1, L), `hidden` (1, L, H); its output
        predicts t_{p+2} through `head` and is the hidden state of the next MTP step."""
        return self.block(self.embed(tokens), hidden, cache)


def mtp_layers(config: dict) -> int:
    """The MTP layers a config.json states (0: none, or a family this does not know)."""
    field = FAMILIES.get(config.get("model_type", ""))
    if field is None:
        return 0
    text = config.get("text_config", config)
    return int(text.get(field, 0) or 0)


def heads_problem(model_dir: Path, speculation: str = "auto") -> str | None:
    """Why MTP cannot draft for the checkpoint in `model_dir` (`--mtp on`), or None; reads the
    config and the safetensors' headers only."""
    if speculation != "auto":
        return "speculation is off (MTP drafts under --speculation auto)"
    config = json.loads((model_dir / "config.json").read_text())
    if not mtp_layers(config):
        known = ", ".join(sorted(FAMILIES))
        return (
            f"its config.json states no MTP layers (mtp_num_hidden_layers, model_type "
            f"{config.get('model_type')!r}; heads are loaded for {known})"
        )
    prefix = _prefix(config)
    if not any(_names(path, prefix) for path in model_dir.glob("*.safetensors")):
        return (
            f"its config.json states MTP layers but its safetensors hold no {prefix}* tensors "
            "(mlx_lm.convert drops them: serve the original checkpoint)"
        )
    return None


def _prefix(config: dict) -> str:
    """Where a checkpoint keeps its heads' tensors."""
    if FAMILIES[config["model_type"]] == "mtp_num_hidden_layers":
        return "mtp."
    return f"model.layers.{config['num_hidden_layers']}."


def _names(path: Path, prefix: str) -> list[str]:
    """The tensor names under `prefix` in a safetensors file's header (no tensor is read)."""
    with path.open("rb") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
    return [name for name in header if name.startswith(prefix)]


def load_heads(model_dir: Path, target: nn.Module) -> MTPHeads | None:
    """The MTP heads of the checkpoint in `model_dir`, for the loaded `target`; None if its
    config states none or its safetensors hold none (mlx-lm's conversion drops them)."""
    config = json.loads((model_dir / "config.json").read_text())
    layers = mtp_layers(config)
    if not layers:
        return None
    weights: dict[str, mx.array] = {}
    hf_layout = False
    prefix = _prefix(config)
    for path in sorted(model_dir.glob("*.safetensors")):
        tensors = mx.load(str(path))
        assert isinstance(tensors, dict)
        for key, value in tensors.items():
            if key.startswith(prefix):
                weights[key[len(prefix) :]] = value
            elif "conv1d.weight" in key and value.shape[-1] != 1:
                hf_layout = True  # as mlx-lm's sanitize tells a Hugging Face checkpoint
    if prefix != "mtp.":
        weights = _from_nextn(weights)
        layers = 1  # a second nextn layer would be a second block: not built
    if not weights:
        log.info("the model's config states %d MTP layer(s) but its weights hold none", layers)
        return None
    block = _block(config, target, layers)
    weights = _sanitize(weights, target, hf_layout)
    quantization = config.get("quantization")
    if quantization and any(k.endswith(".scales") for k in weights):
        nn.quantize(
            block,
            group_size=quantization["group_size"],
            bits=quantization["bits"],
            class_predicate=lambda path, _module: f"{path}.scales" in weights,
        )
    block.load_weights(list(weights.items()), strict=True)
    heads = MTPHeads(target, block)
    norm = getattr(heads.inner, "norm", None)
    if norm is not None:  # the dtype the target computes in (`--kv-dtype` may have cast it)
        block.set_dtype(norm.weight.dtype)
    block.eval()
    mx.eval(block.parameters())
    return heads


def _block(config: dict, target: nn.Module, layers: int) -> MTPBlock:
    """An empty block of `layers` full-attention decoder layers of the target's family."""
    model_type = config["model_type"]
    if model_type in ("qwen3_5", "qwen3_5_moe"):
        from mlx_lm.models.qwen3_5 import DecoderLayer as Layer

        args = target.language_model.args
        index = args.full_attention_interval - 1  # an index whose layer attends (not linear)
    elif model_type == "qwen3_next":
        from mlx_lm.models.qwen3_next import Qwen3NextDecoderLayer as Layer

        args = target.args
        index = args.full_attention_interval - 1
    elif model_type == "glm4_moe":
        from mlx_lm.models.glm4_moe import DecoderLayer as Layer

        args = target.args
        index = args.num_hidden_layers  # the nextn layer's own index: a MoE layer
    else:
        from mlx_lm.models.deepseek_v3 import DeepseekV3DecoderLayer as Layer

        args = target.args
        index = args.num_hidden_layers
    stack = [Layer(args, layer_idx=index) for _ in range(layers)]
    return MTPBlock(stack, args.hidden_size, args.rms_norm_eps)


def _from_nextn(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """A DeepSeek nextn layer's tensors in the block's names: its decoder layer as layer 0."""
    out = {}
    for key, value in weights.items():
        if key.startswith(("embed_tokens.", "shared_head.head.")):
            continue  # copies of the target's embedding and output head
        for theirs, ours in _NEXTN.items():
            if key.startswith(theirs):
                out[ours + key[len(theirs) :]] = value
                break
        else:
            out["layers.0." + key] = value
    return out


def _sanitize(weights: dict[str, mx.array], target: nn.Module, hf_layout: bool) -> dict:
    """The `mtp.*` tensors (prefix cut) in the block's names: the layers through the target's
    own `sanitize` (its experts' layout), zero-centred norms shifted in a Hugging Face layout
    (Qwen3-Next's `sanitize` shifts its layers' itself)."""
    own_shift = not hasattr(target, "language_model")  # qwen3_next (and no shift for DeepSeek)
    if hf_layout:
        weights = {
            k: v + 1.0
            if v.ndim == 1
            and any(k.endswith(s) for s in _NORMS)
            and not (own_shift and k.startswith("layers."))
            else v
            for k, v in weights.items()
        }
    prefix = "model." if own_shift else "language_model.model."
    as_target = {prefix + k: v for k, v in weights.items() if k.startswith("layers.")}
    out = {k: v for k, v in weights.items() if not k.startswith("layers.")}
    for key, value in target.sanitize(as_target).items():
        out[key.removeprefix(prefix)] = value
    return out
