"""A checkpoint's own multi-token-prediction (MTP) heads, kept at load (issue 31, item 2).

Qwen3.5/3.6 and Qwen3-Next ship `mtp.*` tensors beside the model, the DeepSeek-V3 and GLM MoE
families a nextn layer (`model.layers.{num_hidden_layers}`), Nemotron-H an `mtp.layers.{i}`
module (models/mtp_families.py: where each keeps them, which layers hold them): decoder layers
that take the target's last hidden state h_p (after its final norm) and the embedding of the
next token t_{p+1}, and predict t_{p+2} through the target's own output head. mlx-lm drops them
in `sanitize`; here they are read from the same safetensors, after the model loaded, into
`MTPBlock`, built from mlx-lm's own decoder layers of the family (a full-attention one; MLA and
experts where the family has them), so the block runs on the target's kernels and RoPE. The
shape of the block (fc over the normed [embedding, hidden] pair, the layers, a final norm) and
the zero-centred norms of Qwen's Hugging Face checkpoints (+1, as mlx-lm shifts the target's)
follow mlx-vlm's `speculative/drafters/qwen3_5_mtp` (MIT). The embedding and the output head are
the target's: nothing is loaded twice.

`MTPHeads` is what the decode batch uses (engine/speculation/mtp.py): the target's hidden
states and logits from one call (`forward`, the same logits as `model(...)`), and one MTP step.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map_with_path
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import CacheList, KVCache

from mlx_kvserve.models.mtp_families import (
    FAMILIES,
    Stack,
    hidden_first,
    nemotron_names,
    nemotron_pattern,
    one_layer,
    renamed,
    stack,
)

log = logging.getLogger("mlx_kvserve.models")

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

    def __init__(
        self,
        layers: list[nn.Module],
        hidden_size: int,
        eps: float,
        cached: list[bool] | None = None,
    ) -> None:
        super().__init__()
        self.fc = nn.Linear(2 * hidden_size, hidden_size, bias=False)
        self.pre_fc_norm_embedding = nn.RMSNorm(hidden_size, eps=eps)
        self.pre_fc_norm_hidden = nn.RMSNorm(hidden_size, eps=eps)
        self.layers = layers
        self.norm = nn.RMSNorm(hidden_size, eps=eps)
        # which layers take a cache (Nemotron-H's expert blocks attend nowhere)
        self._cached = cached if cached is not None else [True] * len(layers)

    def __call__(self, embedded: mx.array, hidden: mx.array, cache: list) -> mx.array:
        h = mx.concatenate(
            [self.pre_fc_norm_embedding(embedded), self.pre_fc_norm_hidden(hidden)], axis=-1
        )
        h = self.fc(h)
        first = cache[0][0] if isinstance(cache[0], CacheList) else cache[0]
        mask = create_attention_mask(h, first, return_array=True)  # MLA takes arrays only
        caches = iter(cache)
        for layer, cached in zip(self.layers, self._cached, strict=True):
            h = layer(h, mask=mask, cache=next(caches) if cached else None)
        return self.norm(h)


class MTPHeads:
    """A target model's MTP block, bound to the target's embedding and output head."""

    def __init__(
        self, target: nn.Module, block: MTPBlock, caches: list[Callable[[], object]] | None = None
    ) -> None:
        lm = getattr(target, "language_model", target)
        # returns the hidden states after the final norm (Nemotron-H's is its `backbone`)
        self.inner: nn.Module = lm.model if hasattr(lm, "model") else lm.backbone
        embed = getattr(self.inner, "embed_tokens", None)
        self.embed: nn.Embedding = embed if embed is not None else self.inner.embeddings
        head = getattr(lm, "lm_head", None)
        self.head = head if head is not None else self.embed.as_linear
        self.block = block
        self.caches = caches if caches is not None else [KVCache] * len(block.layers)

    @property
    def depth(self) -> int:
        return len(self.block.layers)

    def forward(self, inputs: mx.array, cache: list | None) -> tuple[mx.array, mx.array]:
        """(hidden states, logits) of the target for `inputs`: the logits `model(inputs,
        cache=cache)` returns (its final norm's output through its head), and what made them."""
        hidden = self.inner(inputs, cache)
        return hidden, self.head(hidden)

    def make_cache(self) -> list:
        """One cache per MTP layer that attends, of the target's kinds."""
        return [make() for make in self.caches]

    def step(self, tokens: mx.array, hidden: mx.array, cache: list) -> mx.array:
        """The block over pairs (h_p, t_{p+1}): `tokens` (1, L), `hidden` (1, L, H); its output
        predicts t_{p+2} through `head` and is the hidden state of the next MTP step."""
        return self.block(self.embed(tokens), hidden, cache)


def mtp_layers(config: dict) -> int:
    """The MTP layers a config.json states (0: none, or a family this does not know)."""
    family = FAMILIES.get(config.get("model_type", ""))
    if family is None:
        return 0
    text = config.get("text_config", config)
    return int(text.get(family.field, 0) or 0)


def heads_problem(model_dir: Path, speculation: str = "auto") -> str | None:
    """Why MTP cannot draft for the checkpoint in `model_dir` (`--mtp on`), or None; reads the
    config and the safetensors' headers only."""
    if speculation != "auto":
        return "speculation is off (MTP drafts under --speculation auto)"
    config = json.loads((model_dir / "config.json").read_text())
    if not mtp_layers(config):
        known = ", ".join(sorted(FAMILIES))
        return (
            f"its config.json states no MTP layers (mtp_num_hidden_layers or "
            f"num_nextn_predict_layers, model_type {config.get('model_type')!r}; heads are "
            f"loaded for {known})"
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
    return FAMILIES[config["model_type"]].prefix.format(n=config.get("num_hidden_layers"))


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
    family = FAMILIES[config["model_type"]]
    if family.single is not None:
        weights = one_layer(weights, family.single)
        layers = 1  # a second such layer would be a second block (a chain): not built
        if family.hidden_first:
            weights = hidden_first(weights)
    elif config["model_type"] == "nemotron_h":  # one module of several blocks
        layers = len(nemotron_pattern(config))
        weights = renamed(weights, nemotron_names(layers))
    if not weights:
        log.info("the model's config states %d MTP layer(s) but its weights hold none", layers)
        return None
    layout = stack(config, target, layers)
    block = _block_of(layout)
    weights = _sanitize(weights, target, hf_layout and family.centred, family.target_prefix)
    quantization = config.get("quantization")
    if quantization and any(k.endswith(".scales") for k in weights):
        nn.quantize(
            block,
            group_size=quantization["group_size"],
            bits=quantization["bits"],
            class_predicate=lambda path, _module: f"{path}.scales" in weights,
        )
    block.load_weights(list(weights.items()), strict=True)
    heads = MTPHeads(target, block, [make for make in layout.caches if make is not None])
    norm = getattr(heads.inner, "norm", None) or getattr(heads.inner, "norm_f", None)
    if norm is not None:  # the dtype the target computes in (`--kv-dtype` may have cast it)
        _cast(block, norm.weight.dtype, getattr(target, "cast_predicate", lambda _path: True))
    block.eval()
    mx.eval(block.parameters())
    return heads


def _cast(block: MTPBlock, dtype: mx.Dtype, keep: Callable[[str], bool]) -> None:
    """Cast the block's floating weights to `dtype` but those the target keeps in their own
    (`cast_predicate`: a router's score-correction bias stays float32, or routing changes)."""

    def cast(path: str, value: mx.array) -> mx.array:
        if keep(path) and mx.issubdtype(value.dtype, mx.floating):
            return value.astype(dtype)
        return value

    block.update(tree_map_with_path(cast, block.parameters()))


def _block(config: dict, target: nn.Module, layers: int) -> MTPBlock:
    """An empty block of `layers` decoder layers of the target's family (tests build theirs)."""
    return _block_of(stack(config, target, layers))


def _block_of(layout: Stack) -> MTPBlock:
    cached = [make is not None for make in layout.caches]
    return MTPBlock(layout.layers, layout.hidden_size, layout.eps, cached)


def _sanitize(weights: dict[str, mx.array], target: nn.Module, shift: bool, prefix: str) -> dict:
    """The heads' tensors (prefix cut) in the block's names: the layers through the target's
    own `sanitize` (its experts' layout, MLA's split kv_b_proj), zero-centred norms shifted in a
    Hugging Face layout of Qwen's (Qwen3-Next's `sanitize` shifts its layers' itself)."""
    own_shift = prefix == "model."  # qwen3_next (no shift for the others: `shift` is False)
    if shift:
        weights = {
            k: v + 1.0
            if v.ndim == 1
            and any(k.endswith(s) for s in _NORMS)
            and not (own_shift and k.startswith("layers."))
            else v
            for k, v in weights.items()
        }
    as_target = {prefix + k: v for k, v in weights.items() if k.startswith("layers.")}
    out = {k: v for k, v in weights.items() if not k.startswith("layers.")}
    for key, value in target.sanitize(as_target).items():
        out[key.removeprefix(prefix)] = value
    return out
