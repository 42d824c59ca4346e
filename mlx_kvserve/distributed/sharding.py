"""How a model splits across the ranks of a job, decided before any weight is read.

mlx-lm's models say what they support by what they have: `Model.shard(group)` splits each
layer's heads across the ranks (tensor parallel), `Model.model.pipeline(group)` gives each rank
a run of layers (pipeline); `mlx_lm.utils.sharded_load` asks the same two questions. A model is
built lazily from its config (no weights read) to ask them. Tensor parallelism also needs the
world size to divide the attention heads and the KV heads, and a pipeline needs at least one
layer per rank; a job that breaks either is refused here with the numbers, on every rank,
instead of failing inside a collective or a reshape.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from mlx_kvserve.json_value import JSON
from mlx_kvserve.models.kv_shape import text_config

if TYPE_CHECKING:  # `cluster check` plans from the config alone, without MLX
    import mlx.nn as nn

TENSOR, PIPELINE = "tensor", "pipeline"


class ShardingError(ValueError):
    """A model that cannot be split as asked; the message names the model and the numbers."""


@dataclass(frozen=True)
class ShardPlan:
    mode: str  # TENSOR or PIPELINE
    world_size: int
    supported: tuple[str, ...]  # what the model can do, in order of preference


def supported_modes(model: nn.Module) -> tuple[str, ...]:
    """The splits an mlx-lm model implements, tensor parallel first (it splits every layer's
    work, where a pipeline leaves all but one rank idle for a single request)."""
    modes = []
    if callable(getattr(model, "shard", None)):
        modes.append(TENSOR)
    inner = getattr(model, "model", None)
    if callable(getattr(inner, "pipeline", None)):
        modes.append(PIPELINE)
    return tuple(modes)


def plan_sharding(
    model: nn.Module,
    config: dict[str, JSON],
    world_size: int,
    requested: str | None = None,
    *,
    name: str = "the model",
) -> ShardPlan:
    """The split for `world_size` ranks (`requested`: tensor, pipeline or None for the best the
    model supports); raises ShardingError naming `name` and the cause."""
    if world_size < 1:
        raise ShardingError(f"a job needs at least one rank, got {world_size}")
    supported = supported_modes(model)
    if requested not in (None, TENSOR, PIPELINE):
        raise ShardingError(f"--shard {requested!r}: expected tensor or pipeline")
    if world_size == 1:
        return ShardPlan(requested or (supported[0] if supported else TENSOR), 1, supported)
    if not supported:
        kind = config.get("model_type", "?")
        raise ShardingError(
            f"{name} ({kind}) supports neither tensor nor pipeline sharding in this mlx-lm: "
            f"it cannot run across {world_size} ranks"
        )
    if requested is not None and requested not in supported:
        raise ShardingError(
            f"{name} does not support --shard {requested} (it supports {', '.join(supported)})"
        )
    mode = requested or supported[0]
    c = text_config(config)
    if mode == TENSOR:
        heads = _int(c, "num_attention_heads")
        kv_heads = _int(c, "num_key_value_heads") or heads
        for label, count in (("attention heads", heads), ("KV heads", kv_heads)):
            if count and count % world_size:
                hint = " (try --shard pipeline)" if PIPELINE in supported else ""
                raise ShardingError(
                    f"{name}: {world_size} ranks do not divide its {count} {label} for tensor "
                    f"parallelism{hint}"
                )
    else:
        layers = _int(c, "num_hidden_layers")
        if layers and layers < world_size:
            raise ShardingError(
                f"{name}: {layers} layers cannot give each of {world_size} ranks one"
            )
    return ShardPlan(mode, world_size, supported)


def _int(config: dict[str, JSON], key: str) -> int:
    value = config.get(key)
    return value if isinstance(value, int) and value > 0 else 0


def plan_for_directory(model_dir: Path, world_size: int, shard: str | None) -> str:
    """The split of the model in `model_dir` across `world_size` ranks, from its config alone
    (the model is built lazily: no weight is read). Raises ShardingError."""
    import json

    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ShardingError(f"{model_dir}: no readable config.json ({exc})") from None
    from mlx_lm.utils import load_model  # heavy: only when a model is planned

    try:
        model, _ = load_model(model_dir, lazy=True, strict=False)
    except Exception as exc:  # an architecture mlx-lm cannot build
        raise ShardingError(f"{model_dir}: mlx-lm cannot build this model ({exc})") from None
    return plan_sharding(model, config, world_size, shard, name=str(model_dir)).mode
