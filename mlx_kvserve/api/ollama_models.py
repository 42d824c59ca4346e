"""What Ollama's `/api/tags`, `/api/show` and `/api/ps` say of a model, read from its files.

Clients list models before they load any (VS Code Copilot calls `/api/show` for each one), so
nothing here loads a model: its config.json and safetensors headers give the architecture,
context length, sizes and parameter count; its tokenizer (the loaded engine's, else loaded
alone from disk once) gives the chat template and whether it has a reasoning section.

`capabilities` says what this server really does with the model: `completion` and `tools`
always (a template without tool support gets the constrained Hermes format), `insert` when its
tokenizer has fill-in-the-middle tokens, `thinking` when the tokenizer has reasoning markers,
`vision` when the model sees images (`Slot.sees_images`; no model does yet: a text model is
shown a note in an image's place). An embedding model (embed/kind.py: its
sentence-transformers pooling config) says `embedding` alone, as Ollama says of its embedding
models (Langflow drops such models from its chat lists by this). A generative model embeds
too, by mean pooling, but does not say `embedding`: it is not what the model is for.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import struct
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from mlx_kvserve.api.engine_view import EngineView
from mlx_kvserve.chat.fill_in_middle import fill_format
from mlx_kvserve.chat.reasoning.thinking import markers_for
from mlx_kvserve.embed.kind import kind_of
from mlx_kvserve.json_value import JSON
from mlx_kvserve.models.budget import weights_bytes
from mlx_kvserve.models.context import config_sections, context_from_config
from mlx_kvserve.models.pool import LOADED, Slot

log = logging.getLogger("mlx_kvserve.api")

_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}


@dataclass(frozen=True)
class Files:
    """What a model's files say, read once."""

    architecture: str
    config: dict[str, JSON]
    parameters: int
    dtype: str  # the weights' most common safetensors dtype ("F32", "BF16", "U32"...)
    size: int
    digest: str
    modified_at: str


@dataclass(frozen=True)
class Tokens:
    """What its tokenizer says: the chat template, whether it reasons, and whether it fills
    in the middle (chat/fill_in_middle.py)."""

    template: str
    thinks: bool
    fills: bool = False


_files: dict[str, Files] = {}
_tokens: dict[str, Tokens] = {}


def files_of(slot: Slot) -> Files:
    key = str(slot.model_dir)
    found = _files.get(key)
    if found is None:
        found = _files[key] = _read_files(slot.model_dir, slot.model_id)
    return found


def _read_files(model_dir: Path | None, model_id: str) -> Files:
    config: dict[str, JSON] = {}
    mtime = 0.0
    if model_dir is not None:
        try:
            path = model_dir / "config.json"
            loaded = json.loads(path.read_text())
            config = loaded if isinstance(loaded, dict) else {}
            mtime = path.stat().st_mtime
        except (OSError, ValueError) as exc:
            log.info("no readable config.json for %s: %s", model_id, exc)
    architecture = str(_setting(config, "model_type") or "unknown")
    size = weights_bytes(model_dir) if model_dir is not None else 0
    parameters, dtype = _parameter_count(model_dir, config) if model_dir is not None else (0, "")
    digest = hashlib.sha256(
        json.dumps([model_id, config, size], sort_keys=True, default=str).encode()
    ).hexdigest()
    return Files(
        architecture=architecture,
        config=config,
        parameters=parameters,
        dtype=dtype,
        size=size,
        digest=digest,
        modified_at=datetime.fromtimestamp(mtime, UTC).isoformat().replace("+00:00", "Z"),
    )


def _setting(config: dict[str, JSON], name: str) -> JSON:
    """A config value, at the top level or in the language model's nested config."""
    return next((c[name] for c in config_sections(config) if c.get(name) is not None), None)


def _bits(config: dict[str, JSON]) -> int | None:
    quant = config.get("quantization") or config.get("quantization_config")
    bits = quant.get("bits") if isinstance(quant, dict) else None
    return bits if isinstance(bits, int) and not isinstance(bits, bool) and bits > 0 else None


def _parameter_count(model_dir: Path, config: dict[str, JSON]) -> tuple[int, str]:
    """The weights' element count from the safetensors headers (a quantized weight packs
    32 / bits values in each uint32; its scales and biases are not parameters), and their
    most common dtype."""
    bits = _bits(config)
    total = 0
    by_dtype: dict[str, int] = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        try:
            with path.open("rb") as f:
                (length,) = struct.unpack("<Q", f.read(8))
                if length > 100 << 20:
                    continue
                header = json.loads(f.read(length))
        except (OSError, ValueError, struct.error):
            continue
        names = set(header)
        for name, info in header.items():
            if not isinstance(info, dict) or name == "__metadata__":
                continue
            base = name.rsplit(".", 1)[0]
            if name.endswith((".scales", ".biases")) and f"{base}.weight" in names:
                continue
            count = 1
            for dim in info.get("shape", []):
                count *= int(dim)
            if bits and info.get("dtype") == "U32" and f"{base}.scales" in names:
                count = count * 32 // bits
            total += count
            dtype = str(info.get("dtype"))
            by_dtype[dtype] = by_dtype.get(dtype, 0) + count
    return total, max(by_dtype, key=lambda d: by_dtype[d], default="")


async def tokens_of(slot: Slot) -> Tokens:
    """The template and reasoning of the slot's model: from its engine when loaded, else from
    its tokenizer loaded alone (off the event loop, once)."""
    engine: EngineView | None = slot.engine
    if engine is not None and engine.ready.is_set() and engine.tokenizer is not None:
        return tokens_from(engine.tokenizer)
    found = _tokens.get(slot.name)
    if found is None and slot.model_dir is not None:
        found = _tokens[slot.name] = await asyncio.to_thread(_load_tokens, slot.model_dir)
    return found or Tokens("", False)


def tokens_from(tokenizer: object) -> Tokens:
    template = getattr(tokenizer, "chat_template", None)
    return Tokens(
        template if isinstance(template, str) else "",
        markers_for(tokenizer) is not None,
        fill_format(tokenizer) is not None,
    )


def _load_tokens(model_dir: Path) -> Tokens:
    try:
        from mlx_lm.utils import load_tokenizer

        return tokens_from(load_tokenizer(model_dir))
    except Exception as exc:  # a tokenizer that will not load alone: the model's load says why
        log.info("could not read the tokenizer of %s: %s", model_dir, exc)
        return Tokens("", False)


def context_length(slot: Slot) -> int | None:
    engine = slot.engine
    if engine is not None and engine.context_length is not None:
        return engine.context_length
    return context_from_config(files_of(slot).config)


def details(slot: Slot) -> dict[str, JSON]:
    files = files_of(slot)
    bits = _bits(files.config)
    dtype = _setting(files.config, "torch_dtype") or _setting(files.config, "dtype")
    level = f"Q{bits}" if bits else _DTYPES.get(str(dtype), files.dtype or "unknown")
    return {
        "parent_model": "",
        "format": "safetensors",
        "family": files.architecture,
        "families": [files.architecture],
        "parameter_size": _human(files.parameters),
        "quantization_level": level,
    }


def _human(count: int) -> str:
    if count >= 10**9:
        return f"{count / 1e9:.1f}B"
    if count >= 10**6:
        return f"{count / 1e6:.0f}M"
    return f"{count / 1e3:.0f}K" if count else "unknown"


def tag(slot: Slot, name: str) -> dict[str, JSON]:
    """One `/api/tags` entry."""
    files = files_of(slot)
    return {
        "name": name,
        "model": name,
        "modified_at": files.modified_at,
        "size": files.size,
        "digest": files.digest,
        "details": details(slot),
    }


def capabilities(slot: Slot, tokens: Tokens) -> list[JSON]:
    if kind_of(slot.model_dir).embedding_model:
        return ["embedding"]
    fills = ["insert"] if tokens.fills else []
    thinking = ["thinking"] if tokens.thinks else []
    return ["completion", "tools", *fills, *thinking, *(["vision"] if slot.sees_images else [])]


def model_info(slot: Slot) -> dict[str, JSON]:
    """GGUF-style keys, as Ollama's `model_info` has them."""
    files = files_of(slot)
    arch = files.architecture
    info: dict[str, JSON] = {
        "general.architecture": arch,
        "general.basename": slot.model_id.rsplit("/", 1)[-1],
        "general.parameter_count": files.parameters,
        f"{arch}.context_length": context_length(slot),
    }
    for key, name in (
        ("embedding_length", "hidden_size"),
        ("block_count", "num_hidden_layers"),
        ("feed_forward_length", "intermediate_size"),
        ("attention.head_count", "num_attention_heads"),
        ("attention.head_count_kv", "num_key_value_heads"),
        ("vocab_size", "vocab_size"),
    ):
        value = _setting(files.config, name)
        if isinstance(value, int) and not isinstance(value, bool):
            info[f"{arch}.{key}"] = value
    return {k: v for k, v in info.items() if v is not None}


async def show(slot: Slot) -> dict[str, JSON]:
    """The `/api/show` body (`verbose` adds nothing: there are no large arrays to leave out)."""
    tokens = await tokens_of(slot)
    window = context_length(slot)
    info = model_info(slot)
    return {
        "license": "",
        "modelfile": f"# served by mlx-kvserve\nFROM {slot.model_id}\n",
        "parameters": f"num_ctx {window}" if window else "",
        "template": tokens.template,
        "system": "",
        "details": details(slot),
        "model_info": info,
        "capabilities": capabilities(slot, tokens),
        "modified_at": files_of(slot).modified_at,
    }


FOREVER = "2318-01-01T00:00:00Z"  # Ollama's `expires_at` for a model kept loaded for good


def running(slot: Slot, info: dict[str, JSON], expires: str | None) -> dict[str, JSON]:
    """One `/api/ps` entry (Ollama's fields, and the server's own after them)."""
    return {
        "name": slot.name,
        "model": slot.name,
        "size": slot.footprint,
        "digest": files_of(slot).digest,
        "details": details(slot),
        "expires_at": expires or FOREVER,
        "size_vram": slot.footprint,
        "context_length": context_length(slot) or 0,
        "loaded": slot.state == LOADED,
        **{k: info[k] for k in ("idle_seconds", "keep_alive_seconds", "pinned", "default")},
        "aliases": info["aliases"],
    }
